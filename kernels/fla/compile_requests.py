"""Inside ``requests_only()`` every Triton launch in this thread compiles its kernel and runs nothing on the device:

- a plain kernel's launch becomes its compile (``run(..., warmup=True)``);
- an autotuned kernel's launch compiles the candidates its search will time where its key has no choice yet, else
  its choice (kernels/fla/autotune_searches.py, ``compile_requests``).

The compiles run in parallel threads that also ready each kernel for its first launch
(kernels/common/parallel_compile.py) and have finished on exit; one that fails is dropped (the real launch compiles
it again and raises). The torch operations around the launches still run (FLA's wrappers allocate their outputs
and reduce partial sums): what they compute is never read. Used by kernels/fla/backward_ahead.py.
"""
from __future__ import annotations

import contextlib
import functools
import threading

from la_compiler.kernels.common.parallel_compile import compiles_in_threads
from la_compiler.kernels.fla import autotune_searches

_lock = threading.Lock()
_installed = False


@contextlib.contextmanager
def requests_only():
    _install()
    token = autotune_searches.requests_only.set(True)
    try:
        with compiles_in_threads():
            yield
    finally:
        autotune_searches.requests_only.reset(token)


def _request_instead(run):
    @functools.wraps(run)
    def run_or_request(fn, *args, grid, warmup, **kwargs):
        return run(fn, *args, grid=grid, warmup=warmup or autotune_searches.requests_only.get(), **kwargs)
    return run_or_request


def _install() -> None:
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        autotune_searches._install()
        for launcher in (JITFunction, InterpretedFunction):
            launcher.run = _request_instead(launcher.run)
        _installed = True
