"""The "chunk" kernel variant: generated chunked (WY) Triton kernels of GDN/KDA, forward and backward.

Forward: ``chunk_fwd.py`` (intra, h, o); backward: ``chunk_bwd.py`` (forward recomputed, then
dh, intra). Exact numerics, the Neumann solve, state / W quantization, the FP8/INT8 (row) and NVFP4
GEMM operand sites and accumulator emulation; what else a spec asks for is refused by ``chunk_codegen.unsupported`` (the
selection table then moves on).
"""
from __future__ import annotations

import functools

from la_compiler.kernels.chunk_bwd import chunk_bwd
from la_compiler.kernels.chunk_codegen import ChunkParams
from la_compiler.kernels.chunk_fwd import chunk_fwd
from la_compiler.kernels.chunk_residual import residual_size
from la_compiler.kernels.registry import register_variant, spec_of


@functools.lru_cache(maxsize=256)
def _params(spec) -> ChunkParams:
    """ChunkParams of a spec, once per spec (8 us of host time per call otherwise)."""
    return ChunkParams.from_spec(spec)


def chunk_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, save_to=None):
    return chunk_fwd(_params(spec_of(spec)), q, k, v, g, beta, scale, initial_state, cu_seqlens, save_to=save_to)


def chunk_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, saved=None):
    return chunk_bwd(_params(spec_of(spec)), q, k, v, g, beta, scale, do, dht, initial_state, cu_seqlens, saved=saved)


def chunk_residual_size(spec, q, v, cu_seqlens) -> int:
    return residual_size(_params(spec_of(spec)), q, v, cu_seqlens)


register_variant(
    "chunk",
    chunk_forward,
    chunk_backward,
    "generated chunked (WY) Triton kernels, forward and backward (exact, Neumann solve, state and W QDQ, "
    "FP8/INT8 row and NVFP4 GEMM operand sites, fp16/bf16 accumulator emulation)",
    residual_size=chunk_residual_size,
)
