"""Every tensor saved for the backward by one training forward, attributed to the op that saved it: compiled with
laqat, and for FLA's causal LMs also eager FLA and plain torch.compile, side by side.

    python examples/benchmarks/memory_account.py --model fla-lm --family gdn --out out/memory_gdn.json  # CUDA
    python examples/benchmarks/memory_account.py --model fla-lm --family kda --policy exact,state_fp8 --inductor
    python examples/benchmarks/memory_account.py --model fla-lm --family gdn --layers 2 --hidden 32 --heads 2 \
        --head-dim 16 --seq 70 --device cpu --dtype float32                        # tiny, Triton's interpreter
    python examples/benchmarks/memory_account.py                              # a GDN and a KDA FLA layer, exact
    python examples/benchmarks/memory_account.py --policy state_fp8 --out out/memory.json
    python examples/benchmarks/memory_account.py --model lm --compiler inductor
    python examples/benchmarks/memory_account.py --device cuda --dtype bfloat16 --snapshot out/memory.pickle
    python examples/benchmarks/memory_account.py --model fla-lm --family gdn --peak-breakdown  # CUDA: the peak's
        # blocks by the code that allocated them (peak_breakdown.py)

After the forward, the autograd graph is walked from the output: each node's saved tensors (a Python
``autograd.Function``'s ``saved_tensors`` and the tensors it keeps as ``ctx`` attributes, which no hook packs: FLA's
functions and laqat's ops, which register theirs with ``torch.library.register_autograd``; a built-in node's
``_saved_*`` fields; AOTAutograd's ``CompiledFunctionBackward`` for what Inductor compiled), with shape, dtype and
bytes; a storage saved twice counts once (at the first node of a depth-first walk from the loss), a parameter's not
at all (it lives anyway), a Python number an op keeps (``x * 2.0``) not at all. ``saved_tensors_hooks`` records
what was packed (tensors, and their storages' bytes), so a tensor the walk does not reach shows as a difference.
Each laqat op's calls are recorded at the op's kernel (so also inside Inductor's compiled code), and a saved tensor
that is one of a call's inputs or outputs is named by it (``laqat::delta_rule_train.residual``). The recorder keeps
those tensors alive until the account is taken (no storage is reused under another tensor's name), so an account is
not a peak measurement; on CUDA ``--snapshot`` also records the allocator's history
(``torch.cuda.memory._record_memory_history``).

Every saved tensor falls into one category (``CATEGORIES``): ``laqat ops`` (a laqat op's autograd node, or what
Inductor's compiled function kept of a laqat op call's inputs and outputs), ``FLA module ops`` (an FLA
``autograd.Function``, by its class: ``ChunkGatedDeltaRuleFunction``, ``LayerNormFunction``,
``CausalConv1dFunction``, ``FusedCrossEntropyFunction``, ...), ``Inductor-compiled rest`` (the rest of what a
``CompiledFunctionBackward`` kept) and ``torch ops`` (a built-in node: the inputs and activations of the torch ops
around them).

``--model fla-lm``: model_bench.py's model (its ``build_model``: FLA's ``GatedDeltaNetForCausalLM`` /
``KDAForCausalLM`` with FLA's default fusions, at its shape unless given: 4 layers, hidden 1024, 8 heads of 128,
B = 2, T = 4096, vocab 32000, bf16 on CUDA), one forward with labels (so the loss's fused or fused-linear
cross-entropy is in it) per row, model_bench.py's rows: ``eager FLA`` (the uncompiled model), ``laqat <recipe>``
for each ``--policy`` (the backend's default hand-off: Inductor on CUDA, eager on the CPU; ``--compiler`` names
one), and with ``--inductor`` ``torch.compile (Inductor)`` (FLA's functions are traced through laqat's
substitutions, installed by importing laqat, so its ops are laqat's ops without the rewrite; as in
model_bench.py). On CUDA each row then runs a forward and backward twice (the first compiles and autotunes what
is left) and reports from the second the memory the forward leaves allocated and the peak above the allocation
before it (``torch.cuda.max_memory_allocated``; the parameters' gradients, which the backward allocates, are in
it). GDN's eager and Inductor rows run FLA's chunk backward past its Hopper guard where FLA refuses the machine
(wrong gradients, the same memory). On the CPU, where FLA's Triton kernels do not run, the eager row runs FLA's
torch references instead, as the tests run eager FLA models (tests/passes/fla_oracle.py's ``naive_fla``: FLA's naive
recurrences and gate functions, ``F.conv1d``, ``rms_norm_ref``, ``F.cross_entropy``); the nodes each reference
creates count as the FLA function it stands in for (``chunk_gated_delta_rule (torch ref.)``), so on the CPU the
eager row shows what the references save, not FLA's kernels.

Prints a table (``fla-lm``: per family, MiB per category, per laqat op and FLA op, and each row minus eager FLA)
and writes JSON (``--out``): per row every saved tensor (node, slot, name, shape, dtype, bytes, category, op) and
the totals. docs/memory.md states what laqat's ops save and how to read the comparison;
tests/la_compiler/test_saved_tensors.py checks both with this module.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # laqat's Triton kernels run in the CPU interpreter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ensure_la_compiler  # noqa: E402
from peak_breakdown import format_breakdown, live_at_peak  # noqa: E402

# names of the outputs of laqat's ops (their schemas leave them unnamed); others read "output <i>"
OUTPUT_NAMES = {
    "laqat::delta_rule_train": ("o", "final_state", "residual"),
    "laqat::delta_rule_phased_train": ("o", "final_state", "residual"),
    "laqat::delta_rule_eval": ("o", "final_state"),
    "laqat::causal_conv1d": ("y", "final_state"),
    "laqat::layer_norm_gated": ("y",),
    "laqat::layer_norm": ("y",),
    "laqat::layer_norm_residual": ("y", "residual_out"),
    "laqat::glu_linear": ("out",),
    "laqat::l2_norm": ("y", "rstd"),
    "laqat::softplus_gate": ("out",),
    "laqat::cross_entropy": ("loss", "z_loss", "lse"),
    "laqat::fused_linear_cross_entropy": ("loss", "dx", "dweight", "dbias"),
    "laqat::log_decay": ("log",),
}
# what saved a tensor, the lines of the comparison table
OPS_OF_LAQAT = "laqat ops"  # laqat's custom ops (their autograd, or what Inductor kept of their calls' tensors)
FLA_OPS = "FLA module ops"  # FLA's autograd.Functions (norms, gated norms, convolutions, cross-entropy, the rule)
INDUCTOR_REST = "Inductor-compiled rest"  # the rest of what AOTAutograd's compiled forwards kept
TORCH_OPS = "torch ops"  # built-in autograd nodes of ops outside those: their inputs and activations
CATEGORIES = (OPS_OF_LAQAT, FLA_OPS, INDUCTOR_REST, TORCH_OPS)
_LAQAT_NODE = re.compile(r"GeneratedBackwardFor_laqat_(\w+)_defaultBackward")


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    node: str  # the autograd node that saved it ("laqat::delta_rule_train" for laqat's ops)
    slot: str  # its place in the node: "saved[i]" or the built-in field ("_saved_self")
    name: str  # what it is: "<laqat op>.<argument or output>" where a laqat op's call holds it, else ""
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # of its storage; 0 for a parameter's, and where an earlier entry holds the same storage
    parameter: str = ""  # the model's parameter or buffer whose storage it is
    category: str = ""  # one of CATEGORIES
    op: str = ""  # within the category: the laqat op, FLA's Function (or the FLA function a torch reference stands
    #               in for), else the autograd node


    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Account:
    saved: list[SavedTensor]
    packed: int  # tensors saved_tensors_hooks saw packed during the forward
    packed_bytes: int = 0  # their storages', each once, parameters' and buffers' not counted

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

    @property
    def walked(self) -> list[SavedTensor]:
        """What autograd packed: the saved tensors less those a Python Function keeps as ``ctx`` attributes."""
        return [s for s in self.saved if not s.slot.startswith("ctx.")]

    def by_category(self) -> dict[str, dict[str, int]]:
        """category -> op -> bytes, in CATEGORIES' order; ops largest first."""
        out: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        for s in self.saved:
            ops = out[s.category]
            ops[s.op] = ops.get(s.op, 0) + s.bytes
        return {c: dict(sorted(ops.items(), key=lambda kv: -kv[1])) for c, ops in out.items()}

    def of(self, node: str) -> list[SavedTensor]:
        return [s for s in self.saved if s.node == node]

    def by_node(self) -> dict[str, tuple[int, int]]:
        """node -> (tensors, bytes), largest first."""
        out: dict[str, list[int]] = {}
        for s in self.saved:
            entry = out.setdefault(s.node, [0, 0])
            entry[0] += 1
            entry[1] += s.bytes
        return dict(sorted(((k, tuple(v)) for k, v in out.items()), key=lambda kv: -kv[1][1]))

    def as_dict(self) -> dict:
        return {"total_bytes": self.total_bytes, "saved": [s.as_dict() for s in self.saved], "packed": self.packed,
                "packed_bytes": self.packed_bytes,
                "by_node": {k: {"tensors": n, "bytes": b} for k, (n, b) in self.by_node().items()},
                "by_category": self.by_category()}


