"""Launchers of the chunked (WY) forward kernels, and the recipe that chains them.

    chunk_fwd_cumsum / pair_amax / pairs  -> KDA: g_cum, (NVFP4 pair amaxes), P, P_qk   (by sub-chunk)
    chunk_fwd_intra  -> g_cum (GDN), W, U, A_qk      (all chunks in parallel)
    chunk_fwd_h      -> h (chunk-start states), V_new, final state   (sequential over chunks)
    chunk_fwd_o      -> o                      (all chunks in parallel)

Intermediates are fp32 and dots IEEE fp32 for fp32 inputs (the exact-numerics contract: relative
error <= 1e-5 against the fp64 reference). For 16-bit inputs the GEMMs over values and states run in
the input dtype with W, U, h, V_new kept in it, as FLA's do, unless the spec rounds GEMM operands;
the pair products and the solve multiply in TF32 (chunk/precision.py).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from la_compiler.kernels.common.canonical_inputs import check_canonical_inputs
from la_compiler.kernels.chunk import forms as chunk_forms
from la_compiler.kernels.chunk.forms import (has_nvfp4_operands, kda_pairs_kernel, kda_pairs_nvfp4, kda_rounds_pairs,
                                            max_head_k, pairs_need_all_keys)
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.stages import stage_kernel
from la_compiler.kernels.chunk.residual import clear_gaps, residual_views
from la_compiler.kernels.chunk.precision import dot_precision, gemm_precision, intermediate_dtype
from la_compiler.kernels.chunk.launch import PAIRS_KEY_BLOCK, cdiv, key_block, launch, launch_config, next_power_of_2
from la_compiler.quant.config import QuantConfig
from la_compiler.options import DEFAULT_TUNING, TuningOptions, interpreter


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk of a (possibly packed) batch lives."""

    B: int
    T: int
    N: int  # sequences
    NT: int  # chunks over all sequences
    chunk_indices: torch.Tensor | None  # [NT, 2] int32: (sequence, chunk within it), varlen only
    chunk_offsets: torch.Tensor | None  # [N + 1] int32: first chunk of every sequence, varlen only


def needs_int64_index(B: int, T: int, C: int, heads: int, K: int, V: int, chunks: int, HV: int) -> bool:
    """Whether an element offset of the chunk kernels may pass 2^31 (their ``INDEX_64``): rows of [B, T, heads, ..]
    buffers up to 2C wide (the backward's pair gradients) with every sequence's last chunk padded, or the chunk
    states [chunks, HV, K, V]. int32 offsets take half the registers of the address tiles (KDA's forward pairs
    kernel: 0.59 ms against 0.71 at [8, 4096, 16, 128] on the H200)."""
    return max(B * (T + C) * heads * max(K, V, 2 * C), chunks * HV * K * V) >= 2 ** 31


