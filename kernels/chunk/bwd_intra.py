"""The backward intra stage: every input gradient of one chunk (dq, dk, dv, dbeta, dg), one program per chunk x
value head, from the stored chunk-start state h_n (rounded), the state gradient dh = dS_n+1 and dV_new, with A and
T recomputed (docs/kernels-chunk.md, "What the backward recomputes and what it keeps"). It takes one of three
forms, fixed by the spec: KDA with the exact solve (SPLIT_PAIR_GRADS) runs its key-side gradients key block by
key block and hands dP, dP_qk and its fp32 shares of dq, dk, dG to chunk_bwd_kernel_pairs; GDN with exact
pair products and the exact solve (GDN_KEY_BLOCKS) completes dT, hence dA and the pair products' gradients,
before its key loop, whose blocks then store their final dq, dk; every other spec holds whole key rows (BK >= K,
one key block) and takes the pair products and their gradients here, before the value loop where the Neumann
solve needs A, else after it.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import (acc_gemm, acc_row_sum, chunk_program, gemm, qdq_operand, row_sum,
                                              tile_amax)
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


# ---- decays of the two kinds --------------------------------------------------------------------------------
@triton.jit
def load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K: tl.constexpr, KDA: tl.constexpr):
    """G = cumsum(g) over the chunk: [C] (GDN, one decay per row) or the key block's [C x BK] (KDA)."""
    if KDA:
        return tl.cumsum(tl.load(g + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32), 0)
    else:
        return tl.cumsum(tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32), 0)


@triton.jit
def exp_g(b_G, KDA: tl.constexpr):
    """exp(G) as a factor of a [C x BK] tile."""
    if KDA:
        return tl.exp(b_G)
    else:
        return tl.exp(b_G)[:, None]


@triton.jit
def key_rows(x, KDA: tl.constexpr):
    """dG's share of a [C x BK] tile: per key channel (KDA), or summed over the row (GDN's one decay per row)."""
    if KDA:
        return x
    else:
        return row_sum(x)


