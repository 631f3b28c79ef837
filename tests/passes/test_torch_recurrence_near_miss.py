"""Near misses: recurrences with one thing wrong are left untouched, and the explain report
names the check that failed."""
import warnings

import pytest
import torch

import la_compiler
from la_compiler.passes.module_names import function_behind
from tests.passes.torch_recurrence_near_misses import MISTAKES, gdn_with_mistake


def _inputs(B=2, T=5, H=3, K=5, V=4):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.3 * torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_near_miss_is_reported_and_left_untouched(mistake):
    fn = gdn_with_mistake(mistake)
    args = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(fn, *args)
    assert report.matches == []
    reasons = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert any(MISTAKES[mistake] in r for r in reasons), reasons
    assert MISTAKES[mistake] in str(report)
    # untouched means the compiled function computes what the function computes
    expected = fn(*args)
    for got, want in zip(report.output, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_every_near_miss_function_differs_from_the_delta_rule():
    """Guards the fixtures: each mistake really changes the result (else the test proves nothing)."""
    args = _inputs()
    exact = gdn_with_mistake("")(*args)[0]
    for mistake in MISTAKES:
        got = gdn_with_mistake(mistake)(*args)[0]
        if mistake != "leaked_intermediate":
            assert not torch.allclose(got, exact, atol=1e-4), mistake


# ---- loops unrolled to one step: reported, not rewritten --------------------------------------
def _gdn_tensors(kind="gdn", B=2, T=6, H=2, HV=2, K=5, V=4):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -0.3 * torch.rand((B, T, HV, K) if kind == "kda" else (B, T, HV), generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta, torch.randn(B, HV, K, V, generator=gen)


def _fla_chunk_gdn_one_chunk(q, k, v, g, beta, h0):
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    return naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=h0, output_final_state=True)


def _fla_recurrent_gdn_one_token(q, k, v, g, beta, h0):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)


def _qwen_chunk_one_chunk(q, k, v, g, beta, h0):
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next
    fn = function_behind(modeling_qwen3_next.torch_chunk_gated_delta_rule)
    return fn(q, k, v, g=g, beta=beta, chunk_size=4, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("fn, T, why", [
    (_fla_chunk_gdn_one_chunk, 6, "the loop unrolled to one step (T <= chunk size 8: one chunk)"),
    (_qwen_chunk_one_chunk, 3, "the loop unrolled to one step (T <= chunk size 4: one chunk)"),
    (_fla_recurrent_gdn_one_token, 1, "the loop unrolled to one step (T = 1: one token)"),
], ids=["fla_naive_chunk_T6_C8", "qwen3_next_chunk_T3_C4", "fla_naive_recurrent_T1"])
def test_one_step_loop_is_reported_and_left_untouched(fn, T, why):
    args = _gdn_tensors(T=T)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(fn, *args)
    assert report.matches == []
    reasons = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert [r for r in reasons if r.startswith(why)] and len([r for r in reasons if "one step" in r]) == 1, reasons
    assert why in str(report)
    for got, want in zip(report.output, fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_one_step_report_needs_a_recurrence_shaped_cluster():
    """Negative: index-0 reads of size-1 dims that are no recurrence step, and a two-step loop
    (rewritten), get no one-step report."""
    def too_few_sources(a, b, c):
        return torch.stack([a[:, 0] * b[:, 0]], 1), c[:, 0]  # two sources feed the stack

    def no_output_write(a, b, c):
        return a[:, 0] + b[:, 0] * c[:, 0]  # three sources, no per-step write or stack

    gen = torch.Generator().manual_seed(4)
    a, b, c = (torch.randn(2, 1, 3, 4, generator=gen) for _ in range(3))
    for fn in (too_few_sources, no_output_write):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = la_compiler.explain(fn, a, b, c)
        assert not [n for n in report.near_misses if "one step" in n.reason], (fn.__name__, report.near_misses)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(_fla_recurrent_gdn_one_token, *_gdn_tensors(T=2))
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    assert not [n for n in report.near_misses if "one step" in n.reason], report.near_misses
