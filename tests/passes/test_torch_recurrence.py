"""The torch frontend on real and hand-written GDN/KDA recurrences: exactly one laqat node per
recurrence, and outputs, final states and every gradient equal to eager (fp32, <= 1e-5 rel L2).

One compilation per case (``explain`` compiles with the laqat backend, runs once and returns
the output, through which the gradients flow). The IR op runs the fp64 reference variant.
"""
import functools
import warnings

import pytest
import torch

import la_compiler
from la_compiler.passes.module_names import function_behind
from tests.helpers import assert_close_rel
from tests.passes import torch_recurrence_spellings as spellings

TOL = 1e-5
REFERENCE = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}


def _inputs(kind, B=2, T=6, H=2, HV=2, K=5, V=4, initial_state=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g_shape = (B, T, HV, K) if kind == "kda" else (B, T, HV)
    g = -0.3 * torch.rand(g_shape, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen) if initial_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def _check(fn, kind, tensors, call, *, options=None, n_outputs=2):
    """Compiles ``call(fn, **tensors)`` with laqat, checks one match of ``kind`` and compares
    outputs and gradients of every tensor input with eager."""
    eager_in = {n: t.clone().requires_grad_() if t is not None else None for n, t in tensors.items()}
    laqat_in = {n: t.clone().requires_grad_() if t is not None else None for n, t in tensors.items()}
    expected = call(fn, **eager_in)[:n_outputs]
    with warnings.catch_warnings():
        warnings.simplefilter("error", la_compiler.explain.__globals__["NothingMatchedWarning"])
        report = la_compiler.explain(functools.partial(call, fn), policy=REFERENCE, **laqat_in)
    got = report.output[:n_outputs]
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", kind)], (report.matches, report.near_misses)
    assert report.matches[0].region_size > 0
    torch.manual_seed(1)
    cotangents = [torch.randn_like(e) for e in expected]
    sum((e * c).sum() for e, c in zip(expected, cotangents)).backward()
    sum((o * c).sum() for o, c in zip(got, cotangents)).backward()
    for i, (o, e) in enumerate(zip(got, expected)):
        assert_close_rel(o.detach(), e.detach(), TOL, f"output {i}")
    for name, t in laqat_in.items():
        if t is not None:
            assert_close_rel(t.grad, eager_in[name].grad, TOL, f"d{name}")
    return report


# ---- FLA's naive references -----------------------------------------------------------------
def _fla_recurrent_gdn(fn, q, k, v, g, beta, h0):
    return fn(q, k, v, beta, g, initial_state=h0, output_final_state=True)


def _fla_chunk_gdn(fn, q, k, v, g, beta, h0, chunk_size=4):
    return fn(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0, output_final_state=True)


def _fla_kda(fn, q, k, v, g, beta, h0, **kw):
    return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)


def test_fla_naive_recurrent_gated_delta_rule():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    _check(naive_recurrent_gated_delta_rule, "gdn", _inputs("gdn"), _fla_recurrent_gdn)


def test_fla_naive_chunk_gated_delta_rule_pads_t():
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    _check(naive_chunk_gated_delta_rule, "gdn", _inputs("gdn", T=10), _fla_chunk_gdn)


