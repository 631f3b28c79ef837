"""The launch plan of a chunk step: every decision of the chunk kernels' launches, made once per (spec, shapes,
dtype, tuning).

``chunk_plan`` decides the block sizes (chunk/blocks.py), the precisions and the intermediates' dtype
(chunk/precision.py), the stage forms (chunk/forms.py) and the launch configurations (chunk/launch.py), and holds
each stage as a ``StageLaunch``: its kernel (chunk/stages.py), grid, configuration and constexprs (the spec's,
chunk/flags.py, and the plan's). A stage the spec does not run is None. The stage launchers (``chunk_fwd_h(plan,
layout=..., k=..., ...)`` at the end of each stage module) add the tensors; chunk/fwd.py and chunk/bwd.py chain them.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from la_compiler.kernels.chunk import blocks, forms, stages
from la_compiler.kernels.chunk.flags import kernel_spec_constexprs
from la_compiler.kernels.chunk.launch import (GDN_WHOLE_ROW_BWD_VALUE_BLOCK, PAIRS_KEY_BLOCK, SERVER_CUMSUM_BLOCK,
                                             SERVER_CUMSUM_CONFIG, StageLaunch, cdiv, key_block, launch_config,
                                             next_power_of_2)
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.precision import dot_precision, gemm_precision, intermediate_dtype
from la_compiler.options import TuningOptions, interpreter


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """The shapes a plan is made for: [B, T, H, K] keys, [B, T, HV, V] values, in N sequences of NT chunks."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # sequences
    NT: int  # chunks over all sequences
    varlen: bool  # packed sequences (cu_seqlens)


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    params: ChunkParams
    shape: ChunkShape
    intermediate_dtype: torch.dtype  # of W, U, h, V_new, dh, dV_new: the input dtype for 16-bit GEMMs
    nan_fill: bool  # scratch buffers NaN-filled (``nan_fill``)
    chunks_per_row: int  # the grids' chunk axis: every chunk (varlen), else those of one sequence
    heads: int  # the grids' head axis: value heads, times the batch unless varlen
    pairs_rounded: bool  # KDA's pair products (and their gradients) rounded: the column-by-column kernels
    forward_intra_form: str  # the forward intra stage's kernel: "gdn" or "kda" (chunk/forms.py)
    backward_intra_form: str  # the backward intra stage's kernel: "split_pairs", "key_blocks" or "rows"
    # the forward; KDA's pair kernels only for KDA (pair_amax: NVFP4 at a pairwise site)
    fwd_cumsum: StageLaunch | None
    fwd_pair_amax: StageLaunch | None
    fwd_pairs: StageLaunch | None
    fwd_intra: StageLaunch
    fwd_wu: StageLaunch
    fwd_h: StageLaunch
    fwd_o: StageLaunch
    # the backward (after the forward's recompute); pairs and dg only where KDA splits its pair gradients
    bwd_dh: StageLaunch
    bwd_intra: StageLaunch
    bwd_pairs: StageLaunch | None
    bwd_dg: StageLaunch | None


def nan_fill(tuning: TuningOptions) -> bool:
    """Whether ``scratch`` buffers are NaN-filled: as t.nan_fill says, else under the interpreter (tests see every
    unwritten element); otherwise they are uninitialised (a fill costs a full write of them)."""
    return interpreter() if tuning.nan_fill is None else tuning.nan_fill


def chunk_plan(p: ChunkParams, shape: ChunkShape, dtype: torch.dtype, tuning: TuningOptions) -> ChunkPlan:
    """The plan of a chunk step of ``p`` on inputs of ``shape`` and ``dtype`` under ``tuning`` (t.<name>)."""
    return _plan(p, shape, dtype, tuning, interpreter())


