"""Run torch autograd inside a custom op's implementation.

A custom op's kernel runs below the Autograd dispatch key (``_AutoDispatchBelowAutograd``),
so ops inside it record no graph. Backward implementations that recompute a reference and
differentiate it with ``torch.autograd.grad`` lift that exclusion for their own scope.
"""
from __future__ import annotations

import contextlib

import torch

_C = torch._C


@contextlib.contextmanager
def autograd_enabled():
    exclude = _C._dispatch_tls_local_exclude_set().remove(_C.DispatchKey.AutogradFunctionality)
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def recompute_vjp(forward, q, k, v, g, beta, initial_state, do, dht):
    """Backward of a variant whose forward is differentiable torch code: recompute
    ``forward(q, k, v, g, beta, initial_state) -> (o, ht)`` under autograd and pull
    (do, dht) back. Returns (dq, dk, dv, dg, dbeta, dh0 or None) in the inputs' dtypes."""
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
    wrt = inputs + ([h0] if h0 is not None else [])
    with autograd_enabled():
        o, ht = forward(*inputs, h0)
        outs, grads = [o], [do.to(o.dtype)]
        if dht is not None:
            outs.append(ht)
            grads.append(dht.to(ht.dtype))
        result = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    result = [torch.zeros_like(x) if r is None else r.to(x.dtype) for r, x in zip(result, wrt)]
    return (*result[:5], result[5] if h0 is not None else None)
