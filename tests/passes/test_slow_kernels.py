"""No silent slow path on CUDA: every shipped recipe reaches a Triton kernel there, and the lower pass warns
(``SlowKernelWarning``) or refuses (``NoFastKernelError``) where the kernel-selection table falls to a slow kernel
that nobody pinned (docs/policy.md, "Kernel selection").

No kernel runs and no GPU is needed: the graphs' example values are fake CUDA tensors, and the lower pass only reads
their device, dtype and shapes."""
from __future__ import annotations

import dataclasses
import inspect
import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import la_compiler
from la_compiler.ir.delta_rule import DELTA_RULE, LaqatMeta
from la_compiler.ir.spec import KINDS, RecurrenceSpec
from la_compiler.kernels import registry
from la_compiler.kernels.recurrent.variant import FUSED_RECURRENT_MAX_TOKENS_ON_CUDA
from la_compiler.kernels.selection import KernelSelectionError, NoFastKernelError, select_kernel
from la_compiler.passes.annotate import UnmatchedPolicyRuleWarning, annotate
from la_compiler.passes.lower import lower
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy, load_recipe
from la_compiler.recipes import recipe_names
from la_compiler.record import GraphRecord

HEAD_DIM, SEQ_LEN = 128, 4096
MODULE = "model.layers.0.attn"


def laqat_graph(layers, *, device="cuda", dtype=torch.bfloat16, T=SEQ_LEN, K=HEAD_DIM, V=HEAD_DIM, H=2,
                kernel="auto") -> torch.fx.GraphModule:
    """One laqat node per (module, kind) of ``layers``, as the frontends and attach_meta leave it, over fake
    inputs of ``device``."""
    with FakeTensorMode():
        def fake(*shape):
            return torch.empty(shape, dtype=dtype, device=device)

        values = {"q": fake(1, T, H, K), "k": fake(1, T, H, K), "v": fake(1, T, H, V), "beta": fake(1, T, H),
                  "g_gdn": fake(1, T, H), "g_kda": fake(1, T, H, K)}
    graph = torch.fx.Graph()
    args = {}
    for name, value in values.items():
        args[name] = graph.placeholder(name)
        args[name].meta["val"] = value
    outputs = []
    for module, kind in layers:
        spec = RecurrenceSpec(kind=kind, src="fla", kernel=kernel)
        node = graph.call_function(DELTA_RULE, (args["q"], args["k"], args["v"], args[f"g_{kind}"], args["beta"],
                                                None, None, 0.1, spec.to_string()))
        node.meta["laqat"] = LaqatMeta(spec=spec, frontend="fla", module=module)
        outputs.append(node)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def annotated(gm: torch.fx.GraphModule, policy) -> torch.fx.GraphModule:
    """The annotate pass as the backend runs it: the policy resolved into every node's spec."""
    policy = policy if isinstance(policy, Policy) else la_compiler.load_policy(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedPolicyRuleWarning)  # a GDN-only graph meets the KDA rules
        annotate(gm, policy, GraphRecord(0))
    return gm


def laqat_meta(gm: torch.fx.GraphModule) -> list[LaqatMeta]:
    return [node.meta["laqat"] for node in gm.graph.nodes if "laqat" in node.meta]


