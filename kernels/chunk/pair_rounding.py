"""Template values of KDA's rounded pair-product kernels (chunk_fwd_pairs_rounded, chunk_bwd_pairs_rounded): key_interaction / output_score rounded per pair, one sub-chunk of rows per program.

The pairwise operand k_j e^(G_i - G_j) (row (i, j) over the key channels) must exist to be rounded, so
these kernels hold whole key rows ([BC x K] tiles) and run column by column. Where the reference
rounds, and why the backward needs no rounding on the column side: docs/kernels-chunk.md, "Rounded
pair products".
"""
from __future__ import annotations

from la_compiler.kernels.chunk.snippets import PAIRWISE_SITES, _nvfp4, _op, acc_row_sum, lines
from la_compiler.kernels.common.codegen import render
from la_compiler.kernels.chunk.params import ChunkParams

ROWS = lines(
    "o_r = tl.arange(0, BC)",
    "n_real = seq_len - i_t * C  # rows of this chunk inside the sequence (may exceed C)",
    "x_c = bos + i_t * C  # token of the chunk's row 0",
    "r_b = i_s * BC + o_r",
    "m_b = r_b < n_real",
    "m_bk = m_b[:, None] & m_k[None, :]",
    "x_b = ((x_c + r_b) * H + i_h)[:, None] * K + o_k[None, :]",
    "b_k = tl.load(k + x_b, mask=m_bk, other=0).to(tl.float32)",
    "b_q = tl.load(q + x_b, mask=m_bk, other=0).to(tl.float32)",
    "# rows past the sequence end hold the chunk's last G, as in the reference's zero-padded g",
    "b_G = tl.load(g_cum + ((x_c + tl.minimum(r_b, n_real - 1)) * HV + i_hv)[:, None] * K + o_k[None, :],",
    "              mask=m_k[None, :], other=0)")

# column j (up to the sub-chunk's last row): e^(G_i - G_j) from the prefix difference, masked to j <= i. (Through
# the sub-chunk's first real row for the columns before it, like the exact kernel, saves an exp per element but
# needs a second copy of the loop body: slower on the H200, 14.4 against 11.7 ms per f+b at KDA [8,4096,16,128].)
PAIR_COLUMN = lines(
    "m_jk = m_k & (j + 0 * o_k < n_real)  # a [BK] mask: the interpreter refuses a scalar one in &",
    "b_kj = tl.load(k + ((x_c + j) * H + i_h) * K + o_k, mask=m_jk, other=0).to(tl.float32)",
    "b_gj = tl.load(g_cum + ((x_c + tl.minimum(j, n_real - 1)) * HV + i_hv) * K + o_k, mask=m_k, other=0)",
    "b_e = tl.exp(tl.where((r_b >= j)[:, None], b_G - b_gj[None, :], 0.0))",
    "b_pk = tl.where((r_b > j)[:, None], b_kj[None, :] * b_e, 0.0)",
    "b_pq = tl.where((r_b >= j)[:, None], b_kj[None, :] * b_e, 0.0)")

# row i (>= this sub-chunk's first row, inside the sequence) as [1 x BK] tiles: the column side of the backward
PAIR_ROW = lines(
    "x_i = ((x_c + i) * H + i_h) * K + o_k[None, :]",
    "b_ki = tl.load(k + x_i, mask=m_k[None, :], other=0).to(tl.float32)",
    "b_qi = tl.load(q + x_i, mask=m_k[None, :], other=0).to(tl.float32)",
    "b_gi = tl.load(g_cum + ((x_c + i) * HV + i_hv) * K + o_k[None, :], mask=m_k[None, :], other=0)")


# the backward's column side: rows i in the blocks after this one, as products through its last real row l
COLUMN_BLOCKS = '''# column side, rows i in blocks after this one: e^(G_i - G_j) = e^(G_i - G_l) e^(G_l - G_j) through this
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
    ${BLOCK_OPERANDS}
    b_ei = tl.exp(tl.where(m_i[:, None], tl.load(g_cum + ((x_c + r_i) * HV + i_hv)[:, None] * K + o_k[None, :],
                                                 mask=m_ik, other=0) - b_gl[None, :], 0.0))
    x_pi = ((x_c + r_i) * HV + i_hv) * (2 * C)
    b_dPt = tl.load(dpair + x_pi[None, :] + r_b[:, None], mask=m_i[None, :], other=0)
    b_dQt = tl.load(dpair + x_pi[None, :] + C + r_b[:, None], mask=m_i[None, :], other=0)
    b_dR += _sub_dot(b_dPt, b_klb * b_ei, DOT_PRECISION, BC >= 16) \\
        + _sub_dot(b_dQt, b_qlb * b_ei, DOT_PRECISION, BC >= 16)
b_er = tl.exp(tl.where(m_b[:, None], b_gl[None, :] - b_G, 0.0))
b_dk += b_er * b_dR
b_dG -= b_er * b_k * b_dR
'''

# the backward's column side, rows i one by one: of this block (after COLUMN_BLOCKS), or of every later block
COLUMN_ROWS = '''for i in range(i_s * BC, tl.minimum(n_real, ${ROWS_END})):
    ${PAIR_ROW}
    ${ROW_I_OPERANDS}
    x_pi = ((x_c + i) * HV + i_hv) * (2 * C)
    b_dPi = tl.load(dpair + x_pi + r_b, mask=r_b < i, other=0)
    b_dQi = tl.load(dpair + x_pi + C + r_b, mask=r_b <= i, other=0)
    b_e = tl.exp(tl.where((r_b <= i)[:, None], b_gi - b_G, 0.0))
    b_x = (b_dPi[:, None] * b_kli + b_dQi[:, None] * b_qli) * b_e
    b_dk += b_x
    b_dG -= b_x * b_k
'''


