"""Triton device functions of the decode-phase kernels (templates/decode_fused_kernels.tmpl).

The numerics are those of kernels/reference/decode.py; the QDQ itself comes from kernels/common/qdq.py.
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.qdq import amax_abs, fp8_scale, int8_scale, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32


@triton.jit
def round_state(b_h, CODEC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The state codec on one [BK x BV] tile (one scale group; zero padding leaves amax unchanged)."""
    if CODEC == 1:
        b_h = qdq_fp8_e4m3(b_h, fp8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
    elif CODEC == 2:
        b_h = qdq_int8(b_h, int8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
    elif CODEC == 3:
        b_h = tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))
    return b_h


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
def decayed(b_h, b_g, IS_KDA: tl.constexpr):
    if IS_KDA:
        return b_h * tl.exp(b_g)[:, None]
    else:
        return b_h * tl.exp(b_g)


@triton.jit
def token_update(b_h, b_k, b_v, b_g, b_beta, suffix, IS_KDA: tl.constexpr, REPLAY: tl.constexpr,
                  FACTOR: tl.constexpr):
    """S_a = D S; w = v - S_a^T k; u = beta w; S_b = S_a + k_f u_f^T. Returns (S_a, w, k_f, u_f, S_b)."""
    b_ha = decayed(b_h, b_g, IS_KDA)
    b_w = b_v - tl.sum(b_ha * b_k[:, None], 0)
    b_u = b_beta * b_w
    b_kf = b_k
    b_uf = b_u
    if REPLAY and FACTOR != 0:
        b_kf = tl.where(suffix, round_factor(b_k, FACTOR), b_k)
        b_uf = tl.where(suffix, round_factor(b_u, FACTOR), b_u)
    b_hb = b_ha + b_kf[:, None] * b_uf[None, :]
    return b_ha, b_w, b_kf, b_uf, b_hb


@triton.jit
def stored_length(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        return tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)
    else:
        return T


@triton.jit
def is_write(t, p, window, REPLAY: tl.constexpr):
    """Does suffix token t (t >= p) round the state it writes? Token mode: always; replay: at anchor refresh."""
    if REPLAY:
        return ((t - p + 1) % window) == 0
    else:
        return t >= p
