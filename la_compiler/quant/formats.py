"""Elementwise QDQ per format with a given scale, in fp32 torch ops (docs/numerics.md, "Formats").

Every function takes fp32 ``x`` and a ``scale`` broadcastable to it and returns fp32.
NaN in ``x`` (or a NaN quotient x/scale, e.g. inf/inf) stays NaN; a finite scale
saturates ±Inf to ±qmax * scale; an infinite scale turns finite values into 0 * inf = NaN.
These functions have no useful gradient (rounding); ``reference.fake_quant`` adds the STE.
"""
from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
E2M1_MAX = 6.0
NVFP4_SCALE_FLOOR = 1e-5  # a per-block scale below this is replaced by 1 (docs/numerics.md)
H32_SCALE_FLOOR = 6e-8  # keeps fp16(s) > 0: the smallest fp16 subnormal is 2**-24 ~ 5.96e-8
# 1/sqrt(32) as an fp32 tensor constant: Triton multiplies by the same fp32 number.
H32_NORM = torch.tensor(1.0 / math.sqrt(32.0), dtype=torch.float32)


def qdq_fp8_e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """clamp(x/s, ±448) rounded to E4M3 (nearest-even, subnormals kept), times s."""
    v = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return v.to(torch.float8_e4m3fn).to(torch.float32) * scale


def round_e4m3(t: torch.Tensor) -> torch.Tensor:
    """E4M3 rounding of values already inside [-448, 448] (NVFP4's per-block scales)."""
    return t.to(torch.float8_e4m3fn).to(torch.float32)


def qdq_int8(x: torch.Tensor, scale) -> torch.Tensor:
    """clamp(round_half_even(x/s), -127, 127) * s (narrow range)."""
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX) * scale


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest-even on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, sign kept."""
    a = v.abs()
    q = torch.full_like(a, 6.0)
    # Thresholds from docs/numerics.md, applied from the top so the lowest matching bucket wins.
    for bound, inclusive, value in ((5.0, True, 4.0), (3.5, False, 3.0), (2.5, True, 2.0), (1.75, False, 1.5),
                                    (1.25, True, 1.0), (0.75, False, 0.5), (0.25, True, 0.0)):
        q = torch.where(a <= bound if inclusive else a < bound, value, q)
    return torch.where(torch.isnan(v), v, torch.copysign(q, v))


def qdq_e2m1(x: torch.Tensor, scale) -> torch.Tensor:
    return round_e2m1(x / scale) * scale


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (no |v| + 0.5, which rounds in fp32)."""
    a = v.abs()
    t = torch.trunc(a)
    return torch.copysign(t + (a - t >= 0.5).to(v.dtype), v)


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard-32 on each group of 32 consecutive values of the last axis.

    Five radix-2 stages in constant geometry (pairs (2m, 2m+1) -> outputs m and m+16), then one
    multiply by fp32(1/sqrt(32)). The Triton helper uses the same operations in the same order,
    so both round identically. H is symmetric and orthonormal: it is its own inverse.
    """
    if x.shape[-1] % 32:
        raise ValueError(f"hadamard32: the last axis ({x.shape[-1]}) must be a multiple of 32")
    y = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    for _ in range(5):
        pairs = y.unflatten(-1, (16, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        y = torch.cat([a + b, a - b], dim=-1)
    return (y * H32_NORM).reshape(x.shape)


def h32_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp16(max(amax/127, 6e-8)) as fp32: the codec's stored scale."""
    return torch.clamp_min(amax / INT8_MAX, H32_SCALE_FLOOR).to(torch.float16).to(torch.float32)


def qdq_int8_h32_rotated(y: torch.Tensor, scale16) -> torch.Tensor:
    """The rotated-domain step of the Hadamard codec: clamp(round_away(y/s16), ±127) * s16."""
    return round_half_away((y / scale16).clamp(-INT8_MAX, INT8_MAX)) * scale16


def qdq_log_grid(g: torch.Tensor, step: float) -> torch.Tensor:
    """round_half_even(g/d) * d with d = fp32(step)."""
    d = torch.tensor(step, dtype=torch.float32)
    return torch.round(g / d) * d
