"""The backward's kernels of FLA's functions under laqat's ops, compiled in a background thread from the forward.

On a cold Triton cache each of FLA's autotuned kernels costs its first launch a compile and readying of its
candidates (0.35-1.1 s, docs/model-bench.md "Where the cold first step's time goes"), one after another on the
step's chain, the backward's after the backward graph's compile. At the first CUDA forward of its kind, each of
laqat's FLA ops (norms, l2 norm, short convolution, gated MLP) hands its backward's FLA call, on the forward's
saved tensors and an unwritten gradient of the output's shape and dtype, to a daemon thread that runs it under
``requests_only()`` (kernels/fla/compile_requests.py): every candidate the backward's searches will time is
compiled and readied while the forward, the other layers and the backward graph's compile go on, and the
backward's searches then only time them. The gradients are the same: nothing is launched, and the searches run
where they did.

Once per (op, feature sizes, dtypes, options, device) and process (other sequence lengths included);
``LAQAT_FLA_COMPILE_AHEAD=off`` turns it off. Not under Triton's interpreter, nor while a CUDA graph is captured, nor
on a Triton without ``AsyncCompileMode``. The thread's gradient and outputs (the size of the op's inputs) are freed
when it ends, within the first step. An op's forward does not know whether a backward follows: a process that only
runs inference compiles them to no use, once per kind.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from la_compiler.kernels.common import background_compiles
from la_compiler.kernels.common.parallel_compile import async_compile_mode
from la_compiler.kernels.fla.compile_requests import requests_only
from la_compiler.options import fla_compile_ahead, interpreter

BACKGROUND_THREAD = "laqat-fla-backward-ahead"
_done: set = set()  # the kinds of op call compiled ahead in this process


def available(device: torch.device) -> bool:
    return (device.type == "cuda" and not interpreter() and async_compile_mode() is not None
            and not torch.cuda.is_current_stream_capturing())


def describe(*values) -> tuple:
    """A key part per value: a tensor's rank, last (feature) size, dtype and 16-byte alignment, else the value.
    Token counts and sequence boundaries are left out: another sequence length is the same kind."""
    return tuple((v.dim(), v.shape[-1] if v.dim() else None, v.dtype, v.data_ptr() % 16 == 0)
                 if isinstance(v, torch.Tensor) else v for v in values)


def _warn_failed(e: Exception) -> None:
    warnings.warn(f"laqat: compiling the backward of FLA's kernels ahead failed ({type(e).__name__}: {e}); each "
                  f"kernel compiles at its first launch instead (LAQAT_FLA_COMPILE_AHEAD=off skips the attempt)",
                  stacklevel=2)


def _requests(backward: Callable[[], object]) -> None:
    with requests_only():
        backward()


def compile_backward_ahead(op: str, key: tuple, device: torch.device, backward: Callable[[], object]) -> None:
    """At the first forward of ``op`` of its kind (``key``): ``backward()``, the op's backward as its first call
    will run it, in a background thread with every launch turned into its compiles (see the module's docstring)."""
    key = (op, key, device)
    if key in _done or not fla_compile_ahead() or not available(device) or not background_compiles.first_of_kind(
            _done, key):
        return  # every forward of the op asks: the settled case first
    background_compiles.start(BACKGROUND_THREAD, device, lambda: _requests(backward), _warn_failed)
