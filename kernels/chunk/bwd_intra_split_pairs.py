"""The backward intra stage of KDA with the exact solve: every input gradient of one chunk but the pair products'
share, key block by key block; dP, dP_qk and the fp32 shares of dq, dk, dG go to chunk_bwd_kernel_pairs, which
adds the pair products' share by sub-chunk (no program holds the chunk's full-width tiles through the pair loops).
The device functions: chunk/bwd_intra.py.
"""
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from la_compiler.kernels.chunk.bwd_intra import (exact_solve_grad, key_block_value_sums, load_g_cumsum, load_solved_t,
                                                 output_state_grads, refined_t, state_amax, state_update_grads,
                                                 value_block_grads, value_operand_amaxes, wy_key_grads, wy_key_operand,
                                                 wy_t_operands)
from la_compiler.kernels.chunk.device import chunk_program, gemm
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_intra_split_pairs(
    q,
    k,
    v,
    beta,
    g,
    t_solved,
    p_pairs,
    h,
    dh,
    v_new,
    dv_new,
    do,
    dq,
    dk,
    dv,
    dbeta,
    dg,
    dpair,
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
    Q_OUTPUT_STATE_RHS: tl.constexpr,
    Q_OUTPUT_VALUE_RHS: tl.constexpr,
    Q_STATE_READ_RHS: tl.constexpr,
    Q_STATE_UPDATE_RHS: tl.constexpr,
    Q_WY_KEY_LHS: tl.constexpr,
    Q_WY_KEY_RHS: tl.constexpr,
    Q_WY_VALUE_LHS: tl.constexpr,
    Q_WY_VALUE_RHS: tl.constexpr,
    REFINE_T: tl.constexpr,
):
    """One KDA chunk's dv, dbeta and its shares of dq, dk, dG (fp32, into dq, dk, dg), with dP = dA ⊙ beta and
    dP_qk into dpair ([C | C] per row); T from the forward recompute (t_solved), P from chunk_fwd_kernel_pairs
    (p_pairs). Key blocks of BK columns (BK >= K where an operand rounded over all key rows needs them)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    t_c = i_t * C + o_c
    m_c = t_c < seq_len
    r_hv = (bos + t_c) * HV + i_hv  # token rows of this chunk in the [B, T, HV, ..] tensors
    m_strict = o_c[:, None] > o_c[None, :]
    m_causal = o_c[:, None] >= o_c[None, :]
    i_row_last = tl.minimum(C, seq_len - i_t * C) - 1  # the chunk's last valid row: G_C = G[i_row_last]

    b_beta = tl.load(beta + r_hv, mask=m_c, other=0).to(tl.float32)
    b_T = load_solved_t(t_solved, r_hv, o_c, m_c, C)
    b_Tw, b_Tu = wy_t_operands(b_T, C, Q_WY_KEY_LHS, Q_WY_VALUE_LHS)

    # first value-block loop: what reduces over V alone
    p_hn = h + (i_chunk * HV + i_hv) * K * V
    p_dhn = dh + (i_chunk * HV + i_hv) * K * V
    b_gam_wv, b_gam_vn = value_operand_amaxes(v, v_new, b_beta, r_hv, m_c, V, BV, Q_WY_VALUE_RHS,
                                              Q_OUTPUT_VALUE_RHS, Q_STATE_UPDATE_RHS)
    b_gam_h = state_amax(p_hn, tl.arange(0, BK), tl.arange(0, BK) < K, V, BV, Q_OUTPUT_STATE_RHS, Q_STATE_READ_RHS)
    b_dAqk = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        b_dAqk, b_dT, b_dbeta, o_v, b_dvn = value_block_grads(
            b_dAqk, b_dT, b_dbeta, i_v, v, v_new, dv_new, do, dv, b_Tu, b_beta, b_gam_wv, b_gam_vn, r_hv, m_c, C, V,
            BV, GEMM_PRECISION, Q_OUTPUT_VALUE_RHS, Q_WY_VALUE_RHS)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ck = m_c[:, None] & m_k[None, :]
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        r_qk_v = r_hv[:, None] * K + o_k[None, :]  # dq, dk are per value head: [B, T, HV, K]
        b_dW, b_dQg, b_dKd, b_dlast = key_block_value_sums(
            p_hn, p_dhn, v_new, dv_new, do, b_gam_h, b_gam_vn, r_hv, m_c, o_k, m_k, C, V, BK, BV, GEMM_PRECISION,
            Q_STATE_READ_RHS, Q_OUTPUT_STATE_RHS, Q_STATE_UPDATE_RHS)
        b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_G = load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K, True)
        # each [C x BK] accumulator of the value loop is used up as early as possible (fewer live registers)
        b_eG, b_dq, b_dG = output_state_grads(b_q, b_G, b_dQg, scale, True)
        b_dT += gemm(b_dW, tl.trans(wy_key_operand(b_k, b_beta, b_eG, C, BK, Q_WY_KEY_RHS)), GEMM_PRECISION)
        b_dk, b_dG, b_dbeta = wy_key_grads(b_dG, b_dbeta, b_k, b_beta, b_eG, b_Tw, b_dW, GEMM_PRECISION, True)
        b_dk, b_dG = state_update_grads(b_dk, b_dG, b_k, b_G, b_dKd, b_dlast, o_c, m_c, i_row_last, True)
        tl.store(dq + r_qk_v, b_dq, mask=m_ck)
        tl.store(dk + r_qk_v, b_dk, mask=m_ck)
        tl.store(dg + r_qk_v, b_dG, mask=m_ck)

    # T = solve(A): dA; the pair products' gradients run by sub-chunk (chunk_bwd_kernel_pairs): hand over dP, dP_qk
    b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)
    # P from the forward recompute (chunk_fwd_kernel_pairs; unwritten above the diagonal)
    b_P = tl.load(p_pairs + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_strict, other=0).to(tl.float32)
    b_T = refined_t(b_T, b_P * b_beta[:, None], REFINE_T)  # where T was kept rounded
    b_dA = tl.where(m_strict, exact_solve_grad(b_T, b_dT, DOT_PRECISION), 0.0)
    b_dbeta += tl.sum(b_dA * b_P, 1)
    tl.store(dpair + r_hv[:, None] * (2 * C) + o_c[None, :], b_dA * b_beta[:, None], mask=m_c[:, None])
    tl.store(dpair + r_hv[:, None] * (2 * C) + C + o_c[None, :], b_dPqk, mask=m_c[:, None])
    tl.store(dbeta + r_hv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_c)


KERNELS = {"intra_split_pairs": chunk_bwd_kernel_intra_split_pairs}


def chunk_bwd_intra_split_pairs(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, beta, g, t_solved, p_pairs, h,
                                dh, v_new, dv_new, do, dq, dk, dv, dbeta, dg, dpair, scale):
    """dv, dbeta and all but the pair products' share of dq, dk, dG (fp32) of every chunk; dP, dP_qk into dpair
    (for chunk_bwd_pairs)."""
    launch(plan.bwd_intra, dict(q=q, k=k, v=v, beta=beta, g=g, t_solved=t_solved, p_pairs=p_pairs, h=h, dh=dh,
                                v_new=v_new, dv_new=dv_new, do=do, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg, dpair=dpair,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
                                T=layout.T),
           REFINE_T=t_solved.dtype != torch.float32)  # T kept in 16 bits (chunk/residual.py): refined
