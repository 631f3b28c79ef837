"""The forward intra stage of GDN: G = cumsum(g), the pair products P = K K^T ⊙ Γ and P_qk = Q K^T ⊙ Γ by key
blocks, A, A_qk, the solve and the W / U half (the device functions of chunk/fwd_intra.py), one program per
chunk x value head.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import (acc_gemm, cast_kept, chunk_program, grid_gemm, grid_operand,
                                              qdq_operand)
from la_compiler.kernels.chunk.fwd_intra import solve, wu_half
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit
def gdn_pair_block(b_q, b_k, C: tl.constexpr, BK: tl.constexpr, GEMM_PRECISION: tl.constexpr,
                   Q_KEY_INTERACTION_LHS: tl.constexpr, Q_KEY_INTERACTION_RHS: tl.constexpr,
                   Q_OUTPUT_SCORE_LHS: tl.constexpr, Q_OUTPUT_SCORE_RHS: tl.constexpr,
                   ACC_KEY_INTERACTION: tl.constexpr, ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
                   ACC_OUTPUT_SCORE: tl.constexpr, ACC_OUTPUT_SCORE_BLOCK: tl.constexpr,
                   FACTORED_PAIRS: tl.constexpr):
    """One key block's share (b_Pb, b_Pqkb) of K_l K_r^T and Q_l K_r2^T (Γ comes after the last block).
    GEMM_PRECISION: GDN's pair operands are the raw inputs (Γ comes after the sum), so with 16-bit GEMMs
    they are 16-bit numbers, which TF32 holds exactly: bf16 operands form the same products at twice the
    tensor-core rate. Where GEMM_PRECISION is not 16-bit (rounded operands, fp32 inputs) it is DOT_PRECISION.
    FACTORED_PAIRS: both products on grid values, the row scales applied to the result. An operand that rounds
    the same rows as an earlier one in the same format reuses its result (K for key_interaction and
    output_score): Triton's common-subexpression pass does not merge the amax reductions."""
    if FACTORED_PAIRS:
        b_s_kl, b_q_kl = grid_operand(b_k, Q_KEY_INTERACTION_LHS, 1)
        if Q_KEY_INTERACTION_RHS == Q_KEY_INTERACTION_LHS:
            b_s_kr, b_q_kr = b_s_kl, b_q_kl
        else:
            b_s_kr, b_q_kr = grid_operand(b_k, Q_KEY_INTERACTION_RHS, 1)
        b_s_ql, b_q_ql = grid_operand(b_q, Q_OUTPUT_SCORE_LHS, 1)
        if Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_LHS:
            b_s_kr2, b_q_kr2 = b_s_kl, b_q_kl
        elif Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_RHS:
            b_s_kr2, b_q_kr2 = b_s_kr, b_q_kr
        else:
            b_s_kr2, b_q_kr2 = grid_operand(b_k, Q_OUTPUT_SCORE_RHS, 1)
        b_Pb = grid_gemm(b_q_kl, tl.trans(b_q_kr), b_s_kl, b_s_kr, GEMM_PRECISION)
        b_Pqkb = grid_gemm(b_q_ql, tl.trans(b_q_kr2), b_s_ql, b_s_kr2, GEMM_PRECISION)
    else:
        b_kl = qdq_operand(b_k, None, Q_KEY_INTERACTION_LHS, 1, C, BK, False)
        if Q_KEY_INTERACTION_RHS == Q_KEY_INTERACTION_LHS:
            b_kr = b_kl
        else:
            b_kr = qdq_operand(b_k, None, Q_KEY_INTERACTION_RHS, 1, C, BK, False)
        b_ql = qdq_operand(b_q, None, Q_OUTPUT_SCORE_LHS, 1, C, BK, False)
        if Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_LHS:
            b_kr2 = b_kl
        elif Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_RHS:
            b_kr2 = b_kr
        else:
            b_kr2 = qdq_operand(b_k, None, Q_OUTPUT_SCORE_RHS, 1, C, BK, False)
        b_Pb = acc_gemm(b_kl, tl.trans(b_kr), GEMM_PRECISION, BK, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK)
        b_Pqkb = acc_gemm(b_ql, tl.trans(b_kr2), GEMM_PRECISION, BK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
    return b_Pb, b_Pqkb


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_intra_gdn(
    q,
    k,
    v,
    g,
    beta,
    g_cum,
    w,
    u,
    A_qk,
    t_out,
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
    Q_KEY_INTERACTION_LHS: tl.constexpr,
    Q_KEY_INTERACTION_RHS: tl.constexpr,
    Q_OUTPUT_SCORE_LHS: tl.constexpr,
    Q_OUTPUT_SCORE_RHS: tl.constexpr,
    ACC_KEY_INTERACTION: tl.constexpr,
    ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
    ACC_OUTPUT_SCORE: tl.constexpr,
    ACC_OUTPUT_SCORE_BLOCK: tl.constexpr,
    FACTORED_PAIRS: tl.constexpr,
    SOLVE: tl.constexpr,
    DEGREE: tl.constexpr,
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
):
    """Everything of one GDN chunk that does not depend on the state: G = cumsum(g) into g_cum;
    A = strict_tril(diag(beta)(K K^T ⊙ Γ)); T = (I + A)^-1; W = T diag(beta)(exp(G) ⊙ K); U = T diag(beta) V;
    A_qk = scale tril(Q K^T ⊙ Γ); T itself when STORE_T.
    Keys are read in blocks of BK columns (the pair products are sums over key columns; W's columns are
    independent), so no program holds a full-width [C x K] tile; BK >= K where a rounded pair operand or
    the W quantizer's tile needs all columns at once (chunk.blocks.intra_key_block)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    t_c = i_t * C + o_c
    m_c = t_c < seq_len
    r_hv = (bos + t_c) * HV + i_hv  # token rows of this chunk in the [B, T, HV, ..] tensors

    b_beta = tl.load(beta + r_hv, mask=m_c, other=0).to(tl.float32)
    b_g = tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32)
    b_G = tl.cumsum(b_g, 0)
    tl.store(g_cum + r_hv, b_G, mask=m_c)
    m_strict = o_c[:, None] > o_c[None, :]
    m_causal = o_c[:, None] >= o_c[None, :]
    b_P = tl.zeros([C, C], dtype=tl.float32)
    b_Pqk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_ck = m_c[:, None] & (o_k < K)[None, :]
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_Pb, b_Pqkb = gdn_pair_block(b_q, b_k, C, BK, GEMM_PRECISION, Q_KEY_INTERACTION_LHS,
                                      Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS, Q_OUTPUT_SCORE_RHS,
                                      ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE,
                                      ACC_OUTPUT_SCORE_BLOCK, FACTORED_PAIRS)
        b_P += b_Pb
        b_Pqk += b_Pqkb
    # Γ_ij = exp(G_i - G_j) on the summed products
    b_Gam = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))
    b_P = b_P * b_Gam
    b_Pqk = b_Pqk * b_Gam
    b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)
    b_Aqk = tl.where(m_causal, b_Pqk * scale, 0.0)
    tl.store(A_qk + r_hv[:, None] * C + o_c[None, :], cast_kept(b_Aqk, A_qk, GEMM_PRECISION), mask=m_c[:, None])

    b_T = solve(b_A, None, None, bos, i_t, seq_len, i_hv, o_c, HV, C, False, SOLVE, DEGREE, DOT_PRECISION)
    if STORE_T:  # the backward's recompute keeps T for the input-gradient stage (no second solve)
        tl.store(t_out + r_hv[:, None] * C + o_c[None, :], cast_kept(b_T, t_out, GEMM_PRECISION), mask=m_c[:, None])

    wu_half(k, v, g_cum, w, u, None, b_T, b_beta, b_G, bos, i_t, seq_len, t_c, m_c, r_hv, i_h, i_hv, H, HV, K, V,
            C, BK, BV, GEMM_PRECISION, False, Q_WY_KEY_LHS, Q_WY_KEY_RHS, Q_WY_VALUE_LHS, Q_WY_VALUE_RHS, ACC_WY_KEY,
            ACC_WY_KEY_BLOCK, ACC_WY_VALUE, ACC_WY_VALUE_BLOCK, FACTORED_WY, W_Q, W_BLOCK, W_AMAX_PASS, False)


KERNELS = {"intra_gdn": chunk_fwd_kernel_intra_gdn}


def chunk_fwd_intra_gdn(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, g, beta, g_cum, w, u, A_qk, t_out,
                        scale):
    """G, the pairs and the solve, then W and U, of every GDN chunk; T = (I + A)^-1 into ``t_out`` where it is
    given."""
    launch(plan.fwd_intra, dict(q=q, k=k, v=v, g=g, beta=beta, g_cum=g_cum, w=w, u=u, A_qk=A_qk, t_out=t_out,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
                                T=layout.T),
           STORE_T=t_out is not None)
