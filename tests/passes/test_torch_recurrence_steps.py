"""Steps compared as programs, constants included: a token loop whose steps read a step-dependent constant,
literal or index is never rewritten as if every step were step 0. Each is refused with a near miss naming
the step, the value and its source line, and left untouched (the compiled function computes what the
function computes); fp32 rounding tricks and narrow round trips are refused too. One compile each, T = 6."""
import warnings

import pytest
import torch

import la_compiler
from tests.helpers import assert_close_rel
from tests.passes.test_torch_recurrence import REFERENCE, _inputs
from tests.passes.torch_recurrence_step_dependent import (NATIVE, ROUND_TRIPS, STEP_DEPENDENT, gdn_clamp_on_last_step,
                                                          gdn_into_callers_buffer,
                                                          gdn_shifted_key_outside, gdn_step_dependent,
                                                          gdn_uniform_constant,
                                                          gdn_unit_sphere_renorm)


def _explain(fn, t):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return la_compiler.explain(fn, policy=REFERENCE, **t)


def _refused(fn, kind="gdn"):
    t = _inputs(kind, T=6)
    report = _explain(fn, t)
    assert report.matches == [], report.matches
    reasons = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert len(reasons) == 1, reasons
    for got, want in zip(report.output, fn(**t)):  # left untouched
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return reasons[0]


@pytest.mark.parametrize("name", sorted(STEP_DEPENDENT))
def test_step_dependent_value_is_refused_naming_step_value_and_line(name):
    reason = _refused(gdn_step_dependent(name), "kda" if name.startswith("kda") else "gdn")
    for phrase in STEP_DEPENDENT[name]:
        assert phrase in reason, reason
    assert "torch_recurrence_step_dependent.py:" in reason, reason  # the source line


def test_step_dependent_fixtures_differ_from_the_delta_rule():
    """Guards the fixtures: each really computes something else than the delta rule (at T = 6)."""
    t = _inputs("gdn", T=6)
    exact = gdn_step_dependent("")(**t)[0]
    for name in [*STEP_DEPENDENT, *NATIVE]:
        if not name.startswith("kda"):
            assert not torch.allclose(gdn_step_dependent(name)(**t)[0], exact, atol=1e-4), name


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_fp32_rounding_trick_is_refused(name):
    assert NATIVE[name] in _refused(gdn_step_dependent(name))


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_narrow_round_trip_is_refused(name):
    reason = _refused(gdn_step_dependent(name))
    assert reason.startswith(ROUND_TRIPS[name]) and "narrower dtype" in reason, reason


def test_key_renormalization_off_the_unit_sphere_is_refused():
    reason = _refused(gdn_unit_sphere_renorm)
    assert "does not compute the GDN/KDA delta rule" in reason, reason


def test_outputs_into_the_callers_buffer_are_refused_as_an_input_write():
    t = _inputs("gdn", T=6)
    o = torch.zeros_like(t["v"])
    report = _explain(gdn_into_callers_buffer, dict(t, o=o))
    assert report.matches == []
    (reason,) = [n.reason for n in report.near_misses]
    assert reason.startswith("`setitem` at torch_recurrence_step_dependent.py:") and "input l_o_ in place" in reason
    assert o.abs().sum() > 0  # the compiled function wrote into it, as eager does


def test_last_step_computing_something_else_names_it():
    reason = _refused(gdn_clamp_on_last_step)
    assert reason.startswith("step 5 is not isomorphic to step 4") and "clamp" in reason, reason


@pytest.mark.parametrize("fn", [gdn_uniform_constant, gdn_shifted_key_outside], ids=lambda f: f.__name__)
def test_rewritten_when_every_step_reads_its_own_token(fn):
    """A constant that is the same at every step; a shifted key computed outside the region (the IR node's k)."""
    t = _inputs("gdn", T=6)
    report = _explain(fn, t)
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    for got, want in zip(report.output, fn(**t)):
        assert_close_rel(got, want, 1e-5, "output")
