"""KDA's forward stages before the intra stage: G = cumsum(g) within each chunk (``chunk_fwd_kernel_cumsum``), and
the pair products P_ij = sum_d k_id k_jd exp(G_id - G_jd) and P_qk (q_i for k_i), j <= i, one program per
sub-chunk of BC rows like FLA's split of KDA's intra-chunk forward. Exact products (``chunk_fwd_kernel_pairs``) run
by key blocks and tensor-core dots through the sub-chunk's first real row; rounded ones (operand QDQ or accumulator
emulation at key_interaction / output_score, ``forms.kda_rounds_pairs``: ``chunk_fwd_kernel_pairs_rounded``) form
each pair's operand k_j e^(G_i - G_j) column by column over whole key rows, rounded per pair, after
``chunk_fwd_kernel_pair_amax`` took NVFP4's chunk-wide global amaxes. GDN forms its pair products inside its
intra stage, so these kernels have no kind of their own. docs/kernels-chunk.md derives the decay split, "The
diagonal blocks" and "Rounded pair products".
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import (RCP_LN2, acc_row_sum, chunk_program, gate_exp, qdq_operand, sub_dot,
                                              tile_amax)
from la_compiler.kernels.chunk.launch import launch
from la_compiler.kernels.common.server_gate import SOFTPLUS_THRESHOLD, kda_server_gate

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_cumsum(
    g,
    g_cum,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
    GATE_EXP2: tl.constexpr = False,
    A_log=None,
    dt_bias=None,
    RAW_GATE: tl.constexpr = False,
    HAS_DT_BIAS: tl.constexpr = False,
    THRESHOLD: tl.constexpr = 20.0,
):
    """G = cumsum(g) within each chunk, channel by channel (grid: chunks, value heads, key blocks); in log2 units
    (times 1 / ln 2 after the sum, as vLLM's fused_kda_gate_chunk_cumsum) where GATE_EXP2. RAW_GATE: g is KDA's raw
    gate, and the sum runs over vLLM's gate of it (kernels/common/server_gate.py; A_log [HV], dt_bias [HV K]), as
    that kernel sums it."""
    i_c, i_bh, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seq_len, _, _ = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                               IS_VARLEN, INDEX_64)
    t_c = i_t * C + tl.arange(0, C)
    m_c = t_c < seq_len
    r_hv = (bos + t_c) * HV + i_hv  # token rows of this chunk in the [B, T, HV, K] decays
    o_k = i_kb * BK + tl.arange(0, BK)
    m_ck = m_c[:, None] & (o_k < K)[None, :]
    b_g = tl.load(g + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
    if RAW_GATE:
        if HAS_DT_BIAS:
            b_g += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0).to(tl.float32)[None, :]
        b_g = kda_server_gate(b_g, tl.exp(tl.load(A_log + i_hv).to(tl.float32)), THRESHOLD)
    b_G = tl.cumsum(b_g, 0)
    if GATE_EXP2:
        b_G = b_G * RCP_LN2
    tl.store(g_cum + r_hv[:, None] * K + o_k[None, :], b_G, mask=m_ck)


@triton.jit
def max_of(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_pair_amax(
    q,
    k,
    g_cum,
    pair_amax,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """NVFP4 on KDA's pairwise operands takes its global amax over the chunk's whole operand tile (grid:
    chunks, value heads): writes pair_amax [chunks, heads, 4] = (|k_j e^(G_i - G_j)| over j < i, the same over
    j <= i, |K|, |Q|). exp is increasing, so per channel the largest pair over the rows i > j is the one with
    the largest G_i: max_i |k_jd| e^(G_id - G_jd) = |k_jd| e^(M_jd - G_jd), M_j = max over i > j of G_i (a
    reverse running max of G shifted by one row): the same value the pairs kernel forms for that pair, in
    O(C x K) instead of O(C^2 x K). Rows past the sequence end hold the chunk's last G and zero keys, as
    the reference's zero-padded chunk does (they are pairs i of the tile)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seq_len, _, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                 IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    t_c = i_t * C + o_c
    m_k = o_k < K
    m_ck = (t_c < seq_len)[:, None] & m_k[None, :]
    r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]  # token rows of this chunk in q, k
    n_real = seq_len - i_t * C  # rows of this chunk inside the sequence (may exceed C)
    x_c = bos + i_t * C
    b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
    b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
    x_g = g_cum + (x_c * HV + i_hv) * K + o_k[None, :]
    b_G = tl.load(x_g + (tl.minimum(o_c, n_real - 1) * HV * K)[:, None], mask=m_k[None, :], other=0)
    m_before = (o_c < C - 1)[:, None]  # the chunk's last row has no later row (row C is the next chunk's)
    b_Gn = tl.load(x_g + (tl.minimum(o_c + 1, n_real - 1) * HV * K)[:, None], mask=m_k[None, :], other=0)
    b_Gn = tl.where(m_before, b_Gn, float("-inf"))
    b_M = tl.associative_scan(b_Gn, 0, max_of, reverse=True)  # row j: max over rows i >= j + 1
    b_pk = tl.where(m_before, b_k * tl.exp(tl.where(m_before, b_M - b_G, 0.0)), 0.0)
    b_am_k = tile_amax(b_k)
    b_am_pk = tile_amax(b_pk)
    x_am = (i_c * tl.num_programs(1) + i_bh) * 4
    tl.store(pair_amax + x_am, b_am_pk)
    tl.store(pair_amax + x_am + 1, tl.maximum(b_am_pk, b_am_k))  # j <= i adds the diagonal: |k_j| e^0
    tl.store(pair_amax + x_am + 2, b_am_k)
    tl.store(pair_amax + x_am + 3, tile_amax(b_q))


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_pairs(
    q,
    k,
    g_cum,
    p_pairs,
    p_qk,
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
    GATE_EXP2: tl.constexpr = False,
):
    """KDA's pair products P_ij = sum_d k_id k_jd exp(G_id - G_jd) and P_qk (q_i for k_i), j <= i, for the
    rows of one sub-chunk of BC rows (grid: chunks x sub-chunks, value heads), summed over key blocks of BK
    columns: FLA's split of KDA's intra-chunk forward. Writes the [BC x BC] blocks on and below the
    diagonal of the chunk's rows of p_pairs and p_qk, and zeros in p_pairs' blocks above it (p_pairs is
    part of the training forward's residual, an op output: every element written; the intra kernel masks
    them, and finishes p_qk, A_qk, itself). Every pair goes through the sub-chunk's first real row f (exp(G_i - G_j) =
    exp(G_i - G_f) exp(G_f - G_j)): where the sub-chunk's decay range is at most DIAG_DOT_MAX_RANGE its whole
    row block is one product per key block; else the blocks before it one product each (both factors <= 1)
    and the diagonal block column by column. GATE_EXP2 (g_cum in log2 units): exp2 throughout, and the plan sets
    DIAG_DOT_MAX_RANGE below 0, so every diagonal block is column by column, as vLLM's Kimi-K3 kernels form them
    (chunk_kda_fwd_kernel_intra_token_parallel, then chunk_kda_fwd_kernel_inter_solve_fused off the diagonal)."""
    i_cs, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_s = i_cs // (C // BC), i_cs % (C // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seq_len, _, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                 IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    o_r = tl.arange(0, BC)
    n_real = seq_len - i_t * C  # rows of this chunk inside the sequence (may exceed C)
    x_c = bos + i_t * C  # token of the chunk's row 0
    r_b = i_s * BC + o_r
    m_b = r_b < n_real
    r_f = tl.minimum(i_s * BC, n_real - 1)
    x_out = ((x_c + r_b) * HV + i_hv)[:, None] * C

    # Every column j <= i goes through the sub-chunk's first real row f, exp(G_i - G_j) = exp(G_i - G_f)
    # exp(G_f - G_j): the columns before the sub-chunk with factors <= 1, its own columns with factors within
    # e^(+-DIAG_DOT_MAX_RANGE) where its decay range allows: then the sub-chunk's whole row block of P is one
    # [BC x BK] x [BK x C] dot per key block. Else the blocks before it one dot each, the diagonal block column by
    # column: exp(G_i - G_j) from the prefix difference masked to j <= i (docs/kernels-chunk.md)
    b_range = tl.max(tl.zeros([BK], dtype=tl.float32), axis=0)  # max |G_i - G_f| over the block's real rows
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_bk = m_b[:, None] & m_k[None, :]
        b_gf = tl.load(g_cum + ((x_c + r_f) * HV + i_hv) * K + o_k, mask=m_k, other=0)
        b_d = tl.where(m_bk, tl.load(g_cum + ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :],
                                     mask=m_bk, other=0) - b_gf[None, :], 0.0)
        b_range = tl.maximum(b_range, tl.max(tl.max(tl.abs(b_d), axis=1), axis=0))
    r_end = i_s * BC + BC  # the columns of this sub-chunk's row block: j < r_end
    if b_range <= DIAG_DOT_MAX_RANGE:
        m_col = (o_c < r_end) & (o_c < n_real)
        b_Pr = tl.zeros([BC, C], dtype=tl.float32)
        b_Pqr = tl.zeros([BC, C], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_bk = m_b[:, None] & m_k[None, :]
            m_jka = m_col[:, None] & m_k[None, :]
            x_b = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]
            b_gf = tl.load(g_cum + ((x_c + r_f) * HV + i_hv) * K + o_k, mask=m_k, other=0)
            b_Gb = tl.load(g_cum + ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_bk, other=0)
            b_el = gate_exp(tl.where(m_bk, b_Gb - b_gf[None, :], 0.0), GATE_EXP2)
            b_Ga = tl.load(g_cum + ((x_c + o_c) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jka, other=0)
            b_era = gate_exp(tl.where(m_jka, b_gf[None, :] - b_Ga, 0.0), GATE_EXP2)
            b_kra = tl.load(k + ((x_c + o_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jka,
                            other=0).to(tl.float32) * b_era
            b_Pr += sub_dot(tl.load(k + x_b, mask=m_bk, other=0).to(tl.float32) * b_el, tl.trans(b_kra),
                            DOT_PRECISION, BC >= 16)
            b_Pqr += sub_dot(tl.load(q + x_b, mask=m_bk, other=0).to(tl.float32) * b_el, tl.trans(b_kra),
                             DOT_PRECISION, BC >= 16)
        m_causal_r = r_b[:, None] >= o_c[None, :]
        m_out = m_b[:, None] & (o_c < r_end)[None, :]
        tl.store(p_pairs + x_out + o_c[None, :], tl.where(m_causal_r, b_Pr, 0.0), mask=m_b[:, None])  # whole rows
        tl.store(p_qk + x_out + o_c[None, :], tl.where(m_causal_r, b_Pqr, 0.0), mask=m_out)
    else:
        for i_j in range(0, i_s):
            r_j = i_j * BC + o_r
            m_j = r_j < n_real
            b_P = tl.zeros([BC, BC], dtype=tl.float32)
            b_Pq = tl.zeros([BC, BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_bk = m_b[:, None] & m_k[None, :]
                m_jk = m_j[:, None] & m_k[None, :]
                x_b = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]
                b_gf = tl.load(g_cum + ((x_c + r_f) * HV + i_hv) * K + o_k, mask=m_k, other=0)
                b_Gb = tl.load(g_cum + ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_bk, other=0)
                b_el = gate_exp(tl.where(m_b[:, None], b_Gb - b_gf[None, :], 0.0), GATE_EXP2)
                b_Gj = tl.load(g_cum + ((x_c + r_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
                b_er = gate_exp(tl.where(m_j[:, None], b_gf[None, :] - b_Gj, 0.0), GATE_EXP2)
                b_kr = tl.load(k + ((x_c + r_j) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jk,
                               other=0).to(tl.float32) * b_er
                b_P += sub_dot(tl.load(k + x_b, mask=m_bk, other=0).to(tl.float32) * b_el, tl.trans(b_kr),
                               DOT_PRECISION, BC >= 16)
                b_Pq += sub_dot(tl.load(q + x_b, mask=m_bk, other=0).to(tl.float32) * b_el, tl.trans(b_kr),
                                DOT_PRECISION, BC >= 16)
            tl.store(p_pairs + x_out + r_j[None, :], b_P, mask=m_b[:, None])
            tl.store(p_qk + x_out + r_j[None, :], b_Pq, mask=m_b[:, None])
        b_P = tl.zeros([BC, BC], dtype=tl.float32)
        b_Pq = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_bk = m_b[:, None] & m_k[None, :]
            x_b = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]
            b_k = tl.load(k + x_b, mask=m_bk, other=0).to(tl.float32)
            b_q = tl.load(q + x_b, mask=m_bk, other=0).to(tl.float32)
            b_G = tl.load(g_cum + ((x_c + r_b) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_bk, other=0)
            for jj in range(0, BC):
                r_j = i_s * BC + jj
                m_jk = m_k & (r_j + 0 * o_k < n_real)  # a [BK] mask: the interpreter refuses a scalar one in &
                b_kj = tl.load(k + ((x_c + r_j) * H + i_h) * K + o_k, mask=m_jk, other=0).to(tl.float32)
                b_gj = tl.load(g_cum + ((x_c + r_j) * HV + i_hv) * K + o_k, mask=m_jk, other=0)
                b_kje = b_kj[None, :] * gate_exp(tl.where((m_b & (o_r >= jj))[:, None], b_G - b_gj[None, :], 0.0),
                                                 GATE_EXP2)
                m_jj = o_r[None, :] == jj
                b_P += tl.where(m_jj, tl.sum(b_k * b_kje, 1)[:, None], 0.0)
                b_Pq += tl.where(m_jj, tl.sum(b_q * b_kje, 1)[:, None], 0.0)
        m_causal = o_r[:, None] >= o_r[None, :]
        tl.store(p_pairs + x_out + r_b[None, :], tl.where(m_causal, b_P, 0.0), mask=m_b[:, None])
        tl.store(p_qk + x_out + r_b[None, :], tl.where(m_causal, b_Pq, 0.0), mask=m_b[:, None])
        tl.store(p_pairs + x_out + o_c[None, :], tl.zeros([BC, C], dtype=tl.float32),
                 mask=m_b[:, None] & (o_c >= r_end)[None, :])  # the blocks above the diagonal


# ---- what both rounded pair kernels (this forward one, bwd_pairs' backward one) set up ------------------------
@triton.jit
def rounded_pair_rows(q, k, g_cum, i_s, i_t, bos, seq_len, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """The sub-chunk's rows over all key columns: (o_k, m_k, o_r, n_real (rows of the chunk inside the
    sequence, may exceed C), x_c (token of the chunk's row 0), r_b, m_b, m_bk, b_k, b_q, b_G); rows past the sequence
    end hold the chunk's last G, as in the reference's zero-padded g."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_r = tl.arange(0, BC)
    n_real = seq_len - i_t * C
    x_c = bos + i_t * C
    r_b = i_s * BC + o_r
    m_b = r_b < n_real
    m_bk = m_b[:, None] & m_k[None, :]
    x_b = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + x_b, mask=m_bk, other=0).to(tl.float32)
    b_q = tl.load(q + x_b, mask=m_bk, other=0).to(tl.float32)
    b_G = tl.load(g_cum + ((x_c + tl.minimum(r_b, n_real - 1)) * HV + i_hv)[:, None] * K + o_k[None, :],
                  mask=m_k[None, :], other=0)
    return o_k, m_k, o_r, n_real, x_c, r_b, m_b, m_bk, b_k, b_q, b_G


@triton.jit
def pair_amaxes(pair_amax, i_c, i_bh, PAIRS_NVFP4: tl.constexpr):
    """NVFP4's global amax of each pairwise operand over the chunk (pk, pq, |K|, |Q|: chunk_fwd_kernel_pair_amax);
    zeros, never read, without an NVFP4 pairwise operand."""
    if PAIRS_NVFP4:
        x_am = (i_c * tl.num_programs(1) + i_bh) * 4
        return (tl.load(pair_amax + x_am), tl.load(pair_amax + x_am + 1), tl.load(pair_amax + x_am + 2),
                tl.load(pair_amax + x_am + 3))
    else:
        return 0.0, 0.0, 0.0, 0.0


@triton.jit
def pair_column(k, g_cum, b_G, j, r_b, x_c, n_real, i_h, i_hv, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr):
    """Column j's key row k_j and e^(G_i - G_j) for the sub-chunk's rows, from the prefix difference masked to
    j <= i. (Through the sub-chunk's first real row for the columns before it, like the exact kernel, saves an exp
    per element but needs a second copy of the loop body, and is slower; measured:
    docs/kernels-chunk-measurements.md, "Rounded pair products".)"""
    m_jk = m_k & (j + 0 * o_k < n_real)  # a [BK] mask: the interpreter refuses a scalar one in &
    b_kj = tl.load(k + ((x_c + j) * H + i_h) * K + o_k, mask=m_jk, other=0).to(tl.float32)
    b_gj = tl.load(g_cum + ((x_c + tl.minimum(j, n_real - 1)) * HV + i_hv) * K + o_k, mask=m_k, other=0)
    b_e = tl.exp(tl.where((r_b >= j)[:, None], b_G - b_gj[None, :], 0.0))
    return b_kj, b_e


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_pairs_rounded(
    q,
    k,
    g_cum,
    p_pairs,
    p_qk,
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
    ACC_KEY_INTERACTION: tl.constexpr,
    ACC_KEY_INTERACTION_BLOCK: tl.constexpr,
    ACC_OUTPUT_SCORE: tl.constexpr,
    ACC_OUTPUT_SCORE_BLOCK: tl.constexpr,
    PAIRS_NVFP4: tl.constexpr,
    SHARES_PAIR_RHS: tl.constexpr,
):
    """KDA's pair products with rounding at key_interaction / output_score, for the rows of one sub-chunk
    of BC rows over all key columns (grid: chunks x sub-chunks, value heads): column by column, the
    per-pair operand k_j e^(G_i - G_j) (rows (i, j) over K) is formed, rounded per pair and reduced
    against the rounded rows of K / Q. Writes P (j < i) and P_qk (j <= i) for the columns up to the
    diagonal, and zeros in p_pairs' blocks above it (p_pairs is part of the training forward's residual, an
    op output: every element written; the intra kernel masks them). The pair operands' rows span all key
    columns (BK >= K): a row scale or an NVFP4 block sees the whole pair."""
    i_cs, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_s = i_cs // (C // BC), i_cs % (C // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seq_len, _, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                 IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    o_k, m_k, o_r, n_real, x_c, r_b, m_b, m_bk, b_k, b_q, b_G = rounded_pair_rows(q, k, g_cum, i_s, i_t, bos, seq_len,
                                                                                 i_h, i_hv, H, HV, K, C, BC, BK)
    b_gam_pk, b_gam_pq, b_gam_k, b_gam_q = pair_amaxes(pair_amax, i_c, i_bh, PAIRS_NVFP4)
    # the rounded lhs rows: key_interaction.lhs of K, output_score.lhs of Q (one scale per row over K)
    b_kl = qdq_operand(b_k, b_gam_k, Q_KEY_INTERACTION_LHS, 1, BC, BK, True)
    b_ql = qdq_operand(b_q, b_gam_q, Q_OUTPUT_SCORE_LHS, 1, BC, BK, True)
    x_out = ((x_c + r_b) * HV + i_hv)[:, None] * C
    for i_j in range(0, i_s + 1):
        b_P = tl.zeros([BC, BC], dtype=tl.float32)
        b_Pq = tl.zeros([BC, BC], dtype=tl.float32)
        for jj in range(0, BC):
            j = i_j * BC + jj
            # column j (up to the sub-chunk's last row)
            b_kj, b_e = pair_column(k, g_cum, b_G, j, r_b, x_c, n_real, i_h, i_hv, o_k, m_k, H, HV, K)
            b_pk = tl.where((r_b > j)[:, None], b_kj[None, :] * b_e, 0.0)
            b_pq = tl.where((r_b >= j)[:, None], b_kj[None, :] * b_e, 0.0)
            # the rounded rhs of every pair (i, j) of column j: b_pkq (key_interaction, read where j < i) and
            # b_pqq (output_score, j <= i)
            b_pqq = qdq_operand(b_pq, b_gam_pq, Q_OUTPUT_SCORE_RHS, 1, BC, BK, True)
            if SHARES_PAIR_RHS:
                # q.key_interaction.rhs: the same rows (they differ only on P's diagonal, never read), the same
                # rounding (forms.shares_pair_rhs)
                b_pkq = b_pqq
            else:
                b_pkq = qdq_operand(b_pk, b_gam_pk, Q_KEY_INTERACTION_RHS, 1, BC, BK, True)
            b_cp = acc_row_sum(b_kl * b_pkq, o_k, BK, ACC_KEY_INTERACTION, ACC_KEY_INTERACTION_BLOCK)
            b_cq = acc_row_sum(b_ql * b_pqq, o_k, BK, ACC_OUTPUT_SCORE, ACC_OUTPUT_SCORE_BLOCK)
            m_jj = (o_r == jj)[None, :]
            b_P += tl.where(m_jj, b_cp[:, None], 0.0)
            b_Pq += tl.where(m_jj, b_cq[:, None], 0.0)
        r_j = i_j * BC + o_r
        tl.store(p_pairs + x_out + r_j[None, :], b_P, mask=m_b[:, None])
        tl.store(p_qk + x_out + r_j[None, :], b_Pq, mask=m_b[:, None])
    tl.store(p_pairs + x_out + o_c[None, :], tl.zeros([BC, C], dtype=tl.float32),
             mask=m_b[:, None] & (o_c >= (i_s + 1) * BC)[None, :])  # the blocks above the diagonal


KERNELS = {
    "cumsum": chunk_fwd_kernel_cumsum,
    "pair_amax": chunk_fwd_kernel_pair_amax,
    "pairs": chunk_fwd_kernel_pairs,
    "pairs_rounded": chunk_fwd_kernel_pairs_rounded,
}


def chunk_fwd_cumsum(plan: "ChunkPlan", *, layout: "ChunkLayout", g, g_cum, raw_gate=None):
    """KDA's G = cumsum(g) within every chunk; with ``raw_gate`` = (A_log, dt_bias or None), of vLLM's gate of the
    raw gate g."""
    gate = {} if raw_gate is None else dict(A_log=raw_gate[0], dt_bias=raw_gate[1])
    constexprs = {} if raw_gate is None else dict(RAW_GATE=True, HAS_DT_BIAS=raw_gate[1] is not None,
                                                  THRESHOLD=SOFTPLUS_THRESHOLD)
    launch(plan.fwd_cumsum, dict(g=g, g_cum=g_cum, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
                                 T=layout.T, **gate), **constexprs)


def chunk_fwd_pair_amax(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, g_cum, pair_amax):
    """The chunk-wide amaxes of KDA's NVFP4 pairwise operands."""
    launch(plan.fwd_pair_amax, dict(q=q, k=k, g_cum=g_cum, pair_amax=pair_amax, cu_seqlens=layout.cu_seqlens,
                                    chunk_indices=layout.chunk_indices, T=layout.T))


def chunk_fwd_pairs(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, g_cum, p_pairs, p_qk, pair_amax):
    """KDA's pair products P and P_qk by sub-chunk (the rounded kernel reads ``pair_amax``, the others None)."""
    amaxes = {"pair_amax": pair_amax} if plan.pairs_rounded else {}
    launch(plan.fwd_pairs, dict(q=q, k=k, g_cum=g_cum, p_pairs=p_pairs, p_qk=p_qk, **amaxes,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, T=layout.T))