def column_side_by_products(p: ChunkParams) -> bool:
    """The backward's column side takes the blocks after the sub-chunk as products unless an lhs row is
    NVFP4-rounded: its [BC x K] block QDQ made the kernel slower on the H200 (KDA [8,4096,16,128], f+b ms of
    the backward pairs kernel: FP8 all sites 11.9 by products against 13.4 row by row; NVFP4 32.2 against 24.8)."""
    return not any(_nvfp4(p, f"{site}.lhs") for site in PAIRWISE_SITES)


def _column_side(p: ChunkParams) -> str:
    row_values = {"PAIR_ROW": PAIR_ROW, "ROW_I_OPERANDS": _row_operands(p, "b_ki", "b_qi", "1", tag="_i")}
    if not column_side_by_products(p):
        return render(COLUMN_ROWS, {**row_values, "ROWS_END": "C"}, where="rounded pairs column rows")
    return lines(
        render(COLUMN_BLOCKS, {"BLOCK_OPERANDS": _row_operands(p, "b_kb", "b_qb", "BC", tag="_blk")},
               where="rounded pairs column blocks"),
        "# column side, rows i of this block (i >= j), one by one",
        render(COLUMN_ROWS, {**row_values, "ROWS_END": "i_s * BC + BC"}, where="rounded pairs column rows"))


def kda_pairs_nvfp4(p: ChunkParams) -> bool:
    """NVFP4 at a pairwise site: its global amax spans the chunk (chunk_kda_fwd_kernel_pair_amax first)."""
    return any(_nvfp4(p, f"{site}.{side}") for site in PAIRWISE_SITES for side in ("lhs", "rhs"))


def _global_amax(p: ChunkParams) -> str:
    if not kda_pairs_nvfp4(p):
        return "# no NVFP4 pairwise operand: no chunk-wide amax"
    return lines(
        "# NVFP4's global amax of each pairwise operand over the chunk (chunk_kda_fwd_kernel_pair_amax)",
        "x_am = (i_c * tl.num_programs(1) + i_bh) * 4",
        "b_gam_pk = tl.load(pair_amax + x_am)",
        "b_gam_pq = tl.load(pair_amax + x_am + 1)",
        "b_gam_k = tl.load(pair_amax + x_am + 2)",
        "b_gam_q = tl.load(pair_amax + x_am + 3)")


def _row_operands(p: ChunkParams, k: str, q: str, rows: str, tag: str = "") -> str:
    """The rounded lhs rows: key_interaction.lhs of K, output_score.lhs of Q (one scale per row over K)."""
    return lines(
        _op(p, "key_interaction.lhs", k, 1, k.replace("b_k", "b_kl"), (rows, "BK"), "b_gam_k", tag),
        _op(p, "output_score.lhs", q, 1, q.replace("b_q", "b_ql"), (rows, "BK"), "b_gam_q", tag))


def shares_pair_rhs(p: ChunkParams) -> bool:
    """key_interaction.rhs and output_score.rhs round the same rows k_j e^(G_i - G_j) (i > j; they differ
    only on the diagonal) in the same per-row format: one QDQ serves both. P's diagonal, where they
    differ, is never read (A is strictly lower; dP is masked to i > j). NVFP4's global amaxes differ
    (the causal tile holds the diagonal), so NVFP4 rounds twice."""
    ops = dict(p.operands)
    lhs, rhs = ops.get("key_interaction.rhs"), ops.get("output_score.rhs")
    return lhs == rhs and (lhs is None or not lhs.startswith("nvfp4"))


def _pair_operands(p: ChunkParams) -> str:
    """The rounded rhs of every pair (i, j) of column j: b_pkq (key_interaction, read where j < i) and
    b_pqq (output_score, j <= i)."""
    pq = _op(p, "output_score.rhs", "b_pq", 1, "b_pqq", ("BC", "BK"), "b_gam_pq")
    if shares_pair_rhs(p):
        return lines(pq, "b_pkq = b_pqq  # q.key_interaction.rhs: the same rows, the same rounding")
    return lines(_op(p, "key_interaction.rhs", "b_pk", 1, "b_pkq", ("BC", "BK"), "b_gam_pk"), pq)


def fwd_values(p: ChunkParams) -> dict[str, str]:
    return {
        "ROWS": ROWS, "GLOBAL_AMAX": _global_amax(p), "ROW_OPERANDS": _row_operands(p, "b_k", "b_q", "BC"),
        "PAIR_COLUMN": PAIR_COLUMN, "PAIR_OPERANDS": _pair_operands(p),
        "ROW_SUMS": lines(acc_row_sum(p, "key_interaction", "b_cp", "b_kl * b_pkq"),
                          acc_row_sum(p, "output_score", "b_cq", "b_ql * b_pqq"))}


def bwd_values(p: ChunkParams) -> dict[str, str]:
    return {
        "ROWS": ROWS, "GLOBAL_AMAX": _global_amax(p), "ROW_OPERANDS": _row_operands(p, "b_k", "b_q", "BC"),
        "PAIR_COLUMN": PAIR_COLUMN, "PAIR_OPERANDS": _pair_operands(p), "COLUMN_SIDE": _column_side(p)}
