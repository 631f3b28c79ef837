"""The backward's state-gradient stage (``chunk_bwd_kernel_dh``): one program per value block x sequence x value
head walks the sequence's chunks in reverse, carrying dS, the gradient of the chunk's outgoing state (dht at the
end; identity through the state quantizer). Each chunk stores dS into dh (the intra stage reads it), forms
dV_new = A_qk^T dO + K_d dS with K_d = K ⊙ exp(G_C - G) (KDA: the forward recompute's kd; GDN computes it here,
its decay being one number per row) and takes dS to the chunk's start:
dS <- exp(G_C) dS + scale (Q ⊙ exp G)^T dO - W^T dV_new; dh0 = dS at the sequence's start. The operand sites
output_value.lhs (A_qk), state_update.lhs (K_d) and output_state.lhs (Q ⊙ exp G) are rounded as in the forward,
identity straight-through. docs/kernels-chunk.md derives it.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import cast_for, gemm, qdq_operand
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_dh(
    q,
    k,
    kd,
    w,
    g_cum,
    A_qk,
    do,
    dht,
    dh,
    dv_new,
    dh0,
    cu_seqlens,
    chunk_offsets,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEMM_PRECISION: tl.constexpr,
    KDA: tl.constexpr,
    STATE_VK: tl.constexpr,
    Q_OUTPUT_VALUE_LHS: tl.constexpr,
    Q_STATE_UPDATE_LHS: tl.constexpr,
    Q_OUTPUT_STATE_LHS: tl.constexpr,
):
    """The state gradient, chunk by chunk in reverse (one program per value block x sequence x value head).
    With dS the gradient of the chunk's outgoing state (identity through the state quantizer):
    dV_new = A_qk^T dO + (K ⊙ exp(G_C - G)) dS;  dS_n = scale (Q ⊙ exp G)^T dO + exp(G_C) dS - W^T dV_new.
    dh[chunk] keeps the dS of every chunk's end for the intra-chunk stage. kd: KDA's K ⊙ exp(G_C - G) from the
    forward recompute (GDN computes it here: its decay is one number per row)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = (i_nh // HV).to(tl.int64), i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        seq_len = T
        boh = i_n * tl.cdiv(T, C)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    # a [BK, BV] state tile in dht / dh0: [K, V], or [V, K] for the vk layout
    if STATE_VK:
        o_state = o_k[:, None] + o_v[None, :] * K
    else:
        o_state = o_k[:, None] * V + o_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh * K * V + o_state, mask=m_h, other=0).to(tl.float32)

    for i_r in range(0, tl.cdiv(seq_len, C)):
        i_t = tl.cdiv(seq_len, C) - 1 - i_r
        tl.store(dh + ((boh + i_t) * HV + i_hv) * K * V + o_h, cast_for(b_dh, dh, GEMM_PRECISION), mask=m_h)
        t_c = i_t * C + o_c
        m_c = t_c < seq_len
        r_hv = (bos + t_c) * HV + i_hv
        r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
        m_ck = m_c[:, None] & m_k[None, :]
        m_cv = m_c[:, None] & m_v[None, :]
        b_do = tl.load(do + r_hv[:, None] * V + o_v[None, :], mask=m_cv, other=0).to(tl.float32)
        b_A = tl.load(A_qk + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0).to(tl.float32)
        i_last = bos + tl.minimum(i_t * C + C, seq_len) - 1
        # K_d and the chunk decay exp(G_C) of dS
        if KDA:  # K ⊙ exp(G_C - G) from the forward recompute's intra stage (its decayed keys)
            b_kd = tl.load(kd + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
            b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)
            b_dlast = tl.exp(b_glast)[:, None]
        else:
            b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
            b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)
            b_glast = tl.load(g_cum + i_last * HV + i_hv)
            b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]
            b_dlast = tl.exp(b_glast)
        b_A = qdq_operand(b_A, 0.0, Q_OUTPUT_VALUE_LHS, 1, C, C, False)
        b_kd = qdq_operand(b_kd, 0.0, Q_STATE_UPDATE_LHS, 0, C, BK, False)
        b_dv = gemm(tl.trans(b_A), b_do, GEMM_PRECISION) + gemm(b_kd, b_dh, GEMM_PRECISION)
        tl.store(dv_new + r_hv[:, None] * V + o_v[None, :], cast_for(b_dv, dv_new, GEMM_PRECISION), mask=m_cv)
        b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
        if KDA:
            b_g = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
            b_qg = b_q * tl.exp(b_g)
        else:
            b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)
            b_qg = b_q * tl.exp(b_g)[:, None]
        b_qg = qdq_operand(b_qg, 0.0, Q_OUTPUT_STATE_LHS, 1, C, BK, False)
        b_w = tl.load(w + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
        b_dh = b_dh * b_dlast + scale * gemm(tl.trans(b_qg), b_do, GEMM_PRECISION) \
            - gemm(tl.trans(b_w), b_dv, GEMM_PRECISION)

    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh * K * V + o_state, b_dh, mask=m_h)


KERNELS = {"dh": chunk_bwd_kernel_dh}


def chunk_bwd_dh(plan: "ChunkPlan", *, layout: "ChunkLayout", q, k, kd, w, g_cum, A_qk, do, dht, dh, dv_new, dh0,
                 scale):
    """Walks every sequence's chunks in reverse: dh (the state gradient at every chunk's end), dV_new and dh0 (None:
    no initial state) from dht (None: zeros)."""
    launch(plan.bwd_dh, dict(q=q, k=k, kd=kd, w=w, g_cum=g_cum, A_qk=A_qk, do=do, dht=dht, dh=dh, dv_new=dv_new,
                             dh0=dh0, cu_seqlens=layout.cu_seqlens, chunk_offsets=layout.chunk_offsets, scale=scale,
                             T=layout.T),
           USE_INITIAL_STATE=dh0 is not None, USE_FINAL_STATE_GRADIENT=dht is not None)
