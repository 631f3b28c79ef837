"""The "decode_fused" kernel variant: fused Triton decode-phase training, forward and backward.

One program per (sequence, value head, value tile of BV columns). BV is the state codec's
tile width, so every [K x BV] scale group (and every Hadamard-32 group) lies inside one
program and the rounding needs no cross-program reduction. Each program runs its
sequence token by token: the prefix exactly, then the decode suffix with the rounding of
kernels/decode_reference.py (the numerics contract; docs/decode_phase.md), in the same order.

Backward: the forward kernel, run again with ``SAVE_CKPT``, stores the state entering every
CK-th token; the backward kernel walks the blocks in reverse, recomputes the block's states
from its checkpoint into a per-program scratch, and then runs the reverse recurrence over
the block (identity gradient through every rounding). dq/dk/dg/dbeta are summed over value
tiles (and grouped heads) outside the kernel.

The kernels are specialized with ``tl.constexpr`` flags (kind, layout, codec, readout,
replay, factor rounding, decay grid); the lengths, the replay window and the grid step are
runtime values, so changing the phase compiles nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from la_compiler.kernels.decode_options import DecodeOptions, decode_options
from la_compiler.kernels.decode_reference_variant import require_lengths
from la_compiler.kernels.qdq import amax_abs, fp8_scale, int8_scale, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32, qdq_log_grid
from la_compiler.kernels.registry import register_variant, spec_of

CODEC_IDS = {None: 0, "fp8_e4m3": 1, "int8": 2, "int8_h32": 3}
FACTOR_IDS = {"none": 0, "fp8_e4m3": 1, "int8": 2}
CHECKPOINT_EVERY = 16
MAX_HEAD_DIM = 256
NUM_WARPS: int | None = None  # None: 4 up to 4096 state elements per program, else 8 (benchmarks may override)


def _num_warps(BK: int, BV: int) -> int:
    return NUM_WARPS if NUM_WARPS is not None else (4 if BK * BV <= 4096 else 8)


def unsupported_reason(spec, head_k: int, head_v: int) -> str | None:
    if head_k > MAX_HEAD_DIM or head_v > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} exceed one register tile"
    opts = decode_options(spec)
    if opts.codec == "int8_h32" and head_v % 32:
        return f"the int8_h32 codec needs the value head dim to be a multiple of 32, got {head_v}"
    return None


# ---- device helpers ----------------------------------------------------------------------------
@triton.jit
def _round_state(b_h, CODEC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The state codec on one [BK x BV] tile (one scale group; zero padding leaves amax unchanged)."""
    if CODEC == 1:
        b_h = qdq_fp8_e4m3(b_h, fp8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
    elif CODEC == 2:
        b_h = qdq_int8(b_h, int8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
    elif CODEC == 3:
        b_h = tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))
    return b_h


@triton.jit
def _round_factor(b_x, FACTOR: tl.constexpr):
    """A replay factor (k over K, or u over the program's BV columns): one scale."""
    if FACTOR == 1:
        b_x = qdq_fp8_e4m3(b_x, fp8_scale(tl.max(amax_abs(b_x), axis=0)))
    elif FACTOR == 2:
        b_x = qdq_int8(b_x, int8_scale(tl.max(amax_abs(b_x), axis=0)))
    return b_x


@triton.jit
def _load_decay(p_g, m_k, suffix, step, IS_KDA: tl.constexpr, USE_GRID: tl.constexpr):
    """The token's log-decay (a [BK] vector for KDA, a scalar for GDN), grid-rounded in the suffix."""
    if IS_KDA:
        b_g = tl.load(p_g, mask=m_k, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(p_g).to(tl.float32)
    if USE_GRID:
        b_g = tl.where(suffix, qdq_log_grid(b_g, step), b_g)
    return b_g


@triton.jit
def _decayed(b_h, b_g, IS_KDA: tl.constexpr):
    if IS_KDA:
        return b_h * tl.exp(b_g)[:, None]
    else:
        return b_h * tl.exp(b_g)


@triton.jit
def _token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA: tl.constexpr, REPLAY: tl.constexpr,
                  FACTOR: tl.constexpr):
    """S_a = D S; w = v - S_a^T k; u = beta w; S_b = S_a + k_f u_f^T. Returns (S_a, w, k_f, u_f, S_b)."""
    b_ha = _decayed(b_h, b_g, IS_KDA)
    b_w = b_v - tl.sum(b_ha * b_k[:, None], 0)
    b_u = b_beta * b_w
    b_kf = b_k
    b_uf = b_u
    if REPLAY and FACTOR != 0:
        b_kf = tl.where(suffix, _round_factor(b_k, FACTOR), b_k)
        b_uf = tl.where(suffix, _round_factor(b_u, FACTOR), b_u)
    b_hb = b_ha + b_kf[:, None] * b_uf[None, :]
    return b_ha, b_w, b_kf, b_uf, b_hb


