"""The autotuning searches of FLA's kernels under laqat's ops (kernels/fla/autotune_searches.py): inside
``quick_searches()`` a search compiles every candidate first (a warm-up launch each, before any is timed), times
each with the short bench, keeps the fastest, and leaves the autotuner's own bench as it was; a key already chosen
searches nothing; outside, Triton's search runs untouched. The interpreter has no device to time on, so the tests
give the autotuners timers."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction

from la_compiler.kernels.fla import autotune_searches
from la_compiler.options import OptionsError

CONFIGS = [triton.Config({"B": b}, num_warps=w) for b in (16, 32) for w in (2, 4)]


def make_kernel():
    @triton.autotune(configs=CONFIGS, key=["n"])
    @triton.jit
    def add_one(x, y, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(y + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)
    return add_one


class Timer:
    """Times in the order of the calls: the third candidate timed is the fastest."""

    def __init__(self, events):
        self.events, self.calls = events, 0

    def __call__(self, kernel_call, quantiles):
        kernel_call()
        self.calls += 1
        self.events.append("timed")
        t = 1.0 if self.calls == 3 else 2.0 + self.calls
        return [t, t, t]


@pytest.fixture
def events(monkeypatch):
    seen = []
    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        seen.append(("compile", kwargs["B"], kwargs["num_warps"]) if warmup else "launch")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return seen


def launch(kernel, n=100):
    x = torch.randn(n)
    y = torch.empty(n)
    kernel[lambda m: (triton.cdiv(n, m["B"]),)](x, y, n)
    assert torch.equal(y, x + 1)


def test_a_search_inside_compiles_every_candidate_first_then_times_them_briefly(events, monkeypatch):
    kernel = make_kernel()
    timer = Timer(events)
    monkeypatch.setattr(autotune_searches, "quick_bench", timer)
    with autotune_searches.quick_searches():
        launch(kernel)
    compiles = [e for e in events[:len(CONFIGS)]]
    assert sorted(compiles) == sorted(("compile", c.kwargs["B"], c.num_warps) for c in CONFIGS)
    assert events.count("timed") == len(CONFIGS) and timer.calls == len(CONFIGS)
    assert events[-1] == "launch"  # the chosen candidate's launch
    (choice,) = kernel.cache.values()
    assert choice is CONFIGS[2]  # the fastest
    assert kernel.__dict__.get("_do_bench") is None  # the autotuner's own bench restored

    del events[:]
    with autotune_searches.quick_searches():
        launch(kernel)  # the key is chosen: no search
    assert events == ["launch"] and timer.calls == len(CONFIGS)


def test_outside_a_search_runs_as_triton_runs_it(events, monkeypatch):
    kernel = make_kernel()
    quick = Timer([])
    monkeypatch.setattr(autotune_searches, "quick_bench", quick)
    own = Timer(events)
    kernel._do_bench = own  # the autotuner's bench (the interpreter has no device benchmarker)
    with autotune_searches.quick_searches():
        pass  # installs the wrapper
    launch(kernel)
    assert not [e for e in events if isinstance(e, tuple)]  # no compile ahead
    assert own.calls == len(CONFIGS) and quick.calls == 0
    (choice,) = kernel.cache.values()
    assert choice is CONFIGS[2]


def test_searched_calls_inside_quick_searches():
    seen = []

    def fn(a, b=0):
        seen.append(autotune_searches._inside.get())
        return a + b
    assert autotune_searches.searched(fn)(1, b=2) == 3 and fn(1) == 1
    assert seen == [True, False]


@pytest.mark.parametrize("setting,keep,searched_configs", [
    (None, (({"B": 32}, 2), ({"B": 16}, 4)), [CONFIGS[2], CONFIGS[1]]),
    ("full", (({"B": 32}, 2), ({"B": 16}, 4)), CONFIGS),
    (None, (({"B": 64}, 2),), CONFIGS),  # a list that matches none of the kernel's candidates: the whole search
])
def test_a_narrowed_kernel_searches_only_its_listed_candidates(setting, keep, searched_configs, events, monkeypatch):
    kernel = make_kernel()
    if setting is None:
        monkeypatch.delenv("LAQAT_FLA_SEARCHES", raising=False)
    else:
        monkeypatch.setenv("LAQAT_FLA_SEARCHES", setting)
    monkeypatch.setitem(autotune_searches.NARROWED, "add_one", keep)
    timer = Timer(events)
    monkeypatch.setattr(autotune_searches, "quick_bench", timer)
    with autotune_searches.quick_searches():
        launch(kernel)
    compiled = [e for e in events if isinstance(e, tuple)]
    assert sorted(compiled) == sorted(("compile", c.kwargs["B"], c.num_warps) for c in searched_configs)
    assert timer.calls == len(searched_configs)
    assert kernel.configs == CONFIGS  # FLA's list restored
    (choice,) = kernel.cache.values()
    assert choice in searched_configs


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("LAQAT_FLA_SEARCHES", "some")
    with pytest.raises(OptionsError, match=r"^LAQAT_FLA_SEARCHES: must be one of \['narrowed', 'full'\], got 'some'"):
        with autotune_searches.quick_searches():
            launch(make_kernel())


def test_every_narrowed_candidate_is_one_of_flas():
    """NARROWED names FLA's kernels and candidates as FLA's installed release lists them."""
    fla = pytest.importorskip("fla")  # noqa: F841
    from fla.modules.activations import ops as activations
    from fla.modules.causal_conv1d import ops as conv
    from fla.modules.norm import fused_norm_gate, l2norm, layernorm

    def autotuner(kernel):  # under FLA's heuristics where it has them
        while not isinstance(kernel, Autotuner):
            kernel = kernel.fn
        return kernel

    kernels = {autotuner(k).base_fn.__name__: autotuner(k) for k in (
        activations.swiglu_fwd_kernel, activations.swiglu_fwdbwd_kernel, l2norm.l2norm_fwd_kernel,
        l2norm.l2norm_bwd_kernel, conv.causal_conv1d_fwd_kernel, conv.causal_conv1d_bwd_kernel,
        fused_norm_gate.layer_norm_gated_fwd_kernel, fused_norm_gate.layer_norm_gated_bwd_kernel,
        layernorm.layer_norm_fwd_kernel_row, layernorm.layer_norm_bwd_kernel_row)}
    assert sorted(kernels) == sorted(autotune_searches.NARROWED)
    for name, keep in autotune_searches.NARROWED.items():
        kept = autotune_searches.narrowed(name, kernels[name].configs)
        assert len(kept) == len(keep) < len(kernels[name].configs), name
