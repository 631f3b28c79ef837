"""The decode-suffix kernels of decode-phase training (launched by suffix.py), forward and backward.

Every sequence's decode suffix is packed one after another (``cu_seqlens``) and starts from its handoff state
(the state the chunked prefix left, or the initial state); the suffix runs token by token with the rounding of
kernels/reference/decode.py (the numerics contract; docs/decode_phase.md), in the same order. Four kernels:

    decode_fwd_kernel     one program per (sequence, value head, value tile): the handoff rounding, then every
                          token (o; with SAVE_CKPT also the state entering every CK-th token: the checkpoints)
    decode_dstate_kernel  the same programs walk the suffix in reverse carrying only the state gradient, which
                          (identity through every rounding) does not read the forward's states: it stores the
                          gradient of the state leaving every CK-token block, and that of the handoff state
    decode_bwd_kernel     every block at once (a persistent grid over (block, value head, value tile)): the
                          block's states recomputed from its checkpoint into a per-program scratch, then its
                          reverse recurrence from the block's end gradient: every token's dq, dk, dv, dg, dbeta
    decay_grid_kernel     the decay grid, once, before the token loops (it does not depend on the state)

``round_state_kernel`` rounds a cache as the kernels do on load. docs/decode_phase.md derives the backward.

Plain ``@triton.jit`` kernels specialized by ``tl.constexpr`` arguments. The spec fixes nine of them
(``suffix.DecodeParams.constants()``; the launchers pass them by name):

    IS_KDA        the decay is one value per key channel (KDA), else a scalar per value head (GDN)
    STATE_VK      h0 / ht / dht / dh0 / dh_end are [V, K] in memory instead of [K, V] (the checkpoint and
                  scratch tiles follow: device.tile_offsets)
    CODEC         the state codec: 0 none, 1 fp8_e4m3, 2 int8, 3 int8_h32 (``suffix.CODEC_IDS``)
    CODEC_BLOCK   the codec's scale group: 0 one scale per [K x BV] tile, N one per key row and N values
    READ_STORED   the readout uses the stored (rounded) state, else the working one
    REPLAY        replay mode: a write is rounded at anchor refreshes only (every window-th suffix token),
                  else (token mode) at every suffix token
    FACTOR        the rounding of replay's factors k and u: 0 none, 1 fp8_e4m3, 2 int8 (``suffix.FACTOR_IDS``)
    VFIRST        the state tile V-first in registers (a serving profile: vLLM's order of the sums)
    CACHE         the serving cache's dtype, rounded to after the codec: 0 float32 (nothing), 1 bfloat16,
                  2 float16 (``suffix.CACHE_IDS``; for a GDN serving profile with ``state_dtype: auto`` it
                  follows the inputs' dtype)

The replay window and the grid step are runtime values, so changing the phase compiles nothing.
Device functions: device.py; the QDQ: kernels/common/qdq.py.
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.qdq import qdq_log_grid
from la_compiler.kernels.decode.device import (along_k, along_v, decay_factor, is_write, load_token, round_factor,
                                                round_state, state_offsets, sum_k, sum_v, tile_offsets, token_update)


@triton.jit
def decode_fwd_kernel(
    q, k, v, g, beta, h0, o, ht, ckpt, cu_seqlens, block_offsets,
    scale, window,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, SAVE_CKPT: tl.constexpr,
    IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, CODEC: tl.constexpr, CODEC_BLOCK: tl.constexpr,
    READ_STORED: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr, VFIRST: tl.constexpr,
    CACHE: tl.constexpr,
):
    """One sequence's suffix, token by token, from its handoff state h0 (rounded here: the handoff): o and the
    final state ht; with SAVE_CKPT, the state entering every CK-th token into ckpt [blocks, HV, NV, BK * BV]
    (block_offsets: each sequence's first block)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    NV = tl.num_programs(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = along_k(m_k, VFIRST) & along_v(m_v, VFIRST)
    o_h = state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
    o_c = tile_offsets(BK, BV, STATE_VK, VFIRST)

    b_h = tl.load(h0 + i_nh * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_h = round_state(b_h, CODEC, CODEC_BLOCK, CACHE, BK, BV, VFIRST)  # the handoff
    if SAVE_CKPT:
        first_block = tl.load(block_offsets + i_n).to(tl.int64)
    # the next token's inputs are loaded while this one computes (they do not depend on the state)
    b_q, b_k, b_v, b_beta, b_g = load_token(q, k, v, g, beta, bos, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV, K, V, IS_KDA)
    for t in range(0, L):
        n_q, n_k, n_v, n_beta, n_g = load_token(q, k, v, g, beta, bos + tl.minimum(t + 1, L - 1), i_h, i_hv, o_k,
                                                o_v, m_k, m_v, H, HV, K, V, IS_KDA)
        if SAVE_CKPT:
            if t % CK == 0:
                i_tile = ((first_block + t // CK) * HV + i_hv) * NV + i_v
                tl.store(ckpt + i_tile * BK * BV + o_c, b_h.to(ckpt.dtype.element_ty))
        i_tok = bos + t
        b_q = b_q * scale
        b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, IS_KDA, REPLAY, FACTOR, VFIRST)
        b_new = b_hb
        if is_write(t, window, REPLAY):
            b_new = round_state(b_hb, CODEC, CODEC_BLOCK, CACHE, BK, BV, VFIRST)
        if READ_STORED:
            b_o = sum_k(b_new * along_k(b_q, VFIRST), VFIRST)
        else:
            b_o = sum_k(b_hb * along_k(b_q, VFIRST), VFIRST)
        tl.store(o + (i_tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        b_h = b_new
        b_q, b_k, b_v, b_beta, b_g = n_q, n_k, n_v, n_beta, n_g
    tl.store(ht + i_nh * K * V + o_h, b_h.to(ht.dtype.element_ty), mask=m_h)


@triton.jit
def decode_dstate_kernel(
    q, k, v, g, beta, do, dht, dh_end, dh0, cu_seqlens, block_offsets,
    scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr,
    VFIRST: tl.constexpr,
):
    """The state gradient over one sequence's suffix, in reverse (identity through every rounding):
    dS_b = dS + (scale q) do^T;  dS <- Diag(exp g) (dS_b - k beta (k_f^T dS_b)).
    It reads no forward state and rounds nothing, so its value tile BV is free (narrow: many programs).
    dh_end [blocks, HV, K, V] (V-first with STATE_VK, as the state) receives the gradient of the state leaving
    every CK-token block; dh0 that of the handoff state (before its rounding: identity)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    first_block = tl.load(block_offsets + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = along_k(m_k, VFIRST) & along_v(m_v, VFIRST)
    o_h = state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)  # the tile in dht, dh0 and dh_end

    b_dh = tl.load(dht + i_nh * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
    # the previous token's inputs are loaded while this one computes (they do not depend on the state gradient)
    b_q, b_k, _, b_beta, b_g = load_token(q, k, v, g, beta, bos + L - 1, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV, K, V,
                                          IS_KDA)
    b_do = tl.load(do + ((bos + L - 1) * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    for i_r in range(0, L):
        t = L - 1 - i_r
        i_prev = bos + tl.maximum(t - 1, 0)
        n_q, n_k, _, n_beta, n_g = load_token(q, k, v, g, beta, i_prev, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV, K, V,
                                              IS_KDA)
        n_do = tl.load(do + (i_prev * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if (t == L - 1) | ((t + 1) % CK == 0):
            tl.store(dh_end + ((first_block + t // CK) * HV + i_hv) * K * V + o_h, b_dh, mask=m_h)
        b_q = b_q * scale
        b_kf = b_k
        if REPLAY and FACTOR != 0:
            b_kf = round_factor(b_k, FACTOR)
        b_dhb = b_dh + along_k(b_q, VFIRST) * along_v(b_do, VFIRST)
        b_dw = b_beta * sum_k(b_dhb * along_k(b_kf, VFIRST), VFIRST)
        b_dh = (b_dhb - along_k(b_k, VFIRST) * along_v(b_dw, VFIRST)) * decay_factor(b_g, IS_KDA, VFIRST)
        b_q, b_k, b_beta, b_g, b_do = n_q, n_k, n_beta, n_g, n_do
    tl.store(dh0 + i_nh * K * V + o_h, b_dh, mask=m_h)


@triton.jit
def decode_bwd_kernel(
    q, k, v, g, beta, ckpt, dh_end, scratch, cu_seqlens, block_offsets, block_seq, do,
    dq, dk, dv, dg, dbeta,
    scale, window, TOTAL, N_BLOCKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr,
    IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, CODEC: tl.constexpr, CODEC_BLOCK: tl.constexpr,
    READ_STORED: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr, VFIRST: tl.constexpr, CACHE: tl.constexpr,
):
    """Every CK-token block of every suffix independently (a persistent grid: each program takes work items
    (block, value head, value tile) in turn): the block's states recomputed from its checkpoint into the
    program's scratch [CK, BK * BV], then the reverse recurrence from dh_end [blocks, HV, K, V] (V-first with
    STATE_VK), the gradient of the state leaving the block (identity gradient through every rounding). dq, dk, dg (KDA) and dbeta are this
    value tile's shares ([NV, TOTAL, HV, ...]), summed outside; dv is whole."""
    i_prog = tl.program_id(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    p_sc = scratch + i_prog.to(tl.int64) * CK * BK * BV
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_c = tile_offsets(BK, BV, STATE_VK, VFIRST)
    for i_work in range(i_prog, N_BLOCKS * HV * NV, tl.num_programs(0)):
        i_v = i_work % NV
        i_hv = (i_work // NV) % HV
        i_blk = i_work // (NV * HV)
        i_h = i_hv // (HV // H)
        i_n = tl.load(block_seq + i_blk)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        t0 = ((i_blk - tl.load(block_offsets + i_n)) * CK).to(tl.int32)
        t1 = tl.minimum(t0 + CK, L)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        i_tile = ((i_blk.to(tl.int64) * HV + i_hv) * NV + i_v) * BK * BV
        # the block's states (entering each of its tokens), from its checkpoint
        b_h = tl.load(ckpt + i_tile + o_c).to(tl.float32)
        for t in range(t0, t1):
            tl.store(p_sc + (t - t0) * BK * BV + o_c, b_h)
            b_q, b_k, b_v, b_beta, b_g = load_token(q, k, v, g, beta, bos + t, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV,
                                                    K, V, IS_KDA)
            b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, IS_KDA, REPLAY, FACTOR, VFIRST)
            if is_write(t, window, REPLAY):
                b_hb = round_state(b_hb, CODEC, CODEC_BLOCK, CACHE, BK, BV, VFIRST)
            b_h = b_hb
        tl.debug_barrier()
        # the reverse recurrence over the block
        o_h = state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
        m_h = along_k(m_k, VFIRST) & along_v(m_v, VFIRST)
        b_dh = tl.load(dh_end + (i_blk.to(tl.int64) * HV + i_hv) * K * V + o_h, mask=m_h, other=0.0)
        for j in range(0, t1 - t0):
            t = t1 - 1 - j
            b_h = tl.load(p_sc + (t - t0) * BK * BV + o_c)
            i_tok = bos + t
            b_q, b_k, b_v, b_beta, b_g = load_token(q, k, v, g, beta, i_tok, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV,
                                                    K, V, IS_KDA)
            b_q = b_q * scale
            b_ha, b_w, b_kf, b_uf, b_hb = token_update(b_h, b_k, b_v, b_g, b_beta, IS_KDA, REPLAY, FACTOR, VFIRST)
            b_r = b_hb
            if READ_STORED:
                if is_write(t, window, REPLAY):
                    b_r = round_state(b_hb, CODEC, CODEC_BLOCK, CACHE, BK, BV, VFIRST)
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
            p_row = i_v.to(tl.int64) * TOTAL * HV + i_tok * HV + i_hv
            tl.store(dq + p_row * K + o_k, b_dq, mask=m_k)
            tl.store(dk + p_row * K + o_k, b_dk, mask=m_k)
            tl.store(dbeta + p_row, b_dbeta)
            if IS_KDA:
                tl.store(dg + p_row * K + o_k, sum_v(b_dha * b_ha, VFIRST), mask=m_k)
            else:
                tl.store(dg + p_row, tl.sum(tl.sum(b_dha * b_ha, 1), 0))
            b_dh = b_dha * decay_factor(b_g, IS_KDA, VFIRST)
        tl.debug_barrier()


@triton.jit
def decay_grid_kernel(g, g_grid, step, N, BLOCK: tl.constexpr):
    """The decay grid, once before the token loops: round(g / step) * step of every suffix log-decay, in fp32."""
    o_x = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < N
    b_g = tl.load(g + o_x, mask=m_x, other=0.0).to(tl.float32)
    tl.store(g_grid + o_x, qdq_log_grid(b_g, step), mask=m_x)


@triton.jit
def round_state_kernel(h, out, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       STATE_VK: tl.constexpr, CODEC: tl.constexpr, CODEC_BLOCK: tl.constexpr, VFIRST: tl.constexpr,
                       CACHE: tl.constexpr):
    """The state as a cache holds it: the codec (and the serving cache's dtype) on every [K x BV] tile of
    h [N, HV, K, V] (or V-first), one program per (sequence and head, value tile)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_h = along_k(o_k < K, VFIRST) & along_v(o_v < V, VFIRST)
    o_h = i_nh * K * V + state_offsets(o_k, o_v, K, V, STATE_VK, VFIRST)
    b_h = tl.load(h + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(out + o_h, round_state(b_h, CODEC, CODEC_BLOCK, CACHE, BK, BV, VFIRST), mask=m_h)