@triton.jit
def _stored_length(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        return tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)
    else:
        return T


@triton.jit
def _is_write(t, p, window, REPLAY: tl.constexpr):
    """Does suffix token t (t >= p) round the state it writes? Token mode: always; replay: at anchor refresh."""
    if REPLAY:
        return ((t - p + 1) % window) == 0
    else:
        return t >= p


# ---- forward -------------------------------------------------------------------------------------
@triton.jit
def decode_fwd_kernel(
    q, k, v, g, beta, h0, o, ht, ckpt, cu_seqlens, prefill, valid,
    scale, step, window, T, NCK,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    CODEC: tl.constexpr, READ_STORED: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr,
    USE_GRID: tl.constexpr, SAVE_CKPT: tl.constexpr, STORE_O: tl.constexpr,
):
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
    m_h = m_k[:, None] & m_v[None, :]
    if STATE_VK:
        o_h = o_k[:, None] + o_v[None, :] * K
    else:
        o_h = o_k[:, None] * V + o_v[None, :]
    o_c = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    p_ck = ckpt + (i_nh * NV + i_v).to(tl.int64) * NCK * BK * BV

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h = tl.load(h0 + i_nh * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_h = _round_state(b_h, CODEC, BK, BV)  # a quantized cache, rounded on load

    for t in range(0, L):
        if SAVE_CKPT:
            if t % CK == 0:
                tl.store(p_ck + (t // CK) * BK * BV + o_c, b_h)
        if t == p:
            b_h = _round_state(b_h, CODEC, BK, BV)  # the handoff
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
        b_g = _load_decay(p_g, m_k, suffix, step, IS_KDA, USE_GRID)
        b_ha, b_w, b_kf, b_uf, b_hb = _token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY, FACTOR)
        b_new = b_hb
        if suffix & _is_write(t, p, window, REPLAY):
            b_new = _round_state(b_hb, CODEC, BK, BV)
        if STORE_O:
            if READ_STORED:
                b_o = tl.sum(b_new * b_q[:, None], 0)
            else:
                b_o = tl.sum(b_hb * b_q[:, None], 0)
            tl.store(o + (i_tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        b_h = b_new
    tl.store(ht + i_nh * K * V + o_h, b_h, mask=m_h)
    if STORE_O:  # padding tokens: zero output
        for t in range(L, _stored_length(cu_seqlens, i_n, T, IS_VARLEN)):
            tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty),
                     mask=m_v)


# ---- backward ------------------------------------------------------------------------------------
@triton.jit
def decode_bwd_kernel(
    q, k, v, g, beta, h0, ckpt, scratch, cu_seqlens, prefill, valid, do, dht,
    dq, dk, dv, dg, dbeta, dh0,
    scale, step, window, T, NCK, TOTAL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, IS_KDA: tl.constexpr, STATE_VK: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    CODEC: tl.constexpr, READ_STORED: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr,
    USE_GRID: tl.constexpr,
):
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
    m_h = m_k[:, None] & m_v[None, :]
    if STATE_VK:
        o_h = o_k[:, None] + o_v[None, :] * K
    else:
        o_h = o_k[:, None] * V + o_v[None, :]
    o_c = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
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
                b_h = _round_state(b_h, CODEC, BK, BV)
            suffix = t >= p
            i_tok = bos + t
            b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
            if IS_KDA:
                p_g = g + (i_tok * HV + i_hv) * K + o_k
            else:
                p_g = g + i_tok * HV + i_hv
            b_g = _load_decay(p_g, m_k, suffix, step, IS_KDA, USE_GRID)
            b_ha, b_w, b_kf, b_uf, b_hb = _token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY, FACTOR)
            if suffix & _is_write(t, p, window, REPLAY):
                b_hb = _round_state(b_hb, CODEC, BK, BV)
            b_h = b_hb
        # the reverse recurrence over the block
        for j in range(0, t1 - t0):
            t = t1 - 1 - j
            b_h = tl.load(p_sc + (t - t0) * BK * BV + o_c)
            if t == p:
                b_h = _round_state(b_h, CODEC, BK, BV)
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
            b_g = _load_decay(p_g, m_k, suffix, step, IS_KDA, USE_GRID)
            b_ha, b_w, b_kf, b_uf, b_hb = _token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA, REPLAY, FACTOR)
            b_r = b_hb
            if READ_STORED:
                if suffix & _is_write(t, p, window, REPLAY):
                    b_r = _round_state(b_hb, CODEC, BK, BV)
            b_do = tl.load(do + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            # o = R^T (scale q); S_b's gradient: the carried one (identity through the write) + the readout's
            b_dhb = b_dh + b_q[:, None] * b_do[None, :]
            b_dq = tl.sum(b_r * b_do[None, :], 1) * scale
            b_du = tl.sum(b_dhb * b_kf[:, None], 0)
            b_dk = tl.sum(b_dhb * b_uf[None, :], 1)
            b_dw = b_beta * b_du
            b_dbeta = tl.sum(b_du * b_w, 0)
            b_dk -= tl.sum(b_ha * b_dw[None, :], 1)
            b_dha = b_dhb - b_k[:, None] * b_dw[None, :]
            tl.store(dv + (i_tok * HV + i_hv) * V + o_v, b_dw.to(dv.dtype.element_ty), mask=m_v)
            p_row = p_part + i_tok * HV + i_hv
            tl.store(dq + p_row * K + o_k, b_dq, mask=m_k)
            tl.store(dk + p_row * K + o_k, b_dk, mask=m_k)
            tl.store(dbeta + p_row, b_dbeta)
            if IS_KDA:
                tl.store(dg + p_row * K + o_k, tl.sum(b_dha * b_ha, 1), mask=m_k)
                b_dh = b_dha * tl.exp(b_g)[:, None]
            else:
                tl.store(dg + p_row, tl.sum(tl.sum(b_dha * b_ha, 1), 0))
                b_dh = b_dha * tl.exp(b_g)
    if USE_H0:
        tl.store(dh0 + i_nh * K * V + o_h, b_dh, mask=m_h)
    for t in range(L, _stored_length(cu_seqlens, i_n, T, IS_VARLEN)):  # padding tokens: zero gradients
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


# ---- launchers ---------------------------------------------------------------------------------
def _geometry(q, v, opts: DecodeOptions):
    K, V = q.shape[-1], v.shape[-1]
    BK = triton.next_power_of_2(K)
    BV = opts.block_v if V >= opts.block_v else triton.next_power_of_2(V)
    if opts.codec is None:
        BV = min(BV, 64)
    return K, V, BK, BV, triton.cdiv(V, BV)


def _flags(spec, opts: DecodeOptions, initial_state, cu_seqlens):
    return dict(
        IS_KDA=spec.kind == "kda", STATE_VK=spec.state == "vk", USE_H0=initial_state is not None,
        IS_VARLEN=cu_seqlens is not None, CODEC=CODEC_IDS[opts.codec], READ_STORED=opts.readout == "stored",
        REPLAY=opts.mode == "replay", FACTOR=FACTOR_IDS[opts.factor_format],
        USE_GRID=opts.decay_log_step is not None,
    )


def _check(spec, q, v, cu_seqlens, prefill_lengths, valid_lengths, n):
    reason = unsupported_reason(spec, q.shape[-1], v.shape[-1])
    if reason is not None:
        raise ValueError(f"decode_fused cannot run {spec}: {reason}")
    if prefill_lengths.numel() != n or valid_lengths.numel() != n:
        raise ValueError(f"decode_fused: need {n} prefill/valid lengths, got {prefill_lengths.numel()}/"
                         f"{valid_lengths.numel()}")


def _run_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths, *,
                 save_ckpt: bool):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    opts = decode_options(spec)
    B, T, H, _ = q.shape
    HV = v.shape[2]
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _check(spec, q, v, cu_seqlens, prefill_lengths, valid_lengths, n)
    K, V, BK, BV, NV = _geometry(q, v, opts)
    dev = q.device
    pre = prefill_lengths.to(device=dev, dtype=torch.int32).contiguous()
    val = valid_lengths.to(device=dev, dtype=torch.int32).contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = torch.full((B, T, HV, V), float("nan"), dtype=q.dtype, device=dev)
    ht = torch.full((n, HV, K, V) if spec.state == "kv" else (n, HV, V, K), float("nan"), dtype=torch.float32,
                    device=dev)
    max_len = int(val.max().item()) if save_ckpt and n else 0
    nck = max(triton.cdiv(max_len, CHECKPOINT_EVERY), 1)
    ckpt = torch.empty(n * HV * NV * nck * BK * BV if save_ckpt else 1, dtype=torch.float32, device=dev)
    cu = cu_seqlens.to(torch.int32).contiguous() if cu_seqlens is not None else pre
    decode_fwd_kernel[(NV, n * HV)](
        q, k, v, g, beta, h0 if h0 is not None else q, o, ht, ckpt, cu, pre, val,
        float(scale), float(opts.decay_log_step or 1.0), opts.window, T, nck,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, SAVE_CKPT=save_ckpt, STORE_O=not save_ckpt,
        **_flags(spec, opts, initial_state, cu_seqlens), num_warps=_num_warps(BK, BV),
    )
    return o, ht, (ckpt, nck, pre, val, cu, opts, (K, V, BK, BV, NV), n)


