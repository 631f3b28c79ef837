"""The backward intra stage of GDN with exact pair products and the exact solve: every input gradient of one
chunk, key block by key block. The first value loop also takes dT's share from W, so dT, hence dA and the pair
products' gradients dP ⊙ Γ, dP_qk ⊙ Γ, are complete before the key loop, whose blocks then store their final dq,
dk. No operand it rounds spans all key rows (forms.bwd_intra_by_key_blocks): state_read, output_state and wy_key.rhs
are exact here, and so are key_interaction and output_score. The device functions: chunk/bwd_intra.py.
"""
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from la_compiler.kernels.chunk.bwd_intra import (exact_solve_grad, gdn_pairs_decay, key_block_value_sums, load_solved_t,
                                                 output_state_grads, refined_t, state_update_grads, value_block_grads,
                                                 value_operand_amaxes, wy_key_grads, wy_t_operands)
from la_compiler.kernels.chunk.device import chunk_program, gemm
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_intra_key_blocks(
    q,
    k,
    v,
    beta,
    g,
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
    Q_OUTPUT_VALUE_RHS: tl.constexpr,
    Q_STATE_UPDATE_RHS: tl.constexpr,
    Q_WY_KEY_LHS: tl.constexpr,
    Q_WY_VALUE_LHS: tl.constexpr,
    Q_WY_VALUE_RHS: tl.constexpr,
    REFINE_T: tl.constexpr,
):
    """Every input gradient of one GDN chunk (dq, dk, dv, dbeta, dg); T from the forward recompute (t_solved),
    P, P_qk recomputed over key blocks of BK columns once dA is known."""
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
    b_G = tl.cumsum(tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32), 0)
    b_eG = tl.exp(b_G)[:, None]
    b_T = load_solved_t(t_solved, r_hv, o_c, m_c, C)
    b_Tw, b_Tu = wy_t_operands(b_T, C, Q_WY_KEY_LHS, Q_WY_VALUE_LHS)

    # first value-block loop: what reduces over V alone, and dT's share from W, so that dA is known before the key
    # loop
    b_gam_wv, b_gam_vn = value_operand_amaxes(v, v_new, b_beta, r_hv, m_c, V, BV, Q_WY_VALUE_RHS,
                                              Q_OUTPUT_VALUE_RHS, Q_STATE_UPDATE_RHS)
    b_dAqk = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    p_hn = h + (i_chunk * HV + i_hv) * K * V
    p_dhn = dh + (i_chunk * HV + i_hv) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        b_dAqk, b_dT, b_dbeta, o_v, b_dvn = value_block_grads(
            b_dAqk, b_dT, b_dbeta, i_v, v, v_new, dv_new, do, dv, b_Tu, b_beta, b_gam_wv, b_gam_vn, r_hv, m_c, C, V,
            BV, GEMM_PRECISION, Q_OUTPUT_VALUE_RHS, Q_WY_VALUE_RHS)
        # W = T (beta exp(G) K): dW bk^T = -dV_new (bk h_n)^T
        b_X = tl.zeros([C, BV], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_ck = m_c[:, None] & (o_k < K)[None, :]
            m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
            b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck,
                          other=0).to(tl.float32)
            b_bk = b_k * (b_beta[:, None] * b_eG)
            b_hn = tl.load(p_hn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
            b_X += gemm(b_bk, b_hn, GEMM_PRECISION)
        b_dT -= gemm(b_dvn, tl.trans(b_X), GEMM_PRECISION)

    # dT is complete: P, P_qk recomputed over key blocks (for dA, dbeta and dG), dA, and the pair products'
    # gradients dP ⊙ Γ, dP_qk ⊙ Γ, which each key block multiplies by its K, Q columns
    b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)
    # P = (K K^T) ⊙ Γ and P_qk = (Q K^T) ⊙ Γ: GEMM_PRECISION, as the forward's exact pair products
    b_P = tl.zeros([C, C], dtype=tl.float32)
    b_Pqk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_ck = m_c[:, None] & (o_k < K)[None, :]
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_P += gemm(b_k, tl.trans(b_k), GEMM_PRECISION)
        b_Pqk += gemm(b_q, tl.trans(b_k), GEMM_PRECISION)
    b_P, b_Pqk, b_Gam = gdn_pairs_decay(b_P, b_Pqk, b_G, m_causal)
    # T = solve(A): dA, from T refined against A where it was kept rounded
    b_T = refined_t(b_T, tl.where(m_strict, b_P * b_beta[:, None], 0.0), REFINE_T)
    b_dA = tl.where(m_strict, exact_solve_grad(b_T, b_dT, DOT_PRECISION), 0.0)
    b_dbeta += tl.sum(b_dA * b_P, 1)
    b_dP = b_dA * b_beta[:, None]
    b_M = b_dP * b_P + b_dPqk * b_Pqk
    b_dGs = tl.sum(b_M, 1) - tl.sum(b_M, 0)  # dG, summed with each key block's share below
    b_dKK = b_dP * b_Gam
    b_dQK = b_dPqk * b_Gam

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ck = m_c[:, None] & m_k[None, :]
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        r_qk_v = r_hv[:, None] * K + o_k[None, :]  # dq, dk are per value head: [B, T, HV, K]
        b_dW, b_dQg, b_dKd, b_dlast = key_block_value_sums(
            p_hn, p_dhn, v_new, dv_new, do, 0.0, b_gam_vn, r_hv, m_c, o_k, m_k, C, V, BK, BV, GEMM_PRECISION, "",
            "", Q_STATE_UPDATE_RHS)
        b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
        b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
        # G again rather than held from the start: fewer live registers through the loops (sm_90 builds)
        b_G = tl.cumsum(tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32), 0)
        # each [C x BK] accumulator of the value loop is used up as early as possible (fewer live registers)
        b_eG, b_dq, b_dG = output_state_grads(b_q, b_G, b_dQg, scale, False)
        b_dk, b_dG, b_dbeta = wy_key_grads(b_dG, b_dbeta, b_k, b_beta, b_eG, b_Tw, b_dW, GEMM_PRECISION, False)
        b_dk, b_dG = state_update_grads(b_dk, b_dG, b_k, b_G, b_dKd, b_dlast, o_c, m_c, i_row_last, False)
        # the pair products' gradients: this key block's dq, dk are complete.
        # GEMM_PRECISION, not DOT_PRECISION: with 16-bit GEMMs dP ⊙ Γ is multiplied in the input dtype, as
        # FLA's chunk_bwd_dqkwg does (its ds in bf16) (docs/kernels-chunk.md, "Key blocks")
        b_dk += gemm(b_dKK, b_k, GEMM_PRECISION) + gemm(tl.trans(b_dKK), b_k, GEMM_PRECISION) \
            + gemm(tl.trans(b_dQK), b_q, GEMM_PRECISION)
        b_dq += gemm(b_dQK, b_k, GEMM_PRECISION)
        tl.store(dq + r_qk_v, b_dq.to(dq.dtype.element_ty), mask=m_ck)
        tl.store(dk + r_qk_v, b_dk.to(dk.dtype.element_ty), mask=m_ck)
        b_dGs += b_dG

    # g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk
    b_dg = tl.cumsum(b_dGs, 0, reverse=True)
    tl.store(dg + r_hv, b_dg.to(dg.dtype.element_ty), mask=m_c)
    tl.store(dbeta + r_hv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_c)


KERNELS = {"intra_key_blocks": chunk_bwd_kernel_intra_key_blocks}


def chunk_bwd_intra_key_blocks(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, beta, g, t_solved, h, dh, v_new,
                               dv_new, do, dq, dk, dv, dbeta, dg, scale):
    """Every input gradient of every chunk (GDN, exact pair products and solve)."""
    launch(plan.bwd_intra, dict(q=q, k=k, v=v, beta=beta, g=g, t_solved=t_solved, h=h, dh=dh, v_new=v_new,
                                dv_new=dv_new, do=do, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
                                T=layout.T),
           REFINE_T=t_solved.dtype != torch.float32)  # T kept in 16 bits (chunk/residual.py): refined
