"""The chunk kernels' compile-ahead (kernels/chunk/compile_ahead.py): the compile requests of a training step's
recipe are exactly the launches a real training step makes (kernel, warps, stages, constexprs, every scalar
argument, every tensor's dtype and shape), so every kernel the step reaches compiles ahead and none extra; it
runs once per kind of step, never under t.compile_ahead=false, and launches nothing."""
import threading

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import la_compiler.ir.delta_rule  # noqa: F401  (registers laqat::delta_rule)
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk import compile_ahead
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.common.background_compiles import finish_background_compiles
from la_compiler.options import TuningOptions
from tests.ir_inputs import random_inputs


def describe(kernel, arguments: dict) -> tuple:
    def value(v):
        return ("tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v
    return getattr(kernel, "__name__", None) or kernel.fn.__name__, tuple(sorted(
        (name, value(v)) for name, v in arguments.items()))


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch of the interpreter, described."""
    seen = []
    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        assert not args
        seen.append(describe(self.fn, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return seen


CASES = {
    "gdn": dict(kind="gdn", spec={}, inputs=dict(B=2, T=11, H=1, K=8, V=8)),
    "kda, initial state": dict(kind="kda", spec={}, inputs=dict(B=1, T=9, H=2, K=8, V=8, initial_state=True)),
    "gdn varlen, grouped heads": dict(kind="gdn", spec={}, inputs=dict(B=1, T=13, H=1, HV=2, K=8, V=8,
                                                                     cu_seqlens=[0, 5, 13])),
    "kda, fp8 state, keep all": dict(kind="kda", spec=dict(quant=(("state", "fp8_e4m3/tile16"),)),
                                     tuning={"keep_residual": "all"}, inputs=dict(B=1, T=9, H=1, K=8, V=16)),
    "gdn, no residual": dict(kind="gdn", spec={}, tuning={"keep_residual": "none"},
                             inputs=dict(B=1, T=9, H=1, K=8, V=8, initial_state=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_recipe_requests_exactly_the_launches_of_a_training_step(case, launches):
    c = CASES[case]
    spec = RecurrenceSpec(kind=c["kind"], chunk=8, kernel="chunk", **c["spec"]).replace(tuning=c.get("tuning", {}))
    xs, cu = random_inputs(c["kind"], **c["inputs"])
    o, ht = torch.ops.laqat.delta_rule(*xs[:6], cu, 0.5, str(spec))
    torch.autograd.grad((o * torch.randn_like(o)).sum() + (ht * torch.randn_like(ht)).sum(),
                        [x for x in xs if x is not None])
    real = list(launches)
    assert len(real) >= 5

    requested = []
    p, tuning = ChunkParams.from_spec(spec), spec.tuning_options
    with torch.no_grad(), compile_ahead.compiling_only(lambda kernel, arguments: requested.append(
            describe(kernel, arguments))):
        compile_ahead.run_training_step(p, tuning, *(x.detach() if x is not None else None for x in xs[:5]), 0.5,
                                        xs[5].detach() if xs[5] is not None else None, cu, None)
    assert len(launches) == len(real)  # the recipe launched nothing
    assert sorted(requested, key=repr) == sorted(real, key=repr)


def test_once_per_kind_of_step_and_never_when_turned_off(monkeypatch):
    """compile_training_step (as the chunk variant's training forward calls it): the first forward of a kind of step
    runs the recipe, the next of the same kind (other sequence lengths included) does not, another kind does;
    t.compile_ahead=false never."""
    requests = []
    monkeypatch.setattr(compile_ahead, "available", lambda device: True)
    monkeypatch.setattr(compile_ahead, "request_compile", lambda kernel, arguments: requests.append(kernel))
    monkeypatch.setattr(compile_ahead, "_done", set())

    def train(T, K=8, **tuning):
        spec = RecurrenceSpec(kind="gdn", chunk=8, kernel="chunk").replace(tuning=tuning)
        xs, _ = random_inputs("gdn", B=1, T=T, H=1, K=K, V=8)
        o, _ = torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(spec))
        finish_background_compiles()
        return o

    train(9)
    first = len(requests)
    assert first >= 5
    train(12)
    assert len(requests) == first
    train(9, K=16)
    assert len(requests) == 2 * first
    train(9, K=32, compile_ahead=False)
    assert len(requests) == 2 * first


def test_the_forward_compiles_before_the_step_goes_on_and_the_backward_in_a_background_thread(monkeypatch):
    """compile_training_step requests the forward's kernels on the step's thread and returns; the backward's come
    from a background thread, and both together are the whole recipe's requests."""
    requests = []
    monkeypatch.setattr(compile_ahead, "available", lambda device: True)
    monkeypatch.setattr(compile_ahead, "_done", set())
    release = threading.Event()
    step_thread = threading.current_thread()

    def request(kernel, arguments):
        if threading.current_thread() is not step_thread:
            release.wait(timeout=60)  # the step's thread has returned before any backward compile is done
        requests.append((threading.current_thread().name, describe(kernel, arguments)))
    monkeypatch.setattr(compile_ahead, "request_compile", request)
    spec = RecurrenceSpec(kind="kda", chunk=8, kernel="chunk")
    xs, _ = random_inputs("kda", B=1, T=9, H=1, K=8, V=8)
    torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(spec))  # a training forward
    forward = list(requests)
    release.set()
    finish_background_compiles()
    backward = requests[len(forward):]
    assert forward and backward
    assert {name for name, _ in forward} == {step_thread.name}
    assert {name for name, _ in backward} == {compile_ahead.BACKGROUND_THREAD}

    whole = []
    p, tuning = ChunkParams.from_spec(spec), spec.tuning_options
    with torch.no_grad(), compile_ahead.compiling_only(lambda kernel, arguments: whole.append(
            describe(kernel, arguments))):
        compile_ahead.run_training_step(p, tuning, *(x.detach() for x in xs[:5]), 0.5, None, None, None)
    assert sorted((r for _, r in requests), key=repr) == sorted(whole, key=repr)


def test_a_failing_background_compile_warns_and_the_backward_runs(monkeypatch):
    monkeypatch.setattr(compile_ahead, "available", lambda device: True)
    monkeypatch.setattr(compile_ahead, "_done", set())
    step_thread = threading.current_thread()

    def request(kernel, arguments):
        if threading.current_thread() is not step_thread:
            raise RuntimeError("no compiler in this thread")
    monkeypatch.setattr(compile_ahead, "request_compile", request)
    spec = RecurrenceSpec(kind="gdn", chunk=8, kernel="chunk")
    xs, _ = random_inputs("gdn", B=1, T=9, H=1, K=8, V=8)
    weights = torch.randn(1, 9, 1, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"ahead failed \(RuntimeError: no compiler in this thread\)"):
        o, _ = torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(spec))
        finish_background_compiles()
    grads = torch.autograd.grad((o * weights.to(o.dtype)).sum(), xs[:5])
    off = spec.replace(tuning={"compile_ahead": False})
    o_off, _ = torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(off))
    want = torch.autograd.grad((o_off * weights.to(o.dtype)).sum(), xs[:5])
    assert torch.equal(o, o_off) and all(torch.equal(a, b) for a, b in zip(grads, want))


def test_off_the_gpu_nothing_is_compiled_ahead():
    assert not compile_ahead.available(torch.device("cpu"))
    assert TuningOptions().compile_ahead is True


def test_a_failing_compile_ahead_warns_and_the_step_runs(monkeypatch):
    """Only the compiles' timing is at stake: a recipe that fails ahead warns, and the real launches run."""
    monkeypatch.setattr(compile_ahead, "available", lambda device: True)
    monkeypatch.setattr(compile_ahead, "_done", set())

    def refuse(kernel, arguments):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(compile_ahead, "request_compile", refuse)
    spec = RecurrenceSpec(kind="gdn", chunk=8, kernel="chunk")
    xs, _ = random_inputs("gdn", B=1, T=9, H=1, K=8, V=8)
    with pytest.warns(UserWarning, match=r"compiling the chunk kernels ahead failed \(RuntimeError: no compiler here\)"):
        o, _ = torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(spec))
    want, _ = torch.ops.laqat.delta_rule(*xs[:6], None, 0.5, str(spec.replace(tuning={"compile_ahead": False})))
    assert torch.equal(o, want)
