"""The "chunk" kernel variant: generated chunked (WY) Triton forward of GDN/KDA.

Forward: the generated kernels (``chunk_fwd.py``), exact numerics or state / W quantization.
Backward (INTERMEDIATE, not a fused kernel): ``chunk_backward_via_reference`` recomputes the
forward through the torch chunk reference (``chunk_reference.py``, rounding at the same sites
in the same order, identity STE) under autograd and differentiates it -- fp64 on the CPU,
fp32 on GPUs. docs/kernels-chunk.md says what a fused Triton backward will replace.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.autograd_inside_op import autograd_enabled
from la_compiler.kernels.chunk_codegen import ChunkParams
from la_compiler.kernels.chunk_codegen import unsupported as unsupported_reason  # noqa: F401 (selection)
from la_compiler.kernels.chunk_fwd import chunk_fwd
from la_compiler.kernels.chunk_reference import chunk_delta_rule_reference
from la_compiler.kernels.registry import register_variant, spec_of


def chunk_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    return chunk_fwd(ChunkParams.from_spec(spec_of(spec)), q, k, v, g, beta, scale, initial_state, cu_seqlens)


def chunk_backward_via_reference(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    """Gradients of the chunk emulation by torch autograd over the chunk reference (intermediate)."""
    spec = spec_of(spec)
    ChunkParams.from_spec(spec)  # the same specs as the forward, or a clear error
    dtype = torch.float32 if q.is_cuda else torch.float64
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
    with autograd_enabled():
        o, ht = chunk_delta_rule_reference(*inputs, spec=spec, scale=scale, initial_state=h0,
                                           cu_seqlens=cu_seqlens, dtype=dtype)
        outs, grads = [o], [do.to(dtype)]
        if dht is not None:
            outs.append(ht)
            grads.append(dht.to(dtype))
        wrt = inputs + ([h0] if h0 is not None else [])
        result = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    result = [torch.zeros_like(x) if r is None else r.to(x.dtype) for r, x in zip(result, wrt)]
    return (*result[:5], result[5] if h0 is not None else None)


register_variant(
    "chunk",
    chunk_forward,
    chunk_backward_via_reference,
    "generated chunked (WY) Triton forward (exact, state and W QDQ); backward: the torch chunk reference "
    "recomputed under autograd (intermediate, not a fused kernel)",
)
