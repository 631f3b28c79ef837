"""Identical recurrences share one algebra check (passes/frontends/torch_recurrence/repeats.py).

A layer whose region has the key of one accepted before it takes that region's role assignment: ``solve`` runs
once, every layer still gets its own laqat node and its own rewrite check, and outputs and every gradient equal
eager's. Regions that differ in a literal, a shape or a dtype are checked on their own: a non-causal copy of a
correct layer is refused after the correct one was accepted.
"""
import functools
import sys

import torch
import torch.nn.functional as F

import la_compiler
from la_compiler.passes.frontends.torch_recurrence import SHARED_CHECKS, semantics
from la_compiler.passes.module_names import function_behind
from tests.helpers import assert_close_rel
from tests.passes.torch_recurrence_spellings import gdn_chunked_solve

TOL = 1e-5
REFERENCE = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}


def _inputs(kind, B=2, T=10, H=2, HV=2, K=5, V=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -0.3 * torch.rand((B, T, HV, K) if kind == "kda" else (B, T, HV), generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def _counting_solve(monkeypatch) -> list:
    calls = []
    solve = semantics.solve

    def counted(flow, region, *args, **kwargs):
        calls.append(region)
        return solve(flow, region, *args, **kwargs)

    monkeypatch.setattr(semantics, "solve", counted)
    return calls


def _compare(fn, tensors, report):
    """Outputs and the gradients of every input of the laqat run (``report``, on ``tensors``) against eager."""
    eager_in = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    expected = fn(**eager_in)
    got = report.output
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(e.shape, generator=gen) for e in expected]
    sum((e * c).sum() for e, c in zip(expected, cotangents)).backward()
    sum((o * c).sum() for o, c in zip(got, cotangents)).backward()
    for i, (o, e) in enumerate(zip(got, expected)):
        assert_close_rel(o.detach(), e.detach(), TOL, f"output {i}")
    for name, t in tensors.items():
        assert_close_rel(t.grad, eager_in[name].grad, TOL, f"d{name}")


def _explain(fn, tensors):
    return la_compiler.explain(fn, policy=REFERENCE, **tensors)


def _leaves(tensors):
    return {n: t.clone().requires_grad_() for n, t in tensors.items()}


# ---- transformers' Kimi-Linear chunked KDA, three layers deep -------------------------------------------------
def _kimi_layers(q, k, v, g, beta, h0):
    from transformers.models.kimi_linear import modeling_kimi_linear
    kda = functools.partial(function_behind(modeling_kimi_linear.chunk_kimi_delta_attention), chunk_size=4,
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, states = v, []
    for _ in range(3):  # each layer reads the last one's output, and has a state of its own
        o, s = kda(q, k, torch.tanh(o) + v, g, beta, initial_state=h0)
        states.append(s)
    return (o, *states)


def test_three_identical_kda_layers_share_one_algebra_check(monkeypatch):
    calls = _counting_solve(monkeypatch)
    tensors = _leaves(_inputs("kda"))
    report = _explain(_kimi_layers, tensors)
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "kda")] * 3, report.near_misses
    assert len(calls) == 1
    assert report.graphs[0].pass_counts[SHARED_CHECKS] == 2
    assert len({m.node for m in report.matches}) == 3
    _compare(_kimi_layers, tensors, report)


# ---- a chunked GDN whose layers differ in one literal (the decay mask's diagonal) ----------------------------------
def _two_layers(q, k, v, g, beta, h0, diagonal=0):
    """Two layers reading inputs made alike; the second one's mask diagonal is ``diagonal``."""
    o, s = gdn_chunked_solve(q, k, torch.tanh(v) + v, g, beta, h0)
    o2, s2 = gdn_chunked_solve(q, k, torch.tanh(o) + v, g, beta, h0, mask_diagonal=diagonal)
    return o2, s, s2


