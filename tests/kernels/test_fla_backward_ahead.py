"""The backward of FLA's kernels compiled ahead (kernels/fla/backward_ahead.py, compile_requests.py): inside
``requests_only()`` a launch compiles and runs nothing (a plain kernel its compile; an autotuned kernel without a
choice the candidates its search will time, with one its choice), untimed, nothing chosen; the job runs once per
kind in a background thread, never with LAQAT_FLA_COMPILE_AHEAD=off, and a failing job warns. The interpreter
compiles nothing: the tests record the compile requests (``warmup=True`` launches) and the launches."""
import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from la_compiler.kernels.common.background_compiles import finish_background_compiles
from la_compiler.kernels.fla import autotune_searches, backward_ahead, compile_requests
from la_compiler.options import OptionsError
from tests.kernels.test_autotune_searches import CONFIGS
from tests.kernels.test_autotune_searches import make_kernel as make_tuned  # add_one, autotuned over CONFIGS


@triton.jit
def add_one_plain(x, y, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


@pytest.fixture
def events(monkeypatch):
    """The interpreter's launches and compile requests, as ``requests_only`` hands them on; ``untimed`` fails any
    timing."""
    seen = []
    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        seen.append(("compile", kwargs.get("B"), kwargs.get("num_warps")) if warmup else "launch")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    monkeypatch.setattr(JITFunction, "run", JITFunction.run)  # restored after the re-install below
    monkeypatch.setattr(compile_requests, "_installed", False)
    compile_requests._install()  # wraps the recording run

    def untimed(kernel_call, quantiles):
        raise AssertionError("a candidate was timed")
    monkeypatch.setattr(autotune_searches, "quick_bench", untimed)
    return seen


def buffers(n=40):
    return torch.randn(n), torch.full((n,), 7.0)


def test_an_autotuned_launch_without_a_choice_compiles_the_candidates_its_search_will_time(events, monkeypatch):
    monkeypatch.setitem(autotune_searches.NARROWED, "add_one", (({"B": 32}, 2), ({"B": 16}, 4)))
    kernel = make_tuned()
    x, y = buffers()
    with compile_requests.requests_only():
        with autotune_searches.quick_searches():  # as laqat's ops call FLA's functions
            kernel[lambda m: (triton.cdiv(40, m["B"]),)](x, y, 40)
    assert sorted(events) == [("compile", 16, 4), ("compile", 32, 2)]
    assert not kernel.cache  # nothing chosen: the backward's own search chooses
    assert torch.equal(y, torch.full((40,), 7.0))  # nothing ran


def test_an_autotuned_launch_with_a_choice_compiles_the_choice(events, monkeypatch):
    kernel = make_tuned()
    x, y = buffers()
    (key,) = [autotune_searches.tuning_key(kernel, (x, y, 40), {})]
    kernel.cache[key] = CONFIGS[3]
    with compile_requests.requests_only():
        kernel[lambda m: (triton.cdiv(40, m["B"]),)](x, y, 40)
    assert events == [("compile", 32, 4)]
    assert torch.equal(y, torch.full((40,), 7.0))


def test_a_plain_launch_becomes_its_compile_and_launches_run_again_outside(events):
    x, y = buffers()
    with compile_requests.requests_only():
        add_one_plain[(3,)](x, y, 40, B=16)
    assert events == [("compile", 16, None)] and torch.equal(y, torch.full((40,), 7.0))
    add_one_plain[(3,)](x, y, 40, B=16)
    assert events[1:] == ["launch"] and torch.equal(y, x + 1)


def test_requests_only_holds_in_its_own_thread_only(events):
    """A background job's requests_only leaves the step's launches running."""
    x, y = buffers()
    entered, done = threading.Event(), threading.Event()

    def job():
        with compile_requests.requests_only():
            entered.set()
            done.wait(timeout=60)
    thread = threading.Thread(target=job)
    thread.start()
    entered.wait(timeout=60)
    add_one_plain[(3,)](x, y, 40, B=16)
    done.set()
    thread.join()
    assert events == ["launch"] and torch.equal(y, x + 1)


@pytest.fixture
def jobs(monkeypatch):
    """compile_backward_ahead as on a GPU; each job records its thread and whether requests_only held in it."""
    monkeypatch.setattr(backward_ahead, "available", lambda device: True)
    monkeypatch.setattr(backward_ahead, "_done", set())
    monkeypatch.delenv("LAQAT_FLA_COMPILE_AHEAD", raising=False)
    seen = []

    def ahead(op, key):
        backward_ahead.compile_backward_ahead(op, key, torch.device("cpu"), lambda: seen.append(
            (op, key, threading.current_thread().name, autotune_searches.requests_only.get(),
             torch.is_grad_enabled())))
        finish_background_compiles()
    return seen, ahead


def test_the_backward_runs_once_per_kind_in_a_background_thread_under_requests_only(jobs):
    seen, ahead = jobs
    key = backward_ahead.describe(torch.randn(2, 9, 16), torch.randn(16), 1e-6, True)
    ahead("layer_norm", key)
    ahead("layer_norm", backward_ahead.describe(torch.randn(1, 33, 16), torch.randn(16), 1e-6, True))
    ahead("layer_norm", backward_ahead.describe(torch.randn(2, 9, 32), torch.randn(32), 1e-6, True))
    ahead("l2_norm", key)
    assert [(op, k) for op, k, *_ in seen] == [
        ("layer_norm", key), ("layer_norm", backward_ahead.describe(torch.randn(2, 9, 32), torch.randn(32), 1e-6,
                                                                    True)), ("l2_norm", key)]
    assert {(name, inside, grad) for _, _, name, inside, grad in seen} == {
        (backward_ahead.BACKGROUND_THREAD, True, False)}


def test_never_when_turned_off_and_a_bad_setting_is_refused_by_name(jobs, monkeypatch):
    seen, ahead = jobs
    monkeypatch.setenv("LAQAT_FLA_COMPILE_AHEAD", "off")
    ahead("layer_norm", (1,))
    assert seen == []
    monkeypatch.setenv("LAQAT_FLA_COMPILE_AHEAD", "yes")
    with pytest.raises(OptionsError, match=r"^LAQAT_FLA_COMPILE_AHEAD: must be one of \['on', 'off'\], got 'yes'"):
        ahead("layer_norm", (1,))


def test_a_failing_job_warns_and_names_the_setting(monkeypatch):
    monkeypatch.setattr(backward_ahead, "available", lambda device: True)
    monkeypatch.setattr(backward_ahead, "_done", set())

    def fails():
        raise RuntimeError("no compiler in this thread")
    with pytest.warns(UserWarning, match=r"FLA's kernels ahead failed \(RuntimeError: no compiler in this thread\).*"
                                         r"LAQAT_FLA_COMPILE_AHEAD=off"):
        backward_ahead.compile_backward_ahead("l2_norm", (1,), torch.device("cpu"), fails)
        finish_background_compiles()


def test_off_the_gpu_nothing_is_compiled_ahead():
    assert not backward_ahead.available(torch.device("cpu"))
