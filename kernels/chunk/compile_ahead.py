"""Every Triton kernel of a chunk training step compiled in parallel threads before its first launch.

A training step launches its forward stages and, later, its backward stages (chunk/fwd.py, chunk/bwd.py); Triton
compiles each kernel at its first launch, one after another. ``compile_training_step`` runs the forward and the
backward recipes once with every launch turned into a compile request (``JITFunction.run(..., warmup=True)``,
compiled in threads: kernels/common/parallel_compile.py). The requests carry the very arguments, constexprs, warps
and stages the real launches will, so they compile the kernels the step reaches, keyed as those launches look them
up; the real launches then find them compiled and readied (loaded, their launchers built). Nothing runs on the
device but the buffers' allocation and the residual's gap clearing.

The forward's kernels are compiled before the forward goes on; the backward's compile in a background thread while
the rest of the first step runs (the other layers' forwards, FLA's searches, the backward graph's compile), off the
chain of compiles the first step waits on. A backward launch that comes before its kernel's compile is done waits
for it, or compiles it itself (Triton's disk cache then holds it once the thread's compile is done).

Once per (params, tuning, dtype, head shapes, varlen, initial state, device) and process; the tuning option
``t.compile_ahead`` turns it off. Not under Triton's interpreter (nothing is compiled there), nor on a Triton
without ``AsyncCompileMode``. The measured effect: docs/model-bench.md, "Where the cold first step's time goes".
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.fwd import chunk_fwd, plan_of
from la_compiler.kernels.chunk.launch import compile_request
from la_compiler.kernels.chunk.residual import residual_size
from la_compiler.kernels.common import background_compiles
from la_compiler.kernels.common.parallel_compile import async_compile_mode, compiles_in_threads
from la_compiler.options import interpreter

BACKGROUND_THREAD = "laqat-compile-ahead-backward"  # the name of the threads that compile a backward
_done: set = set()  # the kinds of step compiled ahead in this process


def available(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreter() and async_compile_mode() is not None


def request_compile(kernel, arguments: dict) -> None:
    """The compile a launch of ``kernel`` with ``arguments`` (constexprs, warps and stages included) would do."""
    kernel.run(grid=(1,), warmup=True, **arguments)


@contextlib.contextmanager
def compiling_only(request: Callable | None = None, threads: int | None = None):
    """Inside: chunk/launch.py's ``launch`` hands each launch to ``request`` (default ``request_compile``, whose
    compiles run in ``threads`` threads: kernels/common/parallel_compile.py) instead of launching."""
    with contextlib.ExitStack() as stack:
        if request is None:
            request = request_compile
            stack.enter_context(compiles_in_threads(threads))
        token = compile_request.set(request)
        try:
            yield
        finally:
            compile_request.reset(token)


def step_key(p, tuning, q, v, initial_state, cu_seqlens, raw_gate) -> tuple:
    return (p, tuning, q.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]), initial_state is None, cu_seqlens is None,
            None if raw_gate is None else raw_gate[1] is None, q.device)


def request_forward(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, raw_gate):
    """The forward with its residual, as a training step runs it; under ``compiling_only`` nothing is launched.
    Returns what the backward's requests take: (residual, o)."""
    size = residual_size(p, q, v, cu_seqlens, tuning.keep_residual)
    residual = torch.empty((size,), dtype=torch.float32, device=q.device) if size else None
    o, _ = chunk_fwd(p, q, k, v, g, beta, scale, initial_state, cu_seqlens, save_to=residual, tuning=tuning,
                     raw_gate=raw_gate)
    return residual, o


def request_backward(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, residual, o) -> None:
    """The backward of the inputs from the forward's residual, as a training step runs it."""
    _, _, state_shape = plan_of(p, q, k, v, g, beta, initial_state, cu_seqlens, tuning)
    do = torch.empty(o.shape, dtype=q.dtype, device=q.device)
    dht = torch.empty(state_shape, dtype=torch.float32, device=q.device)
    chunk_bwd(p, q, k, v, g, beta, scale, do, dht, initial_state, cu_seqlens, saved=residual, tuning=tuning)


def run_training_step(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, raw_gate) -> None:
    """The forward (with its residual) and the backward of the inputs, as a training step runs them; under
    ``compiling_only`` nothing is launched."""
    residual, o = request_forward(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, raw_gate)
    if raw_gate is None:  # the raw-gate forward's backward is the decode phase's (kernels/decode/phased.py)
        request_backward(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, residual, o)


def _warn_failed(e: Exception) -> None:
    warnings.warn(f"laqat: compiling the chunk kernels ahead failed ({type(e).__name__}: {e}); each kernel "
                  "compiles at its first launch instead (t.compile_ahead=false skips the attempt)", stacklevel=3)


def _backward_requests(args) -> None:
    with compiling_only():
        request_backward(*args)


def compile_training_step(p, tuning, q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None,
                          raw_gate=None) -> None:
    """Before the first training forward of its kind: every kernel of its forward compiled in parallel (see the
    module's docstring); the backward's kernels then compile in a background thread while the step goes on."""
    if not tuning.compile_ahead or not available(q.device):
        return
    if not background_compiles.first_of_kind(_done, step_key(p, tuning, q, v, initial_state, cu_seqlens,
                                                            raw_gate)):
        return
    try:
        with torch.no_grad(), compiling_only():
            residual, o = request_forward(p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, raw_gate)
    except Exception as e:  # noqa: BLE001 - only the compiles' timing is at stake: the real launches compile
        _warn_failed(e)
        return
    if raw_gate is not None:
        return
    args = (p, tuning, q, k, v, g, beta, scale, initial_state, cu_seqlens, residual, o)
    background_compiles.start(BACKGROUND_THREAD, q.device, lambda: _backward_requests(args), _warn_failed)
