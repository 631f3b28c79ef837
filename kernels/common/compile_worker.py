"""A compile worker process (started by kernels/common/compile_workers.py): compiles each Triton kernel it is sent
into Triton's on-disk cache and builds its launcher there, where the process that sent it then finds both.

Protocol: length-prefixed pickles; a ``("ready", pid)`` once its imports are done, then one reply per
``CompileJob`` read from stdin: ``("compiled", seconds)``, ``("stale", reason)`` (the kernel imported here has
another source than the sender's) or ``("failed", reason)``. It exits at the end of stdin or after the idle seconds
given as its second argument without a job."""
from __future__ import annotations

import importlib
import importlib.util
import os
import select
import sys
import time

from la_compiler.kernels.common.compile_workers import CompileJob, read_message, write_message

# imported before the worker reports ready: the modules whose kernels laqat's compile threads compile
PRELOAD = ("la_compiler.kernels.chunk.fwd", "la_compiler.kernels.chunk.bwd", "fla.modules")


def preload() -> None:
    import triton  # noqa: F401

    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - its kernels fail to resolve later, and their senders compile them
            pass


def resolve(module: str, qualname: str):
    """The JITFunction named ``module.qualname``, under any autotune / heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    while not isinstance(found, JITFunction):
        found = found.fn
    return found


def build_launcher(kernel) -> None:
    """The kernel's launcher built into Triton's cache (Triton versions that build one per signature with the C
    compiler); nothing is loaded onto the device."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the sender's first launch builds it
        pass


def compile_job(job: CompileJob) -> tuple:
    import triton
    from triton.compiler import ASTSource

    started = time.perf_counter()
    kernel_fn = resolve(job.module, job.qualname)
    if kernel_fn.cache_key != job.source_key:
        return ("stale", f"{job.module}.{job.qualname}: another source than the sender's")
    if job.cache_dir is not None:
        triton.knobs.cache.dir = job.cache_dir
    src = ASTSource(kernel_fn, job.signature, job.constants, job.attrs)
    kernel = triton.compile(src, target=job.target, options=job.options, _env_vars=job.env_vars)
    build_launcher(kernel)
    return ("compiled", time.perf_counter() - started)


def main() -> None:
    idle_exit_s = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    replies = os.dup(1)
    os.dup2(2, 1)  # what imported modules print goes to stderr, not among the replies
    preload()
    write_message(replies, ("ready", os.getpid()))
    while select.select([0], [], [], idle_exit_s)[0]:
        job = read_message(0)
        if job is None:
            return
        try:
            reply = compile_job(job)
        except Exception as e:  # noqa: BLE001 - reported; the sender compiles the kernel itself
            reply = ("failed", f"{type(e).__name__}: {e}")
        write_message(replies, reply)
