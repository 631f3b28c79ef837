"""KDA's backward pair-product kernels: the share of dq, dk and dG that the pair products (P_ij and P_qk,ij, sums
over the key channels of k_i k_j e^(G_i - G_j) and q_i k_j e^(G_i - G_j)) take, from the dP, dP_qk that the
backward intra kernel left, one program per sub-chunk of BC rows (FLA's split of KDA's intra backward). ``pairs`` runs the exact products by key blocks, the sub-chunk
blocks before and after the diagonal as tensor-core products through a block row whose decay factors are all
<= 1; ``pairs_rounded`` the products whose operands are rounded (key_interaction / output_score QDQ) or whose
reduction emulates an accumulator, column by column over whole key rows (a pair's row scale spans K), identity
STE through every QDQ. Both add the other shares (dq_rest, dk_rest, dg_rest), write dq, dk and the rows'
complete dG into dg_rest (chunk_bwd_kernel_dg takes its reverse cumsum). docs/kernels-chunk.md derives both,
"Rounded pair products" where the reference rounds and why the column side needs no rounding of its own.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import chunk_program, qdq_operand, sub_dot
from la_compiler.kernels.chunk.fwd_pairs import pair_amaxes, pair_column, rounded_pair_rows
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_pairs(
    q,
    k,
    g_cum,
    dpair,
    dq_rest,
    dk_rest,
    dg_rest,
    dq,
    dk,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIAG_DOT_MAX_RANGE: tl.constexpr,
):
    """The pair products' share of dq, dk and dG for one sub-chunk of BC rows and one key block of BK
    columns (grid: chunks x sub-chunks, value heads, key blocks), FLA's split of KDA's intra backward:
    the intra kernel left dP, dP_qk in dpair and every other share of dq, dk, dG in *_rest. Adds them,
    writes dq, dk and the rows' complete dG into dg_rest (chunk_bwd_kernel_dg takes its reverse cumsum).

    Pairs (i, j) with j in a block before this one go through the block's first real row f
    (exp(G_i - G_j) = exp(G_i - G_f) exp(G_f - G_j)), pairs with i in a block after it through its last real
    row l; every factor is <= 1. The diagonal block goes through f too where its decay range is at most
    DIAG_DOT_MAX_RANGE, else row by row, once for each side (docs/kernels-chunk.md)."""
    i_cs, i_bh, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_s = i_cs // (C // BC), i_cs % (C // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_r = tl.arange(0, BC)
    n_real = seq_len - i_t * C  # rows of this chunk inside the sequence (may exceed C)
    x_c = bos + i_t * C  # token of the chunk's row 0
    r_b = i_s * BC + o_r
    m_b = r_b < n_real
    m_bk = m_b[:, None] & m_k[None, :]
    x_qk = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]
    x_hv = ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :]
    x_pair = ((x_c + r_b) * HV + i_hv) * (2 * C)
    b_k = tl.load(k + x_qk, mask=m_bk, other=0).to(tl.float32)
    b_q = tl.load(q + x_qk, mask=m_bk, other=0).to(tl.float32)
    b_G = tl.load(g_cum + x_hv, mask=m_bk, other=0)
    r_f = tl.minimum(i_s * BC, n_real - 1)
    r_l = tl.minimum(i_s * BC + BC - 1, n_real - 1)
    b_gf = tl.load(g_cum + ((x_c + r_f) * HV + i_hv) * K + o_k, mask=m_k, other=0)
    b_gl = tl.load(g_cum + ((x_c + r_l) * HV + i_hv) * K + o_k, mask=m_k, other=0)

    # blocks before: dL = sum_j dP[b, j] (K_j e^(G_f - G_j)); dk += e^(G - G_f) dL; dG += K e^(G - G_f) dL
    b_dkl = tl.zeros([BC, BK], dtype=tl.float32)
    b_dql = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(0, i_s):
        r_j = i_j * BC + o_r
        m_j = r_j < n_real
        m_jk = m_j[:, None] & m_k[None, :]
        b_kj = tl.load(k + ((x_c + r_j) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
        b_gj = tl.load(g_cum + ((x_c + r_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
        b_kr = b_kj * tl.exp(tl.where(m_j[:, None], b_gf[None, :] - b_gj, 0.0))
        b_dPb = tl.load(dpair + x_pair[:, None] + r_j[None, :], mask=m_b[:, None], other=0)
        b_dQb = tl.load(dpair + x_pair[:, None] + C + r_j[None, :], mask=m_b[:, None], other=0)
        b_dkl += sub_dot(b_dPb, b_kr, DOT_PRECISION, BC >= 16)
        b_dql += sub_dot(b_dQb, b_kr, DOT_PRECISION, BC >= 16)
    b_el = tl.exp(tl.where(m_b[:, None], b_G - b_gf[None, :], 0.0))
    b_dk = b_el * b_dkl
    b_dq = b_el * b_dql
    b_dG = b_el * (b_k * b_dkl + b_q * b_dql)

    # blocks after: dR = sum_i dP[i, b]^T (K_i e^(G_i - G_l)) (+ P_qk's with Q_i); dk += e^(G_l - G) dR; dG -= K e^(G_l - G) dR
    b_dkr = tl.zeros([BC, BK], dtype=tl.float32)
    for i_i in range(i_s + 1, C // BC):
        r_i = i_i * BC + o_r
        m_i = r_i < n_real
        m_ik = m_i[:, None] & m_k[None, :]
        x_i = ((x_c + r_i) * H + i_h)[:, None] * K + o_k[None, :]
        b_ei = tl.exp(tl.where(m_i[:, None], tl.load(g_cum + ((x_c + r_i) * HV + i_hv)[:, None] * K + o_k[None, :],
                                                     mask=m_ik, other=0) - b_gl[None, :], 0.0))
        b_ki = tl.load(k + x_i, mask=m_ik, other=0).to(tl.float32) * b_ei
        b_qi = tl.load(q + x_i, mask=m_ik, other=0).to(tl.float32) * b_ei
        x_pi = ((x_c + r_i) * HV + i_hv) * (2 * C)
        b_dPt = tl.load(dpair + x_pi[None, :] + r_b[:, None], mask=m_i[None, :], other=0)
        b_dQt = tl.load(dpair + x_pi[None, :] + C + r_b[:, None], mask=m_i[None, :], other=0)
        b_dkr += sub_dot(b_dPt, b_ki, DOT_PRECISION, BC >= 16) + sub_dot(b_dQt, b_qi, DOT_PRECISION, BC >= 16)
    b_er = tl.exp(tl.where(m_b[:, None], b_gl[None, :] - b_G, 0.0))
    b_dk += b_er * b_dkr
    b_dG -= b_er * b_k * b_dkr

    # the diagonal block: through its first real row f like the other blocks where the block's decay range
    # allows (every factor within e^(+-DIAG_DOT_MAX_RANGE)), else FLA's two loops (no reduction across rows):
    # the row side takes its rows' columns j <= i one at a time (column jj = row jj of the block), the column
    # side its rows' pairs with rows i >= j (row ii); every exponent there is G_i - G_j with j <= i, masked to
    # 0 elsewhere (docs/kernels-chunk.md)
    b_d = tl.where(m_bk, b_G - b_gf[None, :], 0.0)
    if tl.max(tl.max(tl.abs(b_d), axis=1), axis=0) <= DIAG_DOT_MAX_RANGE:
        b_el = tl.exp(b_d)
        b_er = tl.exp(-b_d)
        m_lower = m_b[:, None] & (o_r[:, None] > o_r[None, :])
        m_causal = m_b[:, None] & (o_r[:, None] >= o_r[None, :])
        b_dPd = tl.load(dpair + x_pair[:, None] + r_b[None, :], mask=m_lower, other=0)
        b_dQd = tl.load(dpair + x_pair[:, None] + C + r_b[None, :], mask=m_causal, other=0)
        b_kr = b_k * b_er
        b_dkd = b_el * sub_dot(b_dPd, b_kr, DOT_PRECISION, BC >= 16)
        b_dqd = b_el * sub_dot(b_dQd, b_kr, DOT_PRECISION, BC >= 16)
        b_dkt = b_er * (sub_dot(tl.trans(b_dPd), b_k * b_el, DOT_PRECISION, BC >= 16)
                        + sub_dot(tl.trans(b_dQd), b_q * b_el, DOT_PRECISION, BC >= 16))
    else:
        b_dkd = tl.zeros([BC, BK], dtype=tl.float32)
        b_dqd = tl.zeros([BC, BK], dtype=tl.float32)
        for jj in range(0, BC):
            r_j = i_s * BC + jj
            m_jk = m_k & (r_j + 0 * o_k < n_real)  # a [BK] mask: the interpreter refuses a scalar one in &
            b_kj = tl.load(k + ((x_c + r_j) * H + i_h) * K + o_k, mask=m_jk, other=0).to(tl.float32)
            b_gj = tl.load(g_cum + ((x_c + r_j) * HV + i_hv) * K + o_k, mask=m_jk, other=0)
            b_dPj = tl.load(dpair + x_pair + r_j, mask=m_b & (o_r > jj), other=0)
            b_dQj = tl.load(dpair + x_pair + C + r_j, mask=m_b & (o_r >= jj), other=0)
            b_kje = b_kj[None, :] * tl.exp(tl.where((m_b & (o_r >= jj))[:, None], b_G - b_gj[None, :], 0.0))
            b_dkd += b_dPj[:, None] * b_kje
            b_dqd += b_dQj[:, None] * b_kje
        b_dkt = tl.zeros([BC, BK], dtype=tl.float32)
        for ii in range(0, BC):
            r_i = i_s * BC + ii
            m_in = m_b & (o_r <= ii) & (r_i + 0 * o_r < n_real)  # pairs (ii, j) of real rows with j <= ii
            m_ik = m_k & (r_i + 0 * o_k < n_real)
            b_ki = tl.load(k + ((x_c + r_i) * H + i_h) * K + o_k, mask=m_ik, other=0).to(tl.float32)
            b_qi = tl.load(q + ((x_c + r_i) * H + i_h) * K + o_k, mask=m_ik, other=0).to(tl.float32)
            b_gi = tl.load(g_cum + ((x_c + r_i) * HV + i_hv) * K + o_k, mask=m_ik, other=0)
            x_pi = ((x_c + r_i) * HV + i_hv) * (2 * C)
            b_dPi = tl.load(dpair + x_pi + r_b, mask=m_in & (o_r < ii), other=0)
            b_dQi = tl.load(dpair + x_pi + C + r_b, mask=m_in, other=0)
            b_e = tl.exp(tl.where(m_in[:, None], b_gi[None, :] - b_G, 0.0))
            b_dkt += (b_dPi[:, None] * b_ki[None, :] + b_dQi[:, None] * b_qi[None, :]) * b_e
    b_dk += b_dkd + b_dkt
    b_dq += b_dqd
    b_dG += b_k * (b_dkd - b_dkt) + b_q * b_dqd

    b_dq += tl.load(dq_rest + x_hv, mask=m_bk, other=0)
    b_dk += tl.load(dk_rest + x_hv, mask=m_bk, other=0)
    b_dG += tl.load(dg_rest + x_hv, mask=m_bk, other=0)
    tl.store(dg_rest + x_hv, b_dG, mask=m_bk)
    tl.store(dq + x_hv, b_dq.to(dq.dtype.element_ty), mask=m_bk)
    tl.store(dk + x_hv, b_dk.to(dk.dtype.element_ty), mask=m_bk)


@triton.jit
def lhs_rows(b_k, b_q, b_gam_k, b_gam_q, Q_KEY_INTERACTION_LHS: tl.constexpr, Q_OUTPUT_SCORE_LHS: tl.constexpr,
             M: tl.constexpr, BK: tl.constexpr, PAIRS_NVFP4: tl.constexpr):
    """The rounded lhs rows of an [M x BK] tile: key_interaction.lhs of K, output_score.lhs of Q (one scale per
    row over K; NVFP4 with the chunk-wide amax)."""
    b_kl = qdq_operand(b_k, b_gam_k, Q_KEY_INTERACTION_LHS, 1, M, BK, PAIRS_NVFP4)
    b_ql = qdq_operand(b_q, b_gam_q, Q_OUTPUT_SCORE_LHS, 1, M, BK, PAIRS_NVFP4)
    return b_kl, b_ql


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_pairs_rounded(
    q,
    k,
    g_cum,
    dpair,
    dq_rest,
    dk_rest,
    dg_rest,
    dq,
    dk,
    pair_amax,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_KEY_INTERACTION_LHS: tl.constexpr,
    Q_KEY_INTERACTION_RHS: tl.constexpr,
    Q_OUTPUT_SCORE_LHS: tl.constexpr,
    Q_OUTPUT_SCORE_RHS: tl.constexpr,
    PAIRS_NVFP4: tl.constexpr,
    COLUMN_SIDE_BY_PRODUCTS: tl.constexpr,
    SHARES_PAIR_RHS: tl.constexpr,
):
    """The rounded pair products' share of dq, dk and dG for the rows of one sub-chunk of BC rows over all
    key columns (grid: chunks x sub-chunks, value heads, 1), identity STE through every QDQ: the intra
    kernel left dP, dP_qk in dpair and every other share of dq, dk, dG in *_rest. Adds them, writes dq,
    dk and the rows' complete dG into dg_rest (chunk_bwd_kernel_dg takes its reverse cumsum).

    Row side (the sub-chunk's rows i against every column j <= i): dk_i, dq_i take the rounded pair
    operand; dG_i the unrounded one. Column side (the sub-chunk's rows as columns j of every row
    i >= j): d(k_j e^(G_i - G_j)) = dP_ij kl_i + dP_qk,ij ql_i with the rounded lhs rows only, so the
    blocks after this one can be products (tensor cores) through its last real row, like the exact kernel,
    unless an lhs row is NVFP4-rounded (COLUMN_SIDE_BY_PRODUCTS: its [BC x K] block QDQ makes the kernel slower;
    measured: docs/kernels-chunk-measurements.md, "Rounded pair products"); then every row i >= the sub-chunk's
    first goes one by one."""
    i_cs, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_s = i_cs // (C // BC), i_cs % (C // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_k, m_k, o_r, n_real, x_c, r_b, m_b, m_bk, b_k, b_q, b_G = rounded_pair_rows(q, k, g_cum, i_s, i_t, bos, seq_len,
                                                                                 i_h, i_hv, H, HV, K, C, BC, BK)
    b_gam_pk, b_gam_pq, b_gam_k, b_gam_q = pair_amaxes(pair_amax, i_c, i_bh, PAIRS_NVFP4)
    b_kl, b_ql = lhs_rows(b_k, b_q, b_gam_k, b_gam_q, Q_KEY_INTERACTION_LHS, Q_OUTPUT_SCORE_LHS, BC, BK,
                          PAIRS_NVFP4)
    x_hv = ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :]
    x_pair = ((x_c + r_b) * HV + i_hv) * (2 * C)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    b_dG = tl.zeros([BC, BK], dtype=tl.float32)

    for j in range(0, i_s * BC + BC):  # column j (up to the sub-chunk's last row)
        b_kj, b_e = pair_column(k, g_cum, b_G, j, r_b, x_c, n_real, i_h, i_hv, o_k, m_k, H, HV, K)
        b_pq = tl.where((r_b >= j)[:, None], b_kj[None, :] * b_e, 0.0)
        # the rounded rhs of every pair (i, j): b_pkq (key_interaction, read where j < i), b_pqq (output_score,
        # j <= i)
        if SHARES_PAIR_RHS:  # the same rows (they differ only on the diagonal, never read), the same rounding
            b_pqq = qdq_operand(b_pq, b_gam_pq, Q_OUTPUT_SCORE_RHS, 1, BC, BK, PAIRS_NVFP4)
            b_pkq = b_pqq
        else:
            b_pk = tl.where((r_b > j)[:, None], b_kj[None, :] * b_e, 0.0)
            b_pkq = qdq_operand(b_pk, b_gam_pk, Q_KEY_INTERACTION_RHS, 1, BC, BK, PAIRS_NVFP4)
            b_pqq = qdq_operand(b_pq, b_gam_pq, Q_OUTPUT_SCORE_RHS, 1, BC, BK, PAIRS_NVFP4)
        b_dPj = tl.load(dpair + x_pair + j, mask=m_b & (r_b > j), other=0)
        b_dQj = tl.load(dpair + x_pair + C + j, mask=m_b & (r_b >= j), other=0)
        b_dk += b_dPj[:, None] * b_pkq
        b_dq += b_dQj[:, None] * b_pqq
        b_dG += (b_dPj[:, None] * b_kl + b_dQj[:, None] * b_ql) * b_pq  # b_pk = b_pq where dP_ij != 0

    if COLUMN_SIDE_BY_PRODUCTS:
        # column side, rows i in blocks after this one: e^(G_i - G_j) = e^(G_i - G_l) e^(G_l - G_j) through this
        # block's last real row l; d(k_j e^(G_i - G_j)) summed over i is a product with the rounded lhs rows
        r_l = tl.minimum(i_s * BC + BC - 1, n_real - 1)
        b_gl = tl.load(g_cum + ((x_c + r_l) * HV + i_hv) * K + o_k, mask=m_k, other=0)
        b_dR = tl.zeros([BC, BK], dtype=tl.float32)
        for i_i in range(i_s + 1, C // BC):
            r_i = i_i * BC + o_r
            m_i = r_i < n_real
            m_ik = m_i[:, None] & m_k[None, :]
            x_i = ((x_c + r_i) * H + i_h)[:, None] * K + o_k[None, :]
            b_kb = tl.load(k + x_i, mask=m_ik, other=0).to(tl.float32)
            b_qb = tl.load(q + x_i, mask=m_ik, other=0).to(tl.float32)
            b_klb, b_qlb = lhs_rows(b_kb, b_qb, b_gam_k, b_gam_q, Q_KEY_INTERACTION_LHS, Q_OUTPUT_SCORE_LHS, BC,
                                    BK, PAIRS_NVFP4)
            b_ei = tl.exp(tl.where(m_i[:, None], tl.load(g_cum + ((x_c + r_i) * HV + i_hv)[:, None] * K + o_k[None, :],
                                                         mask=m_ik, other=0) - b_gl[None, :], 0.0))
            x_pi = ((x_c + r_i) * HV + i_hv) * (2 * C)
            b_dPt = tl.load(dpair + x_pi[None, :] + r_b[:, None], mask=m_i[None, :], other=0)
            b_dQt = tl.load(dpair + x_pi[None, :] + C + r_b[:, None], mask=m_i[None, :], other=0)
            b_dR += sub_dot(b_dPt, b_klb * b_ei, DOT_PRECISION, BC >= 16) \
                + sub_dot(b_dQt, b_qlb * b_ei, DOT_PRECISION, BC >= 16)
        b_er = tl.exp(tl.where(m_b[:, None], b_gl[None, :] - b_G, 0.0))
        b_dk += b_er * b_dR
        b_dG -= b_er * b_k * b_dR
        rows_end = i_s * BC + BC  # column side, rows i of this block (i >= j), one by one
    else:
        rows_end = C  # column side, every row i from this block on, one by one
    # row i (>= this sub-chunk's first row, inside the sequence) as [1 x BK] tiles
    for i in range(i_s * BC, tl.minimum(n_real, rows_end)):
        x_i = ((x_c + i) * H + i_h) * K + o_k[None, :]
        b_ki = tl.load(k + x_i, mask=m_k[None, :], other=0).to(tl.float32)
        b_qi = tl.load(q + x_i, mask=m_k[None, :], other=0).to(tl.float32)
        b_gi = tl.load(g_cum + ((x_c + i) * HV + i_hv) * K + o_k[None, :], mask=m_k[None, :], other=0)
        b_kli, b_qli = lhs_rows(b_ki, b_qi, b_gam_k, b_gam_q, Q_KEY_INTERACTION_LHS, Q_OUTPUT_SCORE_LHS, 1, BK,
                                PAIRS_NVFP4)
        x_pi = ((x_c + i) * HV + i_hv) * (2 * C)
        b_dPi = tl.load(dpair + x_pi + r_b, mask=r_b < i, other=0)
        b_dQi = tl.load(dpair + x_pi + C + r_b, mask=r_b <= i, other=0)
        b_e = tl.exp(tl.where((r_b <= i)[:, None], b_gi - b_G, 0.0))
        b_x = (b_dPi[:, None] * b_kli + b_dQi[:, None] * b_qli) * b_e
        b_dk += b_x
        b_dG -= b_x * b_k

    b_dq += tl.load(dq_rest + x_hv, mask=m_bk, other=0)
    b_dk += tl.load(dk_rest + x_hv, mask=m_bk, other=0)
    b_dG += tl.load(dg_rest + x_hv, mask=m_bk, other=0)
    tl.store(dg_rest + x_hv, b_dG, mask=m_bk)
    tl.store(dq + x_hv, b_dq.to(dq.dtype.element_ty), mask=m_bk)
    tl.store(dk + x_hv, b_dk.to(dk.dtype.element_ty), mask=m_bk)


KERNELS = {"pairs": chunk_bwd_kernel_pairs, "pairs_rounded": chunk_bwd_kernel_pairs_rounded}


def chunk_bwd_pairs(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, g_cum, dpair, dq_rest, dk_rest, dg_rest, dq,
                    dk, pair_amax):
    """KDA's pair products' share of dq, dk, dG by sub-chunk and key block, added to the rest: dq, dk and the
    complete dG (into dg_rest). The rounded kernel reads ``pair_amax``, the others None."""
    amaxes = {"pair_amax": pair_amax} if plan.pairs_rounded else {}
    launch(plan.bwd_pairs, dict(q=q, k=k, g_cum=g_cum, dpair=dpair, dq_rest=dq_rest, dk_rest=dk_rest, dg_rest=dg_rest,
                                dq=dq, dk=dk, **amaxes, cu_seqlens=layout.cu_seqlens,
                                chunk_indices=layout.chunk_indices, T=layout.T))
