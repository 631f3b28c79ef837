"""The forward intra stage of the chunked (WY) kernels: its shared device functions, and its W / U half alone.

One program per chunk x value head computes everything of the chunk that does not depend on the state:
G = cumsum(g) (GDN; KDA's comes from chunk_fwd_kernel_cumsum), the pair products
P = K K^T ⊙ Γ and P_qk = Q K^T ⊙ Γ (GDN in its kernel, by key blocks; KDA's from chunk_fwd_kernel_pairs),
A = strict_tril(diag(beta) P), A_qk = scale tril(P_qk), T = (I + A)^-1 (blocked or row-by-row forward
substitution) or its Neumann polynomial, then W = T diag(beta)(exp(G) ⊙ K) (+ the W quantizer),
U = T diag(beta) V and KDA's decayed keys K ⊙ exp(G_C - G). One kernel per kind (forms.fwd_intra_form):
``chunk_fwd_kernel_intra_gdn`` (fwd_intra_gdn.py) and ``chunk_fwd_kernel_intra_kda`` (fwd_intra_kda.py);
``chunk_fwd_kernel_wu`` (here) is the second half alone, for the backward's recompute from the T (and GDN's G) a
training forward kept (chunk/residual.py); all three run the same device functions ``solve`` / ``wu_half``.
docs/kernels-chunk.md derives the algorithm and lists where each GEMM operand site, accumulator and the W
quantizer round.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk import forms
from la_compiler.kernels.chunk.device import (acc_gemm, cast_for, chunk_program, gate_exp, grid_gemm, grid_operand,
                                              qdq_operand, qdq_w, tile_amax)
from la_compiler.kernels.chunk.launch import launch
from la_compiler.kernels.common.qdq import amax_abs

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan

SOLVE_BLOCK = tl.constexpr(forms.SOLVE_BLOCK)  # rows of the diagonal blocks of the blocked exact solve

# ---- the solve ------------------------------------------------------------------------------------------


@triton.jit
def solve(b_A, p_pairs, beta, bos, i_t, seq_len, i_hv, o_c, HV: tl.constexpr, C: tl.constexpr, KDA: tl.constexpr,
          SOLVE: tl.constexpr, DEGREE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """T = (I + A)^-1: SOLVE "blocked" (chunks of 32, 64, ... rows) or "rows" (forward substitution: row i of
    T = e_i - sum_{j<i} A_ij T_j), both exact; "neumann": the polynomial of degree DEGREE,
    T = sum_{i<=DEGREE} (-A)^i (Horner).

    The blocked solve (docs/kernels-chunk.md, "Blocked solve"): the 16 x 16 diagonal blocks D by forward
    substitution, all blocks at once (16 steps instead of C); then with L the strictly block-lower part and
    M = (I + D)^-1 L (nilpotent of order C/16), T = sum_n<C/16 (-M)^n (I + D)^-1. The substitution holds the
    blocks transposed, X[b, c, j] = (I + D_b)^-1[j, c]: step i's sum over the rows j < i then runs along the
    tile's last axis, inside a warp, where a sum over its middle axis crossed warps (a shared-memory round trip
    per step).

    Row i of every D_b: KDA's A = diag(beta) P is read from p_pairs in memory (chunk_fwd_kernel_pairs wrote
    P), as FLA's solve_tril reads its rows; GDN's A exists only in registers (its pair products are computed
    in the same kernel): the faster form for each kind (docs/kernels-chunk-measurements.md, "Solve forms")."""
    if SOLVE == "blocked":
        NB: tl.constexpr = C // SOLVE_BLOCK
        o_sb = tl.arange(0, NB)
        o_sr = tl.arange(0, SOLVE_BLOCK)
        m_same_blk = o_sb[:, None, None, None] == o_sb[None, None, :, None]
        if not KDA:
            b_D = tl.sum(tl.where(m_same_blk, tl.reshape(b_A, [NB, SOLVE_BLOCK, NB, SOLVE_BLOCK]), 0.0), 2)
        # X[b, c, j] = (I + D_b)^-1[j, c]; step i: column i of X = e_i - sum_j<i D_b[i, j] X[b, :, j]
        m_col = o_sr[None, None, :]
        b_X = tl.where(o_sr[None, :, None] == m_col, 1.0, 0.0) + tl.zeros([NB, SOLVE_BLOCK, SOLVE_BLOCK],
                                                                         dtype=tl.float32)
        for i in range(1, SOLVE_BLOCK):
            if KDA:
                x_i = (bos + i_t * C + o_sb * SOLVE_BLOCK + i) * HV + i_hv  # row i of every diagonal block
                m_ri = (i_t * C + o_sb * SOLVE_BLOCK + i) < seq_len
                b_a = tl.load(p_pairs + x_i[:, None] * C + (o_sb * SOLVE_BLOCK)[:, None] + o_sr[None, :],
                              mask=m_ri[:, None] & (o_sr < i)[None, :], other=0)
                b_a = b_a * tl.load(beta + x_i, mask=m_ri, other=0).to(tl.float32)[:, None]
            else:
                b_a = tl.sum(tl.where(o_sr[None, :, None] == i, b_D, 0.0), 1)
            b_s = tl.sum(b_a[:, None, :] * b_X, 2)
            b_X = tl.where(m_col == i, tl.where(o_sr == i, 1.0, 0.0)[None, :, None] - b_s[:, :, None], b_X)
        b_Td = tl.permute(b_X, (0, 2, 1))
        b_Tbd = tl.reshape(tl.where(m_same_blk, b_Td[:, :, None, :], 0.0), [C, C])
        b_M = tl.dot(b_Tbd, tl.where((o_c // SOLVE_BLOCK)[:, None] > (o_c // SOLVE_BLOCK)[None, :], b_A, 0.0),
                     input_precision=DOT_PRECISION)
        b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
        b_X = b_I - b_M
        for _ in tl.static_range(NB - 2):
            b_X = b_I - tl.dot(b_M, b_X, input_precision=DOT_PRECISION)
        b_T = tl.dot(b_X, b_Tbd, input_precision=DOT_PRECISION)
    elif SOLVE == "rows":
        b_T = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
        for i in range(1, C):
            m_i = o_c == i
            b_a = tl.sum(tl.where(m_i[:, None], b_A, 0.0), 0)
            b_T = tl.where(m_i[:, None], b_T - tl.sum(b_a[:, None] * b_T, 0)[None, :], b_T)
    else:
        b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
        b_T = b_I
        for _ in tl.static_range(DEGREE):
            b_T = b_I - tl.dot(b_A, b_T, input_precision=DOT_PRECISION)
    return b_T


# ---- the W / U half -------------------------------------------------------------------------------------


@triton.jit
def wy_key_block(k, g_cum, i_k, b_Tw, b_s_Tw, b_beta, b_G, bos, t_c, i_h, r_hv, m_c, H: tl.constexpr,
                 K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, GEMM_PRECISION: tl.constexpr, KDA: tl.constexpr,
                 Q_WY_KEY_RHS: tl.constexpr, ACC_WY_KEY: tl.constexpr, ACC_WY_KEY_BLOCK: tl.constexpr,
                 FACTORED_WY: tl.constexpr, GATE_EXP2: tl.constexpr):
    """Key block i_k of W = Q(T) Q(beta exp(G) ⊙ K) (before the W quantizer): (o_k, m_k, m_ck, b_k, b_G, b_w),
    b_G that block's [C x BK] G for KDA (from g_cum), GDN's [C] one unchanged."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
    if KDA:
        b_G = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
        if GATE_EXP2:  # vLLM's recompute_w_u_fwd: (K diag(beta)) exp2(G)
            b_bk = (b_k * b_beta[:, None]) * tl.exp2(b_G)
        else:
            b_bk = b_k * (b_beta[:, None] * tl.exp(b_G))
    else:
        b_bk = b_k * (b_beta[:, None] * tl.exp(b_G)[:, None])
    if FACTORED_WY:
        b_s_bk, b_q_bk = grid_operand(b_bk, Q_WY_KEY_RHS, 0)
        b_w = grid_gemm(b_Tw, b_q_bk, b_s_Tw, b_s_bk, GEMM_PRECISION)
    else:
        b_bk = qdq_operand(b_bk, None, Q_WY_KEY_RHS, 0, C, BK, False)
        b_w = acc_gemm(b_Tw, b_bk, GEMM_PRECISION, C, ACC_WY_KEY, ACC_WY_KEY_BLOCK)
    return o_k, m_k, m_ck, b_k, b_G, b_w


