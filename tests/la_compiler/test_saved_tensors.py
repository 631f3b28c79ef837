"""What laqat's ops save for the backward is what docs/memory.md states: its tables, read here, against the
autograd graph of one compiled FLA layer (examples/benchmarks/memory_account.py walks it and names each saved
tensor by the laqat op call that holds it), bf16, on the CPU (eager hand-off). Under the exact policy the CPU runs
the fused recurrent kernel (an empty residual); under state_fp8 the chunk kernels (their residual, GDN and KDA).
The residual formulas are also checked against the chunk kernels' layout for every mode, dtype and a varlen batch."""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.residual import residual_size
from la_compiler.kernels.registry import get_variant

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "memory.md"
sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
import memory_account  # noqa: E402
from memory_account import Setup, compiled_account  # noqa: E402

SETUP = Setup(batch=2, seq=70, hidden=32, heads=2, head_dim=16, dtype="bfloat16")  # B*T*HV = 280: a(280) = 288
CHUNK = 64
OP = "laqat::delta_rule_train"


def doc_table(heading: str) -> list[list[str]]:
    """The cells of the first table after the line ``heading`` of docs/memory.md."""
    lines = DOC.read_text().splitlines()
    assert heading in lines, f"docs/memory.md has no line {heading!r}"
    rows = []
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]  # past the header and its rule


def code(cell: str) -> str:
    """The first `code` span of a cell."""
    return re.search(r"`([^`]+)`", cell).group(1)


