"""The "reference" kernel variant: the fp64 torch reference, run as a kernel.

Slow (token by token, in Python) but exact, on every device; the lower pass selects it only
where a policy asks for it (``backend: reference``) or where no generated kernel implements
the spec yet, and ``explain`` says so. Backward recomputes the forward under autograd.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.autograd_inside_op import autograd_enabled
from la_compiler.kernels.reference import delta_rule_reference
from la_compiler.kernels.registry import register_variant, spec_of


def _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    spec = spec_of(spec)
    return delta_rule_reference(
        q, k, v, g, beta,
        kind=spec.kind, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_layout=spec.state, dtype=torch.float64,
    )


def reference_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    o, ht = _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale)
    return o.to(q.dtype), ht.to(torch.float32)


def reference_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
    with autograd_enabled():
        o, ht = _run(spec, *inputs, h0, cu_seqlens, scale)
        outs, grads = [o], [do.to(o.dtype)]
        if dht is not None:
            outs.append(ht)
            grads.append(dht.to(ht.dtype))
        wrt = inputs + ([h0] if h0 is not None else [])
        result = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    result = [torch.zeros_like(x) if r is None else r.to(x.dtype) for r, x in zip(result, wrt)]
    return (*result[:5], result[5] if h0 is not None else None)


register_variant(
    "reference",
    reference_forward,
    reference_backward,
    "fp64 torch reference, token by token (any device; slow; exact)",
)
