"""The pair products of one chunk over whole key rows (BK >= K), and their gradients: what the backward intra
stage's whole-row form (chunk_bwd_kernel_intra_rows) recomputes and differentiates. GDN's products are two dots
times Γ (its rounded operands kept for the gradients); KDA's exact ones go by sub-chunk blocks, its rounded ones
column by column (a pair's operand k_j exp(G_i - G_j) must exist to be rounded).
"""
import triton
import triton.language as tl

from la_compiler.kernels.chunk.bwd_intra import gdn_pairs_decay, load_g_cumsum
from la_compiler.kernels.chunk.device import acc_gemm, acc_row_sum, qdq_operand, tile_amax


# ---- GDN -------------------------------------------------------------------------------------------------------
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


# ---- KDA, exact (the Neumann solve) ----------------------------------------------------------------------------
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


# ---- KDA, rounded ----------------------------------------------------------------------------------------------
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


# ---- either kind -----------------------------------------------------------------------------------------------
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