@functools.lru_cache(maxsize=256)
def _plan(p: ChunkParams, shape: ChunkShape, dtype: torch.dtype, tuning: TuningOptions,
          interpreted: bool) -> ChunkPlan:  # interpreted: the key of gemm_precision's and nan_fill's choice
    s, C = shape, p.chunk
    gemm = gemm_precision(p, dtype)
    mid = intermediate_dtype(gemm, dtype)
    chunks_per_row = s.NT if s.varlen else cdiv(s.T, C)
    heads = s.HV * (1 if s.varlen else s.B)
    index_64 = blocks.needs_int64_index(s.B, s.T, C, max(s.H, s.HV), s.K, s.V, max(s.NT, 1), s.HV)
    layout = dict(H=s.H, HV=s.HV, K=s.K, C=C, IS_VARLEN=s.varlen)
    precisions = dict(DOT_PRECISION=dot_precision(p, dtype), GEMM_PRECISION=gemm)

    pairs_rounded = forms.kda_rounds_pairs(p)  # rounded pairs: whole key rows (a pair's row scale spans K)
    sub_chunks = chunks_per_row * (C // p.sub_chunk)
    nvfp4 = forms.has_nvfp4_operands(p)

    def stage(direction, name, grid, config, **constexprs) -> StageLaunch:
        kernel = stages.kernel(direction, name)
        return StageLaunch(kernel, grid, config, {**kernel_spec_constexprs(p, kernel), **constexprs},
                           tuning.autotune)

    def pairs_stage(direction, grid, config, **constexprs) -> StageLaunch:  # KDA's pair products / gradients
        # GATE_EXP2: every diagonal block column by column, as vLLM's token-parallel kernel (no dot through a row)
        diag = {} if pairs_rounded else {"DIAG_DOT_MAX_RANGE": -1.0 if p.gate_exp2 else forms.DIAG_DOT_MAX_RANGE}
        return stage(direction, "pairs_rounded" if pairs_rounded else "pairs", grid, config, **layout, BC=p.sub_chunk,
                     INDEX_64=index_64, DOT_PRECISION=precisions["DOT_PRECISION"], **constexprs, **diag)

    # the forward
    w_block = blocks.w_quant_block(p)
    BK = max(w_block, next_power_of_2(s.K))
    common = dict(layout, V=s.V, BK=BK, **precisions)
    fwd_cumsum = fwd_pair_amax = fwd_pairs = None
    if forms.kda_pairs_kernel(p):  # G = cumsum(g), then P and P_qk (into A_qk) by sub-chunk
        BKG = min(BK, PAIRS_KEY_BLOCK)
        BKP = BK if pairs_rounded else BKG
        # GATE_EXP2 (a serving profile's prefix): the tile and warps of vLLM's gate cumsum, whose scan order they set
        BKC, cumsum_config = ((SERVER_CUMSUM_BLOCK, SERVER_CUMSUM_CONFIG) if p.gate_exp2
                              else (BKG, launch_config("fwd_cumsum", BKG, C)))
        fwd_cumsum = stage("fwd", "cumsum", (chunks_per_row, heads, cdiv(s.K, BKC)), cumsum_config, **layout,
                           BK=BKC, INDEX_64=index_64)
        if p.gate_exp2:  # never another config: the warps are the server's
            fwd_cumsum = dataclasses.replace(fwd_cumsum, autotune=False)
        if forms.kda_pairs_nvfp4(p):
            fwd_pair_amax = stage("fwd", "pair_amax", (chunks_per_row, heads), launch_config("fwd_pair_amax", BKP, C),
                                  **layout, BK=BKP, INDEX_64=index_64)
        fwd_pairs = pairs_stage("fwd", (sub_chunks, heads), launch_config("fwd_pairs", BKP, C, pairs_rounded), BK=BKP)
    fwd_intra_form = forms.fwd_intra_form(p)
    BK_intra = blocks.intra_key_block(p, BK, w_block)
    intra = dict(common, BK=BK_intra, BV=blocks.value_block(s.V), INDEX_64=index_64)
    intra_config = launch_config("fwd_intra", BK_intra, C)
    BV_h = blocks.state_value_block(p, s.V)
    BV_o = blocks.output_value_block(s.V, bool(p.operands or p.acc))

    # the backward
    BK_b = max(16, next_power_of_2(s.K))
    BV_b = blocks.value_block(s.V)
    common_b = dict(common, BK=BK_b, BV=BV_b)
    BK_blocked = key_block(BK_b, p.numerics.bwd_key_block, blocks.bwd_key_block(p, mid))
    by_key_blocks = forms.bwd_intra_by_key_blocks(p)
    bwd_intra_form = forms.bwd_intra_form(p)
    BK_bwd_intra = BK_blocked if by_key_blocks else BK_b
    bwd_intra_config = launch_config("bwd_intra", BK_bwd_intra, C)
    if p.kind == "gdn" and by_key_blocks:
        # four warps made this form fault (illegal memory access) on the H200 with Triton 3.6 at key blocks of
        # 32, at one and three stages; eight never did (docs/kernels-chunk.md, "Key blocks")
        bwd_intra_config = dataclasses.replace(bwd_intra_config, keep_warps=True)
    BV_bwd_intra = min(BV_b, GDN_WHOLE_ROW_BWD_VALUE_BLOCK) if p.kind == "gdn" and not by_key_blocks else BV_b
    bwd_pairs = bwd_dg = None
    if forms.kda_splits_pair_grads(p):  # per sub-chunk: dq, dk and the complete dG; then dg = its reverse cumsum
        BKP_b = BK_b if pairs_rounded else BK_blocked
        NKB = cdiv(s.K, BKP_b)
        bwd_pairs = pairs_stage("bwd", (sub_chunks, heads, NKB), launch_config("bwd_pairs", BKP_b, C), BK=BKP_b)
        bwd_dg = stage("bwd", "dg", (chunks_per_row, heads, NKB), launch_config("bwd_dg", BKP_b, C), **layout,
                       BK=BKP_b, INDEX_64=index_64)

    return ChunkPlan(
        params=p, shape=s, intermediate_dtype=mid, nan_fill=nan_fill(tuning), chunks_per_row=chunks_per_row,
        heads=heads, pairs_rounded=pairs_rounded, forward_intra_form=fwd_intra_form,
        backward_intra_form=bwd_intra_form,
        fwd_cumsum=fwd_cumsum, fwd_pair_amax=fwd_pair_amax, fwd_pairs=fwd_pairs,
        fwd_intra=stage("fwd", f"intra_{fwd_intra_form}", (chunks_per_row, heads), intra_config, **intra),
        fwd_wu=stage("fwd", "wu", (chunks_per_row, heads), intra_config, **intra),
        fwd_h=stage("fwd", "h", (cdiv(s.V, BV_h), s.N * s.HV),
                    launch_config("fwd_h", BK, C, nvfp4_operands=nvfp4, serial_stages=tuning.serial_stages),
                    **dict(common, BV=BV_h)),
        fwd_o=stage("fwd", "o", (cdiv(s.V, BV_o), chunks_per_row, heads),
                    launch_config("fwd_o", BK, C, nvfp4_operands=nvfp4), **common, BV=BV_o, INDEX_64=index_64),
        bwd_dh=stage("bwd", "dh", (cdiv(s.V, BV_b), s.N * s.HV),
                     launch_config("bwd_dh", BK_b, C, nvfp4_operands=nvfp4, serial_stages=tuning.serial_stages),
                     **common_b),
        bwd_intra=stage("bwd", f"intra_{bwd_intra_form}", (chunks_per_row, heads), bwd_intra_config,
                        **dict(common_b, BK=BK_bwd_intra, BV=BV_bwd_intra), INDEX_64=index_64),
        bwd_pairs=bwd_pairs, bwd_dg=bwd_dg,
    )
