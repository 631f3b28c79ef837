"""Triton launches turned into compile requests: inside ``compile_only()`` a kernel launch (``kernel[grid](...)``,
``JITFunction.run``) compiles the kernel for those arguments (``warmup=True``) and launches nothing; an autotuned
kernel whose key its autotuner has not chosen for yet compiles every candidate its search would time
(kernels/fla/autotune_searches.py). The compiles run in parallel threads (kernels/common/parallel_compile.py) and
have all finished, each kernel readied for its first launch, when the block ends. Torch's own operations between the
launches still run: the code inside runs on tensors whose values do not matter (la_compiler/hand_off/
kernels_ahead.py), and the kernels' outputs keep whatever their buffers held.

Only the thread that entered the block is affected: the switch is a context variable, read at every Triton launch
once the wrapper is installed (at the first ``compile_only()``). Under Triton's interpreter a launch inside runs
nothing and compiles nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

from la_compiler.kernels.common.parallel_compile import compiles_in_threads

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("laqat_compile_only", default=False)
_lock = threading.Lock()
_installed = False


def active() -> bool:
    return _active.get()


@contextlib.contextmanager
def compile_only(threads: int | None = None):
    """Inside: Triton launches on this thread compile only, in ``threads`` threads; all compiled on exit."""
    _install()
    from la_compiler.kernels.fla.autotune_searches import install_search_wrapper

    install_search_wrapper()
    token = _active.set(True)
    try:
        with compiles_in_threads(threads, name="laqat-compile-only"):
            yield
    finally:
        _active.reset(token)


def _install() -> None:
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from triton.runtime.jit import JITFunction

        kinds = [JITFunction]
        try:  # under TRITON_INTERPRET=1 kernels are InterpretedFunctions: a warmup launch runs nothing there
            from triton.runtime.interpreter import InterpretedFunction
            kinds.append(InterpretedFunction)
        except ImportError:
            pass
        for kind in kinds:
            kind.run = _compiling_run(kind.run)
        _installed = True


def _compiling_run(run):
    @functools.wraps(run)
    def run_or_compile(fn, *args, **kwargs):
        if _active.get():
            kwargs["warmup"] = True
        return run(fn, *args, **kwargs)
    return run_or_compile
