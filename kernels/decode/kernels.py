"""The decode-phase kernels of the "decode_fused" variant (launched by fused.py), forward and backward.

One program per (sequence, value head, value tile of BV columns), each running its sequence token by token:
the exact prefix, the handoff, then the decode suffix with the rounding of kernels/reference/decode.py (the
numerics contract; docs/decode_phase.md), in the same order. ``round_state_kernel`` rounds a cache as the
kernels do on load; ``decay_grid_kernel`` applies a decay grid once, before the token loops.

Plain ``@triton.jit`` kernels specialized by ``tl.constexpr`` arguments. The spec fixes eight of them
(``fused.DecodeParams.constants()``; the launchers pass them by name):

    IS_KDA        the decay is one value per key channel (KDA), else a scalar per value head (GDN)
    STATE_VK      h0 / ht / dht / dh0 are [V, K] in memory instead of [K, V]
    CODEC         the state codec: 0 none, 1 fp8_e4m3, 2 int8, 3 int8_h32 (``fused.CODEC_IDS``)
    READ_STORED   the readout uses the stored (rounded) state, else the working one
    REPLAY        replay mode: a suffix write is rounded at anchor refreshes only (every window-th suffix
                  token), else (token mode) at every suffix token
    FACTOR        the rounding of replay's factors k and u: 0 none, 1 fp8_e4m3, 2 int8 (``fused.FACTOR_IDS``)
    VFIRST        the state tile V-first in registers (a serving profile: vLLM's order of the sums)
    CACHE         the serving cache's dtype, rounded to after the codec: 0 float32 (nothing), 1 bfloat16,
                  2 float16 (``fused.CACHE_IDS``; for a GDN serving profile with ``state_dtype: auto`` it
                  follows the inputs' dtype)

``round_state_kernel`` takes the four of them it depends on; ``decay_grid_kernel`` none. What the inputs
decide stays a ``tl.constexpr`` set at launch (USE_H0, IS_VARLEN, SAVE_CKPT, STORE_O, ROUND_H0); the
lengths, the replay window and the grid step are runtime values, so changing the phase compiles nothing.
Device functions: device.py; the QDQ: kernels/common/qdq.py.
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.qdq import qdq_log_grid
from la_compiler.kernels.decode.device import (along_k, along_v, decay_factor, is_write, load_decay, round_state,
                                                state_offsets, stored_length, sum_k, sum_v, tile_zeros, token_update)


@triton.jit
def decode_fwd_kernel(
    q, k, v, g, beta, h0, o, ht, ckpt, cu_seqlens, prefill, valid,
    scale, window, T, NCK,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, SAVE_CKPT: tl.constexpr, STORE_O: tl.constexpr,
    ROUND_H0: tl.constexpr,
    IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, CODEC: tl.constexpr, READ_STORED: tl.constexpr,
    REPLAY: tl.constexpr, FACTOR: tl.constexpr, VFIRST: tl.constexpr, CACHE: tl.constexpr,
):
    """Token by token: the exact prefix, the handoff, the decode suffix with its rounding; o and the final
    state (or, with SAVE_CKPT, the state entering every CK-th token instead of o). ROUND_H0=False: the
    initial state is a handoff state computed elsewhere (decode_serving's chunked prefix), not a cache: it
    is rounded by the handoff only."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    NV = tl.num_programs(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
    p = tl.load(prefill + i_n)
    L = tl.load(valid + i_n)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = along_k(m_k, VFIRST) & along_v(m_v, VFIRST)
    o_h = state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
    o_c = along_k(tl.arange(0, BK), VFIRST) * BV + along_v(tl.arange(0, BV), VFIRST)
    p_ck = ckpt + (i_nh * NV + i_v).to(tl.int64) * NCK * BK * BV

    b_h = tile_zeros(BK, BV, VFIRST)
    if USE_H0:
        b_h = tl.load(h0 + i_nh * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
        if ROUND_H0:
            b_h = round_state(b_h, CODEC, CACHE, BK, BV)  # a quantized cache, rounded on load

    for t in range(0, L):
        if SAVE_CKPT:
            if t % CK == 0:
                tl.store(p_ck + (t // CK) * BK * BV + o_c, b_h)
        if t == p:
            b_h = round_state(b_h, CODEC, CACHE, BK, BV)  # the handoff
        suffix = t >= p
        i_tok = bos + t
        b_q = tl.load(q + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
        if IS_KDA:
            p_g = g + (i_tok * HV + i_hv) * K + o_k
        else:
            p_g = g + i_tok * HV + i_hv
        b_g = load_decay(p_g, m_k, IS_KDA)
        b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY, FACTOR,
                                                   VFIRST)
        b_new = b_hb
        if suffix & is_write(t, p, window, REPLAY):
            b_new = round_state(b_hb, CODEC, CACHE, BK, BV)
        if STORE_O:
            if READ_STORED:
                b_o = sum_k(b_new * along_k(b_q, VFIRST), VFIRST)
            else:
                b_o = sum_k(b_hb * along_k(b_q, VFIRST), VFIRST)
            tl.store(o + (i_tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        b_h = b_new
    tl.store(ht + i_nh * K * V + o_h, b_h, mask=m_h)
    if STORE_O:  # padding tokens: zero output
        for t in range(L, stored_length(cu_seqlens, i_n, T, IS_VARLEN)):
            tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty),
                     mask=m_v)


@triton.jit
def decode_bwd_kernel(
    q, k, v, g, beta, h0, ckpt, scratch, cu_seqlens, prefill, valid, do, dht,
    dq, dk, dv, dg, dbeta, dh0,
    scale, window, T, NCK, TOTAL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, CODEC: tl.constexpr, READ_STORED: tl.constexpr,
    REPLAY: tl.constexpr, FACTOR: tl.constexpr, VFIRST: tl.constexpr, CACHE: tl.constexpr,
):
    """Blocks of CK tokens in reverse: the block's states recomputed from its checkpoint into the
    scratch, then the reverse recurrence (identity gradient through every rounding)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    NV = tl.num_programs(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
    p = tl.load(prefill + i_n)
    L = tl.load(valid + i_n)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = along_k(m_k, VFIRST) & along_v(m_v, VFIRST)
    o_h = state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
    o_c = along_k(tl.arange(0, BK), VFIRST) * BV + along_v(tl.arange(0, BV), VFIRST)
    i_prog = (i_nh * NV + i_v).to(tl.int64)
    p_ck = ckpt + i_prog * NCK * BK * BV
    p_sc = scratch + i_prog * CK * BK * BV
    # per-value-tile partial gradients: [NV, TOTAL, HV, K] (dq, dk, dg of KDA), [NV, TOTAL, HV] (dbeta, dg of GDN)
    p_part = i_v.to(tl.int64) * TOTAL * HV

    b_dh = tl.load(dht + i_nh * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
    n_blocks = tl.cdiv(L, CK)
    for i_blk in range(0, n_blocks):
        blk = n_blocks - 1 - i_blk
        t0 = blk * CK
        t1 = tl.minimum(t0 + CK, L)
        # recompute the states entering tokens t0 .. t1-1 into the scratch
        b_h = tl.load(p_ck + blk * BK * BV + o_c)
        for t in range(t0, t1):
            tl.store(p_sc + (t - t0) * BK * BV + o_c, b_h)
            if t == p:
                b_h = round_state(b_h, CODEC, CACHE, BK, BV)
            suffix = t >= p
            i_tok = bos + t
            b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
            if IS_KDA:
                p_g = g + (i_tok * HV + i_hv) * K + o_k
            else:
                p_g = g + i_tok * HV + i_hv
            b_g = load_decay(p_g, m_k, IS_KDA)
            b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY,
                                                       FACTOR, VFIRST)
            if suffix & is_write(t, p, window, REPLAY):
                b_hb = round_state(b_hb, CODEC, CACHE, BK, BV)
            b_h = b_hb
        # the reverse recurrence over the block
        for j in range(0, t1 - t0):
            t = t1 - 1 - j
            b_h = tl.load(p_sc + (t - t0) * BK * BV + o_c)
            if t == p:
                b_h = round_state(b_h, CODEC, CACHE, BK, BV)
            suffix = t >= p
            i_tok = bos + t
            b_q = tl.load(q + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
            b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
            if IS_KDA:
                p_g = g + (i_tok * HV + i_hv) * K + o_k
            else:
                p_g = g + i_tok * HV + i_hv
            b_g = load_decay(p_g, m_k, IS_KDA)
            b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY,
                                                       FACTOR, VFIRST)
            b_r = b_hb
            if READ_STORED:
                if suffix & is_write(t, p, window, REPLAY):
                    b_r = round_state(b_hb, CODEC, CACHE, BK, BV)
            b_do = tl.load(do + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            # o = R^T (scale q); S_b's gradient: the carried one (identity through the write) + the readout's
            b_dhb = b_dh + along_k(b_q, VFIRST) * along_v(b_do, VFIRST)
            b_dq = sum_v(b_r * along_v(b_do, VFIRST), VFIRST) * scale
            b_du = sum_k(b_dhb * along_k(b_kf, VFIRST), VFIRST)
            b_dk = sum_v(b_dhb * along_v(b_uf, VFIRST), VFIRST)
            b_dw = b_beta * b_du
            b_dbeta = tl.sum(b_du * b_w, 0)
            b_dk -= sum_v(b_ha * along_v(b_dw, VFIRST), VFIRST)
            b_dha = b_dhb - along_k(b_k, VFIRST) * along_v(b_dw, VFIRST)
            tl.store(dv + (i_tok * HV + i_hv) * V + o_v, b_dw.to(dv.dtype.element_ty), mask=m_v)
            p_row = p_part + i_tok * HV + i_hv
            tl.store(dq + p_row * K + o_k, b_dq, mask=m_k)
            tl.store(dk + p_row * K + o_k, b_dk, mask=m_k)
            tl.store(dbeta + p_row, b_dbeta)
            if IS_KDA:
                tl.store(dg + p_row * K + o_k, sum_v(b_dha * b_ha, VFIRST), mask=m_k)
            else:
                tl.store(dg + p_row, tl.sum(tl.sum(b_dha * b_ha, 1), 0))
            b_dh = b_dha * decay_factor(b_g, IS_KDA, VFIRST)
    if USE_H0:
        tl.store(dh0 + i_nh * K * V + o_h, b_dh, mask=m_h)
    for t in range(L, stored_length(cu_seqlens, i_n, T, IS_VARLEN)):  # padding tokens: zero gradients
        i_tok = bos + t
        p_row = p_part + i_tok * HV + i_hv
        b_zk = tl.zeros([BK], dtype=tl.float32)
        tl.store(dv + (i_tok * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=tl.float32), mask=m_v)
        tl.store(dq + p_row * K + o_k, b_zk, mask=m_k)
        tl.store(dk + p_row * K + o_k, b_zk, mask=m_k)
        tl.store(dbeta + p_row, 0.0)
        if IS_KDA:
            tl.store(dg + p_row * K + o_k, b_zk, mask=m_k)
        else:
            tl.store(dg + p_row, 0.0)


@triton.jit
def decay_grid_kernel(g, g_grid, cu_seqlens, prefill, step, T, W: tl.constexpr, BT: tl.constexpr,
                      BW: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The decay grid, once before the token loops: round(g / step) * step at the suffix tokens
    (t >= prefill), g itself elsewhere, in fp32. W values per token (HV * K for KDA, HV for GDN)."""
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
    p = tl.load(prefill + i_n)
    o_t = i_t * BT + tl.arange(0, BT)
    o_w = tl.arange(0, BW)
    m = (o_t < stored_length(cu_seqlens, i_n, T, IS_VARLEN))[:, None] & (o_w < W)[None, :]
    offsets = (bos + o_t)[:, None] * W + o_w[None, :]
    b_g = tl.load(g + offsets, mask=m, other=0.0).to(tl.float32)
    b_g = tl.where((o_t >= p)[:, None], qdq_log_grid(b_g, step), b_g)
    tl.store(g_grid + offsets, b_g, mask=m)


@triton.jit
def round_state_kernel(h, out, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       STATE_VK: tl.constexpr, CODEC: tl.constexpr, VFIRST: tl.constexpr,
                       CACHE: tl.constexpr):
    """The state as a cache holds it: the codec (and the serving cache's dtype) on every [K x BV] tile of
    h [N, HV, K, V] (or V-first), one program per (sequence and head, value tile)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_h = along_k(o_k < K, VFIRST) & along_v(o_v < V, VFIRST)
    o_h = i_nh * K * V + state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
    b_h = tl.load(h + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(out + o_h, round_state(b_h, CODEC, CACHE, BK, BV), mask=m_h)
