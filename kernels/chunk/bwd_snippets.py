"""Triton code of the backward intra stage's endings: the key-blocked shares and hand-overs.

KDA with exact pair products hands dP, dP_qk and its fp32 shares of dq, dk, dG to
chunk_kda_bwd_kernel_pairs; GDN with exact pair products completes dT (hence dA and the pair products'
gradients) before its key loop, whose blocks then store their final dq, dk (docs/kernels-chunk.md, "Key
blocks").
"""
from __future__ import annotations

from la_compiler.kernels.chunk.snippets import GDN_BWD, GDN_PAIRS_DECAY, gdn_pair_block, lines, solve_grad
from la_compiler.kernels.chunk.params import ChunkParams

STORE_INPUT_GRADS = (
    "# g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk\n"
    "b_dg = tl.cumsum(b_dG, 0, reverse=True)\n"
    "${STORE_DG}\n"
    "tl.store(dq + r_qk_v, b_dq.to(dq.dtype.element_ty), mask=m_ck)\n"
    "tl.store(dk + r_qk_v, b_dk.to(dk.dtype.element_ty), mask=m_ck)")

HAND_OVER_SHARES = (
    "# this key block's share of dq, dk, dG (fp32) for chunk_kda_bwd_kernel_pairs\n"
    "tl.store(dq + r_qk_v, b_dq, mask=m_ck)\n"
    "tl.store(dk + r_qk_v, b_dk, mask=m_ck)\n"
    "tl.store(dg + r_qk_v, b_dG, mask=m_ck)")

HAND_OVER_PAIRS = (
    "# P from the forward recompute (chunk_kda_fwd_kernel_pairs; unwritten above the diagonal)\n"
    "b_P = tl.load(p_pairs + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_strict, other=0)\n"
    "b_dbeta += tl.sum(b_dA * b_P, 1)\n"
    "# the pair products' gradients run key block by key block (chunk_kda_bwd_kernel_pairs): hand over dP, dP_qk\n"
    "tl.store(dpair + r_hv[:, None] * (2 * C) + o_c[None, :], b_dA * b_beta[:, None], mask=m_c[:, None])\n"
    "tl.store(dpair + r_hv[:, None] * (2 * C) + C + o_c[None, :], b_dPqk, mask=m_c[:, None])")


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def da_from_dt(p: ChunkParams) -> str:
    """dA from dT through the solve, and the masked gradients of the two pair products' users."""
    return lines(
        "# T = solve(A): dA",
        solve_grad(p),
        "b_dA = tl.where(m_strict, b_dA, 0.0)",
        "b_dPqk = tl.where(m_causal, b_dAqk * scale, 0.0)")


DT_FROM_W = "b_dT += _gemm(b_dW, tl.trans(b_bk), GEMM_PRECISION)"

# GDN's key-blocked form (gdn_pair_grads_by_key_blocks): dT, hence dA, is complete before the key loop, so
# each key block adds the pair products' gradients and stores its final dq, dk once.
GDN_LOAD_G = lines(GDN_BWD["LOAD_G"], "b_eG = tl.exp(b_G)[:, None]")

GDN_STATE_SIDE_DT = lines(
    "# dT's share from W = T (beta exp(G) K), here rather than in the key loop: dW bk^T = -dV_new (bk h_n)^T",
    "b_X = tl.zeros([C, BV], dtype=tl.float32)",
    "for i_k in range(0, tl.cdiv(K, BK)):",
    "    o_k = i_k * BK + tl.arange(0, BK)",
    "    m_ck = m_c[:, None] & (o_k < K)[None, :]",
    "    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]",
    "    b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)",
    "    b_bk = b_k * (b_beta[:, None] * b_eG)",
    "    b_hn = tl.load(p_hn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)",
    "    b_X += _gemm(b_bk, b_hn, GEMM_PRECISION)",
    "b_dT -= _gemm(b_dvn, tl.trans(b_X), GEMM_PRECISION)")

GDN_DT_DONE = "# dT is complete (GDN_STATE_SIDE_DT): dBk below is this key block's only W-side gradient"

# GEMM_PRECISION, not DOT_PRECISION: with 16-bit GEMMs dP ⊙ Γ is multiplied in the input dtype, as FLA's
# chunk_bwd_dqkwg does (its ds in bf16): this stage 2.39 -> 2.16 ms at [8,4096,16,128] on the H200
# (docs/kernels-chunk.md, "Key blocks")
GDN_KEY_BLOCK_DONE = (
    "# the pair products' gradients: this key block's dq, dk are complete\n"
    "b_dk += _gemm(b_dKK, b_k, GEMM_PRECISION) + _gemm(tl.trans(b_dKK), b_k, GEMM_PRECISION) \\\n"
    "    + _gemm(tl.trans(b_dQK), b_q, GEMM_PRECISION)\n"
    "b_dq += _gemm(b_dQK, b_k, GEMM_PRECISION)\n"
    "tl.store(dq + r_qk_v, b_dq.to(dq.dtype.element_ty), mask=m_ck)\n"
    "tl.store(dk + r_qk_v, b_dk.to(dk.dtype.element_ty), mask=m_ck)\n"
    "b_dGs += b_dG")

GDN_FINISH = lines(
    "# g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk",
    "b_dg = tl.cumsum(b_dGs, 0, reverse=True)",
    GDN_BWD["STORE_DG"])


def gdn_pair_grads_before_key_loop(p: ChunkParams) -> str:
    """GDN's dA, then P, P_qk recomputed over key blocks (for dbeta and dG) and the pair products'
    gradients dP ⊙ Γ, dP_qk ⊙ Γ, which each key block multiplies by its K, Q columns."""
    key_block = lines(
        "o_k = i_k * BK + tl.arange(0, BK)",
        "m_ck = m_c[:, None] & (o_k < K)[None, :]",
        "r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]",
        "b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)",
        "b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)")
    return lines(
        da_from_dt(p),
        "# P = (K K^T) ⊙ Γ and P_qk = (Q K^T) ⊙ Γ over the key blocks",
        "b_P = tl.zeros([C, C], dtype=tl.float32)",
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)",
        "for i_k in range(0, tl.cdiv(K, BK)):",
        _indented(key_block),
        _indented(gdn_pair_block(p)),
        GDN_PAIRS_DECAY,
        "b_dbeta += tl.sum(b_dA * b_P, 1)",
        "b_dP = b_dA * b_beta[:, None]",
        "b_M = b_dP * b_P + b_dPqk * b_Pqk",
        "b_dGs = tl.sum(b_M, 1) - tl.sum(b_M, 0)  # dG, summed with each key block's share below",
        "b_dKK = b_dP * b_Gam",
        "b_dQK = b_dPqk * b_Gam")
