"""Triton device functions of the decode-phase kernels (kernels.py).

The numerics are those of kernels/reference/decode.py; the QDQ itself comes from kernels/common/qdq.py.

The state tile sits in registers in one of two orientations: ``[BK, BV]`` (K-first, laqat's own) or
``[BV, BK]`` (V-first, ``VFIRST``: vLLM's decode kernels). The orientation decides along which axis of the
tile the sums over K run, and so the order in which Triton adds their terms; a serving profile takes
vLLM's orientation so that its sums are vLLM's, term for term. ``along_k`` / ``along_v`` broadcast a
vector over the tile, ``sum_k`` / ``sum_v`` reduce the tile over K / V.
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.qdq import (amax_abs, fp8_scale, int8_scale, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32,
                                            qdq_rows_3d)


@triton.jit
def along_k(x, VFIRST: tl.constexpr):
    """A [BK] vector broadcast over the state tile's V axis."""
    if VFIRST:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def along_v(x, VFIRST: tl.constexpr):
    """A [BV] vector broadcast over the state tile's K axis."""
    if VFIRST:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def sum_k(b_x, VFIRST: tl.constexpr):
    """The tile summed over K: [BV]."""
    if VFIRST:
        return tl.sum(b_x, 1)
    else:
        return tl.sum(b_x, 0)


@triton.jit
def sum_v(b_x, VFIRST: tl.constexpr):
    """The tile summed over V: [BK]."""
    if VFIRST:
        return tl.sum(b_x, 0)
    else:
        return tl.sum(b_x, 1)


@triton.jit
def tile_zeros(BK: tl.constexpr, BV: tl.constexpr, VFIRST: tl.constexpr):
    if VFIRST:
        return tl.zeros([BV, BK], dtype=tl.float32)
    else:
        return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def round_bf16(x):
    """fp32 -> bf16 -> fp32, round to nearest even, on the bits (what the GPU's cast does; Triton's
    interpreter truncates in ``.to(tl.bfloat16)``). NaN stays NaN, overflow goes to inf."""
    b_bits = x.to(tl.int32, bitcast=True)
    b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & -65536
    return tl.where(x == x, b_bits.to(tl.float32, bitcast=True), x)


@triton.jit
def round_cache(b_h, CACHE: tl.constexpr):
    """The state as the serving cache stores it: 0 fp32 (unchanged), 1 bf16, 2 fp16 (round to nearest even)."""
    if CACHE == 1:
        b_h = round_bf16(b_h)
    elif CACHE == 2:
        b_h = b_h.to(tl.float16).to(tl.float32)
    return b_h


