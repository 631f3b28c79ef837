"""Triton code of the backward intra stage's endings: the key-blocked shares and hand-overs.

KDA with exact pair products hands dP, dP_qk and its fp32 shares of dq, dk, dG to
chunk_kda_bwd_kernel_pairs; GDN with exact pair products keeps its shares in memory per key block and
adds the pair gradients in a second key loop (docs/kernels-chunk.md, "Key blocks").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from la_compiler.kernels.chunk_snippets import GDN_BWD, GDN_PAIRS_DECAY, gdn_pair_block, lines

if TYPE_CHECKING:
    from la_compiler.kernels.chunk_codegen import ChunkParams

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

GDN_KEY_BLOCK_SHARES = (
    "# this key block's share of dq, dk (fp32, in the dq / dk buffers); dG (one per row) summed over blocks\n"
    "tl.store(dq + r_qk_v, b_dq, mask=m_ck)\n"
    "tl.store(dk + r_qk_v, b_dk, mask=m_ck)\n"
    "b_dGs += b_dG")


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def gdn_pairs_by_key_blocks(p: ChunkParams) -> str:
    """GDN's pair products once dA is known: P, P_qk recomputed over key blocks (for dbeta and dG), then a
    second key loop adds (dP ⊙ Γ) K + (dP ⊙ Γ)^T K + (dP_qk ⊙ Γ)^T Q to dk and (dP_qk ⊙ Γ) K to dq."""
    key_block = lines(
        "o_k = i_k * BK + tl.arange(0, BK)",
        "m_ck = m_c[:, None] & (o_k < K)[None, :]",
        "r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]",
        "r_qk_v = r_hv[:, None] * K + o_k[None, :]",
        "b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)",
        "b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)")
    return lines(
        "# P = (K K^T) ⊙ Γ and P_qk = (Q K^T) ⊙ Γ over the key blocks",
        GDN_BWD["LOAD_G"],
        "b_P = tl.zeros([C, C], dtype=tl.float32)",
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)",
        "for i_k in range(0, tl.cdiv(K, BK)):",
        _indented(key_block),
        _indented(gdn_pair_block(p)),
        GDN_PAIRS_DECAY,
        "b_dbeta += tl.sum(b_dA * b_P, 1)",
        "b_dP = b_dA * b_beta[:, None]",
        "b_M = b_dP * b_P + b_dPqk * b_Pqk",
        "b_dGs += tl.sum(b_M, 1) - tl.sum(b_M, 0)",
        "b_dKK = b_dP * b_Gam",
        "b_dQK = b_dPqk * b_Gam",
        "tl.debug_barrier()  # the shares below were stored by other threads in the key loop",
        "for i_k in range(0, tl.cdiv(K, BK)):",
        _indented(key_block),
        "    b_dk = tl.load(dk + r_qk_v, mask=m_ck, other=0) + tl.dot(b_dKK, b_k, input_precision=DOT_PRECISION) \\",
        "        + tl.dot(tl.trans(b_dKK), b_k, input_precision=DOT_PRECISION) \\",
        "        + tl.dot(tl.trans(b_dQK), b_q, input_precision=DOT_PRECISION)",
        "    b_dq = tl.load(dq + r_qk_v, mask=m_ck, other=0) + tl.dot(b_dQK, b_k, input_precision=DOT_PRECISION)",
        "    tl.store(dq + r_qk_v, b_dq, mask=m_ck)",
        "    tl.store(dk + r_qk_v, b_dk, mask=m_ck)",
        "# g -> G = cumsum(g): dg = reverse cumsum of dG within the chunk",
        "b_dg = tl.cumsum(b_dGs, 0, reverse=True)",
        GDN_BWD["STORE_DG"])
