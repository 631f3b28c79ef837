"""Near misses: recurrences with one thing wrong are left untouched, and the explain report
names the check that failed."""
import warnings

import pytest
import torch

import la_compiler
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
