"""einops' rearrange / repeat / reduce under Dynamo (passes/frontends/einops_recipes.py): the compiled function
computes what eager einops computes, values, strides and gradients, with static and symbolic sizes; the pattern is
parsed at trace time as a constant (not traced), and so is the shape arithmetic where every size is static; a
callable reduction traces einops' own code."""
import einops
import pytest
import torch

import la_compiler.backend  # noqa: F401  (installs the trace frontends)
from la_compiler.passes.frontends import dynamo_traces_einops

pytestmark = pytest.mark.skipif(not dynamo_traces_einops(), reason="Dynamo puts einops' functions in the graph "
                                "as ops here (allow_in_graph): the substitution is not installed")
if dynamo_traces_einops():  # importing it registers the substitution
    from la_compiler.passes.frontends import einops_recipes

CASES = [  # (function, pattern, axes lengths, input shape)
    (einops.rearrange, "b t (h d) -> b t h d", dict(d=4), (2, 3, 8)),
    (einops.rearrange, "b t h d -> b h d t", {}, (2, 3, 2, 4)),
    (einops.rearrange, "... (h d) -> ... h d", dict(h=2), (2, 3, 8)),
    (einops.rearrange, "b (t c) h -> (b h) c t", dict(c=2), (2, 6, 3)),
    (einops.repeat, "b t h -> b t (h g) k", dict(g=2, k=3), (2, 3, 4)),
    (einops.reduce, "b t (h d) -> b h", dict(d=4), (2, 3, 8)),
]


def _counted(monkeypatch, name: str) -> list:
    """The calls Dynamo makes of einops_recipes' constant function ``name`` (its first argument each)."""
    calls, original = [], getattr(einops_recipes, name)

    @torch._dynamo.assume_constant_result
    def counted(*args):
        calls.append(args[0])
        return original(*args)
    monkeypatch.setattr(einops_recipes, name, counted)
    return calls


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_einops_is_eager_einops(monkeypatch, case, dynamic):
    fn, pattern, lengths, shape = CASES[case]
    reduction = ("sum",) if fn is einops.reduce else ()
    calls = _counted(monkeypatch, "_plain_recipe")
    cooked = _counted(monkeypatch, "_cooked")

    def f(x):
        return fn(x, pattern, *reduction, **lengths) * 1.5

    x = torch.randn(shape, generator=torch.Generator().manual_seed(case), requires_grad=True)
    want = f(x)
    (want * torch.randn(want.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    want_grad, x.grad = x.grad, None
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)(x)
    (got * torch.randn(got.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=0)
    assert calls == [pattern]
    # static sizes: the shape arithmetic computed once as a constant; symbolic ones: traced
    assert len(cooked) == (0 if dynamic else 1)


def test_a_list_input_and_a_callable_reduction():
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def f(a, b):
        return (einops.rearrange([a, b], "n t c -> t (n c)"),
                einops.reduce(a, "t c -> c", lambda x, axes: x.logsumexp(dim=axes)))

    torch._dynamo.reset()
    for got, want in zip(torch.compile(f, backend="eager", fullgraph=True)(*xs), f(*xs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_shape_mismatch_is_einops_error():
    def f(x):
        return einops.rearrange(x, "b (h d) -> b h d", d=3)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="Shape mismatch"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(2, 8))
