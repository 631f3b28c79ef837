"""The forward intra stage of KDA: A, A_qk from the pair products that chunk_fwd_kernel_pairs left (P in p_pairs,
P_qk in A_qk, G in g_cum), the solve and the W / U half with the decayed keys (the device functions of
chunk/fwd_intra.py), one program per chunk x value head.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import cast_kept, chunk_program
from la_compiler.kernels.chunk.fwd_intra import solve, wu_half
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_intra_kda(
    k,
    v,
    beta,
    g_cum,
    w,
    u,
    kd,
    A_qk,
    t_out,
    p_pairs,
    p_qk,
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
    STORE_T: tl.constexpr,
    SOLVE: tl.constexpr,
    DEGREE: tl.constexpr,
    Q_WY_KEY_LHS: tl.constexpr,
    Q_WY_KEY_RHS: tl.constexpr,
    Q_WY_VALUE_LHS: tl.constexpr,
    Q_WY_VALUE_RHS: tl.constexpr,
    ACC_WY_KEY: tl.constexpr,
    ACC_WY_KEY_BLOCK: tl.constexpr,
    ACC_WY_VALUE: tl.constexpr,
    ACC_WY_VALUE_BLOCK: tl.constexpr,
    FACTORED_WY: tl.constexpr,
    W_Q: tl.constexpr,
    W_BLOCK: tl.constexpr,
    W_AMAX_PASS: tl.constexpr,
    GATE_EXP2: tl.constexpr = False,
):
    """Everything of one KDA chunk that does not depend on the state: A = strict_tril(diag(beta) P);
    T = (I + A)^-1; W = T diag(beta)(exp(G) ⊙ K); U = T diag(beta) V; A_qk = scale tril(P_qk) (P_qk read from
    p_qk: A_qk's own buffer (in place) unless A_qk is a 16-bit part of the residual); T itself when STORE_T;
    kd = K ⊙ exp(G_C - G) for the h and dh stages. Keys in blocks of BK columns (W's columns are independent)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    t_c = i_t * C + o_c
    m_c = t_c < seq_len
    r_hv = (bos + t_c) * HV + i_hv  # token rows of this chunk in the [B, T, HV, ..] tensors

    b_beta = tl.load(beta + r_hv, mask=m_c, other=0).to(tl.float32)
    m_strict = o_c[:, None] > o_c[None, :]
    m_causal = o_c[:, None] >= o_c[None, :]
    # P, P_qk from chunk_fwd_kernel_pairs (the blocks above the diagonal are unwritten: masked here)
    b_P = tl.load(p_pairs + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_causal, other=0)
    b_Pqk = tl.load(p_qk + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_causal, other=0)
    b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)
    b_Aqk = tl.where(m_causal, b_Pqk * scale, 0.0)
    tl.store(A_qk + r_hv[:, None] * C + o_c[None, :], cast_kept(b_Aqk, A_qk, GEMM_PRECISION), mask=m_c[:, None])

    b_T = solve(b_A, p_pairs, beta, bos, i_t, seq_len, i_hv, o_c, HV, C, True, SOLVE, DEGREE, DOT_PRECISION)
    if STORE_T:  # the backward's recompute keeps T for the input-gradient stage (no second solve)
        tl.store(t_out + r_hv[:, None] * C + o_c[None, :], cast_kept(b_T, t_out, GEMM_PRECISION), mask=m_c[:, None])

    # G per key block from g_cum (chunk_fwd_kernel_cumsum wrote it)
    wu_half(k, v, g_cum, w, u, kd, b_T, b_beta, None, bos, i_t, seq_len, t_c, m_c, r_hv, i_h, i_hv, H, HV, K, V, C,
            BK, BV, GEMM_PRECISION, True, Q_WY_KEY_LHS, Q_WY_KEY_RHS, Q_WY_VALUE_LHS, Q_WY_VALUE_RHS, ACC_WY_KEY,
            ACC_WY_KEY_BLOCK, ACC_WY_VALUE, ACC_WY_VALUE_BLOCK, FACTORED_WY, W_Q, W_BLOCK, W_AMAX_PASS, GATE_EXP2)


KERNELS = {"intra_kda": chunk_fwd_kernel_intra_kda}


def chunk_fwd_intra_kda(plan: "ChunkPlan", *, layout: "ChunkLayout", k, v, beta, g_cum, w, u, kd, A_qk, t_out, p_pairs,
                        scale, p_qk=None):
    """A, A_qk and the solve from the pairs kernel's P, P_qk, then W, U and kd, of every KDA chunk;
    T = (I + A)^-1 into ``t_out`` where it is given. ``p_qk``: where the pairs kernel left P_qk (default: in
    A_qk, finished in place)."""
    launch(plan.fwd_intra, dict(k=k, v=v, beta=beta, g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk, t_out=t_out,
                                p_pairs=p_pairs, p_qk=A_qk if p_qk is None else p_qk,
                                cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
                                T=layout.T),
           STORE_T=t_out is not None)
