"""Block sizes of the chunk stages that depend on the spec and the shapes (the launch plan's, chunk/plan.py), and
whether element offsets need 64 bits. The measured constants they choose between are in chunk/launch.py.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.chunk.forms import pairs_need_all_keys
from la_compiler.kernels.chunk.launch import (BWD_KEY_BLOCK_16BIT, GDN_BWD_KEY_BLOCK_16BIT, KEY_BLOCK, key_block,
                                            next_power_of_2)
from la_compiler.kernels.chunk.params import ChunkParams


def needs_int64_index(B: int, T: int, C: int, heads: int, K: int, V: int, chunks: int, HV: int) -> bool:
    """Whether an element offset of the chunk kernels may pass 2^31 (their ``INDEX_64``): rows of [B, T, heads, ..]
    buffers up to 2C wide (the backward's pair gradients) with every sequence's last chunk padded, or the chunk
    states [chunks, HV, K, V]. int32 offsets take half the registers of the address tiles (measured:
    docs/kernels-chunk-measurements.md, "Element offsets")."""
    return max(B * (T + C) * heads * max(K, V, 2 * C), chunks * HV * K * V) >= 2 ** 31


def w_quant_block(p: ChunkParams) -> int:
    """Key columns of one W quantizer block (16 without block<N> groups): the forward's key blocks hold whole ones."""
    w = p.formats.w
    return 16 if w is None else max(16, w.block_size or 16)


def intra_key_block(p: ChunkParams, BK: int, w_block: int) -> int:
    """Key columns the forward intra stage reads at a time (its BK): whole rows where
    ``pairs_need_all_keys``, else ``chunk.launch.key_block``, never fewer than a W quantizer block."""
    if pairs_need_all_keys(p):
        return BK
    return min(BK, max(key_block(BK, p.numerics.key_block), w_block))


def state_value_block(p: ChunkParams, V: int) -> int:
    """Value columns per program of the forward's h stage: the state quantizer's tile where it has one, else 32 (more
    programs for the serial stage); all of V where NVFP4 state_read / state_update operands need it (and whole
    state tiles)."""
    if p.h_full_v:
        return max(16, next_power_of_2(V), p.state_block_v or 16)
    return p.state_block_v or min(32, value_block(V))


def value_block(V: int) -> int:
    """Value columns per program of the stages without a choice of their own: up to 64."""
    return min(64, max(16, next_power_of_2(V)))


def output_value_block(V: int, rounds_operands: bool) -> int:
    """Value columns per program of the output stage. Exact GEMM operands: up to 128, so that one program
    computes Q ⊙ exp(G) and reads Q, G, A_qk once for a whole V = 128 head (measured:
    docs/kernels-chunk-measurements.md, "Output value block"). Rounded operands keep 64 (fp32 [K x BV] state
    tiles)."""
    return min(64 if rounds_operands else 128, max(16, next_power_of_2(V)))


def bwd_key_block(p: ChunkParams, intermediates: torch.dtype) -> int:
    """Key columns per step of the key-blocked backward above 64 columns: with 16-bit GEMMs 64 for KDA and
    128 for GDN, else 32 (measured: docs/kernels-chunk-measurements.md, "Key blocks")."""
    if intermediates == torch.float32:
        return KEY_BLOCK
    return BWD_KEY_BLOCK_16BIT if p.kind == "kda" else GDN_BWD_KEY_BLOCK_16BIT
