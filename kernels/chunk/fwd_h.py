"""The forward's state stage (``chunk_fwd_kernel_h``): one program per value block x sequence x value head walks
the sequence's chunks in order, carrying the state h_n (h0 at the start, through the state quantizer). Each chunk
stores h_n (the output stage reads it), forms V_new = U - W h_n (stored: the output stage's values) and takes the
state to the chunk's end: h_n+1 = exp(G_C) h_n + (K ⊙ exp(G_C - G))^T V_new, then the state quantizer; the final
state goes to ht. The GEMM operand sites state_read.rhs (h_n) and state_update.lhs / .rhs (K_d, V_new) are rounded
here, their accumulators emulated, or the state update runs on grid values (``FACTORED_STATE_UPDATE``). KDA's
K ⊙ exp(G_C - G) comes from the intra stage (kd); GDN's decay, one number per row, is applied here, to K's rows,
or to V_new's where no state_update operand is rounded (``GDN_DECAYS_VALUES``). docs/kernels-chunk.md derives it.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import (acc_gemm, cast_for, gate_exp, gemm, grid_gemm, grid_operand, qdq_operand,
                                              qdq_state)
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_fwd_kernel_h(
    k,
    kd,
    w,
    u,
    g_cum,
    h,
    v_new,
    h0,
    ht,
    cu_seqlens,
    chunk_offsets,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEMM_PRECISION: tl.constexpr,
    KDA: tl.constexpr,
    STATE_VK: tl.constexpr,
    Q_STATE_READ_RHS: tl.constexpr,
    ACC_STATE_READ: tl.constexpr,
    ACC_STATE_READ_BLOCK: tl.constexpr,
    Q_STATE_UPDATE_LHS: tl.constexpr,
    Q_STATE_UPDATE_RHS: tl.constexpr,
    ACC_STATE_UPDATE: tl.constexpr,
    ACC_STATE_UPDATE_BLOCK: tl.constexpr,
    FACTORED_STATE_UPDATE: tl.constexpr,
    GDN_DECAYS_VALUES: tl.constexpr,
    STATE_Q: tl.constexpr,
    STATE_TS: tl.constexpr,
    STATE_BLOCK: tl.constexpr,
    GATE_EXP2: tl.constexpr = False,
):
    """The state recurrence over the chunks of one sequence (one program per value block x sequence x
    value head): h_n is stored (rounded) for the output stage; V_new = U - W h_n;
    h_n+1 = exp(G_C) h_n + (K ⊙ exp(G_C - G))^T V_new, then the state quantizer. kd: KDA's K ⊙ exp(G_C - G)
    from the intra stage. GDN applies its decay (one number per row) here, to K's rows, or to V_new's where no
    state_update operand is rounded (GDN_DECAYS_VALUES). STATE_BLOCK N > 0: the state quantizer's scales are per
    key row x N values, whole blocks in a value tile that is a multiple of N or holds all of V."""
    tl.static_assert(STATE_BLOCK == 0 or BV % STATE_BLOCK == 0 or BV >= V,
                     "the h stage's value tile must hold whole state blocks")
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
    # a [BK, BV] state tile in h0 / ht: [K, V], or [V, K] for the vk layout
    if STATE_VK:
        o_state = o_k[:, None] + o_v[None, :] * K
    else:
        o_state = o_k[:, None] * V + o_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]  # h (chunk-start states) is always [K, V]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_state, mask=m_h, other=0).to(tl.float32)
        b_h = qdq_state(b_h, STATE_Q, BK, BV, STATE_TS, STATE_BLOCK)

    for i_t in range(0, tl.cdiv(seq_len, C)):
        tl.store(h + ((boh + i_t) * HV + i_hv) * K * V + o_h, cast_for(b_h, h, GEMM_PRECISION), mask=m_h)
        t_c = i_t * C + o_c
        m_c = t_c < seq_len
        r_hv = (bos + t_c) * HV + i_hv
        m_ck = m_c[:, None] & m_k[None, :]
        m_cv = m_c[:, None] & m_v[None, :]
        b_w = tl.load(w + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)
        b_u = tl.load(u + r_hv[:, None] * V + o_v[None, :], mask=m_cv, other=0).to(tl.float32)
        # the h stage holds all of V in one tile when an NVFP4 operand needs it (ChunkParams.h_full_v)
        b_hr = qdq_operand(b_h, 0.0, Q_STATE_READ_RHS, 0, BK, BV, False)
        b_wh = acc_gemm(b_w, b_hr, GEMM_PRECISION, BK, ACC_STATE_READ, ACC_STATE_READ_BLOCK)
        b_v = b_u - b_wh
        tl.store(v_new + r_hv[:, None] * V + o_v[None, :], cast_for(b_v, v_new, GEMM_PRECISION), mask=m_cv)

        i_last = bos + tl.minimum(i_t * C + C, seq_len) - 1
        if GDN_DECAYS_VALUES:
            # GDN's state update with no state_update operand rounded: the chunk decay exp(G_C - G) (one number
            # per row) scales V_new's rows instead of K's, K^T loaded as a [BK x C] tile, as FLA's h kernel does;
            # the form below scales K in fp32 and transposes it in registers (state_update.lhs is K ⊙ decay:
            # docs/numerics.md's operand)
            b_kd = tl.load(k + ((bos + t_c) * H + i_h)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_c[None, :],
                           other=0)  # K^T
            b_g = tl.load(g_cum + (bos + t_c) * HV + i_hv, mask=m_c, other=0)
            b_glast = tl.load(g_cum + i_last * HV + i_hv)
            b_v = b_v * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]
            b_h *= tl.exp(b_glast)
            b_upd = gemm(b_kd, b_v, GEMM_PRECISION)  # b_kd: K^T
        else:
            if KDA:  # K ⊙ exp(G_C - G) from the intra stage (its decayed keys)
                b_kd = tl.load(kd + ((bos + t_c) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_ck, other=0)
                b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)
                b_h *= gate_exp(b_glast, GATE_EXP2)[:, None]
            else:
                b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck,
                              other=0).to(tl.float32)
                b_g = tl.load(g_cum + (bos + t_c) * HV + i_hv, mask=m_c, other=0)
                b_glast = tl.load(g_cum + i_last * HV + i_hv)
                b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]
                b_h *= tl.exp(b_glast)
            if FACTORED_STATE_UPDATE:  # K_d [C x BK] and V_new [C x BV], both rounded per column (over the chunk)
                b_s_kd, b_q_kd = grid_operand(b_kd, Q_STATE_UPDATE_LHS, 0)
                b_s_vu, b_q_vu = grid_operand(b_v, Q_STATE_UPDATE_RHS, 0)
                b_upd = grid_gemm(tl.trans(b_q_kd), b_q_vu, b_s_kd, b_s_vu, GEMM_PRECISION)
            else:
                b_kd = qdq_operand(b_kd, 0.0, Q_STATE_UPDATE_LHS, 0, C, BK, False)
                b_vu = qdq_operand(b_v, 0.0, Q_STATE_UPDATE_RHS, 0, C, BV, False)
                b_upd = acc_gemm(tl.trans(b_kd), b_vu, GEMM_PRECISION, C, ACC_STATE_UPDATE, ACC_STATE_UPDATE_BLOCK)
        b_h += b_upd
        b_h = qdq_state(b_h, STATE_Q, BK, BV, STATE_TS, STATE_BLOCK)

    tl.store(ht + i_nh * K * V + o_state, b_h, mask=m_h)


KERNELS = {"h": chunk_fwd_kernel_h}


def chunk_fwd_h(plan: "ChunkPlan", *, layout: "ChunkLayout", k, kd, w, u, g_cum, h, v_new, h0, ht):
    """Walks every sequence's chunks: h (the chunk-start states), V_new and the final state ht, from h0 (None:
    zeros)."""
    launch(plan.fwd_h, dict(k=k, kd=kd, w=w, u=u, g_cum=g_cum, h=h, v_new=v_new, h0=h0, ht=ht,
                            cu_seqlens=layout.cu_seqlens, chunk_offsets=layout.chunk_offsets, T=layout.T),
           USE_INITIAL_STATE=h0 is not None)