def lowered(gm: torch.fx.GraphModule, record: GraphRecord | None = None) -> list[warnings.WarningMessage]:
    """Runs the lower pass; the SlowKernelWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lower(gm, record)
    return [w for w in caught if issubclass(w.category, la_compiler.SlowKernelWarning)]


# ---- every shipped recipe reaches a Triton kernel on CUDA ---------------------------------------

def resolves(policy: Policy, kind: str) -> bool:
    try:
        policy.resolve(MODULE, kind)
    except PolicyError:
        return False
    return True


def is_decode_phase(policy: Policy) -> bool:
    return any(policy.resolve(MODULE, kind).phase != "none" for kind in KINDS if resolves(policy, kind))


def with_decode_token(policy: Policy) -> Policy:
    """The recipe with ``decode: {mode: token}`` in its linear_attention cfg (a rule for every module if it has
    none)."""
    config = policy.to_dict()
    for rule in config["linear_attention"]:
        rule["cfg"]["decode"] = {**rule["cfg"].get("decode", {}), "mode": "token"}
    if not config["linear_attention"]:
        config["linear_attention"] = [{"module_name": "*", "cfg": {"decode": {"mode": "token"}}}]
    return Policy.from_dict(config, name=f"{policy.name}+decode_token")


def recipe_cases():
    """(recipe, phase): a prefill recipe as itself and with a decode phase; a decode-phase recipe as itself."""
    for name in recipe_names():
        phases = ("decode",) if is_decode_phase(load_recipe(name)) else ("prefill", "decode")
        yield from ((name, phase) for phase in phases)


def phase_policy(name: str, phase: str) -> Policy:
    policy = load_recipe(name)
    return with_decode_token(policy) if phase == "decode" and not is_decode_phase(policy) else policy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name, phase", list(recipe_cases()), ids=lambda x: x)
def test_every_recipe_runs_on_a_triton_kernel_on_cuda(name, phase, kind, dtype):
    policy = phase_policy(name, phase)
    if not resolves(policy, kind):  # a profile of one kind (vllm_kda_state_bf16): refused for the other, by design
        with pytest.raises(PolicyError, match=r"serving\.model: .* is vLLM's KDA profile; this recurrence is gdn"):
            policy.resolve(MODULE, kind)
        assert (name, kind) == ("vllm_kda_state_bf16", "gdn")
        return
    (meta,) = laqat_meta(annotated(laqat_graph([(MODULE, kind)], dtype=dtype), policy))
    spec = meta.spec.replace(kernel="auto")
    context = dict(device="cuda", dtype=dtype, head_k=HEAD_DIM, head_v=HEAD_DIM, requested=meta.requested_backend,
                   family=meta.requested_family, seq_len=SEQ_LEN)
    if spec.phase != "none" and any(site != "state" for site, _ in spec.quant):
        # the decode-phase kernels round the state only (the prefix is the exact recurrence): W / GEMM-operand
        # rounding in a decode phase is refused by every decode variant, never run slowly (docs/decode_phase.md)
        with pytest.raises(KernelSelectionError, match="decode-phase kernels round the state only"):
            select_kernel(spec, **context)
        return
    try:
        choice, error = select_kernel(spec, **context), None
    except KernelSelectionError as e:
        choice, error = None, str(e)
    assert choice is not None, f"{name} ({phase}, {kind}, {dtype}): no kernel at all: {error}"
    assert registry.get_variant(choice.variant).implementation == "triton", (
        f"{name} ({phase}, {kind}, {dtype}): {spec} falls to a torch kernel on CUDA:\n{choice.explain()}")


# ---- the lower pass: a slow kernel nobody pinned ------------------------------------------------

def test_the_fp64_reference_on_cuda_warns_once_per_compile_naming_every_layer():
    layers = [("model.layers.0.attn", "gdn"), ("model.layers.1.attn", "gdn"), ("model.layers.2.attn", "kda")]
    gm = annotated(laqat_graph(layers, dtype=torch.float64), "exact")  # float64: no Triton kernel takes it
    record = GraphRecord(0)
    caught = lowered(gm, record)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith("laqat: on CUDA the kernel-selection table sent 3 layers to slow kernels that the "
                              "policy did not pin")
    # identical layers share one entry; each entry names its modules, the kernel, the cost and the rejections
    assert "- modules 'model.layers.0.attn', 'model.layers.1.attn' (gdn; float64, K=128, V=128, T=4096): " \
           "reference, reference is the fp64 torch reference" in message
    assert "- module 'model.layers.2.attn' (kda; float64, K=128, V=128, T=4096): reference" in message
    assert message.count("orders of magnitude slower than the Triton kernels") == 2
    assert "not chunk: it computes in fp32: float64 inputs would come back at fp32 accuracy" in message
    assert "not fla_chunk: " in message and "not fused_recurrent: " in message
    assert "pin it for these modules: linear_attention cfg `backend: reference` (or `solve: {implementation: " \
           "torch}`)" in message
    assert caught[0].filename == __file__, "the warning points at the code that ran the compile, not at laqat"
    assert record.notes == [message]
    assert [m.spec.kernel for m in laqat_meta(gm)] == ["reference"] * 3


def test_head_dims_no_triton_kernel_holds_warn():
    gm = annotated(laqat_graph([(MODULE, "kda")], V=512), "state_fp8")
    (caught,) = lowered(gm)
    assert "(kda; bfloat16, K=128, V=512, T=4096): reference" in str(caught.message)
    assert "head_v above 256" in str(caught.message)


@pytest.mark.parametrize("pin", [
    {"backend": "reference"},
    {"solve": {"method": "exact", "implementation": "torch"}},
])
def test_a_pinned_reference_says_nothing(pin):
    policy = {"linear_attention": [{"module_name": "*", "cfg": pin}]}
    gm = annotated(laqat_graph([(MODULE, "gdn")], dtype=torch.float64), policy)
    assert lowered(gm) == []
    assert laqat_meta(gm)[0].spec.kernel == "reference"


def test_a_spec_naming_its_kernel_is_pinned():
    gm = annotated(laqat_graph([(MODULE, "gdn")], dtype=torch.float64, kernel="reference"), "exact")
    assert lowered(gm) == []


def test_nothing_on_the_cpu():
    gm = annotated(laqat_graph([(MODULE, "gdn")], device="cpu", dtype=torch.float64), "exact")
    assert lowered(gm) == []
    assert laqat_meta(gm)[0].spec.kernel == "reference"


@pytest.fixture
def chunk_without_state_rounding(monkeypatch):
    """The chunk kernels as if they had no state rounding: a numerics field only the reference implements."""
    chunk = registry.get_variant("chunk")

    def supports(spec, ctx):
        return "no state rounding (test)" if "state" in spec.quant_map else chunk.supports(spec, ctx)

    monkeypatch.setitem(registry._VARIANTS, "chunk", dataclasses.replace(chunk, supports=supports))


def test_the_reference_where_only_numerics_keep_the_triton_kernels_off_is_refused(chunk_without_state_rounding):
    layers = [("model.layers.0.attn", "gdn"), ("model.layers.1.attn", "gdn")]
    gm = annotated(laqat_graph(layers), "state_fp8")
    with pytest.raises(NoFastKernelError) as info:
        lowered(gm)
    message = str(info.value)
    assert isinstance(info.value, la_compiler.NoFastKernelError) and isinstance(info.value, KernelSelectionError)
    assert message.startswith("laqat: on CUDA no Triton kernel implements the numerics of 2 layers, and the policy "
                              "did not pin the fp64 torch reference")
    assert "- modules 'model.layers.0.attn', 'model.layers.1.attn' (gdn; bfloat16, K=128, V=128, T=4096): " \
           "reference" in message
    assert "not chunk: no state rounding (test)" in message
    assert ("the Triton kernels run these inputs without q.state=fp8_e4m3/tile64 (quant_cfg: the "
            "gdn_state_quantizer)") in message
    assert re.search(r"to do: set that field to what the Triton kernels implement .* or pin the reference for "
                     r"these modules to run it knowingly: linear_attention cfg `backend: reference`", message)


def test_a_refusal_is_lifted_by_pinning_the_reference(chunk_without_state_rounding):
    policy = load_recipe("state_fp8").to_dict()
    policy["linear_attention"][0]["cfg"]["backend"] = "reference"
    gm = annotated(laqat_graph([(MODULE, "gdn")]), policy)
    assert lowered(gm) == []
    assert laqat_meta(gm)[0].spec.kernel == "reference"


@pytest.fixture
def token_by_token_for_any_length(monkeypatch):
    """The table as if the token-by-token kernel took exact specs of any length on CUDA (it refuses those longer than
    FUSED_RECURRENT_MAX_TOKENS_ON_CUDA): for KDA, FLA's kernel gives way to laqat's, and fused_recurrent is tried
    before chunk."""
    recurrent = registry.get_variant("fused_recurrent")
    monkeypatch.setitem(registry._VARIANTS, "fused_recurrent", dataclasses.replace(
        recurrent, supports=lambda spec, ctx: None if spec.is_exact else "exact only (test)"))


@pytest.mark.parametrize("seq_len, warns", [(FUSED_RECURRENT_MAX_TOKENS_ON_CUDA, False),
                                            (FUSED_RECURRENT_MAX_TOKENS_ON_CUDA + 1, True), (SEQ_LEN, True)])
def test_a_token_by_token_kernel_on_a_long_sequence_warns(token_by_token_for_any_length, seq_len, warns):
    gm = annotated(laqat_graph([(MODULE, "kda")], T=seq_len), "exact")
    caught = lowered(gm)
    assert laqat_meta(gm)[0].spec.kernel == "fused_recurrent"
    assert len(caught) == int(warns)
    if warns:
        message = str(caught[0].message)
        assert (f"(kda; bfloat16, K=128, V=128, T={seq_len}): fused_recurrent, fused_recurrent walks each sequence "
                f"token by token: {seq_len} dependent steps where the chunk kernels run {-(-seq_len // 64)} "
                f"chunks") in message
        assert "`backend: fused_recurrent` (or `solve: {implementation: triton}`)" in message
        assert caught[0].filename == __file__


def test_a_pinned_token_by_token_kernel_says_nothing(token_by_token_for_any_length):
    policy = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "fused_recurrent"}}]}
    gm = annotated(laqat_graph([(MODULE, "kda")]), policy)
    assert lowered(gm) == []
    assert laqat_meta(gm)[0].spec.kernel == "fused_recurrent"


def test_the_decode_phase_kernels_say_nothing():
    """They chunk the prefix; the decode suffix runs token by token by definition."""
    for recipe in ("decode_token_state_fp8", "vllm_kda_state_bf16"):
        gm = annotated(laqat_graph([(MODULE, "kda")]), recipe)
        assert lowered(gm) == []
        assert registry.get_variant(laqat_meta(gm)[0].spec.kernel).implementation == "triton"


def test_fast_kernels_say_nothing():
    gm = annotated(laqat_graph([(MODULE, "gdn"), ("model.layers.1.attn", "kda")]), "exact")
    assert lowered(gm) == []
    assert registry.get_variant(laqat_meta(gm)[1].spec.kernel).implementation == "triton"


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 0.5, "gdn[src=user]")[0]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attention()

    def forward(self, *args):
        return self.attn(*args) * 2


def test_through_torch_compile_the_warning_points_at_the_users_call(monkeypatch):
    """The backend as the user meets it, on this CPU: the lower pass told the device is CUDA (the reference then runs
    on the CPU, 8 tokens in float64)."""
    import la_compiler.passes.lower as lower_pass

    on_cpu = lower_pass.slow_kernel
    monkeypatch.setattr(lower_pass, "slow_kernel", lambda *args, **kwargs: on_cpu(*args, **{**kwargs, "device": "cuda"}))
    inputs = [torch.randn(1, 8, 2, 8, dtype=torch.float64) for _ in range(3)]
    inputs += [-torch.rand(1, 8, 2, dtype=torch.float64), torch.rand(1, 8, 2, dtype=torch.float64)]
    model = torch.compile(_Model(), backend="laqat", options={"compiler": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        model(*inputs)
    (warning,) = [w for w in caught if issubclass(w.category, la_compiler.SlowKernelWarning)]
    assert "- module 'attn' (gdn; float64, K=8, V=8, T=8): reference" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)
