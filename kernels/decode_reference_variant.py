"""The "decode_reference" kernel variant: the fp64 decode-phase reference, run as a kernel.

Slow (token by token, in Python) but exact, on every device. It runs only through
``laqat::delta_rule_phased`` (the phase lengths are its extra inputs); the plain
``laqat::delta_rule`` op has no lengths and gets a clear error instead.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.autograd_inside_op import autograd_enabled
from la_compiler.kernels.decode_options import decode_options
from la_compiler.kernels.decode_reference import delta_rule_decode_reference
from la_compiler.kernels.registry import register_variant, spec_of


class PhaseLengthsMissing(RuntimeError):
    """A decode variant was called without phase lengths (through the plain delta_rule op)."""


def require_lengths(spec, prefill_lengths, valid_lengths):
    if prefill_lengths is None or valid_lengths is None:
        raise PhaseLengthsMissing(
            f"spec {spec} has phase={spec.phase}: it runs through laqat::delta_rule_phased (the laqat backend's "
            f"phase pass rewrites such nodes), not through laqat::delta_rule, which carries no phase lengths")


def _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths):
    return delta_rule_decode_reference(
        q, k, v, g, beta, kind=spec.kind, options=decode_options(spec), prefill_lengths=prefill_lengths,
        valid_lengths=valid_lengths, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_layout=spec.state, dtype=torch.float64)


def decode_reference_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                             valid_lengths=None):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    o, ht = _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths)
    return o.to(q.dtype), ht.to(torch.float32)


def decode_reference_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *,
                              prefill_lengths=None, valid_lengths=None):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
    with autograd_enabled():
        o, ht = _run(spec, *inputs, h0, cu_seqlens, scale, prefill_lengths, valid_lengths)
        outs, grads = [o], [do.to(o.dtype)]
        if dht is not None:
            outs.append(ht)
            grads.append(dht.to(ht.dtype))
        wrt = inputs + ([h0] if h0 is not None else [])
        result = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    result = [torch.zeros_like(x) if r is None else r.to(x.dtype) for r, x in zip(result, wrt)]
    return (*result[:5], result[5] if h0 is not None else None)


register_variant(
    "decode_reference",
    decode_reference_forward,
    decode_reference_backward,
    "fp64 torch reference of decode-phase training (token / replay), token by token (any device; slow)",
)
