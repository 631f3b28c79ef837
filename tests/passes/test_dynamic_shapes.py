"""Dynamic shapes: ``dynamic=True``, ``mark_dynamic`` and automatic dynamic shapes (a second length) for FLA calls
and torch loops compile and compute what a static compile computes; a recompile that rewrites fewer recurrences
than an earlier compile of the same function did, under a policy that changes numerics, warns.

FLA calls keep their lengths symbolic (one compile for every T, number of sequences and cu_seqlens values); an
unrolled torch loop is specialized to its trip count by Dynamo, and the torch frontend pins the sizes its graph
reads to their values (each length is its own compile, each rewritten)."""
import warnings

import pytest
import torch

import la_compiler
from la_compiler.policy_schema import NothingQuantizedWarning
from tests.helpers import rel_l2
from tests.passes.test_torch_recurrence import _inputs as torch_inputs
from tests.passes.torch_recurrence_step_dependent import gdn_step_dependent

pytest.importorskip("fla")

TOL = 1e-5


def _record():
    return la_compiler.backend.last_record()


def _fla_inputs(T, B=1, H=2, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.1 * torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _fla_gdn(q, k, v, g, beta, cu_seqlens=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)


CALLS = [(8, None), (13, None), (13, [0, 5, 13]), (13, [0, 9, 13]), (17, [0, 3, 10, 17])]


@pytest.mark.parametrize("how, compiler", [("dynamic=True", "eager"), ("dynamic=True", "inductor"),
                                           ("mark_dynamic", "eager"), ("automatic", "eager")])
def test_fla_call_with_symbolic_lengths_and_offsets(how, compiler):
    """A symbolic default scale, T, number of sequences and cu_seqlens values: correct results (against FLA's naive
    recurrence), and with dynamic=True one compile without and one with cu_seqlens."""
    from tests.passes.fla_oracle import naive_fla_call
    torch._dynamo.reset()
    compiled = torch.compile(_fla_gdn, backend="laqat", options={"compiler": compiler},
                             **({"dynamic": True} if how == "dynamic=True" else {}))
    first = len(_record().graphs)
    for T, cu in CALLS:
        t = _fla_inputs(T)
        if how == "mark_dynamic":
            for x in t.values():
                torch._dynamo.mark_dynamic(x, 1)
        cu = torch.tensor(cu) if cu is not None else None
        o, ht = compiled(**t, cu_seqlens=cu)
        o_ref, ht_ref = naive_fla_call("gdn", **t, output_final_state=True, cu_seqlens=cu)
        assert rel_l2(o, o_ref) <= TOL and rel_l2(ht, ht_ref) <= TOL, (how, T, cu)
    graphs = _record().graphs[first:]
    assert all(len(g.matches) == 1 for g in graphs), [(g.matches, g.near_misses) for g in graphs]
    if how == "dynamic=True":
        assert len(graphs) == 2, len(graphs)


def test_fla_call_with_a_symbolic_length_under_a_quantizing_policy():
    """dynamic=True under state_fp8: the same numerics as a static compile of each length."""
    options = {"compiler": "eager", "policy": "state_fp8"}
    torch._dynamo.reset()
    dynamic = torch.compile(_fla_gdn, backend="laqat", options=options, dynamic=True)
    for T in (70, 90):
        t = _fla_inputs(T)
        got = dynamic(**t)
        torch._dynamo.reset()
        want = torch.compile(_fla_gdn, backend="laqat", options=options)(**t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), T
        assert "q.state=" in str(_record().graphs[-1].matches[0].spec)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_torch_loop_is_rewritten_at_every_length(dynamic):
    """A second length (automatic dynamic shapes make it symbolic) and dynamic=True: every compile rewrites the
    loop and quantizes it as a static compile of that length does; no warning."""
    fn = gdn_step_dependent("")
    options = {"compiler": "eager", "policy": "state_fp8"}
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="laqat", options=options, dynamic=dynamic)
    first = len(_record().graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        got = {T: compiled(**torch_inputs("gdn", T=T)) for T in (6, 8)}
    assert [len(g.matches) for g in _record().graphs[first:]] == [1, 1], _record().graphs[first:]
    for T, (o, S) in got.items():
        torch._dynamo.reset()
        o_static, S_static = torch.compile(fn, backend="laqat", options=options)(**torch_inputs("gdn", T=T))
        assert torch.equal(o, o_static) and torch.equal(S, S_static), T


def _gdn_with_flag(q, k, v, g, beta, h0, clamp):
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        if clamp:
            S = S.clamp(-1e3, 1e3)
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def test_a_recompile_that_rewrites_less_is_not_silent():
    torch._dynamo.reset()
    compiled = torch.compile(_gdn_with_flag, backend="laqat", options={"compiler": "eager", "policy": "state_fp8"})
    t = torch_inputs("gdn", T=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        compiled(**t, clamp=False)
    with pytest.warns(NothingQuantizedWarning, match=r"rewrote 0 recurrence\(s\) where an earlier compile of it "
                                                      r"rewrote 1.*`clamp`"):
        compiled(**t, clamp=True)
    assert any("where an earlier compile of it rewrote 1" in n for n in _record().graphs[-1].notes)
