"""Inductor with laqat's ops in its graphs: a head-first model ([B, H, T, D] tensors, which the frontend transposes
to the IR's [B, T, H, D]) trains through the Inductor hand-off.

Inductor checks every custom op's outputs against the fake's sizes and strides (``assert_size_stride``): before
the fakes stated contiguous outputs in each input's dtype, the backward of this model failed there in
``laqat::delta_rule_backward`` (its gradients of transposed inputs).
"""
import torch

import la_compiler.backend
from tests.helpers import assert_close_rel

TOL = 1e-5


def gdn_head_first(q, k, v, g, beta, h0):
    """A plain token loop of GDN in head-first layout: q, k [B, H, T, K], v [B, H, T, V], g, beta [B, H, T],
    h0 [B, H, K, V]; returns (o [B, H, T, V], final state)."""
    K = q.shape[-1]
    q = q * K ** -0.5
    S = h0
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - (S * k_t[..., None]).sum(-2))
        S = S + k_t[..., None] * u[..., None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2), S


def _head_first_inputs(B=2, H=2, T=6, K=8, V=8):
    q = torch.randn(B, H, T, K)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, K), dim=-1)
    v = torch.randn(B, H, T, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, T)) * 0.5
    beta = torch.rand(B, H, T)
    h0 = torch.randn(B, H, K, V)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def test_head_first_gdn_trains_through_inductor():
    """options={"compiler": "inductor"}, fullgraph: one laqat node; output, final state and every input's
    gradient equal to eager (fp32, rel L2 <= 1e-5)."""
    tensors = _head_first_inputs()
    eager_in = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    laqat_in = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    expected = gdn_head_first(**eager_in)
    got = torch.compile(gdn_head_first, backend="laqat", fullgraph=True, options={"compiler": "inductor"})(**laqat_in)
    matches = la_compiler.backend.last_record().graphs[-1].matches
    assert [(m.frontend, m.kind) for m in matches] == [("torch", "gdn")], matches
    cotangents = [torch.randn_like(e) for e in expected]
    sum((e * c).sum() for e, c in zip(expected, cotangents)).backward()
    sum((o * c).sum() for o, c in zip(got, cotangents)).backward()
    for name, o, e in zip(("o", "final state"), got, expected):
        assert_close_rel(o.detach(), e.detach(), TOL, name)
    for name, t in laqat_in.items():
        assert_close_rel(t.grad, eager_in[name].grad, TOL, f"d{name}")
