"""Random canonical inputs for the chunk tests (fresh per call; never zeros)."""
import torch
import torch.nn.functional as F


def make_inputs(kind, *, B=1, T=13, H=2, HV=4, K=8, V=8, N=None, dtype=torch.float64, device="cpu",
                with_state=True, decay=0.5):
    """q, k (l2-normalised), v, g <= 0, beta in (0, 1), h0 [N, HV, K, V] (kv layout)."""
    gen = dict(dtype=dtype, device=device)
    q = torch.randn(B, T, H, K, **gen)
    k = F.normalize(torch.randn(B, T, H, K, **gen), dim=-1)
    v = torch.randn(B, T, HV, V, **gen)
    g_shape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    g = F.logsigmoid(torch.randn(g_shape, **gen)) * decay
    beta = torch.rand(B, T, HV, **gen)
    h0 = torch.randn(N or B, HV, K, V, **gen) if with_state else None
    return q, k, v, g, beta, h0


def grads_of(outputs, cotangents, wrt):
    loss = sum((o * c).sum() for o, c in zip(outputs, cotangents))
    present = [x for x in wrt if x is not None]
    grads = iter(torch.autograd.grad(loss, present, allow_unused=True))
    return [None if x is None else next(grads) for x in wrt]
