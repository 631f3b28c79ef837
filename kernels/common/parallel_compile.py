"""Triton compiles in parallel threads: Triton's ``AsyncCompileMode`` over a thread pool. Its compiler releases the
GIL in its passes and runs ptxas as a subprocess, so compiles in threads overlap. Used by the chunk kernels'
compile-ahead (kernels/chunk/compile_ahead.py) and the autotuning searches of FLA's kernels that laqat's ops
launch (kernels/fla/autotune_searches.py)."""
from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor

COMPILE_THREADS = min(16, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def async_compile_mode():
    """Triton's AsyncCompileMode, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@contextlib.contextmanager
def compiles_in_threads(threads: int | None = None):
    """Inside: a Triton kernel compile (a launch with ``warmup=True``) is queued to ``threads`` threads (default
    ``COMPILE_THREADS``); all have finished on exit. A compile that fails is dropped: the kernel's real launch
    compiles it again and raises. Without AsyncCompileMode, compiles run where they are requested."""
    mode = async_compile_mode()
    if mode is None:
        yield
        return
    with ThreadPoolExecutor(threads or COMPILE_THREADS, thread_name_prefix="laqat-compile") as pool, \
            mode(pool, ignore_errors=True):
        yield