@triton.jit
def wu_half(k, v, g_cum, w, u, kd, b_T, b_beta, b_G, bos, i_t, seq_len, t_c, m_c, r_hv, i_h, i_hv,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, GEMM_PRECISION: tl.constexpr, KDA: tl.constexpr,
            Q_WY_KEY_LHS: tl.constexpr, Q_WY_KEY_RHS: tl.constexpr, Q_WY_VALUE_LHS: tl.constexpr,
            Q_WY_VALUE_RHS: tl.constexpr, ACC_WY_KEY: tl.constexpr, ACC_WY_KEY_BLOCK: tl.constexpr,
            ACC_WY_VALUE: tl.constexpr, ACC_WY_VALUE_BLOCK: tl.constexpr, FACTORED_WY: tl.constexpr,
            W_Q: tl.constexpr, W_BLOCK: tl.constexpr, W_AMAX_PASS: tl.constexpr, GATE_EXP2: tl.constexpr):
    """From T: W = T diag(beta)(exp(G) ⊙ K) (+ the W quantizer) into w, U = T diag(beta) V into u, KDA's
    decayed keys into kd. b_G: GDN's [C] cumulative decay (KDA: None, its G is read per key block).
    FACTORED_WY: W = Q(T) Q(beta e^G K) and U = Q(T) Q(beta V) on grid values (both or neither, T is shared)."""
    # T rounded once where wy_key and wy_value round it the same way
    if FACTORED_WY:
        b_s_Tw, b_Tw = grid_operand(b_T, Q_WY_KEY_LHS, 1)
        if Q_WY_VALUE_LHS == Q_WY_KEY_LHS:
            b_s_Tu, b_Tu = b_s_Tw, b_Tw
        else:
            b_s_Tu, b_Tu = grid_operand(b_T, Q_WY_VALUE_LHS, 1)
    else:
        b_s_Tw, b_s_Tu = None, None
        b_Tw = qdq_operand(b_T, None, Q_WY_KEY_LHS, 1, C, C, False)
        if Q_WY_VALUE_LHS == Q_WY_KEY_LHS:
            b_Tu = b_Tw
        else:
            b_Tu = qdq_operand(b_T, None, Q_WY_VALUE_LHS, 1, C, C, False)
    # W's per-row amax over all key blocks, before any block is rounded (W quantizers with row groups or
    # NVFP4's global scale; blocks of N columns are local). W is cheap to form twice (a [C x C] x [C x BK]
    # dot per block), cheaper than storing it unrounded and reading it back; with one key block (K <= BK)
    # the pass is skipped and the block's own amax is the row's.
    if W_AMAX_PASS:
        b_wamax = tl.zeros([C], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK) if K > BK else 0):
            o_k, m_k, m_ck, b_k, b_Gk, b_w = wy_key_block(
                k, g_cum, i_k, b_Tw, b_s_Tw, b_beta, b_G, bos, t_c, i_h, r_hv, m_c, H, K, C, BK, GEMM_PRECISION,
                KDA, Q_WY_KEY_RHS, ACC_WY_KEY, ACC_WY_KEY_BLOCK, FACTORED_WY, GATE_EXP2)
            b_wamax = tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1))
    else:
        b_wamax = None
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k, m_ck, b_k, b_Gk, b_w = wy_key_block(
            k, g_cum, i_k, b_Tw, b_s_Tw, b_beta, b_G, bos, t_c, i_h, r_hv, m_c, H, K, C, BK, GEMM_PRECISION,
            KDA, Q_WY_KEY_RHS, ACC_WY_KEY, ACC_WY_KEY_BLOCK, FACTORED_WY, GATE_EXP2)
        if W_Q != "":
            b_w = qdq_w(b_w, b_wamax, W_Q, W_BLOCK, C, BK)
        tl.store(w + r_hv[:, None] * K + o_k[None, :], cast_for(b_w, w, GEMM_PRECISION), mask=m_ck)
        if KDA:
            # K ⊙ exp(G_last - G) of the chunk's state update, written here (this stage holds K and G by key
            # block) for the h and dh stages: each of their value-block programs would otherwise load G [C x K]
            # and exponentiate it again (docs/kernels-chunk.md, "Decayed keys")
            b_glast = tl.load(g_cum + ((bos + tl.minimum(i_t * C + C, seq_len) - 1) * HV + i_hv) * K + o_k,
                              mask=m_k, other=0)
            b_kd = b_k * tl.where(m_ck, gate_exp(b_glast[None, :] - b_Gk, GATE_EXP2), 0.0)
            tl.store(kd + r_hv[:, None] * K + o_k[None, :], cast_for(b_kd, kd, GEMM_PRECISION), mask=m_ck)

    # NVFP4 wy_value.rhs: the global amax of beta V over every value block (the U loop sees one at a time)
    if Q_WY_VALUE_RHS == "nvfp4":
        b_gam_wv = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(v + r_hv[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :],
                               other=0).to(tl.float32) * b_beta[:, None]
            b_gam_wv = tl.maximum(b_gam_wv, tile_amax(b_amax_x))
    else:
        b_gam_wv = None
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_c[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + r_hv[:, None] * V + o_v[None, :], mask=m_cv, other=0).to(tl.float32)
        b_bv = b_v * b_beta[:, None]
        if FACTORED_WY:
            b_s_bv, b_q_bv = grid_operand(b_bv, Q_WY_VALUE_RHS, 0)
            b_u = grid_gemm(b_Tu, b_q_bv, b_s_Tu, b_s_bv, GEMM_PRECISION)
        else:
            b_bv = qdq_operand(b_bv, b_gam_wv, Q_WY_VALUE_RHS, 0, C, BV, True)
            b_u = acc_gemm(b_Tu, b_bv, GEMM_PRECISION, C, ACC_WY_VALUE, ACC_WY_VALUE_BLOCK)
        tl.store(u + r_hv[:, None] * V + o_v[None, :], cast_for(b_u, u, GEMM_PRECISION), mask=m_cv)


