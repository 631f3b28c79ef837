"""The backward intra stage over whole key rows (BK >= K, one key block): every input gradient of one chunk, the
pair products and their gradients included (row_pairs.py). The form of every spec that neither KDA's split pair
gradients nor GDN's key blocks take (forms.bwd_intra_form): GDN with a rounded pair product, the Neumann solve or
an operand rounded over all key rows; KDA with the Neumann solve. The pair products come before the value loop
where the Neumann solve needs A, else after it. The device functions: chunk/bwd_intra.py.
"""
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from la_compiler.kernels.chunk.bwd_intra import (exact_solve_grad, key_block_value_sums, load_solved_t, neumann_solve,
                                                 neumann_solve_grad, output_state_grads, state_amax, state_update_grads,
                                                 value_block_grads, value_operand_amaxes, wy_key_grads, wy_key_operand,
                                                 wy_t_operands)
from la_compiler.kernels.chunk.device import chunk_program, gemm
from la_compiler.kernels.chunk.launch import launch
from la_compiler.kernels.chunk.row_pairs import kda_pair_grads, kda_pair_grads_rounded, whole_row_pairs

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_intra_rows(
    q,
    k,
    v,
    beta,
    g,
    g_cum,
    t_solved,
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
    KDA: tl.constexpr,
    SOLVE: tl.constexpr,
    DEGREE: tl.constexpr,
    PAIRS_ROUNDED: tl.constexpr,
    SUB_CHUNK: tl.constexpr,
    Q_KEY_INTERACTION_LHS: tl.constexpr,
    Q_KEY_INTERACTION_RHS: tl.constexpr,
    Q_OUTPUT_SCORE_LHS: tl.constexpr,
    Q_OUTPUT_SCORE_RHS: tl.constexpr,
    Q_OUTPUT_STATE_RHS: tl.constexpr,
    Q_OUTPUT_VALUE_RHS: tl.constexpr,
    Q_STATE_READ_RHS: tl.constexpr,
    Q_STATE_UPDATE_RHS: tl.constexpr,
    Q_WY_KEY_LHS: tl.constexpr,
    Q_WY_KEY_RHS: tl.constexpr,
    Q_WY_VALUE_LHS: tl.constexpr,
    Q_WY_VALUE_RHS: tl.constexpr,
    ACC_KEY_INTERACTION: tl.constexpr,
    ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
    ACC_OUTPUT_SCORE: tl.constexpr,
    ACC_OUTPUT_SCORE_BLOCK: tl.constexpr,
):
    """Every input gradient of one chunk (dq, dk, dv, dbeta, dg) over whole key rows; T from the forward recompute
    (t_solved; exact solve) or its Neumann polynomial recomputed; P, P_qk recomputed (KDA's exact ones read G's
    columns from g_cum)."""
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
    r_qk_v = r_hv[:, None] * K + o_k[None, :]  # dq, dk are per value head: [B, T, HV, K]
    m_strict = o_c[:, None] > o_c[None, :]
    m_causal = o_c[:, None] >= o_c[None, :]
    i_row_last = tl.minimum(C, seq_len - i_t * C) - 1  # the chunk's last valid row: G_C = G[i_row_last]

    b_beta = tl.load(beta + r_hv, mask=m_c, other=0).to(tl.float32)
    if SOLVE == "neumann":  # q, k, G, P before the value loop: the Neumann polynomial needs A
        b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2 = whole_row_pairs(
            q, k, g, g_cum, r_qk, r_hv, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_c, m_k, m_ck, m_causal, H, HV, K,
            C, BK, DOT_PRECISION, GEMM_PRECISION, KDA, PAIRS_ROUNDED, SUB_CHUNK, Q_KEY_INTERACTION_LHS,
            Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS, Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION,
            ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
        b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)
        b_T = neumann_solve(b_A, C, DEGREE, DOT_PRECISION)  # cheap dots: recomputed
    else:
        b_T = load_solved_t(t_solved, r_hv, o_c, m_c, C)
    b_Tw, b_Tu = wy_t_operands(b_T, C, Q_WY_KEY_LHS, Q_WY_VALUE_LHS)

    # first value-block loop: what reduces over V alone
    p_hn = h + (i_chunk * HV + i_hv) * K * V
    p_dhn = dh + (i_chunk * HV + i_hv) * K * V
    b_gam_wv, b_gam_vn = value_operand_amaxes(v, v_new, b_beta, r_hv, m_c, V, BV, Q_WY_VALUE_RHS,
                                              Q_OUTPUT_VALUE_RHS, Q_STATE_UPDATE_RHS)
    b_gam_h = state_amax(p_hn, o_k, m_k, V, BV, Q_OUTPUT_STATE_RHS, Q_STATE_READ_RHS)
    b_dAqk = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        b_dAqk, b_dT, b_dbeta, o_v, b_dvn = value_block_grads(
            b_dAqk, b_dT, b_dbeta, i_v, v, v_new, dv_new, do, dv, b_Tu, b_beta, b_gam_wv, b_gam_vn, r_hv, m_c, C, V,
            BV, GEMM_PRECISION, Q_OUTPUT_VALUE_RHS, Q_WY_VALUE_RHS)

    if SOLVE != "neumann":  # q, k, G, P after the value loop (T comes from the forward recompute)
        b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2 = whole_row_pairs(
            q, k, g, g_cum, r_qk, r_hv, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_c, m_k, m_ck, m_causal, H, HV, K,
            C, BK, DOT_PRECISION, GEMM_PRECISION, KDA, PAIRS_ROUNDED, SUB_CHUNK, Q_KEY_INTERACTION_LHS,
            Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS, Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION,
            ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
    # second value-block loop, over the one key block
    b_dW, b_dQg, b_dKd, b_dlast = key_block_value_sums(
        p_hn, p_dhn, v_new, dv_new, do, b_gam_h, b_gam_vn, r_hv, m_c, o_k, m_k, C, V, BK, BV, GEMM_PRECISION,
        Q_STATE_READ_RHS, Q_OUTPUT_STATE_RHS, Q_STATE_UPDATE_RHS)
    # each [C x BK] accumulator of the value loop is used up as early as possible (fewer live registers)
    b_eG, b_dq, b_dG = output_state_grads(b_q, b_G, b_dQg, scale, KDA)
    b_dT += gemm(b_dW, tl.trans(wy_key_operand(b_k, b_beta, b_eG, C, BK, Q_WY_KEY_RHS)), GEMM_PRECISION)
    b_dk, b_dG, b_dbeta = wy_key_grads(b_dG, b_dbeta, b_k, b_beta, b_eG, b_Tw, b_dW, GEMM_PRECISION, KDA)
    b_dk, b_dG = state_update_grads(b_dk, b_dG, b_k, b_G, b_dKd, b_dlast, o_c, m_c, i_row_last, KDA)

    # T = solve(A): dA, and the masked gradients of the two pair products' users
    if SOLVE == "neumann":
        b_dA = neumann_solve_grad(b_A, b_dT, C, DEGREE, DOT_PRECISION)
    else:
        b_dA = exact_solve_grad(b_T, b_dT, DOT_PRECISION)
    b_dA = tl.where(m_strict, b_dA, 0.0)
    b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)
    b_dbeta += tl.sum(b_dA * b_P, 1)
    b_dP = b_dA * b_beta[:, None]
    if KDA and PAIRS_ROUNDED:
        b_dq, b_dk, b_dG = kda_pair_grads_rounded(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_k, b_G, b_kl, b_ql, o_c, C, BK,
                                                  Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_RHS)
    elif KDA:
        b_dq, b_dk, b_dG = kda_pair_grads(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_q, b_k, b_G, k, g_cum, bos, i_t, seq_len,
                                          i_h, i_hv, o_c, o_k, m_k, H, HV, K, C, BK, SUB_CHUNK, DOT_PRECISION)
    else:
        # P = (K_l K_r^T) ⊙ Γ, P_qk = (Q_l K_r2^T) ⊙ Γ, Γ_ij = exp(G_i - G_j); rounded operands, identity STE
        b_dKK = b_dP * b_Gam
        b_dQK = b_dPqk * b_Gam
        b_dk += tl.dot(b_dKK, b_kr, input_precision=DOT_PRECISION) \
            + tl.dot(tl.trans(b_dKK), b_kl, input_precision=DOT_PRECISION) \
            + tl.dot(tl.trans(b_dQK), b_ql, input_precision=DOT_PRECISION)
        b_dq += tl.dot(b_dQK, b_kr2, input_precision=DOT_PRECISION)
        b_M = b_dP * b_P + b_dPqk * b_Pqk
        b_dG += tl.sum(b_M, 1) - tl.sum(b_M, 0)

    # g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk
    b_dg = tl.cumsum(b_dG, 0, reverse=True)
    if KDA:
        tl.store(dg + r_hv[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty), mask=m_ck)
    else:
        tl.store(dg + r_hv, b_dg.to(dg.dtype.element_ty), mask=m_c)
    tl.store(dq + r_qk_v, b_dq.to(dq.dtype.element_ty), mask=m_ck)
    tl.store(dk + r_qk_v, b_dk.to(dk.dtype.element_ty), mask=m_ck)
    tl.store(dbeta + r_hv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_c)


KERNELS = {"intra_rows": chunk_bwd_kernel_intra_rows}


def chunk_bwd_intra_rows(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, beta, g, g_cum, t_solved, h, dh, v_new,
                         dv_new, do, dq, dk, dv, dbeta, dg, scale):
    """Every input gradient of every chunk, over whole key rows. ``t_solved`` is unread under the Neumann solve."""
    if plan.params.solve == "exact" and t_solved.dtype != torch.float32:
        # this form runs with the exact solve only where a key-side GEMM operand rounds, hence fp32 GEMMs and an fp32
        # T; it does not refine a 16-bit one (chunk_bwd_intra_key_blocks, chunk_bwd_intra_split_pairs do)
        raise ValueError(f"chunk_bwd_intra_rows: T must be fp32 under the exact solve, got {t_solved.dtype}")
    launch(plan.bwd_intra, dict(q=q, k=k, v=v, beta=beta, g=g, g_cum=g_cum, t_solved=t_solved, h=h, dh=dh,
                                v_new=v_new, dv_new=dv_new, do=do, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
                                T=layout.T))