def test_fla_naive_chunk_gdn_63_step_forward_substitution():
    """chunk_size 64: the forward-substitution loop has 63 steps (two chunks: T = 72)."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    _check(naive_chunk_gated_delta_rule, "gdn", _inputs("gdn", T=72, H=1, HV=1, initial_state=False),
           functools.partial(_fla_chunk_gdn, chunk_size=64))


def test_fla_naive_recurrent_kda_grouped_heads():
    from fla.ops.kda.naive import naive_recurrent_kda
    _check(naive_recurrent_kda, "kda", _inputs("kda", H=1, HV=2), _fla_kda)


def test_fla_naive_chunk_kda():
    from fla.ops.kda.naive import naive_chunk_kda
    _check(naive_chunk_kda, "kda", _inputs("kda", T=8), functools.partial(_fla_kda, chunk_size=4))


# ---- transformers' Qwen3-Next torch fallbacks (the undecorated torch functions) -------------
def _qwen(name):
    from transformers.models.qwen3_next import modeling_qwen3_next
    return function_behind(getattr(modeling_qwen3_next, name))


def _qwen_call(fn, q, k, v, g, beta, h0, **kw):
    return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


def test_qwen3_next_torch_recurrent_gated_delta_rule():
    _check(_qwen("torch_recurrent_gated_delta_rule"), "gdn", _inputs("gdn", H=1, HV=2), _qwen_call)


def test_qwen3_next_torch_chunk_gated_delta_rule_verify_mode():
    fn = _qwen("torch_chunk_gated_delta_rule")
    report = _check(fn, "gdn", _inputs("gdn", T=10, H=1, HV=2), functools.partial(_qwen_call, chunk_size=4))
    assert "torch_recurrence" in report.graphs[0].pass_seconds
    # verify=True runs the original region and the IR node at compile time as well
    torch._dynamo.reset()
    t = _inputs("gdn", T=10, H=1, HV=2)
    compiled = torch.compile(functools.partial(_qwen_call, fn, chunk_size=4), backend="laqat",
                             options={"compiler": "eager", "verify": True, "policy": REFERENCE})
    o, s = compiled(**t)
    o_ref, s_ref = _qwen_call(fn, chunk_size=4, **t)
    assert_close_rel(o, o_ref, TOL, "o (verify mode)")
    assert_close_rel(s, s_ref, TOL, "state (verify mode)")


# ---- hand-written spellings -----------------------------------------------------------------
def _spelling_call(fn, q, k, v, g, beta, h0):
    return fn(q, k, v, g, beta, h0)


@pytest.mark.parametrize("name,kind,shape", [
    ("gdn_list_stack_matmul_preexp", "gdn", dict(initial_state=False)),
    ("kda_bhtd_setitem_bmm", "kda", dict(H=1, HV=2)),
    ("gdn_unbind_cat", "gdn", dict()),
    ("gdn_chunked_solve", "gdn", dict(T=7)),
])
def test_spellings(name, kind, shape):
    _check(getattr(spellings, name), kind, _inputs(kind, **shape), _spelling_call)


def test_two_layers_two_nodes_and_rest_of_graph_kept():
    """Two recurrences in one graph, with ordinary ops before, between and after."""
    def two_layers(q, k, v, g, beta, h0):
        o1, s1 = spellings.gdn_unbind_cat(torch.tanh(q), k, v, g, beta, h0)
        o2, s2 = spellings.gdn_unbind_cat(q, k, o1 * 0.5 + v, g, beta, s1)
        return o2 + 1.0, s2

    t = _inputs("gdn", K=4, V=4)
    report = la_compiler.explain(two_layers, policy=REFERENCE, **t)
    assert [m.frontend for m in report.matches] == ["torch", "torch"]
    o, s = two_layers(**t)
    assert_close_rel(report.output[0], o, TOL, "o")
    assert_close_rel(report.output[1], s, TOL, "state")


# ---- transformers' Kimi-Linear torch fallbacks (KDA; the chunked one has the 63-step loop) ---
def _kimi(name):
    from transformers.models.kimi_linear import modeling_kimi_linear
    return function_behind(getattr(modeling_kimi_linear, name))


def _kimi_call(fn, q, k, v, g, beta, h0, **kw):
    return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


def test_kimi_linear_recurrent_kda():
    _check(_kimi("recurrent_kimi_delta_attention"), "kda", _inputs("kda"), _kimi_call)


def test_kimi_linear_chunk_kda_forward_substitution():
    _check(_kimi("chunk_kimi_delta_attention"), "kda", _inputs("kda", T=10),
           functools.partial(_kimi_call, chunk_size=4))