@triton.jit
def round_state(b_h, CODEC: tl.constexpr, CODEC_BLOCK: tl.constexpr, CACHE: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, VFIRST: tl.constexpr):
    """The state codec on one state tile, then the serving cache's dtype. CODEC_BLOCK 0: one scale for the tile
    (one scale group; zero padding leaves amax unchanged); N: one scale per key row and N values along V (the
    tile's BV is a multiple of N). int8_h32 groups 32 values along V: only in the K-first orientation."""
    if CODEC == 3:
        b_h = tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))
    elif CODEC != 0:
        if CODEC_BLOCK == 0:
            b_amax = tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)
            if CODEC == 1:
                b_h = qdq_fp8_e4m3(b_h, fp8_scale(b_amax))
            else:
                b_h = qdq_int8(b_h, int8_scale(b_amax))
        elif VFIRST:
            b_t = tl.reshape(qdq_rows_3d(tl.reshape(tl.trans(b_h), (BK, BV // CODEC_BLOCK, CODEC_BLOCK)), CODEC == 1),
                             (BK, BV))
            b_h = tl.trans(b_t)
        else:
            b_h = tl.reshape(qdq_rows_3d(tl.reshape(b_h, (BK, BV // CODEC_BLOCK, CODEC_BLOCK)), CODEC == 1), (BK, BV))
    return round_cache(b_h, CACHE)


@triton.jit
def round_factor(b_x, FACTOR: tl.constexpr):
    """A replay factor (k over K, or u over the program's BV columns): one scale."""
    if FACTOR == 1:
        b_x = qdq_fp8_e4m3(b_x, fp8_scale(tl.max(amax_abs(b_x), axis=0)))
    elif FACTOR == 2:
        b_x = qdq_int8(b_x, int8_scale(tl.max(amax_abs(b_x), axis=0)))
    return b_x


@triton.jit
def load_decay(p_g, m_k, IS_KDA: tl.constexpr):
    """The token's log-decay (a [BK] vector for KDA, a scalar for GDN). A decay grid was applied
    before the token loop (decay_grid_kernel), so the loop carries no rounding of its own."""
    if IS_KDA:
        b_g = tl.load(p_g, mask=m_k, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(p_g).to(tl.float32)
    return b_g


@triton.jit
def load_token(q, k, v, g, beta, i_tok, i_h, i_hv, o_k, o_v, m_k, m_v, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, IS_KDA: tl.constexpr):
    """One token's q, k [BK], v [BV], beta and log-decay (a [BK] vector for KDA, a scalar for GDN), in fp32."""
    b_q = tl.load(q + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + (i_tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
    if IS_KDA:
        b_g = load_decay(g + (i_tok * HV + i_hv) * K + o_k, m_k, IS_KDA)
    else:
        b_g = load_decay(g + i_tok * HV + i_hv, m_k, IS_KDA)
    return b_q, b_k, b_v, b_beta, b_g


@triton.jit
def decay_factor(b_g, IS_KDA: tl.constexpr, VFIRST: tl.constexpr):
    """exp(g): a scalar (GDN) or a [BK] vector broadcast over the tile (KDA)."""
    if IS_KDA:
        return along_k(tl.exp(b_g), VFIRST)
    else:
        return tl.exp(b_g)


@triton.jit
def token_update(b_h, b_k, b_v, b_g, b_beta, IS_KDA: tl.constexpr, REPLAY: tl.constexpr, FACTOR: tl.constexpr,
                 VFIRST: tl.constexpr):
    """S_a = D S; w = v - S_a^T k; u = beta w; S_b = S_a + k_f u_f^T. Returns (S_a, w, k_f, u_f, S_b).
    The operations and their order are those of vLLM's fused_recurrent kernels (``b_h *= exp(g)``,
    ``b_v -= sum(b_h * k)``, ``b_v *= beta``, ``b_h += b_v * k``)."""
    b_ha = b_h * decay_factor(b_g, IS_KDA, VFIRST)
    b_w = b_v - sum_k(b_ha * along_k(b_k, VFIRST), VFIRST)
    b_u = b_beta * b_w
    b_kf = b_k
    b_uf = b_u
    if REPLAY and FACTOR != 0:
        b_kf = round_factor(b_k, FACTOR)
        b_uf = round_factor(b_u, FACTOR)
    b_hb = b_ha + along_k(b_kf, VFIRST) * along_v(b_uf, VFIRST)
    return b_ha, b_w, b_kf, b_uf, b_hb


@triton.jit
def state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_VK: tl.constexpr, VFIRST: tl.constexpr):
    """Offsets of the state tile in memory (layout kv or vk), in the tile's register orientation."""
    if STATE_VK:
        return along_k(o_k, VFIRST) + along_v(o_v, VFIRST) * K
    else:
        return along_k(o_k, VFIRST) * V + along_v(o_v, VFIRST)


@triton.jit
def tile_offsets(BK: tl.constexpr, BV: tl.constexpr, STATE_VK: tl.constexpr, VFIRST: tl.constexpr):
    """Offsets of a [BK x BV] tile in a private buffer (checkpoints, scratch), in the state's memory orientation:
    every state-sized load and store of a kernel then runs along the same axis, so that Triton keeps one register
    layout for the tile in the token loop instead of converting it."""
    if STATE_VK:
        return along_k(tl.arange(0, BK), VFIRST) + along_v(tl.arange(0, BV), VFIRST) * BK
    else:
        return along_k(tl.arange(0, BK), VFIRST) * BV + along_v(tl.arange(0, BV), VFIRST)


@triton.jit
def is_write(t, window, REPLAY: tl.constexpr):
    """Does suffix token t (counted from the suffix's start) round the state it writes? Token mode: always;
    replay: at the anchor refresh, every window-th token."""
    if REPLAY:
        return ((t + 1) % window) == 0
    else:
        return True
