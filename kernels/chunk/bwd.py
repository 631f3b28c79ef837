"""Launchers of the chunked (WY) backward kernels, and the recipe that chains them.

    chunk_fwd (recomputed)  -> g_cum, W (rounded), A_qk, T (exact solve), h (rounded chunk-start states), V_new
    chunk_bwd_dh            -> dh (state gradient at every chunk's end), dV_new, dh0   (reverse over chunks)
    chunk_bwd_intra         -> dq, dk, dv, dbeta, dg                                 (all chunks in parallel)
    chunk_bwd_pairs         -> KDA exact: the pair products' share of dq, dk, dG    (sub-chunks x key blocks)
    chunk_bwd_dg            -> KDA exact: dg = reverse cumsum of dG within each chunk (chunks x key blocks)

Exact gradients of the emulated forward with identity straight-through at every QDQ; the
derivation and what is recomputed rather than stored are in docs/kernels-chunk.md.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from la_compiler.kernels.chunk import forms as chunk_forms
from la_compiler.kernels.chunk.forms import (bwd_intra_by_key_blocks, has_nvfp4_operands, kda_rounds_pairs,
                                            kda_splits_pair_grads)
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.fwd import check_inputs, chunk_fwd, chunk_layout, nan_fill, needs_int64_index, scratch
from la_compiler.kernels.chunk.launch import (BWD_KEY_BLOCK_16BIT, GDN_BWD_KEY_BLOCK_16BIT,
                                            GDN_WHOLE_ROW_BWD_VALUE_BLOCK, KEY_BLOCK, cdiv, key_block, launch,
                                            launch_config, next_power_of_2)
from la_compiler.options import DEFAULT_TUNING, TuningOptions
from la_compiler.kernels.chunk.precision import dot_precision, gemm_precision, intermediate_dtype
from la_compiler.kernels.chunk.stages import stage_kernel


def chunk_bwd(p: ChunkParams, q, k, v, g, beta, scale, do, dht=None, initial_state=None, cu_seqlens=None,
              saved: torch.Tensor | None = None, tuning: TuningOptions = DEFAULT_TUNING):
    """Returns (dq, dk, dv, dg, dbeta, dh0 or None), each in its input's dtype (dh0 in h0's). ``saved``: the
    residual a training forward of the same inputs and ``tuning`` filled (chunk_fwd's ``save_to``), so the
    recompute skips the pairs and the solve (t.keep_residual=all: every forward kernel)."""
    B, T, H, K, HV, V, N, state_shape = check_inputs(p, q, k, v, g, beta, initial_state, cu_seqlens)
    if tuple(do.shape) != (B, T, HV, V):
        raise ValueError(f"do must be {(B, T, HV, V)}, got {tuple(do.shape)}")
    if dht is not None and tuple(dht.shape) != state_shape:
        raise ValueError(f"dht must be {state_shape}, got {tuple(dht.shape)}")
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    dht = None if dht is None else dht.contiguous()
    parts: dict = {}
    chunk_fwd(p, q, k, v, g, beta, scale, initial_state, cu_seqlens, intermediates=parts, need_output=False,
              saved=saved, tuning=tuning)

    C = p.chunk
    lay = chunk_layout(B, T, C, cu_seqlens)

    def run(stage, grid, *args, **launch_constexprs):  # one backward stage: its kernel, the spec's constexprs
        kernel, spec_constexprs = stage_kernel(p, "bwd", stage)
        launch(kernel, grid, *args, autotune=tuning.autotune, **spec_constexprs, **launch_constexprs)

    BK = max(16, next_power_of_2(K))
    BV = min(64, max(16, next_power_of_2(V)))
    dev, f32 = q.device, torch.float32
    gemm = gemm_precision(p, q.dtype)
    mid = intermediate_dtype(gemm, q.dtype)  # of dh, dV_new (and the forward's W, U, h, V_new)
    fill = nan_fill(tuning)
    buffer = functools.partial(scratch, fill=fill)
    dh = buffer((max(lay.NT, 1), HV, K, V), mid, dev)
    dv_new = buffer((B, T, HV, V), mid, dev)
    dh0 = buffer(state_shape, f32, dev) if initial_state is not None else None
    group = HV // H
    # per value head; summed over a group of value heads (HV > H) in fp32, else written in the input dtype
    dq = buffer((B, T, HV, K), f32 if group > 1 else q.dtype, dev)
    dk = buffer((B, T, HV, K), f32 if group > 1 else k.dtype, dev)
    dv = buffer(v.shape, v.dtype, dev)
    dbeta = buffer((B, T, HV), beta.dtype, dev)
    dg = buffer(g.shape, g.dtype, dev)
    index_64 = needs_int64_index(B, T, C, max(H, HV), K, V, max(lay.NT, 1), HV)
    common = dict(H=H, HV=HV, K=K, V=V, C=C, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
                  DOT_PRECISION=dot_precision(p, q.dtype), GEMM_PRECISION=gemm)
    run("dh", (cdiv(V, BV), N * HV),
                 q, k, parts["kd"], parts["w"], parts["g_cum"], parts["A_qk"], do, dht, dh, dv_new, dh0, cu_seqlens,
                 lay.chunk_offsets, scale, T, USE_INITIAL_STATE=initial_state is not None,
                 USE_FINAL_STATE_GRADIENT=dht is not None,
                 config=launch_config("bwd_dh", BK, C, nvfp4_operands=has_nvfp4_operands(p),
                                      serial_stages=tuning.serial_stages), **common)
    if lay.NT:
        chunks_per_row = lay.NT if cu_seqlens is not None else cdiv(T, C)
        heads = HV * (1 if cu_seqlens is not None else B)
        t_solved = parts["t_solved"] if parts["t_solved"] is not None else parts["A_qk"]  # unread for Neumann
        split = kda_splits_pair_grads(p)
        if split:  # the intra kernel hands dP, dP_qk and the other shares of dq, dk, dG (fp32) to the pairs kernel
            # dq's share goes into W's buffer (same shape), which nothing reads after the dh stage, where it is fp32
            # and not the forward's kept W (a second backward of the same graph reads that again)
            own_w = saved is None or tuning.keep_residual != "all"
            rest = [_fp32_or_new(parts["w"], fill) if own_w else buffer((B, T, HV, K), f32, dev)] + [
                buffer((B, T, HV, K), f32, dev) for _ in range(2)]
            dpair = buffer((B, T, HV, 2 * C), f32, dev)
        intra_out = (*rest[:2], dv, dbeta, rest[2], dpair) if split else (dq, dk, dv, dbeta, dg, dq)
        p_pairs = parts["p_pairs"] if split else t_solved  # unread unless split
        BKP = key_block(BK, p.numerics.bwd_key_block, bwd_key_block(p, mid))
        by_key_blocks = bwd_intra_by_key_blocks(p)
        BK_intra = BKP if by_key_blocks else BK
        config = launch_config("bwd_intra", BK_intra, C)
        if p.kind == "gdn" and by_key_blocks:
            # four warps made this form fault (illegal memory access) on the H200 with Triton 3.6 at key blocks of
            # 32, at one and three stages; eight never did (docs/kernels-chunk.md, "Key blocks")
            config = dataclasses.replace(config, keep_warps=True)
        BV_intra = min(BV, GDN_WHOLE_ROW_BWD_VALUE_BLOCK) if p.kind == "gdn" and not by_key_blocks else BV
        run("intra", (chunks_per_row, heads),
                     q, k, v, beta, g, parts["g_cum"], t_solved, p_pairs, parts["h"], dh, parts["v_new"], dv_new, do,
                     *intra_out, cu_seqlens, lay.chunk_indices, scale, T, config=config, INDEX_64=index_64,
                     **dict(common, BK=BK_intra, BV=BV_intra))
        if split:  # per sub-chunk: dq, dk and the complete dG (into its share's buffer); then dg = its reverse cumsum
            rounded = kda_rounds_pairs(p)  # rounded pairs: whole key rows (a pair's row scale spans K)
            BKP = BK if rounded else BKP
            NKB = cdiv(K, BKP)
            BC = p.sub_chunk
            run("pairs_rounded" if rounded else "pairs", (chunks_per_row * (C // BC), heads, NKB),
                         q, k, parts["g_cum"], dpair, *rest, dq, dk, *([parts["pair_amax"]] if rounded else []),
                         cu_seqlens, lay.chunk_indices, T, H=H, HV=HV, K=K, C=C, BC=BC, BK=BKP,
                         IS_VARLEN=cu_seqlens is not None,
                         INDEX_64=index_64, DOT_PRECISION=common["DOT_PRECISION"],
                         config=launch_config("bwd_pairs", BKP, C),
                         **({} if rounded else {"DIAG_DOT_MAX_RANGE": chunk_forms.DIAG_DOT_MAX_RANGE}))
            run("dg", (chunks_per_row, heads, NKB),
                         rest[2], dg, cu_seqlens, lay.chunk_indices, T, H=H, HV=HV, K=K, C=C, BK=BKP,
                         IS_VARLEN=cu_seqlens is not None, INDEX_64=index_64, config=launch_config("bwd_dg", BKP, C))
    if group > 1:
        dq = dq.view(B, T, H, group, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, group, K).sum(3).to(k.dtype)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def _fp32_or_new(buffer: torch.Tensor, fill: bool) -> torch.Tensor:
    """``buffer`` to be reused as fp32 scratch of its shape, or a new one where it is 16-bit (16-bit GEMMs)."""
    return buffer if buffer.dtype == torch.float32 else scratch(buffer.shape, torch.float32, buffer.device, fill)


def bwd_key_block(p: ChunkParams, intermediates: torch.dtype) -> int:
    """Key columns per step of the key-blocked backward above 64 columns: with 16-bit GEMMs 64 for KDA and
    128 for GDN (measured), else 32."""
    if intermediates == torch.float32:
        return KEY_BLOCK
    return BWD_KEY_BLOCK_16BIT if p.kind == "kda" else GDN_BWD_KEY_BLOCK_16BIT
