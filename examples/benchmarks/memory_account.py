"""Every tensor saved for the backward by one compiled training forward, attributed to the op that saved it.

    python examples/benchmarks/memory_account.py                              # a GDN and a KDA FLA layer, exact
    python examples/benchmarks/memory_account.py --policy state_fp8 --out out/memory.json
    python examples/benchmarks/memory_account.py --model lm --compiler inductor
    python examples/benchmarks/memory_account.py --device cuda --dtype bfloat16 --snapshot out/memory.pickle

After the forward, the autograd graph is walked from the output: each node's saved tensors (a custom op's
autograd, which laqat's ops register with ``torch.library.register_autograd``; a built-in node's ``_saved_*``
fields; AOTAutograd's ``CompiledFunctionBackward`` for what Inductor compiled), with shape, dtype and bytes; a
storage saved twice counts once, a parameter's not at all (it lives anyway). ``saved_tensors_hooks`` counts what
was packed, so a tensor the walk does not reach shows as a difference. Each laqat op's calls are recorded at the
op's kernel (so also inside Inductor's compiled code), and a saved tensor that is one of a call's inputs or
outputs is named by it (``laqat::delta_rule_train.residual``). The recorder keeps those tensors alive until the
account is taken (no storage is reused under another tensor's name), so this is an account, not a peak
measurement; on CUDA ``--snapshot`` also records the allocator's history
(``torch.cuda.memory._record_memory_history``).

Prints a table and writes JSON (``--out``): per layer and policy, every saved tensor and the totals.
docs/memory.md states what laqat's ops save; tests/la_compiler/test_saved_tensors.py checks it with this module.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # laqat's Triton kernels run in the CPU interpreter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ensure_la_compiler  # noqa: E402

# names of the outputs of laqat's ops (their schemas leave them unnamed); others read "output <i>"
OUTPUT_NAMES = {
    "laqat::delta_rule_train": ("o", "final_state", "residual"),
    "laqat::delta_rule_phased_train": ("o", "final_state", "residual"),
    "laqat::delta_rule_eval": ("o", "final_state"),
    "laqat::causal_conv1d": ("y", "final_state"),
    "laqat::layer_norm_gated": ("y",),
    "laqat::layer_norm": ("y",),
    "laqat::cross_entropy": ("loss", "z_loss", "lse"),
    "laqat::fused_linear_cross_entropy": ("loss", "dx", "dweight", "dbias"),
    "laqat::log_decay": ("log",),
}
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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Account:
    saved: list[SavedTensor]
    packed: int  # tensors saved_tensors_hooks saw packed during the forward

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

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
                "by_node": {k: {"tensors": n, "bytes": b} for k, (n, b) in self.by_node().items()}}


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


def _saved_of(node) -> list[tuple[str, object]]:
    """(slot, value) of what ``node`` saved: a Python node's ``saved_tensors``, a built-in node's ``_saved_*``."""
    if hasattr(node, "saved_tensors"):
        return [(f"saved[{i}]", t) for i, t in enumerate(node.saved_tensors)]
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


def walk_saved(output: torch.Tensor, calls: list[_Call], parameters: dict | None = None) -> list[SavedTensor]:
    """Every tensor the autograd graph behind ``output`` saved, in the order of a depth-first walk from it;
    ``parameters``: storage key -> name of the tensors that live anyway."""
    parameters = parameters or {}
    saved, counted, seen = [], set(parameters), set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node_name(node)
        for slot, t in _saved_of(node):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            fresh = t.numel() == 0 or key not in counted
            counted.add(key)
            saved.append(SavedTensor(name, slot, _name_in_calls(t, calls, name), tuple(t.shape),
                                     str(t.dtype).replace("torch.", ""), key[1] if fresh else 0,
                                     parameters.get(key, "")))
        stack.extend(fn for fn, _ in reversed(node.next_functions))
    return saved


def account(forward: Callable[[], torch.Tensor], model: torch.nn.Module | None = None) -> Account:
    """Runs ``forward`` (it returns a tensor that needs a gradient) and accounts for what its graph saved;
    ``model``'s parameters and buffers are named as such and count no bytes."""
    packed = []

    def pack(t):
        packed.append(1)
        return t

    with laqat_op_calls() as calls, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    parameters = {} if model is None else {_storage_key(t): n for n, t in (*model.named_parameters(),
                                                                          *model.named_buffers())}
    return Account(walk_saved(out, calls, parameters), len(packed))


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


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("layer", "lm"), default="layer", help="one FLA layer, or a tiny 2-layer LM")
    p.add_argument("--kinds", default="gdn,kda")
    p.add_argument("--policy", default="exact", help="comma-separated recipe names (default exact)")
    p.add_argument("--compiler", choices=("inductor", "eager"), default=None, help="default: the backend's choice")
    for name, default in (("batch", 2), ("seq", 70), ("hidden", 32), ("heads", 2), ("head-dim", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--snapshot", help="CUDA: also record the allocator's history and dump it here (a pickle)")
    args = p.parse_args(argv)
    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    rows = []
    for policy in args.policy.split(","):
        for kind in args.kinds.split(","):
            setup = Setup(args.model, kind, policy, args.compiler, args.batch, args.seq, args.hidden, args.heads,
                          args.head_dim, args.device, args.dtype)
            acc, graphs = compiled_account(setup)
            hand_off = sorted({f"{g.hand_off} ({g.hand_off_reason})" for g in graphs})
            print(table(acc, f"{args.model} {kind} {policy}, {args.dtype}, hand-off {', '.join(hand_off)}"),
                  flush=True)
            rows.append({**dataclasses.asdict(setup), "hand_off": hand_off,
                         "specs": [m.spec for g in graphs for m in g.matches], **acc.as_dict()})
    if args.snapshot:
        torch.cuda.memory._dump_snapshot(args.snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return rows

if __name__ == "__main__":
    main()