@dataclasses.dataclass
class _Call:
    op: str
    tensors: dict[str, torch.Tensor]  # argument or output name -> tensor (kept alive)


def _tensors_of(op: str, schema, args, kwargs, result) -> dict[str, torch.Tensor]:
    named = dict(zip((a.name for a in schema.arguments), args))
    named.update(kwargs)
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    names = OUTPUT_NAMES.get(op, ())
    for i, out in enumerate(outputs):
        named[names[i] if i < len(names) else f"output {i}"] = out
    return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def laqat_op_calls():
    """Records every call of a laqat custom op (``laqat::*``) at its kernel, eager or from compiled code."""
    from torch._library.custom_ops import OPDEFS

    calls: list[_Call] = []
    replaced = []
    for qualname, op in list(OPDEFS.items()):
        if not qualname.startswith("laqat::"):
            continue
        for device, kernel in list(op._backend_fns.items()):
            def recording(*args, _op=qualname, _kernel=kernel, _schema=op._opoverload._schema, **kwargs):
                result = _kernel(*args, **kwargs)
                calls.append(_Call(_op, _tensors_of(_op, _schema, args, kwargs, result)))
                return result
            op._backend_fns[device] = recording
            replaced.append((op, device, kernel))
    try:
        yield calls
    finally:
        for op, device, kernel in replaced:
            op._backend_fns[device] = kernel


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _name_in_calls(t: torch.Tensor, calls: list[_Call], prefer: str | None) -> str:
    """``<op>.<name>`` of the laqat call argument or output that ``t`` is (same storage, offset, shape and strides;
    an empty tensor by shape and dtype within the node's own op); outputs before inputs, the node's own op first."""
    key = _storage_key(t)
    ordered = sorted(calls, key=lambda c: c.op != prefer)
    for call in ordered:
        for name, x in reversed(list(call.tensors.items())):  # outputs were added last
            if t.numel() == 0:
                if call.op == prefer and x.numel() == 0 and x.shape == t.shape and x.dtype == t.dtype:
                    return f"{call.op}.{name}"
            elif (_storage_key(x) == key and x.shape == t.shape and x.stride() == t.stride()
                  and x.storage_offset() == t.storage_offset()):
                return f"{call.op}.{name}"
    return ""