def a(n) -> int:
    return -(-int(n) // 16) * 16


DIMS = dict(B=SETUP.batch, T=SETUP.seq, H=SETUP.heads, HV=SETUP.heads, K=SETUP.head_dim, V=SETUP.head_dim, C=CHUNK,
            N=SETUP.batch, e=2 if SETUP.dtype in ("bfloat16", "float16") else 4)  # e: 16-bit GEMMs (state_fp8)


def evaluate(expression: str, values: dict):
    return eval(expression, {"__builtins__": {}, "a": a, "ceil": math.ceil}, values)  # noqa: S307


def residual_formula(variant: str, keep: str, kind: str) -> str:
    for row in doc_table("### The residual R"):
        variants = re.findall(r"`(\w+)`", row[0])
        if variant in variants and (variant != "chunk" or code(row[1]) == keep) and row[2] in (kind.upper(), "both"):
            return code(row[3])
    raise AssertionError(f"docs/memory.md gives no residual for {variant}, {keep}, {kind}")


def _input_dtype(name: str) -> str:
    """The dtype the FLA layer's graph gives the op's input: q, k, v in the model's, the gates in fp32 (the
    frontend computes the decay and beta's sigmoid in fp32; the page says so)."""
    return "float32" if name.endswith((".g", ".beta")) else SETUP.dtype


def documented_saves(kind: str, variant: str) -> list[tuple[str, str, tuple, str]]:
    """(slot, name, shape, dtype) of what the page says the op saves for a layer without initial state or
    offsets."""
    values = dict(DIMS)
    out = []
    for slot, tensor, shape, dtype, saved in doc_table("## `laqat::delta_rule_train`"):
        name = code(tensor)
        qualifier = re.search(r"\((GDN|KDA)\)", tensor)
        if saved != "always" or (qualifier and qualifier.group(1) != kind.upper()):
            continue
        if name == "residual":
            values["R"] = evaluate(residual_formula(variant, "intra", kind), values)
        dtype = code(dtype) if "`" in dtype else _input_dtype(f"{OP}.{name}")  # "the input's"
        out.append((f"saved[{slot}]", f"{OP}.{name}", tuple(evaluate(code(shape), values)), dtype))
    return out


@pytest.fixture(scope="module")
def accounts():
    cache = {}

    def get(kind, policy):
        if (kind, policy) not in cache:
            cache[kind, policy] = compiled_account(dataclasses.replace(SETUP, kind=kind, policy=policy))
        return cache[kind, policy]
    return get


@pytest.mark.parametrize("kind,policy,variant", [("gdn", "exact", "fused_recurrent"), ("gdn", "state_fp8", "chunk"),
                                                 ("kda", "state_fp8", "chunk")])
def test_the_recurrence_op_saves_what_the_page_states(accounts, kind, policy, variant):
    acc, graphs = accounts(kind, policy)
    assert [m.kernel for g in graphs for m in g.matches] == [variant]
    assert acc.packed == len(acc.walked)  # the walk reached every tensor autograd packed
    assert [(s.slot, s.name, s.shape, s.dtype) for s in acc.of(OP)] == documented_saves(kind, variant)


def test_every_laqat_op_in_the_layer_saves_what_the_page_lists(accounts):
    """The other laqat ops of the layer (its short convolutions, q and k's l2 norm, its gate, its gated output norm): each saved tensor is one of
    the op's arguments or outputs, in the page's order; no laqat op saves anything the page does not list."""
    listed = {code(op): re.findall(r"`(\w+)`", saves) for op, saves in doc_table("## The other ops")}
    listed[OP] = list(dict.fromkeys(code(row[1]) for row in doc_table("## `laqat::delta_rule_train`")))
    for kind in ("gdn", "kda"):
        acc, _ = accounts(kind, "state_fp8")
        nodes = {s.node for s in acc.saved if s.node.startswith("laqat::")}
        assert nodes == {OP, "laqat::causal_conv1d", "laqat::layer_norm_gated", "laqat::l2_norm",
                         "laqat::softplus_gate"}, nodes
        for node in nodes:
            for call in _calls(acc.of(node)):
                names = [s.name.split(".", 1)[1] if s.name.startswith(node + ".") else s.name for s in call]
                assert names == [n for n in listed[node] if n in names], (node, names, listed[node])


def _calls(saved):
    """One node's saved tensors split per autograd node (each starts again at saved[0])."""
    calls = []
    for s in saved:
        if s.slot == "saved[0]":
            calls.append([])
        calls[-1].append(s)
    return calls


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("keep", ["intra", "all", "none"])
@pytest.mark.parametrize("dtype,gemm", [(torch.float32, "input"), (torch.bfloat16, "input"), (torch.bfloat16, "tf32")])
def test_the_residual_formulas_are_the_chunk_kernels_layout(kind, keep, dtype, gemm):
    """e: bytes of W, U, h, V_new and KDA's kd (2 with 16-bit GEMMs, else 4); M: the chunk-start states."""
    spec = RecurrenceSpec(kind=kind, chunk=CHUNK).replace(numerics={} if gemm == "input" else {"gemm": gemm})
    params = ChunkParams.from_spec(spec)
    formula = residual_formula("chunk", keep, kind)
    for B, T, H, K, V, cu in ((2, 70, 2, 16, 8, None), (1, 150, 3, 32, 16, [0, 40, 150])):
        q, v = torch.empty(B, T, H, K, dtype=dtype), torch.empty(B, T, H, V, dtype=dtype)
        cu_seqlens = None if cu is None else torch.tensor(cu)
        N = B if cu is None else len(cu) - 1
        M = B * math.ceil(T / CHUNK) if cu is None else math.ceil(T / CHUNK) + N
        e = 2 if dtype == torch.bfloat16 and gemm == "input" else 4
        values = dict(B=B, T=T, H=H, HV=H, K=K, V=V, C=CHUNK, N=N, M=M, e=e)
        assert evaluate(formula, values) == residual_size(params, q, v, cu_seqlens, keep), (B, T, cu)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("kind,codec,group", [("gdn", "fp8_e4m3/tile64", 64), ("kda", "int8/block32", 32)])
def test_the_decode_phase_residual_formula_is_the_decode_kernels_bound(kind, codec, group):
    """The page's R of ``laqat::delta_rule_phased_train``, BV the codec's value group (next_power_of_2(V) below it),
    against what the decode variants allocate."""
    line = next(x for x in DOC.read_text().splitlines() if x.strip().startswith("R = (ceil(B*T"))
    formula = line.split("=", 1)[1]
    spec = RecurrenceSpec(kind, phase="token", quant=(("state", codec),), kernel="decode_fused")
    for B, T, H, K, V, cu in ((2, 70, 2, 16, 128, None), (1, 150, 3, 24, 16, [0, 40, 150])):
        q, v = torch.empty(B, T, H, K), torch.empty(B, T, H, V)
        cu_seqlens = None if cu is None else torch.tensor(cu)
        values = dict(B=B, T=T, HV=H, V=V, N=B if cu is None else len(cu) - 1, BK=_next_power_of_2(K),
                      BV=group if V >= group else _next_power_of_2(V))
        assert evaluate(formula, values) == get_variant("decode_fused").residual_numel(spec, q, v, cu_seqlens)


def test_a_python_function_of_fla_is_accounted_to_it_with_its_ctx_tensors():
    """FLA's autograd.Functions (here ``L2Wrap``, one that runs on the CPU) are named by their class; a tensor a
    Function keeps on its ctx counts, though no saved_tensors_hooks packs it."""
    from fla.modules.l2warp import l2_warp

    class KeepsOnCtx(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.offsets = torch.arange(5)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    logits = torch.randn(1, 6, 10, requires_grad=True)
    acc = memory_account.account(lambda: l2_warp(KeepsOnCtx.apply(logits).sum(), logits))
    fla = [s for s in acc.saved if s.category == memory_account.FLA_OPS]
    assert [(s.op, s.slot, s.shape) for s in fla] == [("L2Wrap", "saved[0]", (1, 6, 1)),
                                                      ("L2Wrap", "saved[1]", (1, 6, 1))]
    ctx = [s for s in acc.saved if s.slot.startswith("ctx.")]
    assert [(s.slot, s.bytes, s.category) for s in ctx] == [("ctx.offsets", 40, memory_account.TORCH_OPS)]
    assert acc.packed == len(acc.walked) and acc.packed_bytes == acc.total_bytes - 40


def test_the_fla_lm_account_compares_eager_fla_with_laqat():
    """``--model fla-lm`` at a tiny shape on the CPU: eager FLA (FLA's torch references) and laqat exact (eager
    hand-off). Each row's walk reaches every storage autograd packed; the eager row's FLA ops are the references
    standing in for FLA's, the compiled row's laqat's ops, and both rows have every category."""
    args = memory_account.parse(["--model", "fla-lm", "--family", "gdn", "--layers", "1", "--hidden", "32",
                                 "--heads", "2", "--head-dim", "16", "--seq", "40", "--vocab", "64",
                                 "--device", "cpu"])
    eager, exact = memory_account.lm_rows("gdn", memory_account.lm_row_names(["exact"], False), args)
    assert (eager["row"], exact["row"]) == ("eager FLA", "laqat exact") and "error" not in exact, exact
    for row in (eager, exact):
        assert row["total_bytes"] == row["packed_bytes"] > 0, row["row"]
        assert row["packed"] == sum(not s["slot"].startswith("ctx.") for s in row["saved"]), row["row"]
        assert list(row["by_category"]) == list(memory_account.CATEGORIES)
    eager_fla = eager["by_category"][memory_account.FLA_OPS]
    exact_laqat = exact["by_category"][memory_account.OPS_OF_LAQAT]
    assert {"chunk_gated_delta_rule (torch ref.)", "causal_conv1d (torch ref.)", "rms_norm_gated (torch ref.)",
            "FusedCrossEntropyLoss.forward (torch ref.)"} <= set(eager_fla), eager_fla
    assert not eager["by_category"][memory_account.OPS_OF_LAQAT] and not exact["by_category"][memory_account.FLA_OPS]
    assert {"laqat::delta_rule_train", "laqat::causal_conv1d", "laqat::layer_norm_gated",
            "laqat::cross_entropy"} <= set(exact_laqat), exact_laqat
    table = memory_account.comparison_table("gdn", [eager, exact]).splitlines()
    labels = [line[:50].strip() for line in table[1:]]
    assert set(memory_account.CATEGORIES) <= set(labels) and "chunk_gated_delta_rule (torch ref.)" in labels


def _partition_only(graph, inputs, **_):
    """Inductor's joint-graph partition (AOTAutograd's min-cut partitioner as Inductor calls it) with the partitioned
    graphs run eagerly: what the Inductor hand-off saves, without Inductor's C++ build."""
    import functools

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    eager = lambda gm, _: make_boxed_func(gm)  # noqa: E731
    return aot_module_simplified(graph, inputs, fw_compiler=eager, bw_compiler=eager,
                                 partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                                compiler="inductor"))


def _inductor_layer_account(tagged: bool):
    """A bf16 KDA layer compiled under the Inductor hand-off (its partition only), with or without the recompute
    tag: what its compiled function saved, and every gradient of one backward."""
    from la_compiler.hand_off import compiler_choice

    setup = dataclasses.replace(SETUP, kind="kda", policy="exact", compiler="inductor")
    model = memory_account.build(setup).to(torch.bfloat16)
    x = torch.randn(2, 70, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch._dynamo.reset()
    layer = torch.compile(model, backend="laqat", options={"policy": "exact", "compiler": "inductor"})
    outputs = []

    def forward():
        outputs.append((layer(x)[0].float() * torch.linspace(-1, 1, 32)).sum())
        return outputs[-1]

    with pytest.MonkeyPatch.context() as patch:
        if not tagged:
            patch.setattr(compiler_choice, "tag_recomputed_ops", lambda graph: 0)
        acc = memory_account.account(forward, model)
    outputs[-1].backward()
    gate = {(s.name.split(".", 1)[1], s.dtype) for s in acc.saved if s.op == "laqat::softplus_gate"}
    return gate, [x.grad] + [p.grad for p in model.parameters()]


def test_the_inductor_hand_off_keeps_the_raw_gate_and_recomputes_the_fp32_decay(monkeypatch):
    """Under the Inductor hand-off a bf16 KDA layer's backward recomputes ``laqat::softplus_gate`` from the raw
    16-bit gate (docs/memory.md, "The gate under Inductor"): the compiled function keeps the raw gate and not the
    fp32 decay, where without the tag (la_compiler/hand_off/recompute_tags.py) it keeps the fp32 decay; every
    gradient is the same bit for bit either way."""
    import torch._inductor.compile_fx as inductor

    monkeypatch.setattr(inductor, "compile_fx", _partition_only)
    tagged, tagged_grads = _inductor_layer_account(True)
    untagged, untagged_grads = _inductor_layer_account(False)
    assert ("g", "bfloat16") in tagged and ("out", "float32") not in tagged, tagged
    assert ("out", "float32") in untagged and ("g", "bfloat16") not in untagged, untagged
    for got, want in zip(tagged_grads, untagged_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