def chunk_layout(B: int, T: int, C: int, cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    if cu_seqlens is None:
        return ChunkLayout(B, T, B, B * cdiv(T, C), None, None)
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={B}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [(n + C - 1) // C for n in lengths]
    rows = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    dev = cu_seqlens.device
    indices = torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=dev).reshape(-1, 2)
    return ChunkLayout(B, T, len(lengths), len(rows), indices, torch.tensor(offsets, dtype=torch.int32, device=dev))


def check_inputs(p: ChunkParams, q, k, v, g, beta, initial_state, cu_seqlens):
    max_k, why = max_head_k(p)
    return check_canonical_inputs("the chunk kernels", p.kind, p.state, q, k, v, g, beta, initial_state, cu_seqlens,
                                  max_k=max_k, max_v=256, why_max=f" ({why})")


def nan_fill(tuning: TuningOptions) -> bool:
    """Whether ``scratch`` buffers are NaN-filled: as t.nan_fill says, else under the interpreter (tests see every
    unwritten element); otherwise they are uninitialised (a fill costs a full write of them)."""
    return interpreter() if tuning.nan_fill is None else tuning.nan_fill


def scratch(shape, dtype, device, fill: bool) -> torch.Tensor:
    """An output/intermediate buffer, NaN-filled where ``fill`` (``nan_fill``: a launcher decides once for all
    its buffers)."""
    if fill:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def intra_key_block(p: ChunkParams, BK: int, w_block: int) -> int:
    """Key columns the forward intra stage reads at a time (its BK): whole rows where
    ``pairs_need_all_keys``, else ``chunk.launch.key_block``, never fewer than a W quantizer block."""
    if pairs_need_all_keys(p):
        return BK
    return min(BK, max(key_block(BK, p.numerics.key_block), w_block))


def output_value_block(V: int, rounds_operands: bool) -> int:
    """Value columns per program of the output stage. Exact GEMM operands: up to 128, so that one program
    computes Q ⊙ exp(G) and reads Q, G, A_qk once for a whole V = 128 head (H200, [8, 4096, 16, 128] bf16, per
    call: KDA 0.34 -> 0.30 ms, GDN 0.21 -> 0.20; eight warps at 128: 0.46). Rounded operands keep 64 (fp32
    [K x BV] state tiles; unmeasured wider)."""
    return min(64 if rounds_operands else 128, max(16, next_power_of_2(V)))


def chunk_fwd(p: ChunkParams, q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None,
              intermediates: dict | None = None, need_output: bool = True, save_to: torch.Tensor | None = None,
              saved: torch.Tensor | None = None, tuning: TuningOptions = DEFAULT_TUNING):
    """Returns (o [B, T, HV, V] in q.dtype, final state fp32 in the params' layout).

    ``intermediates``, if given, receives the buffers g_cum, w, u, A_qk, v_new, kd (KDA) [B, T, HV, ..] and h, the
    chunk-start states [chunks, HV, K, V] (tests count rounding flips in w and h): fp32, except W, U, h,
    V_new in the input dtype for 16-bit GEMMs (chunk/precision.py).
    ``need_output=False`` (the backward's recompute) skips the output stage and returns o = None.
    With ``intermediates`` and the exact solve, T = (I + A)^-1 is kept too (t_solved [B, T, HV, C]):
    the backward's input-gradient stage loads it instead of solving again.
    ``save_to`` (a buffer of ``chunk.residual.residual_size``): the forward also stores there what the backward
    keeps (T, A_qk and G or P; with t.keep_residual=all W, U, h, V_new too). ``saved`` (such a buffer, filled by a
    forward of the same inputs and tuning): the recompute loads them and runs only the W / U half of the intra
    stage and the h stage (KDA: after its cumsum), or (all) no kernel but KDA's NVFP4 pair amaxes. ``tuning``: the
    spec's t.<name> options (residual mode, serial stages, autotuning, NaN fill)."""
    if save_to is not None and saved is not None:
        raise ValueError("chunk_fwd takes save_to or saved, not both")
    if saved is not None and need_output:
        raise ValueError("chunk_fwd's saved is for the backward's recompute (need_output=False)")
    B, T, H, K, HV, V, N, state_shape = check_inputs(p, q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    initial_state = None if initial_state is None else initial_state.contiguous()
    C = p.chunk
    lay = chunk_layout(B, T, C, cu_seqlens)
    def run(stage, grid, *args, **launch_constexprs):  # one forward stage: its kernel, the spec's constexprs
        kernel, spec_constexprs = stage_kernel(p, "fwd", stage)
        launch(kernel, grid, *args, autotune=tuning.autotune, **spec_constexprs, **launch_constexprs)
    w_block = 16 if p.w_quant is None else max(16, getattr(_cfg(p.w_quant), "block_size", None) or 16)
    BK = max(w_block, next_power_of_2(K))
    BV_io = min(64, max(16, next_power_of_2(V)))
    BV_h = p.state_block_v or min(32, BV_io)  # no state tile to honour: more programs for the serial stage
    if p.h_full_v:  # NVFP4 state_read / state_update operands: one tile over all of V (and whole state tiles)
        BV_h = max(16, next_power_of_2(V), p.state_block_v or 16)
    dev, f32 = q.device, torch.float32
    gemm = gemm_precision(p, q.dtype)
    mid = intermediate_dtype(gemm, q.dtype)  # of W, U, h, V_new: the input dtype for 16-bit GEMMs
    buffer = functools.partial(scratch, fill=nan_fill(tuning))
    residual = saved if saved is not None else save_to
    keep = tuning.keep_residual
    kept = residual_views(p, residual, q, v, cu_seqlens, keep) if residual is not None else {}
    if save_to is not None:  # the op returns the buffer: no element of it left unwritten (chunk/residual.py)
        clear_gaps(p, save_to, q, v, cu_seqlens, keep)
        if "h" in kept and kept["h"].shape[0] > lay.NT:  # a varlen batch's chunk states past its count
            kept["h"][lay.NT:].zero_()
    rerun = saved is None or keep != "all"  # whether the intra (or W / U) and h stages run

    def take(name, shape, dtype):  # the kept part of that name, else a scratch buffer
        return kept[name] if name in kept else buffer(shape, dtype, dev)

    g_cum = take("g_cum", g.shape, f32)
    w = take("w", (B, T, HV, K), mid)
    u = take("u", (B, T, HV, V), mid)
    A_qk = take("A_qk", (B, T, HV, C), f32)
    h = take("h", (max(lay.NT, 1), HV, K, V), mid)
    v_new = take("v_new", (B, T, HV, V), mid)
    kd = take("kd", (B, T, HV, K), mid) if p.kind == "kda" else None  # K ⊙ exp(G_C - G), intra -> h
    o = buffer((B, T, HV, V), q.dtype, dev) if need_output else None
    keep_t = kept or (intermediates is not None and p.solve == "exact")
    t_solved = take("t_solved", (B, T, HV, C), f32) if keep_t else None
    p_pairs = take("p_pairs", (B, T, HV, C), f32) if kda_pairs_kernel(p) else None
    chunks_per_row = lay.NT if cu_seqlens is not None else cdiv(T, C)
    heads = HV * (1 if cu_seqlens is not None else B)
    BC = p.sub_chunk
    # NVFP4 pairwise operands: the chunk-wide amaxes (pk, pq, |K|, |Q|)
    pair_amax = buffer((chunks_per_row, heads, 4), f32, dev) if kda_pairs_nvfp4(p) else None
    ht = buffer(state_shape, f32, dev)
    index_64 = needs_int64_index(B, T, C, max(H, HV), K, V, max(lay.NT, 1), HV)
    common = dict(H=H, HV=HV, K=K, V=V, C=C, BK=BK, IS_VARLEN=cu_seqlens is not None,
                  DOT_PRECISION=dot_precision(p, q.dtype), GEMM_PRECISION=gemm)
    rounds = bool(p.operands or p.acc)  # rounded GEMM operands: the output stage's value block
    nvfp4 = has_nvfp4_operands(p)
    if lay.NT and kda_pairs_kernel(p):  # G = cumsum(g), then P and P_qk (into A_qk) by sub-chunk
        BKG = min(BK, PAIRS_KEY_BLOCK)
        if rerun:
            run("cumsum", (chunks_per_row, heads, cdiv(K, BKG)),
                         g, g_cum, cu_seqlens, lay.chunk_indices, T, H=H, HV=HV, K=K, C=C, BK=BKG,
                         IS_VARLEN=cu_seqlens is not None, INDEX_64=index_64,
                         config=launch_config("fwd_cumsum", BKG, C))
        rounded = kda_rounds_pairs(p)  # rounded pairs: whole key rows (a pair's row scale spans K)
        BKP = BK if rounded else BKG
        sub_grid = (chunks_per_row * (C // BC), heads)
        if pair_amax is not None:
            run("pair_amax", (chunks_per_row, heads),
                         q, k, g_cum, pair_amax, cu_seqlens, lay.chunk_indices, T, H=H, HV=HV, K=K, C=C, BK=BKP,
                         IS_VARLEN=cu_seqlens is not None, INDEX_64=index_64,
                         config=launch_config("fwd_pair_amax", BKP, C))
        if saved is None:  # else P and P_qk (in A_qk, finished by the intra stage) are the forward's
            run("pairs_rounded" if rounded else "pairs", sub_grid,
                         q, k, g_cum, p_pairs, A_qk, *([pair_amax] if rounded else []), cu_seqlens,
                         lay.chunk_indices, T,
                         H=H, HV=HV, K=K, C=C, BC=BC, BK=BKP, IS_VARLEN=cu_seqlens is not None, INDEX_64=index_64,
                         DOT_PRECISION=common["DOT_PRECISION"], config=launch_config("fwd_pairs", BKP, C, rounded),
                         **({} if rounded else {"DIAG_DOT_MAX_RANGE": chunk_forms.DIAG_DOT_MAX_RANGE}))
    if lay.NT and rerun:
        BK_intra = intra_key_block(p, BK, w_block)
        intra = dict(BV=BV_io, config=launch_config("fwd_intra", BK_intra, C), INDEX_64=index_64,
                     **dict(common, BK=BK_intra))
        if saved is not None:  # T, A_qk (GDN: and G) from the training forward: W and U alone
            run("wu", (chunks_per_row, heads),
                         q, k, v, g, beta, g_cum, w, u, kd, A_qk, t_solved, p_pairs, cu_seqlens,
                         lay.chunk_indices, scale, T, STORE_T=False, **intra)
        else:
            run("intra", (chunks_per_row, heads),
                         q, k, v, g, beta, g_cum, w, u, kd, A_qk, t_solved, p_pairs, cu_seqlens,
                         lay.chunk_indices, scale, T, STORE_T=t_solved is not None, **intra)
    if rerun:
        run("h", (cdiv(V, BV_h), N * HV),
                     k, kd, w, u, g_cum, h, v_new, initial_state, ht, cu_seqlens, lay.chunk_offsets, T,
                     BV=BV_h, USE_INITIAL_STATE=initial_state is not None,
                     config=launch_config("fwd_h", BK, C, nvfp4_operands=nvfp4, serial_stages=tuning.serial_stages),
                     **common)
    if lay.NT and need_output:
        BV_o = output_value_block(V, rounds)
        run("o", (cdiv(V, BV_o), chunks_per_row, heads),
                     q, g_cum, A_qk, h, v_new, o, cu_seqlens, lay.chunk_indices, scale, T,
                     BV=BV_o, INDEX_64=index_64, config=launch_config("fwd_o", BK, C, nvfp4_operands=nvfp4), **common)
    if intermediates is not None:
        intermediates.update(g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk, h=h[: lay.NT], v_new=v_new, t_solved=t_solved,
                             p_pairs=p_pairs, pair_amax=pair_amax)
    return o, (ht if rerun else None)


def _cfg(text) -> QuantConfig:
    return QuantConfig.parse(text)
