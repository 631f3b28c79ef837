"""laqat's kernels of a graph compiled while Inductor compiles the graph (docs/options.md, "Hand-off").

A first training step compiles one thing after another: Dynamo's capture, laqat's passes, Inductor's compile of the
graph, then, at their first launches, laqat's chunk kernels (their compile-ahead: kernels/chunk/compile_ahead.py)
and FLA's module kernels with their autotuning searches (kernels/fla/autotune_searches.py): seconds each
(docs/model-bench.md, "Every compile and search of the first step"). Under Inductor on a GPU, ``start`` hands every
distinct call of a laqat op in the rewritten graph (the op and its arguments' shapes, strides, storage offsets and
dtypes, from Dynamo's example values) to one background thread. It runs each call, and its backward where an output
needs a gradient, on zero-filled tensors of those layouts under kernels/common/compile_only.py: a Triton launch
compiles its kernel and launches nothing, a search compiles its candidates. Those compiles overlap Inductor's. The
compiled graph's first call waits for the thread to end (``after_kernels_ahead``), so nothing of the thread runs
beside the step, and its launches find their kernels compiled, its searches left with their timing only.

What runs is the same: only Triton's caches, and the chunk compile-ahead's note of the kinds it compiled, learn
anything. A call that fails in the thread leaves its kernels to their first launch (logged). Off under Triton's
interpreter, on a Triton without AsyncCompileMode, for a call with a symbolic size, and with the tuning option
``compile_ahead=false``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_map

logger = logging.getLogger(__name__)

_compiled_calls: set = set()  # the calls whose kernels this process compiled ahead (or tried to)
_lock = threading.Lock()
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a tensor argument's kernels specialize on, from its example value."""
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "Layout":
        return Layout(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device, t.requires_grad)


@dataclasses.dataclass(frozen=True)
class OpCall:
    op: Any  # torch.ops.laqat.<name> (packet or overload)
    args: tuple  # Layouts for the tensors, plain values otherwise
    kwargs: tuple  # (name, value) pairs, as args

    def key(self) -> tuple:
        return str(self.op), _hashable(self.args), _hashable(self.kwargs)


@dataclasses.dataclass
class KernelsAhead:
    """One graph's background compile: how many op calls it runs, and when it ended."""
    calls: list[OpCall]
    failed: list[str] = dataclasses.field(default_factory=list)
    seconds: float | None = None  # the thread's, once it ended
    waited_s: float | None = None  # how long the graph's first call waited for it
    _done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._done.wait()
        self.waited_s = time.perf_counter() - t0

    def describe(self) -> str:
        text = f"{len(self.calls)} laqat op calls"
        if self.seconds is not None:
            text += f", their kernels compiled in {self.seconds:.2f} s"
        if self.waited_s is not None:
            text += f" (the first call waited {self.waited_s:.2f} s)"
        if self.failed:
            text += f"; left to their first launch: {', '.join(self.failed)}"
        return text


def is_laqat_op(target) -> bool:
    return (isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            and str(target).split(".")[0] == "laqat")


def _value(node: torch.fx.Node):
    meta = node.meta
    return meta["example_value"] if "example_value" in meta else meta.get("val", _MISSING)


def _concrete(value) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    if isinstance(value, torch.Tensor):
        return not any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return value is not _MISSING


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def laqat_calls(graph: torch.fx.GraphModule) -> list[OpCall]:
    """The distinct calls of laqat's ops in ``graph`` whose every argument has a concrete value (Dynamo's example
    values: fake tensors on the graph's devices)."""
    calls, keys = [], set()
    for node in graph.graph.nodes:
        if node.op != "call_function" or not is_laqat_op(node.target):
            continue
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), _value)
        if not all(_concrete(v) for v in tree_leaves((args, kwargs))):
            continue
        args, kwargs = tree_map(lambda v: Layout.of(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        call = OpCall(node.target, tuple(args), tuple(sorted(kwargs.items())))
        if call.key() not in keys:
            keys.add(call.key())
            calls.append(call)
    return calls


def _layouts(call: OpCall) -> list[Layout]:
    return [v for v in tree_leaves((call.args, call.kwargs)) if isinstance(v, Layout)]


def _on_gpu(call: OpCall) -> bool:
    return any(layout.device.type == "cuda" for layout in _layouts(call))


def available() -> bool:
    from la_compiler.kernels.common.parallel_compile import async_compile_mode
    from la_compiler.options import interpreter

    return torch.cuda.is_available() and not interpreter() and async_compile_mode() is not None


def zeros_of(layout: Layout) -> torch.Tensor:
    """A zero-filled tensor of ``layout``: its shape, strides, storage offset, dtype, device and requires_grad."""
    extent = 0
    if all(s > 0 for s in layout.shape):
        extent = 1 + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride))
    base = torch.zeros(layout.offset + extent, dtype=layout.dtype, device=layout.device)
    return base.as_strided(layout.shape, layout.stride, layout.offset).requires_grad_(layout.requires_grad)


def run_compiling(call: OpCall) -> None:
    """``call`` on zero-filled tensors, and its backward where an output needs a gradient (under compile_only,
    nothing is launched)."""
    args, kwargs = tree_map(lambda v: zeros_of(v) if isinstance(v, Layout) else v, (call.args, dict(call.kwargs)),
                            is_leaf=lambda v: isinstance(v, Layout))
    out = call.op(*args, **kwargs)
    needing = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing:
        torch.autograd.backward(needing, [torch.zeros_like(t) for t in needing])


def _run(job: KernelsAhead, record) -> None:
    from la_compiler.kernels.common.compile_only import compile_only

    t0 = time.perf_counter()
    try:
        with compile_only():
            for call in job.calls:
                device = _layouts(call)[0].device
                try:
                    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                        run_compiling(call)
                except Exception as e:  # noqa: BLE001 - only the compiles' timing is at stake: the launches compile
                    job.failed.append(str(call.op))
                    logger.info("laqat: compiling the kernels of %s ahead failed (%s: %s); they compile at their "
                                "first launch", call.op, type(e).__name__, e)
    except Exception as e:  # noqa: BLE001 - as above
        logger.info("laqat: compiling kernels ahead failed (%s: %s)", type(e).__name__, e)
    finally:
        job.seconds = time.perf_counter() - t0
        if record is not None:
            record.kernels_ahead = job.describe()
        job._done.set()


def start(graph: torch.fx.GraphModule, record=None) -> KernelsAhead | None:
    """The background compile of ``graph``'s laqat op calls not compiled ahead before in this process, started; None
    where there is none or it is not available."""
    if not available():
        return None
    with _lock:
        calls = [c for c in laqat_calls(graph) if _on_gpu(c) and c.key() not in _compiled_calls]
        _compiled_calls.update(c.key() for c in calls)
    if not calls:
        return None
    job = KernelsAhead(calls)
    threading.Thread(target=_run, args=(job, record), name="laqat-kernels-ahead", daemon=True).start()
    return job


def after_kernels_ahead(compiled: Callable, job: KernelsAhead | None, record=None) -> Callable:
    """``compiled``, its first call waiting for ``job`` to end."""
    if job is None:
        return compiled
    pending = [job]

    def run(*args):
        if pending:
            pending.pop().wait()
            if record is not None:
                record.kernels_ahead = job.describe()
        return compiled(*args)
    return run
