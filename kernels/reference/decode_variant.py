"""The "decode_reference" kernel variant: the fp64 decode-phase reference, run as a kernel.

Slow (token by token, in Python) but exact, on every device. It runs only through
``laqat::delta_rule_phased`` (the phase lengths are its extra inputs); the plain
``laqat::delta_rule`` op has no lengths and gets a clear error instead.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.common.autograd_inside_op import recompute_vjp
from la_compiler.kernels.common.canonical_inputs import final_state_dtype
from la_compiler.kernels.common.decode_phase import decode_reason, require_lengths
from la_compiler.kernels.reference.decode import delta_rule_decode_reference
from la_compiler.kernels.registry import register_variant, spec_of
from la_compiler.options import decode_options


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
    return o.to(q.dtype), ht.to(final_state_dtype(q.dtype))


def decode_reference_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *,
                              prefill_lengths=None, valid_lengths=None):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    return recompute_vjp(lambda *xs: _run(spec, *xs, cu_seqlens, scale, prefill_lengths, valid_lengths),
                         q, k, v, g, beta, initial_state, do, dht)


register_variant(
    "decode_reference",
    decode_reference_forward,
    decode_reference_backward,
    "fp64 torch reference of decode-phase training (token / replay), token by token (any device; slow)",
    supports=lambda spec, ctx: decode_reason(spec),
    summary="fp64 torch reference of decode-phase training (slow)",
    implementation="torch",
)