def _ctx_tensors(node) -> list[tuple[str, object]]:
    """What a Python Function keeps on its ``ctx`` besides ``save_for_backward`` (FLA's functions keep
    ``cu_seqlens`` and chunk indices there): no hook packs those, the node holds them all the same."""
    out = []
    for attr, value in vars(node).items():
        if isinstance(value, torch.Tensor):
            out.append((f"ctx.{attr}", value))
        elif isinstance(value, (list, tuple)):
            out += [(f"ctx.{attr}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return out


def _saved_of(node) -> list[tuple[str, object]]:
    """(slot, value) of what ``node`` saved: a Python node's ``saved_tensors`` and tensors on its ``ctx``, a
    built-in node's ``_saved_*``."""
    if hasattr(node, "saved_tensors"):
        return [(f"saved[{i}]", t) for i, t in enumerate(node.saved_tensors)] + _ctx_tensors(node)
    out = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            value = getattr(node, attr)
            if isinstance(value, (list, tuple)):
                out += [(f"{attr}[{i}]", v) for i, v in enumerate(value)]
            else:
                out.append((attr, value))
    return out


def node_name(node) -> str:
    match = _LAQAT_NODE.fullmatch(node.name())
    return f"laqat::{match.group(1)}" if match else node.name()


def fla_function(node) -> str:
    """The class name of the FLA ``autograd.Function`` whose backward ``node`` is, else ""."""
    cls = getattr(node, "_forward_cls", None)
    return cls.__name__ if cls is not None and cls.__module__.startswith("fla.") else ""


def attribute(node, name: str, saved_name: str, regions: dict) -> tuple[str, str]:
    """(category, op) of a tensor ``node`` saved; ``saved_name`` names it by a laqat op call, ``regions`` maps
    the nodes a stand-in for an FLA function created to that function."""
    if name.startswith("laqat::"):
        return OPS_OF_LAQAT, name
    if fla_function(node):
        return FLA_OPS, fla_function(node)
    if node in regions:
        return FLA_OPS, regions[node]
    if name == "CompiledFunctionBackward":
        # what the partitioner kept of a laqat op call's inputs and outputs counts as the op's
        return (OPS_OF_LAQAT, saved_name.split(".")[0]) if saved_name else (INDUCTOR_REST, name)
    return TORCH_OPS, name


def _is_python_number(slot: str, t: torch.Tensor, packed: set | None) -> bool:
    """A Python scalar operand (``x * 2.0``) that a built-in node keeps as a 0-dim CPU tensor: no hook packs it
    (``packed``: the storages the hooks saw; None: unknown, then nothing is taken for a number)."""
    return (packed is not None and slot.startswith("_saved_") and t.dim() == 0 and t.device.type == "cpu"
            and t.dtype in (torch.float64, torch.int64, torch.complex128) and _storage_key(t) not in packed)


def walk_saved(output: torch.Tensor, calls: list[_Call], parameters: dict | None = None,
               regions: dict | None = None, packed: set | None = None) -> list[SavedTensor]:
    """Every tensor the autograd graph behind ``output`` saved, in the order of a depth-first walk from it;
    ``parameters``: storage key -> name of the tensors that live anyway; ``regions``: see ``attribute``;
    ``packed``: the storages saved_tensors_hooks packed (to tell Python numbers from 0-dim tensors)."""
    parameters, regions = parameters or {}, regions or {}
    saved, counted, seen = [], set(parameters), set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node_name(node)
        for slot, t in _saved_of(node):
            if not isinstance(t, torch.Tensor) or _is_python_number(slot, t, packed):
                continue
            key = _storage_key(t)
            fresh = t.numel() == 0 or key not in counted
            counted.add(key)
            saved_name = _name_in_calls(t, calls, name)
            category, op = attribute(node, name, saved_name, regions)
            saved.append(SavedTensor(name, slot, saved_name, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                     key[1] if fresh else 0, parameters.get(key, ""), category, op))
        stack.extend(fn for fn, _ in reversed(node.next_functions))
    return saved


def parameter_storages(model: torch.nn.Module | None) -> dict[tuple[int, int], str]:
    if model is None:
        return {}
    return {_storage_key(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}


def account(forward: Callable[[], torch.Tensor], model: torch.nn.Module | None = None,
            regions: dict | None = None) -> Account:
    """Runs ``forward`` (it returns a tensor that needs a gradient) and accounts for what its graph saved;
    ``model``'s parameters and buffers are named as such and count no bytes; ``regions``: see ``attribute``."""
    packed = {}  # storage key -> bytes, of every tensor autograd packed
    count = []

    def pack(t):
        count.append(1)
        packed[_storage_key(t)] = _storage_key(t)[1]
        return t

    with laqat_op_calls() as calls, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    parameters = parameter_storages(model)
    packed_bytes = sum(b for key, b in packed.items() if key not in parameters)
    return Account(walk_saved(out, calls, parameters, regions, set(packed)), len(count), packed_bytes)


def table(acc: Account, title: str) -> str:
    lines = [f"{title}: {len(acc.saved)} saved tensors ({acc.packed} packed), {acc.total_bytes / 2**20:.3f} MiB",
             f"  {'node':48s} {'slot':18s} {'what':34s} {'shape':22s} {'dtype':9s} {'bytes':>10s}"]
    for s in acc.saved:
        what = s.name or (f"parameter {s.parameter}" if s.parameter else "")
        lines.append(f"  {s.node[:48]:48s} {s.slot[:18]:18s} {what[:34]:34s} {str(list(s.shape)):22s} "
                     f"{s.dtype:9s} {s.bytes:10d}")
    lines.append("  by node: " + ", ".join(f"{k} {n} / {b}" for k, (n, b) in acc.by_node().items()))
    return "\n".join(lines)


# ---- the models ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    """One compiled forward to account for."""

    model: str = "layer"  # "layer": one FLA layer (GatedDeltaNet / KimiDeltaAttention); "lm": a tiny 2-layer LM
    kind: str = "gdn"
    policy: str = "exact"
    compiler: str | None = None  # None: the backend's choice
    batch: int = 2
    seq: int = 70
    hidden: int = 32
    heads: int = 2
    head_dim: int = 16
    device: str = "cpu"
    dtype: str = "float32"


def build(setup: Setup) -> torch.nn.Module:
    torch.manual_seed(0)
    if setup.model == "lm":
        from la_compiler.tiny_models import TinyConfig, TinyHybridLM

        return TinyHybridLM(TinyConfig(hidden_size=setup.hidden, num_heads=setup.heads, head_dim=setup.head_dim,
                                       layers=(setup.kind,) * 2))
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    layer = GatedDeltaNet if setup.kind == "gdn" else KimiDeltaAttention
    return layer(hidden_size=setup.hidden, num_heads=setup.heads, head_dim=setup.head_dim, expand_v=1,
                 use_short_conv=True, layer_idx=0)


def compiled_account(setup: Setup) -> tuple[Account, list]:
    """The account of one forward of ``setup``'s model compiled with laqat, and the records of its graphs."""
    ensure_la_compiler()
    import la_compiler.backend

    device, dtype = torch.device(setup.device), getattr(torch, setup.dtype)
    model = build(setup).to(device, dtype)
    options = {"policy": setup.policy}
    if setup.compiler is not None:
        options["compiler"] = setup.compiler
    torch._dynamo.reset()
    if setup.model == "lm":
        tokens = torch.randint(0, model.cfg.vocab_size, (setup.batch, setup.seq + 1), device=device)
        loss = torch.compile(model.loss, backend="laqat", options=options)
        forward = lambda: loss(tokens)  # noqa: E731
    else:
        x = torch.randn(setup.batch, setup.seq, setup.hidden, device=device, dtype=dtype, requires_grad=True)
        layer = torch.compile(model, backend="laqat", options=options)
        forward = lambda: layer(x)[0].float().sum()  # noqa: E731  (the sum saves no tensor)
    start = len(la_compiler.backend.last_record().graphs)
    acc = account(forward, model)
    return acc, la_compiler.backend.last_record().graphs[start:]


# ---- FLA's causal LMs: eager FLA against the compiled rows ------------------------------------

REPO = Path(__file__).resolve().parents[2]
FLA_LM_SHAPE = dict(layers=4, hidden=1024, heads=8, head_dim=128, batch=2, seq=4096, vocab=32000)  # model_bench's
LAYER_SHAPE = dict(layers=2, hidden=32, heads=2, head_dim=16, batch=2, seq=70, vocab=32000)
EAGER_ROW, INDUCTOR_ROW = "eager FLA", "torch.compile (Inductor)"  # model_bench.py's row names


def _model_bench():
    """examples/benchmarks/model_bench.py: its model builder and its rows' plans."""
    import model_bench

    return model_bench


def _tensors_in(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _nodes_behind(outputs: list[torch.Tensor], stop: set):
    """The autograd nodes behind ``outputs`` up to (without) the nodes in ``stop``."""
    seen, stack = set(), [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        yield node
        stack.extend(fn for fn, _ in node.next_functions)


def _labelled(fn, label: str, regions: dict):
    """``fn``, recording every autograd node a call of it creates under ``label`` (an inner call's label stays)."""
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        inputs = {t.grad_fn for t in _tensors_in((args, kwargs))}
        for node in _nodes_behind(_tensors_in(result), inputs):
            regions.setdefault(node, label)
        return result
    return call


def _fla_attributes() -> dict:
    """(module or class, name) -> value, for every attribute of FLA's loaded modules and of their classes."""
    out = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("fla."):
            continue
        for name, value in list(vars(module).items()):
            out[module, name] = value
            if isinstance(value, type) and value.__module__ == module_name:
                out.update(((value, attr), v) for attr, v in vars(value).items())
    return out


@contextlib.contextmanager
def fla_torch_references(regions: dict):
    """Eager FLA on the CPU: FLA's kernels replaced by FLA's torch references, as the tests run eager FLA models
    (tests/passes/fla_oracle.py's ``naive_fla``). Every autograd node a reference creates is recorded in ``regions``
    under the FLA function it stands in for (``chunk_gated_delta_rule (torch ref.)``)."""
    sys.path.insert(0, str(REPO))
    from tests.passes.fla_oracle import naive_fla

    before = _fla_attributes()
    with naive_fla():
        replaced = [(owner, name, value) for (owner, name), value in _fla_attributes().items()
                    if (owner, name) in before and before[owner, name] is not value]
        for owner, name, reference in replaced:
            what = name if owner.__class__.__name__ == "module" else f"{owner.__name__}.{name}"
            setattr(owner, name, _labelled(reference, f"{what} (torch ref.)", regions))
        try:
            yield
        finally:
            for owner, name, reference in replaced:
                setattr(owner, name, reference)


def cuda_step_memory(step: Callable[[], torch.Tensor], model: torch.nn.Module) -> dict:
    """CUDA: one forward and backward (the second of two: the first compiles and autotunes what is left), what the
    forward leaves allocated (the saved tensors, the loss) and the peak above the allocation before it (with the
    parameters' gradients, which the backward allocates)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        del loss
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    model.zero_grad(set_to_none=True)
    return {"held_after_forward_bytes": held, "peak_extra_bytes": peak}


def peak_breakdown(step: Callable[[], torch.Tensor], model: torch.nn.Module) -> dict:
    """CUDA: what is alive at the peak of one more forward and backward, by allocating code (peak_breakdown.py)."""
    def forward_backward():
        model.zero_grad(set_to_none=True)
        step().backward()

    result = live_at_peak(forward_backward)
    model.zero_grad(set_to_none=True)
    return result


def lm_row_names(policies: list[str], inductor: bool) -> list[str]:
    return [EAGER_ROW, *(f"laqat {p}" for p in policies), *((INDUCTOR_ROW,) if inductor else ())]


def _compiled(model, backend: str | None, policy, compiler: str | None):
    if backend is None:
        return model
    if backend == "inductor":
        return torch.compile(model)
    options = {"policy": policy} if compiler is None else {"policy": policy, "compiler": compiler}
    return torch.compile(model, backend="laqat", options=options)


@contextlib.contextmanager
def _row_context(references: bool, prefix: bool, lift: bool, ids: torch.Tensor, regions: dict):
    """What a row's forwards run under: FLA's torch references (the CPU's eager row), a decode phase (the first half
    of every sequence its prefix, as in model_bench.py), FLA's GDN backward past its guard."""
    import la_compiler
    from bench_common import fla_gdn_guard_lifted

    B, T = ids.shape
    with contextlib.ExitStack() as stack:
        stack.enter_context(fla_gdn_guard_lifted(lift))
        if prefix:
            stack.enter_context(la_compiler.phase(prefill_lengths=[T // 2] * B, sequence_lengths=[T] * B))
        if references:
            stack.enter_context(fla_torch_references(regions))
        yield


def lm_row(name: str, family: str, base: torch.nn.Module, ids: torch.Tensor, args) -> dict:
    """The account of one row (model_bench.py's row ``name``) of ``family``'s LM: one forward with labels; on CUDA
    also the memory of a forward and backward."""
    import la_compiler.backend
    from bench_common import fla_gdn_blocker

    planned, why = _model_bench().plan(name, family)
    if planned is None:
        return {"family": family, "row": name, "skipped": why}
    backend, policy, prefix = planned
    cuda = ids.is_cuda
    record = {"family": family, "row": name}
    # FLA's GDN chunk backward refuses some Hopper/Triton pairs; past its guard it computes wrong gradients in the
    # same memory, which is all this measures
    lift = cuda and family == "gdn" and backend != "laqat" and fla_gdn_blocker()
    if lift:
        record["note"] = f"FLA's GDN chunk backward past its guard (memory only): {lift}"
    model = copy.deepcopy(base).to(getattr(torch, args.dtype))
    torch._dynamo.reset()
    fn = _compiled(model, backend, policy, args.compiler)
    regions: dict = {}
    step = lambda: fn(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
    start = len(la_compiler.backend.last_record().graphs)
    with _row_context(backend is None and not cuda, prefix, bool(lift), ids, regions):
        acc = account(step, model, regions)
        memory = cuda_step_memory(step, model) if cuda else {}
        if cuda and args.peak_breakdown:
            record["peak_breakdown"] = peak_breakdown(step, model)
            print(format_breakdown(f"{family} {name}", record["peak_breakdown"]), flush=True)
    graphs = la_compiler.backend.last_record().graphs[start:]
    if backend == "laqat":
        record["hand_off"] = sorted({f"{g.hand_off} ({g.hand_off_reason})" for g in graphs})
        record["specs"] = [m.spec for g in graphs for m in g.matches]
    record.update(**memory, **acc.as_dict())
    return record


def lm_rows(family: str, names: list[str], args) -> list[dict]:
    device = torch.device(args.device)
    base = _model_bench().build_model(family, args).to(device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            rows.append(lm_row(name, family, base, ids, args))
        except Exception as e:  # a failing row is a result to report
            rows.append({"family": family, "row": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        rows[-1]["seconds"] = round(time.perf_counter() - start, 1)  # compiles and autotuning included
        print(f"{family} {name} ({rows[-1]['seconds']} s): " + (rows[-1].get("error") or rows[-1].get("skipped") or
                                      f"{rows[-1]['total_bytes'] / 2**20:.3f} MiB saved"), flush=True)
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _mib(n: int | None) -> str:
    return f"{'-':>10}" if n is None else f"{n / 2**20:10.3f}"


def _delta(n: int | None, eager: int | None) -> str:
    return f"{'':>10}" if n is None or eager is None else f"{(n - eager) / 2**20:+10.3f}"


def comparison_lines(family: str, rows: list[dict]) -> list[tuple[str, list[int | None]]]:
    """(label, bytes per row) of the comparison table: each category and its ops, the totals, and on CUDA the
    memory the forward leaves allocated and the peak extra."""
    cats = [r.get("by_category", {}) for r in rows]
    lines = []
    for category in CATEGORIES:
        lines.append((category, [None if not c else sum(c[category].values()) for c in cats]))
        if category in (OPS_OF_LAQAT, FLA_OPS):
            ops = dict.fromkeys(op for c in cats if c for op in c[category])
            lines += [(f"  {op}", [None if not c else c[category].get(op, 0) for c in cats]) for op in ops]
    lines.append(("all saved tensors", [r.get("total_bytes") for r in rows]))
    lines.append(("  packed by saved_tensors_hooks", [r.get("packed_bytes") for r in rows]))
    lines.append(("held after the forward (CUDA)", [r.get("held_after_forward_bytes") for r in rows]))
    lines.append(("peak extra of forward+backward (CUDA)", [r.get("peak_extra_bytes") for r in rows]))
    return lines


def comparison_table(family: str, rows: list[dict]) -> str:
    """MiB per category (and per op of laqat's and FLA's) and row, and each compiled row minus eager FLA."""
    width = 50
    ok = [r for r in rows if "total_bytes" in r]
    eager = next((i for i, r in enumerate(ok) if r["row"] == EAGER_ROW), None)
    others = [i for i in range(len(ok)) if i != eager]
    head = f"{family}: saved for the backward, MiB".ljust(width) + "".join(f" {r['row'][:24]:>24}" for r in ok)
    if eager is not None:
        head += "".join(f" {'- eager: ' + ok[i]['row'][:15]:>24}" for i in others)
    out = [head]
    for label, values in comparison_lines(family, ok):
        line = f"{label[:width]:{width}s}" + "".join(f" {_mib(v):>24}" for v in values)
        if eager is not None:
            line += "".join(f" {_delta(values[i], values[eager]):>24}" for i in others)
        out.append(line)
    for r in rows:
        if "total_bytes" not in r:
            out.append(f"  {r['row']}: {r.get('error') or 'not a row of this family: ' + r.get('skipped', '')[:150]}")
        elif r.get("hand_off") or r.get("note"):
            notes = [f"hand-off {', '.join(r['hand_off'])}" if r.get("hand_off") else "", r.get("note", "")]
            out.append(f"  {r['row']}: {'; '.join(filter(None, notes))}")
    return "\n".join(out)


def fla_lm_main(args) -> list[dict]:
    names = lm_row_names(args.policy.split(","), args.inductor)
    rows = []
    for family in args.family:
        family_rows = lm_rows(family, names, args)
        print(comparison_table(family, family_rows), flush=True)
        rows += family_rows
    return rows


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("layer", "lm", "fla-lm"), default="layer",
                   help="one FLA layer, a tiny 2-layer LM (compiled only), or FLA's causal LM eager and compiled")
    p.add_argument("--family", "--kinds", nargs="+", default=["gdn", "kda"], help="gdn, kda (or 'gdn,kda')")
    p.add_argument("--policy", default="exact", help="comma-separated recipe names (default exact)")
    p.add_argument("--compiler", choices=("inductor", "eager"), default=None, help="default: the backend's choice")
    p.add_argument("--inductor", action="store_true", help="fla-lm: also the row torch.compile (Inductor)")
    for name in ("layers", "batch", "seq", "hidden", "heads", "head-dim", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help="default: model_bench.py's shape for fla-lm, a tiny one otherwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 for fla-lm on CUDA, else float32")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--snapshot", help="CUDA: also record the allocator's history and dump it here (a pickle)")
    p.add_argument("--peak-breakdown", action="store_true",
                   help="fla-lm on CUDA: what is alive at each row's peak, by the code that allocated it")
    args = p.parse_args(argv)
    args.family = [f for part in args.family for f in part.split(",") if f]
    shape = FLA_LM_SHAPE if args.model == "fla-lm" else LAYER_SHAPE
    for name, default in shape.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.model == "fla-lm" and args.device.startswith("cuda") else "float32"
    return args


def layer_main(args) -> list[dict]:
    rows = []
    for policy in args.policy.split(","):
        for kind in args.family:
            setup = Setup(args.model, kind, policy, args.compiler, args.batch, args.seq, args.hidden, args.heads,
                          args.head_dim, args.device, args.dtype)
            acc, graphs = compiled_account(setup)
            hand_off = sorted({f"{g.hand_off} ({g.hand_off_reason})" for g in graphs})
            print(table(acc, f"{args.model} {kind} {policy}, {args.dtype}, hand-off {', '.join(hand_off)}"),
                  flush=True)
            rows.append({**dataclasses.asdict(setup), "hand_off": hand_off,
                         "specs": [m.spec for g in graphs for m in g.matches], **acc.as_dict()})
    return rows


def main(argv=None) -> list[dict]:
    args = parse(argv)
    ensure_la_compiler()
    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    rows = fla_lm_main(args) if args.model == "fla-lm" else layer_main(args)
    if args.snapshot:
        torch.cuda.memory._dump_snapshot(args.snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "args": vars(args), "rows": rows},
                                             indent=1))
    return rows


if __name__ == "__main__":
    main()
