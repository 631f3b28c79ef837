"""The once-per-process cache keys computed ahead (la_compiler/hand_off/process_keys_ahead.py)."""
import os
import signal
import threading
import time

import pytest

import la_compiler.backend  # noqa: F401  (its import starts the thread)
from la_compiler.hand_off import process_keys_ahead
from la_compiler.options import PROCESS_KEYS_AHEAD_ENV, OptionsError


def test_the_backends_import_computed_both_keys(monkeypatch):
    import triton.runtime.cache
    from torch._inductor import codecache

    assert process_keys_ahead._started, "importing la_compiler.backend started no thread"
    thread = process_keys_ahead.start()
    assert thread is not None and thread.name == process_keys_ahead.THREAD_NAME and thread.daemon
    assert process_keys_ahead.start() is thread  # once per process
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert triton.runtime.cache.triton_key.cache_info().currsize == 1
    # torch_key's cache is filled: a second computation would be a different call, so count them
    calls = []
    monkeypatch.setattr(codecache, "build_code_hash", lambda *a: calls.append(a))
    first = codecache.torch_key()
    assert codecache.torch_key() is first and not calls and isinstance(first, bytes) and len(first) == 32


def test_off_starts_nothing(monkeypatch):
    monkeypatch.setattr(process_keys_ahead, "_started", [])
    monkeypatch.setenv(PROCESS_KEYS_AHEAD_ENV, "off")
    before = {t.ident for t in threading.enumerate()}
    assert process_keys_ahead.start() is None
    assert {t.ident for t in threading.enumerate()} <= before


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setattr(process_keys_ahead, "_started", [])
    monkeypatch.setenv(PROCESS_KEYS_AHEAD_ENV, "yes")
    with pytest.raises(OptionsError, match=PROCESS_KEYS_AHEAD_ENV):
        process_keys_ahead.start()


def test_a_fork_waits_for_the_thread(monkeypatch):
    """A child forked right after the thread starts neither inherits a lock the thread held (it would hang at an
    import) nor misses the keys: the fork waited for the thread."""
    import triton.runtime.cache
    from torch._inductor import codecache

    triton.runtime.cache.triton_key.cache_clear()
    codecache.torch_key.clear()
    monkeypatch.setattr(process_keys_ahead, "_started", [])
    thread = process_keys_ahead.start()
    pid = os.fork()
    if pid == 0:  # the child: the keys are there, and imports do not hang
        import importlib

        ok = (triton.runtime.cache.triton_key.cache_info().currsize == 1 and not thread.is_alive())
        importlib.import_module("torch._inductor.runtime.triton_compat")
        os._exit(0 if ok else 3)
    assert not thread.is_alive()  # the parent joined it before forking
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child did not finish within 120 s")
