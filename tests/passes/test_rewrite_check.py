"""The rewrite check (passes/frontends/torch_recurrence/verify_mode.py): on every compile, the IR node against the
original region on random inputs at a bounded cost; ``verify=True`` runs the whole region. And the decay
passed in already exponentiated: rewritten, its log checked positive at run time (``laqat::log_decay``).

- the default check is a second line behind the structural proofs: with them switched off, every token loop
  of tests/passes/torch_recurrence_step_dependent.py is still refused (at T = 24: a prefix of 8 steps and
  three sampled segments), and the compiled function computes what the function computes;
- a rewrite made wrong on purpose (a scale off by 1 %) is refused by the default check and by verify, for a
  token loop and a loop over chunks; the check's time is recorded;
- ``segments`` bounds the steps a token loop's default check runs, independently of T.
"""
import warnings

import pytest
import torch

from la_compiler.backend import laqat_backend
from la_compiler.explainer import ExplainReport
from la_compiler.ir.checks import IRInputError
from la_compiler.passes.frontends.torch_recurrence import CHECK_SECONDS, loops, steps, verify_mode
from la_compiler.passes.frontends.torch_recurrence.verify_mode import (PREFIX_STEPS, SAMPLED_SEGMENTS,
                                                                       SEGMENT_STEPS, WHOLE_STEPS, segments)
from la_compiler.record import CompileRecord
from tests.helpers import assert_close_rel
from tests.passes.test_torch_recurrence import REFERENCE, _inputs
from tests.passes.torch_recurrence_step_dependent import STEP_DEPENDENT, gdn_step_dependent

CHECK_REASON = "check: the IR node differs from the original region on random inputs"
VERIFY_REASON = "verify: the IR node differs from the original region on random inputs"


def _explain(fn, verify=False, **tensors):
    """Compiles (eager hand-off, the fp64 reference kernel) and runs ``fn`` once: the report explain gives."""
    record = CompileRecord()
    options = {"compiler": "eager", "policy": REFERENCE, "verify": verify}

    def backend(gm, example_inputs):
        return laqat_backend(gm, example_inputs, options=options, _record=record)

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = torch.compile(fn, backend=backend)(**tensors)
    return ExplainReport(graphs=record.graphs, graph_breaks=0, output=output)


@pytest.mark.parametrize("n", [*range(1, 40), 64, 1000, 1024, 4096])
def test_segments_bound_the_steps_independently_of_t(n):
    segs = segments(n)
    assert segs[0].start == 0 and segs[-1].stop == n
    if n <= WHOLE_STEPS:
        assert [(s.start, s.stop) for s in segs] == [(0, n)]
        return
    assert sum(s.stop - s.start for s in segs) == PREFIX_STEPS + SAMPLED_SEGMENTS * SEGMENT_STEPS
    # a step the check does not run between two segments: its carried state is replaced by a random one
    assert all(b.start > a.stop for a, b in zip(segs, segs[1:]))


# the algebra check (steps 0 and 1) already refuses these; the default check refuses the others
ALGEBRA_REFUSES = {"key_roll_by_t": "does not compute the GDN/KDA delta rule"}
WHERE = {  # keep[t] = t < 12: the prefix agrees, the segment sampled from a random state at steps 15-16 does not
    "context_cap": "(steps 15-16 of 24 from a random state, generic inputs: o relative L2",
    "divide_by_max_t_1": "(steps 0-7 of 24, generic inputs: o relative L2",
}