def decode_fused_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                         valid_lengths=None):
    o, ht, _ = _run_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths,
                            valid_lengths, save_ckpt=False)
    return o, ht


def decode_fused_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *,
                          prefill_lengths=None, valid_lengths=None):
    spec = spec_of(spec)
    _, _, (ckpt, nck, pre, val, cu, opts, (K, V, BK, BV, NV), n) = _run_forward(
        spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths, save_ckpt=True)
    B, T, H, _ = q.shape
    HV = v.shape[2]
    dev = q.device
    total = B * T
    nan = float("nan")  # every element is written by the kernel (padding tokens with zeros)
    dq = torch.full((NV, total, HV, K), nan, dtype=torch.float32, device=dev)
    dk = torch.full_like(dq, nan)
    dg = torch.full((NV, total, HV, K if spec.kind == "kda" else 1), nan, dtype=torch.float32, device=dev)
    dbeta = torch.full((NV, total, HV), nan, dtype=torch.float32, device=dev)
    dv = torch.full((B, T, HV, V), nan, dtype=torch.float32, device=dev)
    dh0 = torch.full_like(initial_state, float("nan"), dtype=torch.float32) if initial_state is not None else None
    scratch = torch.empty(n * HV * NV * CHECKPOINT_EVERY * BK * BV, dtype=torch.float32, device=dev)
    h0 = initial_state.contiguous() if initial_state is not None else None
    decode_bwd_kernel[(NV, n * HV)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        h0 if h0 is not None else q, ckpt, scratch, cu, pre, val, do.contiguous(), dht.contiguous(),
        dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else dq,
        float(scale), float(opts.decay_log_step or 1.0), opts.window, T, nck, total,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, **_flags(spec, opts, initial_state, cu_seqlens),
        num_warps=_num_warps(BK, BV),
    )
    group = HV // H
    dq = dq.sum(0).view(B, T, H, group, K).sum(3)
    dk = dk.sum(0).view(B, T, H, group, K).sum(3)
    dg = dg.sum(0).view(B, T, HV, -1)
    dg = dg if spec.kind == "kda" else dg[..., 0]
    dbeta = dbeta.sum(0).view(B, T, HV)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if dh0 is not None else None)


register_variant(
    "decode_fused",
    decode_fused_forward,
    decode_fused_backward,
    "fused Triton decode-phase training kernel (token / replay), fp32 state, fwd + bwd with state checkpoints",
)
