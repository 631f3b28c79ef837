"""The once-per-process keys of Inductor's and Triton's caches, computed ahead in a daemon thread.

Inductor's FX graph cache and AOTAutograd's cache key every graph by hashes a process computes once: of torch's
Python sources (``torch._inductor.codecache.torch_key``) and of Triton's sources and its ``libtriton`` binary
(``triton.runtime.cache.triton_key``, which Triton's own kernel cache also keys by). Without this the first compile
of a process computes them inside laqat's hand-off, on the first step's critical path (0.5-0.7 s of a warm
16-layer step on the H200: docs/model-bench.md, "The caches' once-per-process keys"). ``start()``, called at the
import of laqat's backend, computes both in a daemon thread. The thread reads and hashes files, and gets the
interpreter's lock between reads: it finishes while the program does work outside the interpreter (building the
model, moving it to the GPU); while Dynamo traces, it waits, and the first compile computes what is left. Nothing
here touches a device. A key computed twice (the thread and a compile at once) is the same value; an error in the
thread is left for the compile that needs the key to raise. A fork (``os.fork``: multiprocessing's and DataLoader's
fork workers) first waits for the thread: a child forked while it ran would inherit the locks it held (an import's
module lock), held forever in the child. ``LAQAT_PROCESS_KEYS_AHEAD=off`` leaves both to the first compile.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from la_compiler.options import process_keys_ahead

THREAD_NAME = "laqat-process-keys-ahead"
_started: list[threading.Thread] = []


def key_functions() -> list[Callable[[], Any]]:
    """The functions computing the keys, imported here, on the caller's thread."""
    functions = []
    try:
        from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key

        if HAS_TRITON:
            functions.append(triton_key)
    except ImportError:
        pass
    try:
        from torch._inductor.codecache import torch_key

        functions.append(torch_key)
    except ImportError:
        pass
    return functions


def compute_keys(functions: list[Callable[[], Any]]) -> None:
    for key in functions:
        try:
            key()
        except Exception:  # noqa: BLE001  (the compile that needs the key raises it)
            pass


def start() -> threading.Thread | None:
    """Starts the thread once per process (None with ``LAQAT_PROCESS_KEYS_AHEAD=off``); -> the thread."""
    if _started:
        return _started[0]
    if not process_keys_ahead():
        return None
    thread = threading.Thread(target=compute_keys, args=(key_functions(),), name=THREAD_NAME, daemon=True)
    _started.append(thread)
    thread.start()
    os.register_at_fork(before=thread.join)
    return thread