# ---- the solve ----------------------------------------------------------------------------------------------
@triton.jit
def neumann_solve(b_A, C: tl.constexpr, DEGREE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Neumann polynomial of degree DEGREE: T = sum_{i<=DEGREE} (-A)^i (Horner)
    o_c = tl.arange(0, C)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_T = b_I
    for _ in tl.static_range(DEGREE):
        b_T = b_I - tl.dot(b_A, b_T, input_precision=DOT_PRECISION)
    return b_T


@triton.jit
def exact_solve_grad(b_T, b_dT, DOT_PRECISION: tl.constexpr):
    # T = (I + A)^-1: dA = -T^T dT T^T
    return -tl.dot(tl.trans(b_T), tl.dot(b_dT, tl.trans(b_T), input_precision=DOT_PRECISION),
                   input_precision=DOT_PRECISION)


@triton.jit
def neumann_solve_grad(b_A, b_dT, C: tl.constexpr, DEGREE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Horner T_m+1 = I - A T_m (m < DEGREE) differentiated step by step; T_m recomputed
    o_c = tl.arange(0, C)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    b_dTm = b_dT
    for i_r in range(0, DEGREE):
        b_Tm = b_I
        for _ in range(0, DEGREE - 1 - i_r):
            b_Tm = b_I - tl.dot(b_A, b_Tm, input_precision=DOT_PRECISION)
        b_dA -= tl.dot(b_dTm, tl.trans(b_Tm), input_precision=DOT_PRECISION)
        b_dTm = -tl.dot(tl.trans(b_A), b_dTm, input_precision=DOT_PRECISION)
    return b_dA


# ---- GDN's pair products --------------------------------------------------------------------------------------
@triton.jit
def gdn_pair_block(b_q, b_k, GEMM_PRECISION: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   Q_KEY_INTERACTION_LHS: tl.constexpr, Q_KEY_INTERACTION_RHS: tl.constexpr,
                   Q_OUTPUT_SCORE_LHS: tl.constexpr, Q_OUTPUT_SCORE_RHS: tl.constexpr,
                   ACC_KEY_INTERACTION: tl.constexpr, ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
                   ACC_OUTPUT_SCORE: tl.constexpr, ACC_OUTPUT_SCORE_BLOCK: tl.constexpr):
    """One key block's share of K_l K_r^T and Q_l K_r2^T (Γ comes after the sum over the blocks), and the rounded
    operands K_l, K_r, Q_l, K_r2. GEMM_PRECISION: GDN's pair operands are the raw inputs, so with 16-bit GEMMs
    they are 16-bit numbers, which TF32 holds exactly: bf16 operands form the same products at twice the
    tensor-core rate. Where GEMM_PRECISION is not 16-bit (rounded operands, fp32 inputs) it is DOT_PRECISION."""
    # sites sharing an operand (K for key_interaction and output_score) round it once
    b_kl = qdq_operand(b_k, 0.0, Q_KEY_INTERACTION_LHS, 1, C, BK, False)
    if Q_KEY_INTERACTION_RHS == Q_KEY_INTERACTION_LHS:
        b_kr = b_kl
    else:
        b_kr = qdq_operand(b_k, 0.0, Q_KEY_INTERACTION_RHS, 1, C, BK, False)
    b_ql = qdq_operand(b_q, 0.0, Q_OUTPUT_SCORE_LHS, 1, C, BK, False)
    if Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_LHS:
        b_kr2 = b_kl
    elif Q_OUTPUT_SCORE_RHS == Q_KEY_INTERACTION_RHS:
        b_kr2 = b_kr
    else:
        b_kr2 = qdq_operand(b_k, 0.0, Q_OUTPUT_SCORE_RHS, 1, C, BK, False)
    b_Pb = acc_gemm(b_kl, tl.trans(b_kr), GEMM_PRECISION, BK, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK)
    b_Pqkb = acc_gemm(b_ql, tl.trans(b_kr2), GEMM_PRECISION, BK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
    return b_Pb, b_Pqkb, b_kl, b_kr, b_ql, b_kr2


@triton.jit
def gdn_pairs_decay(b_P, b_Pqk, b_G, m_causal):
    """Γ_ij = exp(G_i - G_j) on the summed products: (P ⊙ Γ, P_qk ⊙ Γ, Γ)."""
    b_Gam = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))
    b_P = b_P * b_Gam
    b_Pqk = b_Pqk * b_Gam
    return b_P, b_Pqk, b_Gam


# ---- KDA's pair products over whole key rows (the Neumann solve) ------------------------------------------
@triton.jit
def kda_pairs(b_q, b_k, b_G, k, g_cum, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_k, H: tl.constexpr,
              HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """P = K K^T ⊙ Γ and P_qk = Q K^T ⊙ Γ of one KDA chunk over the key columns in b_q, b_k, b_G (masks applied
    later). Off-diagonal sub-chunk blocks (rows in block b, columns before its first row r): dots of
    K exp(G - G_r) and K exp(G_r - G), both factors <= 1 (G falls along the chunk). Diagonal blocks: column jj
    of every block at once, exp(G_i - G_j) from the prefix difference masked to j <= i before the exp; the
    column's rows are gathered from k and g_cum in memory."""
    # sub-chunks of BC rows: off-diagonal blocks by dots through a reference row, diagonal blocks columnwise
    b_P = tl.zeros([C, C], dtype=tl.float32)
    b_Pqk = tl.zeros([C, C], dtype=tl.float32)
    o_blk = o_c // BC
    for i_sb in range(1, C // BC):
        i_ref = i_sb * BC
        b_gr = tl.sum(tl.where((o_c == i_ref)[:, None], b_G, 0.0), 0)
        m_in = o_blk == i_sb
        m_before = o_c < i_ref
        b_el = tl.exp(tl.where(m_in[:, None], b_G - b_gr[None, :], 0.0))
        b_er = tl.exp(tl.where(m_before[:, None], b_gr[None, :] - b_G, 0.0))
        b_kr = tl.where(m_before[:, None], b_k * b_er, 0.0)
        b_P += tl.dot(tl.where(m_in[:, None], b_k * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)
        b_Pqk += tl.dot(tl.where(m_in[:, None], b_q * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)
    for jj in range(0, BC):
        o_j = o_blk * BC + jj
        t_j = i_t * C + o_j
        m_jk = (t_j < seq_len)[:, None] & m_k[None, :]
        b_kj = tl.load(k + ((bos + t_j) * H + i_h)[:, None] * K + o_k[None, :],
                       mask=m_jk, other=0).to(tl.float32)
        b_gj = tl.load(g_cum + ((bos + t_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
        b_kj = b_kj * tl.exp(tl.where((o_c >= o_j)[:, None], b_G - b_gj, 0.0))
        m_sel = o_c[None, :] == o_j[:, None]
        b_P += tl.where(m_sel, tl.sum(b_k * b_kj, 1)[:, None], 0.0)
        b_Pqk += tl.where(m_sel, tl.sum(b_q * b_kj, 1)[:, None], 0.0)
    return b_P, b_Pqk


@triton.jit
def kda_pair_grads(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_q, b_k, b_G, k, g_cum, bos, i_t, seq_len, i_h, i_hv, o_c,
                   o_k, m_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Gradients of ``kda_pairs`` (the same blocking) added to the dq, dk, dG [C x BK] tiles."""
    # off-diagonal blocks: P_b = (K e^(G - G_r)) (K e^(G_r - G))^T
    o_blk = o_c // BC
    for i_sb in range(1, C // BC):
        i_ref = i_sb * BC
        b_gr = tl.sum(tl.where((o_c == i_ref)[:, None], b_G, 0.0), 0)
        m_in = o_blk == i_sb
        m_before = o_c < i_ref
        b_el = tl.exp(tl.where(m_in[:, None], b_G - b_gr[None, :], 0.0))
        b_er = tl.exp(tl.where(m_before[:, None], b_gr[None, :] - b_G, 0.0))
        m_blk = m_in[:, None] & m_before[None, :]
        b_kl = tl.where(m_in[:, None], b_k * b_el, 0.0)
        b_ql = tl.where(m_in[:, None], b_q * b_el, 0.0)
        b_kr = tl.where(m_before[:, None], b_k * b_er, 0.0)
        b_dPb = tl.where(m_blk, b_dP, 0.0)
        b_dQb = tl.where(m_blk, b_dPqk, 0.0)
        b_dkl = tl.dot(b_dPb, b_kr, input_precision=DOT_PRECISION)
        b_dql = tl.dot(b_dQb, b_kr, input_precision=DOT_PRECISION)
        b_dkr = tl.dot(tl.trans(b_dPb), b_kl, input_precision=DOT_PRECISION) \
            + tl.dot(tl.trans(b_dQb), b_ql, input_precision=DOT_PRECISION)
        b_dk += b_el * b_dkl + b_er * b_dkr
        b_dq += b_el * b_dql
        b_tl = b_kl * b_dkl + b_ql * b_dql
        b_tr = b_kr * b_dkr
        b_dG += b_tl - b_tr
        b_dG += tl.where((o_c == i_ref)[:, None], (tl.sum(b_tr, 0) - tl.sum(b_tl, 0))[None, :], 0.0)
    # diagonal blocks, column jj of every block at once; row j of each block collects its column's sums
    for jj in range(0, BC):
        o_j = o_blk * BC + jj
        t_j = i_t * C + o_j
        m_jk = (t_j < seq_len)[:, None] & m_k[None, :]
        b_kj = tl.load(k + ((bos + t_j) * H + i_h)[:, None] * K + o_k[None, :],
                       mask=m_jk, other=0).to(tl.float32)
        b_gj = tl.load(g_cum + ((bos + t_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
        b_e = tl.exp(tl.where((o_c >= o_j)[:, None], b_G - b_gj, 0.0))
        m_sel = o_c[None, :] == o_j[:, None]
        b_dPj = tl.sum(tl.where(m_sel, b_dP, 0.0), 1)
        b_dQj = tl.sum(tl.where(m_sel, b_dPqk, 0.0), 1)
        b_kje = b_kj * b_e
        b_dk += b_dPj[:, None] * b_kje
        b_dq += b_dQj[:, None] * b_kje
        b_x = (b_dPj[:, None] * b_k + b_dQj[:, None] * b_q) * b_e
        b_tj = b_x * b_kj
        b_dG += b_tj
        m_isj = ((o_c % BC) == jj)[:, None]
        b_xs = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(b_x, (C // BC, BC, BK)), 1)[:, None, :],
                                          (C // BC, BC, BK)), (C, BK))
        b_ts = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(b_tj, (C // BC, BC, BK)), 1)[:, None, :],
                                          (C // BC, BC, BK)), (C, BK))
        b_dk += tl.where(m_isj, b_xs, 0.0)
        b_dG -= tl.where(m_isj, b_ts, 0.0)
    return b_dq, b_dk, b_dG


@triton.jit
def pair_rows(j, b_k, b_G, o_c):
    """Column j of the rounded KDA pair products: m_j (row j), exp(G_i - G_j) (i >= j) and the pairwise operands
    k_j exp(G_i - G_j) of P (rows i > j) and of P_qk (rows i >= j), [C x BK] each."""
    m_j = o_c == j
    b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)
    b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)
    b_e = tl.exp(tl.where((o_c >= j)[:, None], b_G - b_gj[None, :], 0.0))
    b_pk = tl.where((o_c > j)[:, None], b_kj[None, :] * b_e, 0.0)
    b_pq = tl.where((o_c >= j)[:, None], b_kj[None, :] * b_e, 0.0)
    return m_j, b_e, b_pk, b_pq


@triton.jit
def pair_amax(b_k, b_G, o_c, C: tl.constexpr):
    """NVFP4 on the pairwise operands: the global amaxes over the chunk's whole [C x C x K] pair tiles."""
    b_gam_pk = tl.max(tl.zeros([C], dtype=tl.float32), axis=0)
    b_gam_pq = tl.max(tl.zeros([C], dtype=tl.float32), axis=0)
    for j in range(0, C):
        m_j, b_e, b_pk, b_pq = pair_rows(j, b_k, b_G, o_c)
        b_gam_pk = tl.maximum(b_gam_pk, tile_amax(b_pk))
        b_gam_pq = tl.maximum(b_gam_pq, tile_amax(b_pq))
    return b_gam_pk, b_gam_pq


@triton.jit
def kda_pairs_rounded(b_q, b_k, b_G, o_c, o_k, C: tl.constexpr, BK: tl.constexpr,
                      Q_KEY_INTERACTION_LHS: tl.constexpr, Q_KEY_INTERACTION_RHS: tl.constexpr,
                      Q_OUTPUT_SCORE_LHS: tl.constexpr, Q_OUTPUT_SCORE_RHS: tl.constexpr,
                      ACC_KEY_INTERACTION: tl.constexpr, ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
                      ACC_OUTPUT_SCORE: tl.constexpr, ACC_OUTPUT_SCORE_BLOCK: tl.constexpr):
    """KDA pair products when key_interaction / output_score are quantized: the per-pair operand
    k_j exp(G_i - G_j) (row (i, j) over the key channels) must exist to be rounded, so column by column over whole
    key rows (the exact solve's pair products run in chunk_fwd_kernel_pairs / chunk_bwd_kernel_pairs).
    Returns P, P_qk and the rounded K_l, Q_l."""
    # column by column: the pairwise operands k_j exp(G_i - G_j) (rows (i, j) over K) are rounded per pair
    b_kl = qdq_operand(b_k, 0.0, Q_KEY_INTERACTION_LHS, 1, C, BK, False)
    b_ql = qdq_operand(b_q, 0.0, Q_OUTPUT_SCORE_LHS, 1, C, BK, False)
    b_gam_pk = 0.0  # unused unless NVFP4
    b_gam_pq = 0.0
    if Q_KEY_INTERACTION_RHS == "nvfp4" or Q_OUTPUT_SCORE_RHS == "nvfp4":
        b_gam_pk, b_gam_pq = pair_amax(b_k, b_G, o_c, C)
    b_P = tl.zeros([C, C], dtype=tl.float32)
    b_Pqk = tl.zeros([C, C], dtype=tl.float32)
    for j in range(0, C):
        m_j, b_e, b_pk, b_pq = pair_rows(j, b_k, b_G, o_c)
        b_pk_q = qdq_operand(b_pk, b_gam_pk, Q_KEY_INTERACTION_RHS, 1, C, BK, True)
        b_pq_q = qdq_operand(b_pq, b_gam_pq, Q_OUTPUT_SCORE_RHS, 1, C, BK, True)
        b_cp = acc_row_sum(b_kl * b_pk_q, o_k, BK, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK)
        b_cq = acc_row_sum(b_ql * b_pq_q, o_k, BK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
        b_P += tl.where(m_j[None, :], b_cp[:, None], 0.0)
        b_Pqk += tl.where(m_j[None, :], b_cq[:, None], 0.0)
    return b_P, b_Pqk, b_kl, b_ql


@triton.jit
def kda_pair_grads_rounded(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_k, b_G, b_kl, b_ql, o_c, C: tl.constexpr,
                           BK: tl.constexpr, Q_KEY_INTERACTION_RHS: tl.constexpr, Q_OUTPUT_SCORE_RHS: tl.constexpr):
    """Gradients of ``kda_pairs_rounded``: the rounded other operand in every product, identity STE."""
    b_gam_pk = 0.0  # unused unless NVFP4
    b_gam_pq = 0.0
    if Q_KEY_INTERACTION_RHS == "nvfp4" or Q_OUTPUT_SCORE_RHS == "nvfp4":
        b_gam_pk, b_gam_pq = pair_amax(b_k, b_G, o_c, C)
    for j in range(0, C):
        m_j, b_e, b_pk, b_pq = pair_rows(j, b_k, b_G, o_c)
        b_pkq = qdq_operand(b_pk, b_gam_pk, Q_KEY_INTERACTION_RHS, 1, C, BK, True)
        b_pqq = qdq_operand(b_pq, b_gam_pq, Q_OUTPUT_SCORE_RHS, 1, C, BK, True)
        b_dPj = tl.sum(tl.where(m_j[None, :], b_dP, 0.0), 1)
        b_dQj = tl.sum(tl.where(m_j[None, :], b_dPqk, 0.0), 1)
        b_dk += b_dPj[:, None] * b_pkq
        b_dq += b_dQj[:, None] * b_pqq
        b_dpk = b_dPj[:, None] * b_kl
        b_dpq = b_dQj[:, None] * b_ql
        b_t = b_dpk * b_pk + b_dpq * b_pq
        b_dG += b_t
        b_dk = tl.where(m_j[:, None], b_dk + tl.sum((b_dpk + b_dpq) * b_e, 0)[None, :], b_dk)
        b_dG = tl.where(m_j[:, None], b_dG - tl.sum(b_t, 0)[None, :], b_dG)
    return b_dq, b_dk, b_dG


# ---- the whole-row form's pair products -----------------------------------------------------------------
@triton.jit
def whole_row_pairs(q, k, g, g_cum, r_qk, r_hv, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_c, m_k, m_ck, m_causal,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, GEMM_PRECISION: tl.constexpr, KDA: tl.constexpr,
                    PAIRS_ROUNDED: tl.constexpr, SUB_CHUNK: tl.constexpr,
                    Q_KEY_INTERACTION_LHS: tl.constexpr, Q_KEY_INTERACTION_RHS: tl.constexpr,
                    Q_OUTPUT_SCORE_LHS: tl.constexpr, Q_OUTPUT_SCORE_RHS: tl.constexpr,
                    ACC_KEY_INTERACTION: tl.constexpr, ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
                    ACC_OUTPUT_SCORE: tl.constexpr, ACC_OUTPUT_SCORE_BLOCK: tl.constexpr):
    """q, k, G over whole key rows (BK >= K), the chunk's pair products P, P_qk and what their gradients take:
    (b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2). The rounded operands K_l, K_r, Q_l, K_r2 are
    GDN's; KDA's rounded form has K_l and Q_l, its exact form none (the raw rows stand in for them, unread).
    Γ is GDN's; KDA has none (its decay sits inside the products' reduction): P stands in, unread."""
    b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
    b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
    b_G = load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K, KDA)
    if KDA:
        if PAIRS_ROUNDED:
            b_P, b_Pqk, b_kl, b_ql = kda_pairs_rounded(
                b_q, b_k, b_G, o_c, o_k, C, BK, Q_KEY_INTERACTION_LHS, Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS,
                Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE,
                ACC_OUTPUT_SCORE_BLOCK)
        else:
            b_P, b_Pqk = kda_pairs(b_q, b_k, b_G, k, g_cum, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_k, H, HV, K,
                                   C, SUB_CHUNK, DOT_PRECISION)
            b_kl = b_k
            b_ql = b_q
        return b_q, b_k, b_G, b_P, b_Pqk, b_P, b_kl, b_k, b_ql, b_k
    else:
        b_P = tl.zeros([C, C], dtype=tl.float32)
        b_Pqk = tl.zeros([C, C], dtype=tl.float32)
        b_Pb, b_Pqkb, b_kl, b_kr, b_ql, b_kr2 = gdn_pair_block(
            b_q, b_k, GEMM_PRECISION, C, BK, Q_KEY_INTERACTION_LHS, Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS,
            Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE,
            ACC_OUTPUT_SCORE_BLOCK)
        b_P += b_Pb
        b_Pqk += b_Pqkb
        b_P, b_Pqk, b_Gam = gdn_pairs_decay(b_P, b_Pqk, b_G, m_causal)
        return b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_intra(
    q,
    k,
    v,
    beta,
    g,
    g_cum,
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
    KDA: tl.constexpr,
    SOLVE: tl.constexpr,
    DEGREE: tl.constexpr,
    SPLIT_PAIR_GRADS: tl.constexpr,
    GDN_KEY_BLOCKS: tl.constexpr,
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
    """Every input gradient of one chunk (one program per chunk x value head), from the stored chunk-start
    state h_n = S_n (rounded), the state gradient dh = dS_n+1 and dV_new; A, T recomputed. Derivation:
    docs/kernels-chunk.md. QDQ sites pass gradients straight through.
    Two passes over the value blocks: the first for what reduces over V alone (dA_qk, dT from U, dv; GDN's
    key-blocked form also dT from W, so that dA is known before the key loop), the second once per key block
    of BK columns for the key-side gradients (with BK >= K where the pair products' gradients need the whole
    key rows in this kernel: one key block)."""
    # the whole-row form: the pair products and their gradients here, over one key block of BK >= K columns
    WHOLE_ROWS: tl.constexpr = not SPLIT_PAIR_GRADS and not GDN_KEY_BLOCKS
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
    if GDN_KEY_BLOCKS:
        b_G = load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K, KDA)
        b_eG = tl.exp(b_G)[:, None]
    elif WHOLE_ROWS and SOLVE == "neumann":  # q, k, G, P before the value loop: the Neumann polynomial needs A
        b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2 = whole_row_pairs(
            q, k, g, g_cum, r_qk, r_hv, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_c, m_k, m_ck, m_causal, H, HV, K,
            C, BK, DOT_PRECISION, GEMM_PRECISION, KDA, PAIRS_ROUNDED, SUB_CHUNK, Q_KEY_INTERACTION_LHS,
            Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS, Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION,
            ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
        b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)
    if SOLVE == "neumann":  # a Neumann polynomial is recomputed (cheap dots)
        b_T = neumann_solve(b_A, C, DEGREE, DOT_PRECISION)
    else:
        # T stored by the forward recompute (chunk_fwd STORE_T; rows past the sequence end are the identity's,
        # as a solve of their zero rows gives)
        b_T = tl.load(t_solved + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0)
        b_T = tl.where(m_c[:, None], b_T, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0))
    # wy_key and wy_value round the same T: a second site with the same format reuses the first's rounding
    b_Tw = qdq_operand(b_T, 0.0, Q_WY_KEY_LHS, 1, C, C, False)
    if Q_WY_VALUE_LHS == Q_WY_KEY_LHS:
        b_Tu = b_Tw
    else:
        b_Tu = qdq_operand(b_T, 0.0, Q_WY_VALUE_LHS, 1, C, C, False)

    # first value-block loop: what reduces over V alone
    b_dAqk = tl.zeros([C, C], dtype=tl.float32)
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    # NVFP4 operands spanning every value block (the tiles see one block at a time) take their global amax
    # first: b_gam_wv (beta V), b_gam_h (h_n), b_gam_vn (V_new); unused by the other formats
    b_gam_wv = 0.0
    b_gam_h = 0.0
    b_gam_vn = 0.0
    if Q_WY_VALUE_RHS == "nvfp4":
        b_gam_wv = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(v + r_hv[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :],
                               other=0).to(tl.float32) * b_beta[:, None]
            b_gam_wv = tl.maximum(b_gam_wv, tile_amax(b_amax_x))
    if Q_OUTPUT_STATE_RHS == "nvfp4" or Q_STATE_READ_RHS == "nvfp4":
        b_gam_h = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(h + (i_chunk * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                               mask=m_k[:, None] & (o_v < V)[None, :], other=0)
            b_gam_h = tl.maximum(b_gam_h, tile_amax(b_amax_x))
    if Q_OUTPUT_VALUE_RHS == "nvfp4" or Q_STATE_UPDATE_RHS == "nvfp4":
        b_gam_vn = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(v_new + r_hv[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :],
                               other=0)
            b_gam_vn = tl.maximum(b_gam_vn, tile_amax(b_amax_x))
    p_hn = h + (i_chunk * HV + i_hv) * K * V
    p_dhn = dh + (i_chunk * HV + i_hv) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_c[:, None] & (o_v < V)[None, :]
        r_cv = r_hv[:, None] * V + o_v[None, :]
        b_do = tl.load(do + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_vn = tl.load(v_new + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_dvn = tl.load(dv_new + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_v = tl.load(v + r_cv, mask=m_cv, other=0).to(tl.float32)
        # the forward's rounded operands (the other side of every product; identity STE)
        b_vn_ov = qdq_operand(b_vn, b_gam_vn, Q_OUTPUT_VALUE_RHS, 0, C, BV, True)
        b_dAqk += gemm(b_do, tl.trans(b_vn_ov), GEMM_PRECISION)
        # U = T (beta V): dU = dV_new
        b_bv = b_v * b_beta[:, None]
        b_bv = qdq_operand(b_bv, b_gam_wv, Q_WY_VALUE_RHS, 0, C, BV, True)
        b_dT += gemm(b_dvn, tl.trans(b_bv), GEMM_PRECISION)
        b_dBv = gemm(tl.trans(b_Tu), b_dvn, GEMM_PRECISION)
        tl.store(dv + r_cv, (b_dBv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_cv)
        b_dbeta += tl.sum(b_dBv * b_v, 1)
        if GDN_KEY_BLOCKS:
            # dT's share from W = T (beta exp(G) K), here rather than in the key loop: dW bk^T = -dV_new (bk h_n)^T
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

    if GDN_KEY_BLOCKS:
        # dT is complete: dA, then P, P_qk recomputed over key blocks (for dbeta and dG) and the pair products'
        # gradients dP ⊙ Γ, dP_qk ⊙ Γ, which each key block multiplies by its K, Q columns
        # T = solve(A): dA
        b_dA = exact_solve_grad(b_T, b_dT, DOT_PRECISION)
        b_dA = tl.where(m_strict, b_dA, 0.0)
        b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)
        # P = (K K^T) ⊙ Γ and P_qk = (Q K^T) ⊙ Γ over the key blocks
        b_P = tl.zeros([C, C], dtype=tl.float32)
        b_Pqk = tl.zeros([C, C], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_ck = m_c[:, None] & (o_k < K)[None, :]
            r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
            b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
            b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
            b_Pb, b_Pqkb, b_kl, b_kr, b_ql, b_kr2 = gdn_pair_block(
                b_q, b_k, GEMM_PRECISION, C, BK, Q_KEY_INTERACTION_LHS, Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS,
                Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE,
                ACC_OUTPUT_SCORE_BLOCK)
            b_P += b_Pb
            b_Pqk += b_Pqkb
        b_P, b_Pqk, b_Gam = gdn_pairs_decay(b_P, b_Pqk, b_G, m_causal)
        b_dbeta += tl.sum(b_dA * b_P, 1)
        b_dP = b_dA * b_beta[:, None]
        b_M = b_dP * b_P + b_dPqk * b_Pqk
        b_dGs = tl.sum(b_M, 1) - tl.sum(b_M, 0)  # dG, summed with each key block's share below
        b_dKK = b_dP * b_Gam
        b_dQK = b_dPqk * b_Gam
    elif WHOLE_ROWS:
        if SOLVE != "neumann":  # q, k, G, P after the value loop (T comes from the forward recompute)
            b_q, b_k, b_G, b_P, b_Pqk, b_Gam, b_kl, b_kr, b_ql, b_kr2 = whole_row_pairs(
                q, k, g, g_cum, r_qk, r_hv, bos, i_t, seq_len, i_h, i_hv, o_c, o_k, m_c, m_k, m_ck, m_causal, H,
                HV, K, C, BK, DOT_PRECISION, GEMM_PRECISION, KDA, PAIRS_ROUNDED, SUB_CHUNK, Q_KEY_INTERACTION_LHS,
                Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_LHS, Q_OUTPUT_SCORE_RHS, ACC_KEY_INTERACTION,
                ACC_KEY_INTERACTION_BLOCK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
            b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)
        # one key block: the loop's gradients are carried out of it into the pair products' part
        b_dq = tl.zeros([C, BK], dtype=tl.float32)
        b_dk = tl.zeros([C, BK], dtype=tl.float32)
        if KDA:
            b_dG = tl.zeros([C, BK], dtype=tl.float32)
        else:
            b_dG = tl.zeros([C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ck = m_c[:, None] & m_k[None, :]
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        r_qk_v = r_hv[:, None] * K + o_k[None, :]  # dq, dk are per value head: [B, T, HV, K]
        # second value-block loop: the key block's share of everything that reduces over V
        b_dW = tl.zeros([C, BK], dtype=tl.float32)
        b_dQg = tl.zeros([C, BK], dtype=tl.float32)
        b_dKd = tl.zeros([C, BK], dtype=tl.float32)
        b_dlast = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_cv = m_c[:, None] & (o_v < V)[None, :]
            m_kv = m_k[:, None] & (o_v < V)[None, :]
            r_cv = r_hv[:, None] * V + o_v[None, :]
            b_do = tl.load(do + r_cv, mask=m_cv, other=0).to(tl.float32)
            b_vn = tl.load(v_new + r_cv, mask=m_cv, other=0).to(tl.float32)
            b_dvn = tl.load(dv_new + r_cv, mask=m_cv, other=0).to(tl.float32)
            b_hn = tl.load(p_hn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
            b_dhn = tl.load(p_dhn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
            # state_read and output_state round the same h_n block: one QDQ where their formats agree
            b_hn_sr = qdq_operand(b_hn, b_gam_h, Q_STATE_READ_RHS, 0, BK, BV, True)
            if Q_OUTPUT_STATE_RHS == Q_STATE_READ_RHS:
                b_hn_os = b_hn_sr
            else:
                b_hn_os = qdq_operand(b_hn, b_gam_h, Q_OUTPUT_STATE_RHS, 0, BK, BV, True)
            b_vn_su = qdq_operand(b_vn, b_gam_vn, Q_STATE_UPDATE_RHS, 0, C, BV, True)
            b_dW -= gemm(b_dvn, tl.trans(b_hn_sr), GEMM_PRECISION)
            b_dQg += gemm(b_do, tl.trans(b_hn_os), GEMM_PRECISION)
            b_dKd += gemm(b_vn_su, tl.trans(b_dhn), GEMM_PRECISION)
            b_dlast += tl.sum(b_dhn * b_hn, 1)

        if not WHOLE_ROWS:  # (the whole rows were loaded with the pair products)
            b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
            b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
            b_G = load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K, KDA)
        # each [C x BK] accumulator of the loop is used up as early as possible (fewer live registers)
        # Q exp(G) (output_state)
        b_eG = exp_g(b_G, KDA)
        b_dq = b_eG * b_dQg * scale
        b_dG = key_rows(b_q * b_eG * b_dQg * scale, KDA)

        # W = T (beta exp(G) K)
        b_bk = b_k * (b_beta[:, None] * b_eG)
        b_bk = qdq_operand(b_bk, 0.0, Q_WY_KEY_RHS, 0, C, BK, False)
        if not GDN_KEY_BLOCKS:  # (GDN's key-blocked form completed dT in the first value loop)
            b_dT += gemm(b_dW, tl.trans(b_bk), GEMM_PRECISION)
        b_dBk = gemm(tl.trans(b_Tw), b_dW, GEMM_PRECISION)
        b_dk = b_dBk * (b_beta[:, None] * b_eG)
        b_t = b_k * b_eG * b_dBk
        b_dbeta += tl.sum(b_t, 1)
        b_dG += key_rows(b_t * b_beta[:, None], KDA)

        # K exp(G_C - G) and exp(G_C) (state_update)
        if KDA:
            b_glast = tl.sum(tl.where((o_c == i_row_last)[:, None], b_G, 0.0), 0)
            b_ed = tl.where(m_c[:, None], tl.exp(b_glast[None, :] - b_G), 0.0)
            b_dk += b_ed * b_dKd
            b_t = b_k * b_dKd * b_ed
            b_dG -= b_t
            b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * b_dlast
            b_dG += tl.where((o_c == i_row_last)[:, None], b_dGlast[None, :], 0.0)
        else:
            b_glast = tl.sum(tl.where(o_c == i_row_last, b_G, 0.0), 0)
            b_ed = tl.where(m_c, tl.exp(b_glast - b_G), 0.0)
            b_dk += b_ed[:, None] * b_dKd
            b_t = tl.sum(b_k * b_dKd, 1) * b_ed
            b_dG -= b_t
            b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * tl.sum(b_dlast, 0)
            b_dG += tl.where(o_c == i_row_last, b_dGlast, 0.0)
        if SPLIT_PAIR_GRADS:
            # this key block's share of dq, dk, dG (fp32) for chunk_bwd_kernel_pairs
            tl.store(dq + r_qk_v, b_dq, mask=m_ck)
            tl.store(dk + r_qk_v, b_dk, mask=m_ck)
            tl.store(dg + r_qk_v, b_dG, mask=m_ck)
        elif GDN_KEY_BLOCKS:
            # the pair products' gradients: this key block's dq, dk are complete.
            # GEMM_PRECISION, not DOT_PRECISION: with 16-bit GEMMs dP ⊙ Γ is multiplied in the input dtype, as
            # FLA's chunk_bwd_dqkwg does (its ds in bf16): this stage 2.39 -> 2.16 ms at [8,4096,16,128] on the
            # H200 (docs/kernels-chunk.md, "Key blocks")
            b_dk += gemm(b_dKK, b_k, GEMM_PRECISION) + gemm(tl.trans(b_dKK), b_k, GEMM_PRECISION) \
                + gemm(tl.trans(b_dQK), b_q, GEMM_PRECISION)
            b_dq += gemm(b_dQK, b_k, GEMM_PRECISION)
            tl.store(dq + r_qk_v, b_dq.to(dq.dtype.element_ty), mask=m_ck)
            tl.store(dk + r_qk_v, b_dk.to(dk.dtype.element_ty), mask=m_ck)
            b_dGs += b_dG

    if GDN_KEY_BLOCKS:
        # g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk
        b_dg = tl.cumsum(b_dGs, 0, reverse=True)
        tl.store(dg + r_hv, b_dg.to(dg.dtype.element_ty), mask=m_c)
    else:
        # T = solve(A): dA, and the masked gradients of the two pair products' users
        if SOLVE == "neumann":
            b_dA = neumann_solve_grad(b_A, b_dT, C, DEGREE, DOT_PRECISION)
        else:
            b_dA = exact_solve_grad(b_T, b_dT, DOT_PRECISION)
        b_dA = tl.where(m_strict, b_dA, 0.0)
        b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)
        if SPLIT_PAIR_GRADS:
            # P from the forward recompute (chunk_fwd_kernel_pairs; unwritten above the diagonal)
            b_P = tl.load(p_pairs + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_strict, other=0)
            b_dbeta += tl.sum(b_dA * b_P, 1)
            # the pair products' gradients run key block by key block (chunk_bwd_kernel_pairs): hand over
            # dP, dP_qk
            tl.store(dpair + r_hv[:, None] * (2 * C) + o_c[None, :], b_dA * b_beta[:, None], mask=m_c[:, None])
            tl.store(dpair + r_hv[:, None] * (2 * C) + C + o_c[None, :], b_dPqk, mask=m_c[:, None])
        else:
            b_dbeta += tl.sum(b_dA * b_P, 1)
            b_dP = b_dA * b_beta[:, None]
            if KDA and PAIRS_ROUNDED:
                b_dq, b_dk, b_dG = kda_pair_grads_rounded(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_k, b_G, b_kl, b_ql,
                                                          o_c, C, BK, Q_KEY_INTERACTION_RHS, Q_OUTPUT_SCORE_RHS)
            elif KDA:
                b_dq, b_dk, b_dG = kda_pair_grads(b_dq, b_dk, b_dG, b_dP, b_dPqk, b_q, b_k, b_G, k, g_cum, bos, i_t,
                                                  seq_len, i_h, i_hv, o_c, o_k, m_k, H, HV, K, C, BK, SUB_CHUNK,
                                                  DOT_PRECISION)
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


KERNELS = {"intra": chunk_bwd_kernel_intra}


def chunk_bwd_intra(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, v, beta, g, g_cum, t_solved, p_pairs, h, dh,
                    v_new, dv_new, do, dq, dk, dv, dbeta, dg, dpair, scale):
    """Every input gradient of every chunk; where KDA splits its pair gradients, dq, dk, dg receive the other shares
    and dpair dP, dP_qk (for chunk_bwd_pairs)."""
    launch(plan.bwd_intra, dict(q=q, k=k, v=v, beta=beta, g=g, g_cum=g_cum, t_solved=t_solved, p_pairs=p_pairs, h=h,
                                dh=dh, v_new=v_new, dv_new=dv_new, do=do, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg,
                                dpair=dpair, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
                                scale=scale, T=layout.T))
