"""QDQ as Triton device functions (arithmetic, or the GPU's E4M3 conversion), plus small test launchers.

Use the ``@triton.jit`` functions inside other kernels::

    from la_compiler.kernels.common.qdq import amax_abs, fp8_scale, qdq_fp8_e4m3
    b_s = fp8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0))
    b_h = qdq_fp8_e4m3(b_h, b_s)

They round bit-identically to ``la_compiler.quant.formats`` (the torch reference): E4M3
through the GPU's conversion instruction where it has one (``hardware_fp8_cast``), else through
the exponent read from the fp32 bits (step 2^(e-3), e >= -6), never through the interpreter's
cast to tl.float8e4nv (wrong at binade edges, triton-lang/triton#8322);
every quotient x / scale is correctly rounded (``quotient``: FMAs that give ``tl.div_rn``'s bits; ``/`` is
not correctly rounded on NVIDIA GPUs); clamps are written with ``tl.where`` so NaN passes through on every
backend. The ``*_in`` forms take both choices as constexpr flags, so that the tests check every form bit for
bit on the machine they run on.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from la_compiler.options import interpreter

FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)
E2M1_MAX = tl.constexpr(6.0)
NVFP4_GLOBAL_DIV = tl.constexpr(2688.0)  # 6 * 448
NVFP4_SCALE_FLOOR = tl.constexpr(1e-5)
H32_SCALE_FLOOR = tl.constexpr(6e-8)
H32_NORM = tl.constexpr(1.0 / math.sqrt(32.0))

def hardware_fp8_cast() -> bool:
    """Round to E4M3 with the GPU's own conversion (cvt.rn.satfinite.e4m3x2.f32, sm_89 and later: round to
    nearest even, NaN kept; the QDQ clamps to +-448 first, so saturation never decides). Never under the
    interpreter, whose cast is wrong at binade edges (triton-lang/triton#8322). Both forms give the same bits
    (tests/kernels/test_qdq_triton.py checks both where the GPU has the conversion); the arithmetic one is
    slower there (measured: docs/kernels-chunk-measurements.md, "Shared QDQ and the QDQ's arithmetic")."""
    if interpreter() or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:  # ROCm: its capability numbers are not NVIDIA's; E4M3 there is unmeasured
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


FP8_CAST = tl.constexpr(hardware_fp8_cast())  # read when this module is imported (by the first kernel load)

# Divide by a scale through its reciprocal and two FMA corrections (``quotient_in``'s FMA form) rather than
# ``tl.div_rn`` per element (a reciprocal on the special-function unit and a Newton step): the same RN(x / scale)
# bit for bit (tests/kernels/test_qdq_triton.py runs both; docs/numerics.md gives the argument), and faster
# (measured: docs/kernels-chunk-measurements.md, "Shared QDQ and the QDQ's arithmetic").
FMA_DIVISION = tl.constexpr(True)

FORMAT_IDS = {"fp8_e4m3": 0, "int8": 1, "e2m1": 2, "log_grid": 3, "int8_h32": 4, "quotient": 5}


# ---- building blocks -------------------------------------------------------------------
@triton.jit
def amax_abs(x):
    """|x| with NaN read as 0, ready for tl.max (amax ignores NaN)."""
    return tl.where(x == x, tl.abs(x), 0.0)


@triton.jit
def copy_sign(mag, v):
    """mag (>= 0, sign bit clear) with the sign bit of v (keeps -0.0 and tiny negatives)."""
    b_sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (mag.to(tl.int32, bitcast=True) | b_sign).to(tl.float32, bitcast=True)


@triton.jit
def clamp_keep_nan(v, lo, hi):
    return tl.where(v > hi, hi, tl.where(v < lo, lo, v))


@triton.jit
def _rhe_small(m):
    """Round half to even for finite 0 <= m < 2**31."""
    b_t = m.to(tl.int32)
    b_tf = b_t.to(tl.float32)
    b_f = m - b_tf
    b_up = (b_f > 0.5) | ((b_f == 0.5) & ((b_t & 1) == 1))
    return b_tf + b_up.to(tl.float32)


@triton.jit
def round_half_even(v):
    """Signed round half to even; NaN and |v| >= 2**23 (already integral, Inf too) pass through."""
    b_a = tl.abs(v)
    b_big = (b_a >= 8388608.0) | (v != v)
    b_r = copy_sign(_rhe_small(tl.where(b_big, 0.0, b_a)), v)
    return tl.where(b_big, v, b_r)


@triton.jit
def round_half_away(v):
    """Signed round half away from zero for |v| < 2**31; NaN passes through."""
    b_a = tl.where(v == v, tl.abs(v), 0.0)
    b_tf = b_a.to(tl.int32).to(tl.float32)
    b_r = copy_sign(b_tf + (b_a - b_tf >= 0.5).to(tl.float32), v)
    return tl.where(v == v, b_r, v)


@triton.jit
def round_e4m3(v):
    """Round v (|v| <= 448 or NaN) to the nearest E4M3 value, ties to even, subnormals kept."""
    return round_e4m3_in(v, FP8_CAST)


@triton.jit
def round_e4m3_in(v, HARDWARE: tl.constexpr):
    """``round_e4m3`` through the GPU's conversion (HARDWARE) or the arithmetic form."""
    if HARDWARE:
        return v.to(tl.float8e4nv).to(tl.float32)
    b_a = tl.where(v == v, tl.abs(v), 0.0)
    b_e = ((b_a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    b_e = tl.maximum(b_e, -6)  # below 2^-6 the E4M3 grid is the subnormal step 2^-9
    b_inv_step = ((3 - b_e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(3-e), exact product
    b_step = ((b_e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    b_r = copy_sign(_rhe_small(b_a * b_inv_step) * b_step, v)
    return tl.where(v == v, b_r, v)


@triton.jit
def round_e2m1(v):
    """Nearest-even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, sign kept; NaN passes."""
    b_a = tl.where(v == v, tl.abs(v), 0.0)
    b_q = tl.where(b_a <= 5.0, 4.0, 6.0)
    b_q = tl.where(b_a < 3.5, 3.0, b_q)
    b_q = tl.where(b_a <= 2.5, 2.0, b_q)
    b_q = tl.where(b_a < 1.75, 1.5, b_q)
    b_q = tl.where(b_a <= 1.25, 1.0, b_q)
    b_q = tl.where(b_a < 0.75, 0.5, b_q)
    b_q = tl.where(b_a <= 0.25, 0.0, b_q)
    return tl.where(v == v, copy_sign(b_q, v), v)


@triton.jit
def quotient(x, scale):
    """RN(x / scale) for scale > 0, in the FMA form (``quotient_in``)."""
    return quotient_in(x, scale, FMA_DIVISION)


@triton.jit
def quotient_in(x, scale, FMA: tl.constexpr):
    """RN(x / scale) for scale > 0 (NaN, Inf and zero x and an infinite scale as IEEE division gives them).

    With FMA: q0 = x * RN(1 / scale) is within two ulps of x / scale; each step
    q <- q + (x - q scale) RN(1 / scale) (the residual exact in an FMA) brings it closer, and the second
    step rounds correctly (Markstein's theorem: q within one ulp, the reciprocal within half an ulp). The
    reciprocal is one division per scale where the compiler keeps a broadcast row scale in one register.
    Scales outside [2^-60, 2^100] are first multiplied, with x, by a power of two (exact), so that the
    reciprocal and the residuals stay normal wherever the quotient is large enough to matter; a quotient
    beyond 2^100 (every format saturates far below) or a zero x is q0 itself."""
    if FMA:
        b_m = tl.where(scale < 8.673617379884035e-19, 1.8446744073709552e19,  # 2^-60, 2^64
                       tl.where(scale > 1.2676506002282294e30, 5.421010862427522e-20, 1.0))  # 2^100, 2^-64
        b_s = scale * b_m
        b_r = tl.div_rn(1.0, b_s)
        b_x = x * b_m
        b_q0 = b_x * b_r
        b_q1 = tl.fma(tl.fma(-b_q0, b_s, b_x), b_r, b_q0)
        b_q2 = tl.fma(tl.fma(-b_q1, b_s, b_x), b_r, b_q1)
        b_ok = (tl.abs(b_q0) <= 1.2676506002282294e30) & (b_x != 0)
        return tl.where(b_r > 0, tl.where(b_ok, b_q2, b_q0), b_q0)  # (a scalar scale's test apart: the interpreter)
    else:
        return tl.div_rn(x, scale)


# ---- scales (zero guard: a scale of 0 becomes 1) ---------------------------------------
@triton.jit
def fp8_scale(amax):
    b_s = tl.div_rn(amax, FP8_MAX)
    return tl.where(b_s > 0, b_s, 1.0)


@triton.jit
def int8_scale(amax):
    b_s = tl.div_rn(amax, INT8_MAX)
    return tl.where(b_s > 0, b_s, 1.0)


@triton.jit
def nvfp4_global_scale(global_amax):
    b_gs = tl.div_rn(global_amax, NVFP4_GLOBAL_DIV)
    return tl.where(b_gs > 0, b_gs, 1.0)


@triton.jit
def nvfp4_block_scale(block_amax, gs):
    """s_b = e4m3(min(block_amax / (6 gs), 448)) * gs, and 1 where that is below 1e-5."""
    b_t = tl.div_rn(block_amax, E2M1_MAX * gs)
    b_sb = round_e4m3(tl.where(b_t > FP8_MAX, FP8_MAX, b_t)) * gs
    return tl.where(b_sb < NVFP4_SCALE_FLOOR, 1.0, b_sb)


@triton.jit
def h32_scale(amax):
    """fp16(max(amax / 127, 6e-8)) as fp32: the Hadamard codec's stored scale."""
    b_s = tl.div_rn(amax, INT8_MAX)
    b_s = tl.where(b_s < H32_SCALE_FLOOR, H32_SCALE_FLOOR, b_s)
    return b_s.to(tl.float16).to(tl.float32)


# ---- QDQ with a given scale (broadcastable to x) ---------------------------------------
@triton.jit
def quant_fp8_e4m3(x, scale):
    """The E4M3 grid value of x / scale (what qdq_fp8_e4m3 multiplies by the scale): exact in bf16."""
    return quant_fp8_e4m3_in(x, scale, FMA_DIVISION, FP8_CAST)


@triton.jit
def quant_fp8_e4m3_in(x, scale, FMA: tl.constexpr, HARDWARE: tl.constexpr):
    """``quant_fp8_e4m3`` with the quotient's and the rounding's forms given."""
    return round_e4m3_in(clamp_keep_nan(quotient_in(x, scale, FMA), -FP8_MAX, FP8_MAX), HARDWARE)


@triton.jit
def quant_int8(x, scale):
    """The INT8 grid value (an integer, |q| <= 127) of x / scale: exact in bf16."""
    return round_half_even(clamp_keep_nan(quotient(x, scale), -INT8_MAX, INT8_MAX))


@triton.jit
def qdq_fp8_e4m3(x, scale):
    return quant_fp8_e4m3(x, scale) * scale


@triton.jit
def qdq_int8(x, scale):
    return quant_int8(x, scale) * scale


@triton.jit
def qdq_rows_3d(x3, IS_FP8: tl.constexpr):
    """FP8 E4M3 (IS_FP8) or INT8 of x3 [R, G, N] with one dynamic scale per [r, g, :] (amax over the last axis):
    the block groups of the state and W quantizers."""
    b_amax = tl.max(amax_abs(x3), axis=2)
    if IS_FP8:
        return qdq_fp8_e4m3(x3, fp8_scale(b_amax)[:, :, None])
    else:
        return qdq_int8(x3, int8_scale(b_amax)[:, :, None])


BF16_GRID_DOT = tl.constexpr(not interpreter())  # the interpreter's bf16 tl.dot is wrong


@triton.jit
def grid_dot(a, b, PRECISION: tl.constexpr):
    """a @ b of FP8 / INT8 grid values (exact in bf16; each product exact in fp32), fp32 accumulation: bf16
    operands for 16-bit inputs (PRECISION "tf32") on a GPU, else fp32 operands (IEEE under the interpreter, whose
    tl.dot of bf16 operands returns garbage in Triton 3.9)."""
    if PRECISION == "tf32" and BF16_GRID_DOT:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PRECISION == "tf32":
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def qdq_e2m1(x, scale):
    return round_e2m1(quotient(x, scale)) * scale


@triton.jit
def qdq_log_grid(g, step):
    return round_half_even(tl.div_rn(g, step)) * step


@triton.jit
def hadamard32(x):
    """Orthonormal Sylvester Hadamard-32 on each row of x [M, 32] (its own inverse).

    Same stages as la_compiler.quant.formats.hadamard32: pairs (2m, 2m+1) -> outputs m, m+16.
    """
    M: tl.constexpr = x.shape[0]
    for _ in tl.static_range(5):
        b_a, b_b = tl.split(tl.reshape(x, (M, 16, 2)))
        x = tl.reshape(tl.permute(tl.join(b_a + b_b, b_a - b_b), (0, 2, 1)), (M, 32))
    return x * H32_NORM


@triton.jit
def qdq_int8_h32(x):
    """The INT8 Hadamard-32 codec on x [M, 32]: rotate, one fp16 scale per row, round half away
    from zero, clamp ±127, dequantize, rotate back."""
    b_y = hadamard32(x)
    b_s = h32_scale(tl.max(amax_abs(b_y), axis=1))[:, None]
    b_q = round_half_away(clamp_keep_nan(quotient(b_y, b_s), -INT8_MAX, INT8_MAX))
    return hadamard32(b_q * b_s)


# ---- standalone test kernels -----------------------------------------------------------
@triton.jit
def qdq_elementwise_kernel(x_ptr, s_ptr, y_ptr, n, step, FORMAT: tl.constexpr, BLOCK: tl.constexpr,
                           FMA: tl.constexpr, HARDWARE: tl.constexpr):
    o_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < n
    b_x = tl.load(x_ptr + o_i, mask=m_i, other=0.0)
    if FORMAT == 3:
        b_y = qdq_log_grid(b_x, step)
    else:
        b_s = tl.load(s_ptr + o_i, mask=m_i, other=1.0)
        if FORMAT == 0:
            b_y = quant_fp8_e4m3_in(b_x, b_s, FMA, HARDWARE) * b_s
        elif FORMAT == 1:
            b_y = qdq_int8(b_x, b_s)
        elif FORMAT == 2:
            b_y = qdq_e2m1(b_x, b_s)
        else:  # the bare quotient x / s
            b_y = quotient_in(b_x, b_s, FMA)
    tl.store(y_ptr + o_i, b_y, mask=m_i)


def qdq_elementwise(x: torch.Tensor, scale: torch.Tensor | None, fmt: str, *, step: float = 1.0,
                    block: int | None = None, fma: bool = True, hardware_cast: bool | None = None):
    """Elementwise QDQ of fp32 x with a per-element scale (fmt fp8_e4m3 / int8 / e2m1) or a grid step (log_grid);
    fmt "quotient" returns x / scale as ``quotient_in`` computes it. ``fma``: the quotient's form of fp8_e4m3 and
    quotient (False: ``tl.div_rn``); ``hardware_cast``: fp8_e4m3 through the GPU's conversion (default: where the
    kernels take it, ``hardware_fp8_cast``; never possible under the interpreter).

    The default block is one huge program in the interpreter (fast there) and 1024 on a GPU."""
    if hardware_cast is None:
        hardware_cast = FP8_CAST.value
    elif hardware_cast and not hardware_fp8_cast():
        raise ValueError("qdq_elementwise: hardware_cast=True needs a GPU with the E4M3 conversion (sm_89 or later), "
                         "never Triton's interpreter")
    if block is None:
        block = 1 << 20 if x.device.type == "cpu" or interpreter() else 1024
    x = x.contiguous().float()
    y = torch.full_like(x, float("nan"))
    s = x if scale is None else scale.to(torch.float32).expand(x.shape).contiguous()
    grid = (triton.cdiv(x.numel(), block),)
    qdq_elementwise_kernel[grid](x, s, y, x.numel(), step, FORMAT=FORMAT_IDS[fmt], BLOCK=block, FMA=fma,
                                 HARDWARE=hardware_cast)
    return y


@triton.jit
def qdq_tile_kernel(x_ptr, y_ptr, K, V, FORMAT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One program per (leading index n, value tile j) of x [N, K, V]: dynamic tile scale."""
    i_n, i_v = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    p_x = x_ptr + i_n * K * V + o_k[:, None] * V + o_v[None, :]
    b_x = tl.load(p_x, mask=m_kv, other=0.0)
    if FORMAT == 4:
        b_y = tl.reshape(qdq_int8_h32(tl.reshape(b_x, (BK * BV // 32, 32))), (BK, BV))
    else:
        b_amax = tl.max(tl.max(amax_abs(b_x), axis=1), axis=0)
        if FORMAT == 0:
            b_y = qdq_fp8_e4m3(b_x, fp8_scale(b_amax))
        else:
            b_y = qdq_int8(b_x, int8_scale(b_amax))
    tl.store(y_ptr + i_n * K * V + o_k[:, None] * V + o_v[None, :], b_y, mask=m_kv)


def qdq_tile(x: torch.Tensor, fmt: str, block_v: int):
    """Tile-scale QDQ of a state x [..., K, V] (fmt fp8_e4m3 / int8 / int8_h32), amax in-kernel."""
    if fmt == "int8_h32" and (x.shape[-1] % 32 or block_v % 32):
        raise ValueError(f"qdq_tile: int8_h32 needs V and block_v multiples of 32, got V={x.shape[-1]}, block_v={block_v}")
    K, V = x.shape[-2:]
    xc = x.contiguous().float().reshape(-1, K, V)
    y = torch.full_like(xc, float("nan"))
    grid = (xc.shape[0], triton.cdiv(V, block_v))
    qdq_tile_kernel[grid](xc, y, K, V, FORMAT=FORMAT_IDS[fmt], BK=triton.next_power_of_2(K), BV=block_v)
    return y.reshape(x.shape)


@triton.jit
def qdq_nvfp4_kernel(x_ptr, gamax_ptr, y_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """NVFP4 over x [R, C] (C a multiple of 16) in blocks of 16 along C; the global amax is given."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m_rc = (o_r[:, None] < R) & (o_c[None, :] < C)
    p_x = x_ptr + o_r[:, None] * C + o_c[None, :]
    b_x = tl.reshape(tl.load(p_x, mask=m_rc, other=0.0), (BR, BC // 16, 16))
    b_gs = nvfp4_global_scale(tl.load(gamax_ptr))
    b_sb = nvfp4_block_scale(tl.max(amax_abs(b_x), axis=2), b_gs)
    b_y = tl.reshape(qdq_e2m1(b_x, b_sb[:, :, None]), (BR, BC))
    tl.store(y_ptr + o_r[:, None] * C + o_c[None, :], b_y, mask=m_rc)


def qdq_nvfp4(x: torch.Tensor, block_rows: int = 64, block_cols: int = 64):
    """NVFP4 QDQ of x [..., C] (C % 16 == 0): global amax over x (NaN ignored), blocks of 16 along C."""
    if x.shape[-1] % 16:
        raise ValueError(f"qdq_nvfp4: the last axis ({x.shape[-1]}) must be a multiple of 16")
    xc = x.contiguous().float().reshape(-1, x.shape[-1])
    gamax = torch.nan_to_num(xc.abs(), nan=0.0, posinf=float("inf")).amax().reshape(1)
    y = torch.full_like(xc, float("nan"))
    R, C = xc.shape
    grid = (triton.cdiv(R, block_rows), triton.cdiv(C, block_cols))
    qdq_nvfp4_kernel[grid](xc, gamax, y, R, C, BR=block_rows, BC=block_cols)
    return y.reshape(x.shape)
