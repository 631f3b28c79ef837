"""Property: every program near the delta rule that the torch frontend rewrites computes exactly
what eager computes, in forward and in every gradient, at several magnitudes.

Seeded random mutants of a correct token-loop GDN step (``torch_recurrence_mutants.py``: an op
inserted, a token swapped, a statement removed; and mutants whose steps differ: a constant or schedule
indexed by t, a literal from t, a mask from positions, a read of a fixed or shifted token). Each is compiled once (laqat, eager compiler,
the fp64 reference kernel); a rewritten one is then run at generic inputs, with a large state
(v x 1e2, h0 x 1e4, beta over (0, 2)) and with deep decays (g x 20), and compared with eager:
outputs and the vector-Jacobian product for every input, relative L2 <= 1e-5. Bounded: N programs
of T = 3 tokens.
"""
import warnings

import pytest
import torch

from la_compiler.backend import laqat_backend
from la_compiler.record import CompileRecord
from tests.helpers import rel_l2
from tests.passes.torch_recurrence_mutants import STEP, TEMPLATE, build, seeded

N_PROGRAMS = 60
N_STEP_PROGRAMS = 24
SEED = 2024
TOL = 1e-5
REFERENCE = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}


def _inputs(seed, B=2, T=3, H=2, K=4, V=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.3 * torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def _magnitudes(base):
    large = dict(base, v=base["v"] * 1e2, h0=base["h0"] * 1e4, beta=base["beta"] * 1.99)
    deep = dict(base, g=base["g"] * 20)
    return {"generic": base, "large state": large, "deep decay": deep}


def _run(fn, tensors):
    """Outputs and the VJP for every input, with fixed cotangents."""
    leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    outs = fn(**leaves)
    gen = torch.Generator().manual_seed(5)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return [o.detach() for o in outs], dict(zip(leaves, grads))


def _compile(fn):
    record = CompileRecord()

    def backend(gm, example_inputs):
        return laqat_backend(gm, example_inputs, options={"compiler": "eager", "policy": REFERENCE}, _record=record)

    return torch.compile(fn, backend=backend), record


def test_the_unmutated_step_is_rewritten():
    fn = build(TEMPLATE.format(body="\n".join(" " * 8 + line for line in STEP)))
    compiled, record = _compile(fn)
    _run(compiled, _inputs(0))
    assert [m.frontend for g in record.graphs for m in g.matches] == ["torch"]


@pytest.mark.parametrize("chunk", [0, 1, 2, "steps"])
def test_every_rewritten_mutant_equals_eager(chunk):
    """chunk "steps": mutants whose steps differ (a step-dependent constant, literal, mask or token read)."""
    programs = seeded(N_STEP_PROGRAMS, SEED, steps=True) if chunk == "steps" else seeded(N_PROGRAMS, SEED)[chunk::3]
    stats = {"invalid": 0, "left alone": 0, "rewritten": 0}
    for i, (what, source) in enumerate(programs):
        fn = build(source)
        base = _inputs(i)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _run(fn, base)
        except Exception:  # not a valid program (shapes, names): nothing to check
            stats["invalid"] += 1
            continue
        torch._dynamo.reset()
        compiled, record = _compile(fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(compiled, base)
        matches = [m for g in record.graphs for m in g.matches]
        if not matches:
            stats["left alone"] += 1
            continue
        stats["rewritten"] += 1
        assert len(matches) == 1, (what, matches)
        for label, tensors in _magnitudes(base).items():
            want_o, want_g = _run(fn, tensors)
            got_o, got_g = _run(compiled, tensors)
            for j, (x, y) in enumerate(zip(got_o, want_o)):
                assert rel_l2(x, y) <= TOL, f"{what}: output {j} at {label}: {rel_l2(x, y):.2e}\n{source}"
            for name, y in want_g.items():
                x = got_g[name]
                if y is None or x is None:
                    assert x is None and y is None, f"{what}: d{name} at {label}\n{source}"
                    continue
                assert rel_l2(x, y) <= TOL, f"{what}: d{name} at {label}: {rel_l2(x, y):.2e}\n{source}"
    print(stats)
    assert stats["left alone"] >= 3 and stats["rewritten"] >= (0 if chunk == "steps" else 2), stats
    assert sum(stats.values()) == len(programs), stats