@pytest.mark.parametrize("name", sorted(STEP_DEPENDENT))
def test_default_check_refuses_step_dependent_loops_without_the_structural_proofs(name, monkeypatch):
    """The literals compared step by step (loops.py) and the slices a step reads (steps.py) switched off: the
    algebra check (steps 0 and 1) passes all but one of these, the default check refuses each."""
    monkeypatch.setattr(loops, "_literal_differs", lambda *args: None)
    monkeypatch.setattr(steps, "check_step_inputs", lambda *args: None)
    kind = "kda" if name.startswith("kda") else "gdn"
    fn = gdn_step_dependent(name)
    tensors = _inputs(kind, T=24)
    report = _explain(fn, **tensors)
    assert report.matches == [], report.matches
    (reason,) = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert reason.startswith(ALGEBRA_REFUSES.get(name, CHECK_REASON)) or ALGEBRA_REFUSES.get(name, "?") in reason, \
        reason
    assert WHERE.get(name, "") in reason, reason
    for got, want in zip(report.output, fn(**tensors)):  # left untouched
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _tampered(monkeypatch, factor=1.01):
    """The rewrite check run on an assignment whose scale is off by ``factor``: a wrong rewrite."""
    original = verify_mode.check_rewrite

    def check(flow, region, a, spec, *, thorough=False):
        a.scale *= factor
        return original(flow, region, a, spec, thorough=thorough)

    monkeypatch.setattr(verify_mode, "check_rewrite", check)


def _chunk_gdn(q, k, v, g, beta, h0=None):
    """A loop over chunks of 4 tokens (FLA's naive chunk GDN, T = 8: two chunks)."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule  # noqa: PLC0415

    return naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=h0, output_final_state=True)


@pytest.mark.parametrize("verify", [False, True], ids=["default", "verify"])
@pytest.mark.parametrize("case", ["token_loop_T24", "chunk_loop_T8"])
def test_a_wrong_rewrite_is_refused(case, verify, monkeypatch):
    fn, tensors = (gdn_step_dependent(""), _inputs("gdn", T=24)) if case == "token_loop_T24" else \
        (_chunk_gdn, _inputs("gdn", T=8))
    report = _explain(fn, **tensors)  # untampered: rewritten, the check's time recorded
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    seconds = report.graphs[0].pass_seconds
    assert 0 < seconds[CHECK_SECONDS] < seconds["torch_recurrence"]
    _tampered(monkeypatch)
    report = _explain(fn, verify=verify, **tensors)
    assert report.matches == []
    (reason,) = [n.reason for n in report.near_misses]
    assert reason.startswith(VERIFY_REASON if verify else CHECK_REASON) and "o relative L2" in reason, reason


# ---- a decay passed in already exponentiated ------------------------------------------------------
def _gdn_preexp(q, k, v, d, beta):
    """The state multiplied by ``d`` itself: a decay computed outside the compiled function."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * d[:, t, :, None, None]
        u = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)) * beta[:, t, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K ** -0.5)
    return torch.stack(outs, 1), S


def test_a_decay_passed_in_exponentiated_is_rewritten_and_checked_at_run_time():
    t = _inputs("gdn", T=5)
    args = dict(q=t["q"], k=t["k"], v=t["v"], d=t["g"].exp(), beta=t["beta"])
    eager_in = {n: x.clone().requires_grad_() for n, x in args.items()}
    laqat_in = {n: x.clone().requires_grad_() for n, x in args.items()}
    report = _explain(_gdn_preexp, **laqat_in)
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    assert "laqat.log_decay" in report.graphs[0].readable
    want = _gdn_preexp(**eager_in)
    sum(x.sum() for x in want).backward()
    sum(x.sum() for x in report.output).backward()
    for got, ref in zip(report.output, want):
        assert_close_rel(got.detach(), ref.detach(), 1e-5, "output")
    for name in args:
        assert_close_rel(laqat_in[name].grad, eager_in[name].grad, 1e-5, f"d{name}")
    compiled = torch.compile(_gdn_preexp, backend="laqat", options={"compiler": "eager", "policy": REFERENCE})
    compiled(**args)
    bad = dict(args, d=args["d"].clone())
    bad["d"][1, 3, 0] = 0.0
    with pytest.raises(IRInputError, match=r"the decay l_d_ \(read at test_rewrite_check\.py:\d+ \(S = S \* d\[:, t, "
                                           r":, None, None\]\)\) must be positive.*got 1 of 20 values <= 0"):
        compiled(**bad)
    torch._dynamo.reset()


def test_a_provably_positive_decay_takes_the_plain_log():
    """exp inside the compiled function: no run-time check."""
    t = _inputs("gdn", T=5)
    report = _explain(lambda q, k, v, g, beta: _gdn_preexp(q, k, v, g.exp(), beta),
                      q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"])
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    assert "log_decay" not in report.graphs[0].readable
