"""fake_quant: dynamic-scale QDQ of a tensor by a QuantConfig, with a straight-through gradient.

Scale groups (the tensor ``x`` the caller passes; QDQ arithmetic in fp32, result in x.dtype):

- ``tensor``: one scale over all of x.
- ``axis:i,j``: one scale per index of the kept axes i, j (ModelOpt's ``axis``).
- ``row``: one scale per row of the last axis (the reduction axis: per token and head for W).
- ``block<N>``: one scale per N consecutive values of the last axis (a shorter last block
  when the axis length is not a multiple of N).
- ``tile<BV>``: x is a state ``[..., K, V]`` (kv layout; transpose a vk state first); one
  scale per tile of all K rows x BV consecutive value columns, per leading index
  (sequence, head); a shorter last tile when V is not a multiple of BV.
- ``nvfp4/block16``: per-16-block E4M3 scales under one global scale over all of x.
- ``int8_h32/tile<BV>``: Hadamard-32 on each key row's 32-value groups, one scale per
  (key row, 32 values); BV (a multiple of 32) only records the kernel's tile width.

amax ignores NaN; NaN elements stay NaN. A ±Inf makes its group's amax infinite and the
whole group NaN (0 * inf); see docs/numerics.md.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from la_compiler.quant import formats as F
from la_compiler.quant.config import QuantConfig, QuantConfigError


def _amax(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over dim (keepdim), NaN ignored (taken as 0)."""
    a = torch.nan_to_num(x.abs(), nan=0.0, posinf=float("inf"))
    if dim == ():
        return a
    return a.amax(dim=dim, keepdim=True)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _guard(s: torch.Tensor) -> torch.Tensor:
    """Zero guard: a scale of 0 (amax 0, or amax/qmax underflowing) becomes 1."""
    return torch.where(s > 0, s, torch.ones_like(s))


def group_amax(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """amax per scale group of fp32 x, broadcast back to x's shape (fp8/int8 groups)."""
    if cfg.group == "tensor":
        return _amax(x, tuple(range(x.dim()))).expand(x.shape)
    if cfg.group == "row":
        return _amax(x, (-1,)).expand(x.shape)
    if cfg.group == "axis":
        kept = set()
        for a in cfg.axis:
            if not -x.dim() <= a < x.dim():
                raise QuantConfigError(f"quant axis {a} is out of range for a tensor of {x.dim()} dims")
            kept.add(a % x.dim())
        return _amax(x, tuple(d for d in range(x.dim()) if d not in kept)).expand(x.shape)
    if cfg.group == "block":
        n = cfg.block_size
        xb = _pad_last(x, n)
        amax = _amax(xb.unflatten(-1, (-1, n)), (-1,)).expand(*xb.shape[:-1], -1, n)
        return amax.flatten(-2)[..., : x.shape[-1]]
    if cfg.group == "tile":
        if x.dim() < 2:
            raise QuantConfigError(f"quant group 'tile' needs a state [..., K, V], got shape {tuple(x.shape)}")
        bv = cfg.block_v
        xt = _pad_last(x, bv).unflatten(-1, (-1, bv))  # [..., K, V/BV, BV]
        amax = _amax(xt, (-3, -1)).expand(xt.shape)
        return amax.flatten(-2)[..., : x.shape[-1]]
    raise QuantConfigError(f"quant group {cfg.group!r} has no amax rule")


def _nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(QDQ'd x, per-element block scale s_b) for NVFP4 blocks of 16 along the last axis."""
    gamax = _amax(x, tuple(range(x.dim())))
    gs = _guard(gamax / (F.E2M1_MAX * F.FP8_E4M3_MAX))
    xb = _pad_last(x, 16).unflatten(-1, (-1, 16))
    bamax = _amax(xb, (-1,))
    sb = F.round_e4m3(torch.clamp_max(bamax / (F.E2M1_MAX * gs), F.FP8_E4M3_MAX)) * gs
    sb = torch.where(sb < F.NVFP4_SCALE_FLOOR, torch.ones_like(sb), sb)
    out = F.qdq_e2m1(xb, sb).flatten(-2)[..., : x.shape[-1]]
    return out, sb.expand(xb.shape).flatten(-2)[..., : x.shape[-1]]


def _int8_h32(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2 or x.shape[-1] % 32:
        raise QuantConfigError(
            f"quant format 'int8_h32' needs a state [..., K, V] with V a multiple of 32, got shape {tuple(x.shape)}"
        )
    y = F.hadamard32(x).unflatten(-1, (-1, 32))
    s16 = F.h32_scale(_amax(y, (-1,)))
    return F.hadamard32(F.qdq_int8_h32_rotated(y, s16).flatten(-2))


def _qdq_fp32(x: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(QDQ'd fp32 x, the clipped-STE mask or None)."""
    if cfg.format == "log_grid":
        return F.qdq_log_grid(x, cfg.step), None
    if cfg.format == "int8_h32":
        return _int8_h32(x), None
    if cfg.format == "nvfp4":
        out, sb = _nvfp4(x)
        mask = x.abs() <= F.E2M1_MAX * sb if cfg.ste == "clipped" else None
        return out, mask
    amax = group_amax(x, cfg)
    if cfg.format == "fp8_e4m3":
        out = F.qdq_fp8_e4m3(x, _guard(amax / F.FP8_E4M3_MAX))
    else:
        out = F.qdq_int8(x, _guard(amax / F.INT8_MAX))
    return out, (x.abs() <= amax if cfg.ste == "clipped" else None)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg):
        with torch.no_grad():
            out, mask = _qdq_fp32(x.to(torch.float32), cfg)
        ctx.save_for_backward(mask if mask is not None else torch.empty(0))
        ctx.clipped = mask is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clipped:
            return grad, None
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype), None


def fake_quant(x: torch.Tensor, cfg: "QuantConfig | str | Mapping[str, Any]", *, site: str | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` with dynamic scales; backward is the straight-through estimator.

    ``cfg`` is a QuantConfig, a canonical string (``"fp8_e4m3/tile64"``) or a ModelOpt quant_cfg
    ``cfg`` dict (``site`` then picks the seeds' grouping, see ``QuantConfig.from_modelopt``).
    Arithmetic is fp32; the result has x's dtype (fp64 callers get fp32-rounded values back).
    """
    cfg = QuantConfig.coerce(cfg, site)
    if not x.is_floating_point():
        raise TypeError(f"fake_quant: x must be a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        return x.clone()
    return _FakeQuantSTE.apply(x, cfg)


def quant_scale(x: torch.Tensor, cfg: "QuantConfig | str") -> torch.Tensor:
    """The scale every element of fp32 ``x`` is divided by (fp8/int8/nvfp4), broadcast to x's shape."""
    cfg = QuantConfig.coerce(cfg)
    x = x.to(torch.float32)
    if cfg.format == "nvfp4":
        return _nvfp4(x)[1]
    if cfg.format not in ("fp8_e4m3", "int8"):
        raise QuantConfigError(f"quant_scale: format {cfg.format!r} has no single per-element scale")
    qmax = F.FP8_E4M3_MAX if cfg.format == "fp8_e4m3" else F.INT8_MAX
    return _guard(group_amax(x, cfg) / qmax)
