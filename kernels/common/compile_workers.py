"""Worker processes for the Triton compiles that laqat's compile threads request (kernels/common/parallel_compile.py:
the chunk kernels' compile-ahead, the candidates of FLA's searches).

Much of a Triton compile is Python (the front end's code generation) and holds the interpreter's lock, so compiles
in threads overlap only in part. A thread that is handed a compile first gives it to an idle worker process
(kernels/common/compile_worker.py) as data: the kernel's module and name, its signature, constexprs, attributes,
target, options and the cache-invalidating environment, the very inputs of the compile Triton queued
(``JITFunction._do_compile``'s async-compile closure). The worker compiles it into Triton's on-disk cache and builds
its launcher; the thread then runs Triton's own compile, which finds the kernel there under the same key. The
result is always the thread's own compile: where the worker fails, differs (another source of the kernel) or none
is idle, that compile does the work itself, as without workers.

The workers start when a graph on a CUDA device is compiled (``start_for``), import torch, Triton, laqat's chunk
kernels and FLA's modules while the graph compiles, and each exits after ``IDLE_EXIT_S`` without work; the next
graph compile starts them again. ``LAQAT_COMPILE_WORKERS`` sets how many (la_compiler.options.compile_workers).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import Any, Callable

from la_compiler.options import compile_workers, interpreter

IDLE_EXIT_S = 120.0
# the names JITFunction._do_compile's async-compile closure binds (Triton 3.5 to 3.9)
_CLOSURE_NAMES = frozenset({"src", "target", "options", "env_vars"})
_HEADER = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class CompileJob:
    module: str
    qualname: str
    source_key: str  # the JITFunction's cache_key (its source and dependencies), checked by the worker
    signature: dict
    constants: dict
    attrs: dict
    target: Any
    options: dict
    env_vars: dict
    cache_dir: str | None


def write_message(fd: int, message) -> None:
    data = pickle.dumps(message)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_message(fd: int):
    """The next message on ``fd``, or None at its end."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def job_of(compile_fn: Callable) -> CompileJob | None:
    """The compile that Triton's async-compile closure ``compile_fn`` runs, as data a worker can redo; None where
    the closure is not the one Triton's ``JITFunction._do_compile`` makes, the kernel cannot be imported by name
    (defined in a function) or its inputs cannot be pickled."""
    code, closure = getattr(compile_fn, "__code__", None), getattr(compile_fn, "__closure__", None)
    if code is None or closure is None or not _CLOSURE_NAMES <= set(code.co_freevars):
        return None
    try:
        bound = {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure) if name in _CLOSURE_NAMES}
        src = bound["src"]
        python_fn = src.fn.fn
        module, qualname = python_fn.__module__, python_fn.__qualname__
        if not module or "<locals>" in qualname:
            return None
        job = CompileJob(module=module, qualname=qualname, source_key=src.fn.cache_key,
                         signature=dict(src.signature), constants=dict(src.constants), attrs=dict(src.attrs),
                         target=bound["target"], options=dict(vars(bound["options"])), env_vars=dict(bound["env_vars"]),
                         cache_dir=_triton_cache_dir())
        pickle.dumps(job)
    except Exception:  # noqa: BLE001 - not a compile a worker can redo: the thread compiles it
        return None
    return job


def _triton_cache_dir() -> str | None:
    try:
        from triton import knobs
        return knobs.cache.dir
    except Exception:  # noqa: BLE001 - a Triton without knobs: the worker reads the environment as Triton does
        return None


class CompileWorkers:
    """The process's compile workers: started by ``start``, handed one compile at a time by ``compile``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._processes: list[subprocess.Popen] = []
        self._owner_pid: int | None = None

    def start(self, count: int) -> None:
        """``count`` workers running (those still alive kept); they become idle once their imports are done."""
        with self._lock:
            if self._owner_pid != os.getpid():  # a forked child does not share its parent's workers
                self._processes, self._idle, self._owner_pid = [], queue.SimpleQueue(), os.getpid()
            self._processes = [p for p in self._processes if p.poll() is None]
            for _ in range(count - len(self._processes)):
                self._processes.append(self._spawn())

    def _spawn(self) -> subprocess.Popen:
        boot = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
                "from la_compiler.kernels.common.compile_worker import main; main()")
        process = subprocess.Popen([sys.executable, "-c", boot, json.dumps(sys.path), str(IDLE_EXIT_S)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        threading.Thread(target=self._await_ready, args=(process,), daemon=True,
                         name="laqat-compile-worker-start").start()
        return process

    def _await_ready(self, process: subprocess.Popen) -> None:
        try:
            message = read_message(process.stdout.fileno())
        except (OSError, ValueError, pickle.UnpicklingError):
            message = None
        if message is not None and message[0] == "ready":
            self._idle.put(process)
        else:
            process.kill()

    def compile(self, job: CompileJob) -> bool:
        """``job`` compiled by an idle worker into Triton's cache (True), or False: no worker idle, or it failed."""
        if self._owner_pid != os.getpid():
            return False
        try:
            process = self._idle.get_nowait()
        except queue.Empty:
            return False
        try:
            write_message(process.stdin.fileno(), job)
            reply = read_message(process.stdout.fileno())
        except (OSError, ValueError, pickle.UnpicklingError):
            reply = None
        if reply is None:  # it exited (idle too long, or killed): the next start replaces it
            process.kill()
            return False
        self._idle.put(process)
        return reply[0] == "compiled"

    def stop(self) -> None:
        with self._lock:
            for process in self._processes:
                if process.poll() is None:
                    process.kill()
            self._processes = []


WORKERS = CompileWorkers()
atexit.register(WORKERS.stop)


def start_for(example_inputs) -> None:
    """The compile workers started where a graph with these inputs will launch laqat's compile threads: a tensor on
    a CUDA device, compiled Triton (not its interpreter) with async compiles, ``LAQAT_COMPILE_WORKERS`` > 0."""
    if interpreter() or not any(getattr(getattr(x, "device", None), "type", None) == "cuda" for x in example_inputs):
        return
    from la_compiler.kernels.common.parallel_compile import async_compile_mode

    count = compile_workers()
    if count and async_compile_mode() is not None:
        WORKERS.start(count)


def compile_in_worker(compile_fn: Callable) -> bool:
    """Triton's queued compile ``compile_fn`` done by a worker into Triton's cache, where there is one."""
    job = job_of(compile_fn)
    return job is not None and WORKERS.compile(job)
