"""Triton compiles in parallel threads: Triton's ``AsyncCompileMode`` over a thread pool. Its compiler releases the
GIL in its passes and runs ptxas as a subprocess, so compiles in threads overlap. Each thread also readies the
kernel it compiled for its first launch: the kernel's binary loaded onto the device and its launcher built (Triton
builds a C launcher per argument signature with the system's C compiler, another subprocess), work that Triton
otherwise does at that first launch, one kernel after another. Used by the chunk kernels' compile-ahead
(kernels/chunk/compile_ahead.py) and the autotuning searches of FLA's kernels that laqat's ops launch
(kernels/fla/autotune_searches.py)."""
from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable

COMPILE_THREADS = min(16, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def async_compile_mode():
    """Triton's AsyncCompileMode, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def _active_mode():
    from triton.runtime._async_compile import active_mode

    return active_mode


def triton_device_calls() -> tuple[Callable[[], int], Callable[[int], None]]:
    """The active Triton driver's (current device, set current device)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.set_current_device


class CompileAndReady(Executor):
    """An executor for AsyncCompileMode whose jobs, once a kernel is compiled, ready it for its first launch on the
    device current where the compile was requested (``CompiledKernel._init_handles``: load the binary, build the
    launcher). A kernel that cannot be readied (e.g. it needs more shared memory than the device has) is returned
    as compiled: its first launch readies it again and raises as it would have."""

    def __init__(self, pool: Executor, device_calls: tuple[Callable[[], int], Callable[[int], None]] | None = None):
        self._pool = pool
        self._device_calls = device_calls

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._device_calls is None:  # the driver is looked up at the first compile, not under the interpreter
            self._device_calls = triton_device_calls()
        return self._pool.submit(self._compile_and_ready, self._device_calls[0](), fn, args, kwargs)

    def _compile_and_ready(self, device: int, compile_fn: Callable, args, kwargs):
        kernel = compile_fn(*args, **kwargs)
        ready = getattr(kernel, "_init_handles", None)
        if ready is not None:
            try:
                self._device_calls[1](device)
                ready()
            except Exception:  # noqa: BLE001 - the kernel's first launch readies it again and reports the failure
                pass
        return kernel

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


@contextlib.contextmanager
def compiles_in_threads(threads: int | None = None):
    """Inside: a Triton kernel compile (a launch with ``warmup=True``) is queued to ``threads`` threads (default
    ``COMPILE_THREADS``), which also ready each kernel for its first launch (``CompileAndReady``); all have
    finished on exit. A compile that fails is dropped: the kernel's real launch compiles it again and raises.
    Inside another, the outer one's threads compile them (they have finished when it exits). Without
    AsyncCompileMode, compiles run where they are requested."""
    mode = async_compile_mode()
    if mode is None or _active_mode().get() is not None:
        yield
        return
    with ThreadPoolExecutor(threads or COMPILE_THREADS, thread_name_prefix="laqat-compile") as pool, \
            mode(CompileAndReady(pool), ignore_errors=True):
        yield
