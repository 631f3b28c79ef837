"""Regions that are not the plain delta rule although they compute it at small random inputs (a
clamp, a value-dependent mask, nan_to_num, a narrow round-trip, a detach or no_grad island, an
in-place or random op): never rewritten; the near-miss reason names the op and its source line."""
import warnings

import pytest
import torch

import la_compiler
from tests.passes.test_torch_recurrence import _inputs
from tests.passes.torch_recurrence_refusals import REFUSALS, gdn_refusal

RANDOM = {"dropout_on_delta", "noise_on_state"}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_with_the_op_and_its_line(name):
    op, phrase = REFUSALS[name]
    fn = gdn_refusal(name)
    t = _inputs("gdn", T=5 if name.startswith("chunk") else 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        report = la_compiler.explain(fn, **t)
    assert report.matches == []
    reasons = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert len(reasons) == 1, reasons
    (reason,) = reasons
    assert reason.startswith(op) and phrase in reason, reason
    source = "torch_recurrence_spellings.py:" if name.startswith("chunk") else "torch_recurrence_refusals.py:"
    assert f" at {source}" in reason, reason  # the source line of the op
    if name not in RANDOM:  # left untouched: the compiled function computes what the function computes
        for got, want in zip(report.output, fn(**t)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refused_spellings_agree_with_the_delta_rule_at_small_inputs():
    """Why the ops are checked before probing: the clamp, nan_to_num and detach variants compute
    exactly the delta rule's forward values at the probes' magnitudes."""
    t = _inputs("gdn", T=3)
    exact = gdn_refusal("")(**t)
    for name in ("state_clamp", "delta_clamp", "state_nan_to_num", "state_detach", "key_detach_in_delta",
                 "state_where", "state_inplace_clamp"):
        with torch.no_grad():
            got = gdn_refusal(name)(**t)
        torch.testing.assert_close(got[0], exact[0], rtol=1e-6, atol=1e-6, msg=name)


def test_an_input_mutated_in_place_is_refused():
    """``h0 *= d`` on the caller's tensor: eager mutates it, the IR node would not."""
    from tests.passes.torch_recurrence_refusals import gdn_mutating_input_state
    t = _inputs("gdn", T=3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h0 = t["h0"].clone()
        report = la_compiler.explain(gdn_mutating_input_state, **dict(t, h0=h0))
    assert report.matches == []
    (reason,) = [n.reason for n in report.near_misses]
    assert reason.startswith("`imul` at torch_recurrence_refusals.py:") and "input l_h0_ in place" in reason, reason
    assert not torch.equal(h0, t["h0"])  # the compiled function mutated it, as eager does


def test_the_allow_list_is_documented():
    """docs/torch_frontend.md lists every op of the allow-list (kept as data in allowed_ops.py)."""
    from pathlib import Path

    from la_compiler.passes.frontends.torch_recurrence.allowed_ops import ALLOWED
    doc = (Path(__file__).parents[2] / "docs" / "torch_frontend.md").read_text()
    assert [op for op in ALLOWED if f"`{op}`" not in doc] == []
    for op, why in ALLOWED.items():
        assert why, op  # each entry says why it preserves the algebra