def test_a_layer_differing_in_one_literal_is_checked_on_its_own(monkeypatch):
    calls = _counting_solve(monkeypatch)
    tensors = _leaves(_inputs("gdn", H=2, HV=2, K=4, V=4))
    report = _explain(_two_layers, tensors)  # both causal: one check
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "gdn")] * 2, report.near_misses
    assert len(calls) == 1 and report.graphs[0].pass_counts[SHARED_CHECKS] == 1

    calls.clear()
    torch._dynamo.reset()
    causal_then_not = functools.partial(_two_layers, diagonal=1)
    tensors = _leaves(_inputs("gdn", H=2, HV=2, K=4, V=4))
    report = _explain(causal_then_not, tensors)
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "gdn")]
    assert len(report.near_misses) == 1 and "non-causal" in report.near_misses[0].reason, report.near_misses
    assert len(calls) == 2
    assert SHARED_CHECKS not in report.graphs[0].pass_counts
    _compare(causal_then_not, tensors, report)


def _keys(monkeypatch) -> list:
    package = sys.modules[semantics.__name__.rpartition(".")[0]]
    keys, region_key = [], package.region_key

    def kept(flow, region):
        keyed = region_key(flow, region)
        keys.append(keyed[0] if keyed else None)
        return keyed

    monkeypatch.setattr(package, "region_key", kept)
    return keys


def test_the_key_tells_the_literal_apart(monkeypatch):
    """The confirming run would catch a key that missed the literal (the test above then still passes): the key
    itself differs."""
    keys = _keys(monkeypatch)
    for diagonal in (0, 1):
        torch._dynamo.reset()
        _explain(functools.partial(_two_layers, diagonal=diagonal), _leaves(_inputs("gdn", H=2, HV=2, K=4, V=4)))
    same, different = keys[:2], keys[2:]
    assert len(keys) == 4 and None not in keys
    assert same[0] == same[1] and different[0] != different[1]


def test_the_non_causal_layer_alone_is_refused():
    """The premise of the test above: the second layer is no delta rule by itself."""
    tensors = _leaves(_inputs("gdn", H=2, HV=2, K=4, V=4))
    report = _explain(functools.partial(gdn_chunked_solve, mask_diagonal=1), tensors)
    assert report.matches == [] and len(report.near_misses) == 1


def _two_head_sizes(q, k, v, g, beta, h0, q2, k2, h2):
    o, s = gdn_chunked_solve(q, k, v, g, beta, h0)
    o2, s2 = gdn_chunked_solve(q2, k2, v, g, beta, h2)
    return o + o2, s, s2


def test_layers_of_other_shapes_or_dtypes_are_checked_on_their_own(monkeypatch):
    calls = _counting_solve(monkeypatch)
    tensors = _inputs("gdn", K=4, V=4)
    other = _inputs("gdn", K=6, V=4, seed=1)
    tensors.update(q2=other["q"], k2=other["k"], h2=other["h0"])
    tensors = _leaves(tensors)
    report = _explain(_two_head_sizes, tensors)
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "gdn")] * 2, report.near_misses
    assert len(calls) == 2
    _compare(_two_head_sizes, tensors, report)

    calls.clear()
    torch._dynamo.reset()
    doubles = _leaves({n: t.detach().double() for n, t in _inputs("gdn", K=4, V=4).items()})
    singles = _leaves(_inputs("gdn", K=4, V=4, seed=2))
    both = dict(doubles, **{f"{n}2": t for n, t in singles.items()})

    def fp64_then_fp32(q, k, v, g, beta, h0, q2, k2, v2, g2, beta2, h02):
        o, s = gdn_chunked_solve(q, k, v, g, beta, h0)
        o2, s2 = gdn_chunked_solve(q2, k2, v2, g2, beta2, h02)
        return o, s, o2, s2

    report = _explain(fp64_then_fp32, both)
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "gdn")] * 2, report.near_misses
    assert len(calls) == 2