# ---- the W / U half alone -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_wu(
    q,
    k,
    v,
    g,
    beta,
    g_cum,
    w,
    u,
    kd,
    A_qk,
    t_out,
    p_pairs,
    cu_seqlens,
    chunk_indices,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEMM_PRECISION: tl.constexpr,
    STORE_T: tl.constexpr,
    KDA: tl.constexpr,
    Q_WY_KEY_LHS: tl.constexpr,
    Q_WY_KEY_RHS: tl.constexpr,
    Q_WY_VALUE_LHS: tl.constexpr,
    Q_WY_VALUE_RHS: tl.constexpr,
    ACC_WY_KEY: tl.constexpr,
    ACC_WY_KEY_BLOCK: tl.constexpr,
    ACC_WY_VALUE: tl.constexpr,
    ACC_WY_VALUE_BLOCK: tl.constexpr,
    FACTORED_WY: tl.constexpr,
    W_Q: tl.constexpr,
    W_BLOCK: tl.constexpr,
    W_AMAX_PASS: tl.constexpr,
    GATE_EXP2: tl.constexpr = False,
):
    """The intra stage's second half, for the backward's recompute from a kept residual:
    W = T diag(beta)(exp(G) ⊙ K) (+ W quantizer), U = T diag(beta) V, KDA's decayed keys, from the T (and GDN's G)
    that the training forward kept (chunk/residual.py)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    t_c = i_t * C + o_c
    m_c = t_c < seq_len
    m_k = o_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    # token rows of this chunk in the [B, T, heads, D] inputs
    r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
    r_hv = (bos + t_c) * HV + i_hv

    b_beta = tl.load(beta + r_hv, mask=m_c, other=0).to(tl.float32)
    if KDA:
        b_G = None  # per key block from g_cum
    else:
        b_G = tl.load(g_cum + r_hv, mask=m_c, other=0)
    # T from the training forward's residual (rows past the sequence end: the identity's, as its solve gives them)
    b_T = tl.load(t_out + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0).to(tl.float32)
    b_T = tl.where(m_c[:, None], b_T, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0))
    wu_half(k, v, g_cum, w, u, kd, b_T, b_beta, b_G, bos, i_t, seq_len, t_c, m_c, r_hv, i_h, i_hv, H, HV, K, V, C,
            BK, BV, GEMM_PRECISION, KDA, Q_WY_KEY_LHS, Q_WY_KEY_RHS, Q_WY_VALUE_LHS, Q_WY_VALUE_RHS, ACC_WY_KEY,
            ACC_WY_KEY_BLOCK, ACC_WY_VALUE, ACC_WY_VALUE_BLOCK, FACTORED_WY, W_Q, W_BLOCK, W_AMAX_PASS, GATE_EXP2)


KERNELS = {"wu": chunk_fwd_kernel_wu}


def chunk_fwd_wu(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, g, beta, g_cum, w, u, kd, A_qk, t_solved,
                 p_pairs, scale):
    """W, U and KDA's kd of every chunk from a kept T (``t_solved``), A_qk and G or P (the backward's recompute)."""
    launch(plan.fwd_wu, dict(q=q, k=k, v=v, g=g, beta=beta, g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk, t_out=t_solved,
                             p_pairs=p_pairs, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
                             scale=scale, T=layout.T),
           STORE_T=False)
