"""The forward's output stage (``chunk_fwd_kernel_o``): one program per value block x chunk x value head forms
O = scale (Q ⊙ exp G) h_n + A_qk V_new from the chunk-start state h_n and the values V_new that the h stage
stored and the intra stage's A_qk (scale tril(Q K^T ⊙ Γ)). The GEMM operand sites output_state.lhs / .rhs
(Q ⊙ exp G, h_n) and output_value.lhs / .rhs (A_qk, V_new) are rounded here, their accumulators emulated, or a
product runs on grid values (``FACTORED_OUTPUT_STATE`` / ``FACTORED_OUTPUT_VALUE``). An NVFP4 h_n or V_new takes
its global amax over all value blocks of the operand, of which the program holds one. docs/kernels-chunk.md
derives it.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import (acc_gemm, cast_for, chunk_program, grid_gemm, grid_operand, qdq_operand,
                                              tile_amax)
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit
def value_blocks_amax(p_rows, m_rows, V: tl.constexpr, BV: tl.constexpr):
    """max |x| over the rows ``p_rows`` (pointers to their first value column, valid where ``m_rows``) of a
    [.. x V] operand, read value block by value block: the global amax of an NVFP4 operand that spans every value
    block (h_n, V_new) where the program's tile holds one."""
    b_amax = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
    for i_vb in range(0, tl.cdiv(V, BV)):
        o_vb = i_vb * BV + tl.arange(0, BV)
        b_x = tl.load(p_rows[:, None] + o_vb[None, :], mask=m_rows[:, None] & (o_vb < V)[None, :], other=0)
        b_amax = tl.maximum(b_amax, tile_amax(b_x))
    return b_amax


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_o(
    q,
    g_cum,
    A_qk,
    h,
    v_new,
    o,
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
    Q_OUTPUT_STATE_LHS: tl.constexpr,
    Q_OUTPUT_STATE_RHS: tl.constexpr,
    ACC_OUTPUT_STATE: tl.constexpr,
    ACC_OUTPUT_STATE_BLOCK: tl.constexpr,
    FACTORED_OUTPUT_STATE: tl.constexpr,
    Q_OUTPUT_VALUE_LHS: tl.constexpr,
    Q_OUTPUT_VALUE_RHS: tl.constexpr,
    ACC_OUTPUT_VALUE: tl.constexpr,
    ACC_OUTPUT_VALUE_BLOCK: tl.constexpr,
    FACTORED_OUTPUT_VALUE: tl.constexpr,
    GATE_EXP2: tl.constexpr = False,
):
    """O = scale (Q ⊙ exp G) h_n + A_qk V_new (one program per value block x chunk x value head). GATE_EXP2 (KDA, G
    in log2 units): vLLM's chunk_gla_fwd_o_gk, ((scale Q in q's dtype) ⊙ exp2 G) h_n + A_qk V_new."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_cv = m_c[:, None] & m_v[None, :]

    b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
    if KDA:
        b_g = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
        if GATE_EXP2:
            b_q = cast_for(b_q * scale, q, GEMM_PRECISION).to(tl.float32)
            b_qg = b_q * tl.exp2(b_g)
        else:
            b_qg = b_q * tl.exp(b_g)
    else:
        b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)
        b_qg = b_q * tl.exp(b_g)[:, None]
    p_h = h + (i_chunk * HV + i_hv) * K * V + o_k * V  # h_n's rows
    b_h = tl.load(p_h[:, None] + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
    # NVFP4 h_n / V_new: the global amax over all of V (b_gam_*: unused by the other formats)
    if Q_OUTPUT_STATE_RHS == "nvfp4":
        b_gam_h = value_blocks_amax(p_h, m_k, V, BV)
    else:
        b_gam_h = 0.0
    if Q_OUTPUT_VALUE_RHS == "nvfp4":
        b_gam_vn = value_blocks_amax(v_new + r_hv * V, m_c, V, BV)
    else:
        b_gam_vn = 0.0
    if FACTORED_OUTPUT_STATE:
        b_s_qg, b_q_qg = grid_operand(b_qg, Q_OUTPUT_STATE_LHS, 1)
        b_s_h, b_q_h = grid_operand(b_h, Q_OUTPUT_STATE_RHS, 0)
        b_os = grid_gemm(b_q_qg, b_q_h, b_s_qg, b_s_h, GEMM_PRECISION)
    else:
        b_qg = qdq_operand(b_qg, 0.0, Q_OUTPUT_STATE_LHS, 1, C, BK, False)
        b_h = qdq_operand(b_h, b_gam_h, Q_OUTPUT_STATE_RHS, 0, BK, BV, True)
        b_os = acc_gemm(b_qg, b_h, GEMM_PRECISION, BK, ACC_OUTPUT_STATE, ACC_OUTPUT_STATE_BLOCK)
    if GATE_EXP2:  # scale is in Q
        b_o = b_os
    else:
        b_o = b_os * scale
    b_A = tl.load(A_qk + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0).to(tl.float32)
    b_v = tl.load(v_new + r_hv[:, None] * V + o_v[None, :], mask=m_cv, other=0)
    if FACTORED_OUTPUT_VALUE:
        b_s_A, b_q_A = grid_operand(b_A, Q_OUTPUT_VALUE_LHS, 1)
        b_s_v, b_q_v = grid_operand(b_v, Q_OUTPUT_VALUE_RHS, 0)
        b_ov = grid_gemm(b_q_A, b_q_v, b_s_A, b_s_v, GEMM_PRECISION)
    else:
        b_A = qdq_operand(b_A, 0.0, Q_OUTPUT_VALUE_LHS, 1, C, C, False)
        b_v = qdq_operand(b_v, b_gam_vn, Q_OUTPUT_VALUE_RHS, 0, C, BV, True)
        b_ov = acc_gemm(b_A, b_v, GEMM_PRECISION, C, ACC_OUTPUT_VALUE, ACC_OUTPUT_VALUE_BLOCK)
    b_o += b_ov
    tl.store(o + r_hv[:, None] * V + o_v[None, :], cast_for(b_o, o, GEMM_PRECISION), mask=m_cv)


KERNELS = {"o": chunk_fwd_kernel_o}


def chunk_fwd_o(plan: "ChunkPlan", *, layout: "ChunkLayout", q, g_cum, A_qk, h, v_new, o, scale):
    """o of every chunk from its chunk-start state h and V_new."""
    launch(plan.fwd_o, dict(q=q, g_cum=g_cum, A_qk=A_qk, h=h, v_new=v_new, o=o, cu_seqlens=layout.cu_seqlens,
                            chunk_indices=layout.chunk_indices, scale=scale, T=layout.T))
