"""Compile requests run in daemon threads while the training step goes on: the chunk kernels' backward
(kernels/chunk/compile_ahead.py) and the backward searches of FLA's kernels under laqat's ops
(kernels/fla/backward_ahead.py). A job that fails warns through ``on_failure``; the launches it was compiling for
then compile their kernels themselves."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

_threads: list[threading.Thread] = []
_lock = threading.Lock()


def first_of_kind(seen: set, key) -> bool:
    """True once per ``key`` added to ``seen`` (a module's set of kinds already requested), across threads."""
    if key in seen:  # every forward asks: the lock only for a new kind
        return False
    with _lock:
        if key in seen:
            return False
        seen.add(key)
        return True


def _run(device: torch.device, job: Callable[[], None], on_failure: Callable[[Exception], None]) -> None:
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    try:
        with on_device, torch.no_grad():
            job()
    except Exception as e:  # noqa: BLE001 - the real launches compile what is missing
        on_failure(e)


def start(name: str, device: torch.device, job: Callable[[], None], on_failure: Callable[[Exception], None]) -> None:
    """``job()`` in a daemon thread named ``name``, with ``device`` current and autograd off."""
    thread = threading.Thread(target=_run, args=(device, job, on_failure), daemon=True, name=name)
    with _lock:
        _threads[:] = [t for t in _threads if t.is_alive()] + [thread]
    thread.start()


def finish_background_compiles() -> None:
    """Wait for every background compile started so far."""
    while True:
        with _lock:
            if not _threads:
                return
            thread = _threads.pop()
        thread.join()
