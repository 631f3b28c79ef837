"""A recurrence written with ``torch._higher_order_ops.scan`` and a readout of the negated query ``S^T (-q)`` are
rewritten, and equal eager in the output, the final state and every input gradient; their near variants are left
alone (refused with a true reason, eager's values at magnitudes where the variant differs), and a scan left alone
is the graph Dynamo gave (its unrolled copy erased)."""
import warnings

import pytest
import torch

import la_compiler
from la_compiler.passes.frontends.torch_recurrence import rewrite_torch_recurrences
from la_compiler.record import GraphRecord
from tests.helpers import rel_l2
from tests.passes import torch_recurrence_completeness as completeness
from tests.passes.test_torch_recurrence import REFERENCE, _check, _inputs

SCAN = torch.ops.higher_order.scan


def _call(fn, q, k, v, g, beta, h0):
    return fn(q, k, v, g, beta, h0)


@pytest.mark.parametrize("name", ["gdn_scan", "gdn_scan_reverse", "gdn_negated_query", "gdn_negated_query_matmul",
                                  "gdn_negated_query_and_final_state"])
def test_rewritten_and_equal_to_eager(name):
    _check(getattr(completeness, name), "gdn", _inputs("gdn"), _call)


def _large_state(t):
    return dict(t, h0=t["h0"] * 1e3)


NEAR_VARIANTS = {  # name -> (inputs, the variant it is near, a phrase of the reason)
    "gdn_scan_read_before_update": (_inputs("gdn"), "gdn_scan", "does not compute the GDN/KDA delta rule"),
    "gdn_scan_state_clamp": (_large_state(_inputs("gdn")), "gdn_scan", "`clamp` at torch_recurrence_completeness"),
    "gdn_negated_query_mixed_signs": (_inputs("gdn"), "gdn_negated_query", "does not compute the GDN/KDA delta rule"),
    "gdn_negated_query_subtracted_update": (_inputs("gdn"), "gdn_negated_query",
                                            "does not compute the GDN/KDA delta rule"),
}


@pytest.mark.parametrize("name", sorted(NEAR_VARIANTS))
def test_near_variants_are_left_alone(name):
    tensors, near, phrase = NEAR_VARIANTS[name]
    fn = getattr(completeness, name)
    # the inputs show the difference: the variant's eager values are far from the delta rule's
    assert rel_l2(fn(**tensors)[0], getattr(completeness, near)(**tensors)[0]) > 1e-2
    eager_in = {n: x.clone().requires_grad_() for n, x in tensors.items()}
    laqat_in = {n: x.clone().requires_grad_() for n, x in tensors.items()}
    want = fn(**eager_in)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(fn, policy=REFERENCE, **laqat_in)
    assert report.matches == []
    (reason,) = [m.reason for m in report.near_misses if m.frontend == "torch"]
    assert phrase in reason, reason
    cotangents = [torch.randn_like(w) for w in want]
    sum((w * c).sum() for w, c in zip(want, cotangents)).backward()
    sum((o * c).sum() for o, c in zip(report.output, cotangents)).backward()
    for got, w in zip(report.output, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    for n, x in laqat_in.items():
        assert rel_l2(x.grad, eager_in[n].grad) <= 1e-6, n


def _graph_after_rewrite(fn, tensors):
    """(Dynamo's graph code, the code after the torch frontend, recurrences rewritten)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = gm.code
        seen["rewritten"] = rewrite_torch_recurrences(gm, GraphRecord(0))
        seen["after"], seen["scans"] = gm.code, sum(n.target is SCAN for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(**tensors)
    return seen


def test_a_scan_left_alone_is_the_graph_dynamo_gave():
    seen = _graph_after_rewrite(completeness.gdn_scan_read_before_update, _inputs("gdn"))
    assert seen["rewritten"] == 0 and seen["scans"] == 1
    assert seen["after"] == seen["before"]


def test_a_rewritten_scan_leaves_the_graph():
    seen = _graph_after_rewrite(completeness.gdn_scan, _inputs("gdn"))
    assert seen["rewritten"] == 1 and seen["scans"] == 0
    assert "scan_combine_fn" not in seen["after"], seen["after"]


def test_a_scan_at_a_second_length_is_rewritten_again():
    """Automatic dynamic shapes make the scanned length symbolic at the second length: pinned, rewritten."""
    torch._dynamo.reset()
    compiled = torch.compile(completeness.gdn_scan, backend="laqat", options={"compiler": "eager", "policy": REFERENCE})
    first = len(la_compiler.backend.last_record().graphs)
    for T in (5, 7):
        t = _inputs("gdn", T=T, seed=T)
        o, S = compiled(**t)
        o_ref, S_ref = completeness.gdn_scan(**t)
        assert rel_l2(o, o_ref) <= 1e-5 and rel_l2(S, S_ref) <= 1e-5, T
    graphs = la_compiler.backend.last_record().graphs[first:]
    assert [len(g.matches) for g in graphs] == [1, 1], [g.near_misses for g in graphs]


def _scan_left_alone(t) -> str:
    """Explains the GDN scan on inputs ``t``: nothing rewritten, the output eager's bit for bit; the near miss."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(completeness.gdn_scan, policy=REFERENCE, **t)
    assert report.matches == []
    for got, want in zip(report.output, completeness.gdn_scan(**t)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (reason,) = [m.reason for m in report.near_misses if m.frontend == "torch"]
    return reason


def test_a_scan_over_a_length_marked_dynamic_is_left_alone_and_says_why():
    t = _inputs("gdn", T=5)
    for name in ("q", "k", "v", "g", "beta"):
        torch._dynamo.mark_dynamic(t[name], 1)
    reason = _scan_left_alone(t)
    assert "its length is marked dynamic" in reason and "maybe_mark_dynamic" in reason, reason


def test_a_scan_longer_than_the_unrolled_limit_is_left_alone_and_says_why(monkeypatch):
    from la_compiler.passes.frontends.torch_recurrence import scan
    monkeypatch.setattr(scan, "MAX_STEPS", 4)
    reason = _scan_left_alone(_inputs("gdn", T=6))
    assert "it has 6 steps; scans of at most 4 steps are unrolled" in reason, reason
