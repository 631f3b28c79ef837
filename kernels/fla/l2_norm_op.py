"""``laqat::l2_norm``: FLA's l2 norm (``fla.modules.norm.l2norm``'s ``l2norm_fwd`` / ``l2norm_bwd``) as an opaque op.

    laqat::l2_norm(x [..., D], eps, output_dtype?) -> (y [..., D] in output_dtype (x's by default), rstd [...] fp32)

    rstd = 1 / sqrt(sum(x^2) + eps)     in fp32
    y    = x * rstd                     stored in output_dtype

The FLA frontend puts it in front of the recurrence where FLA's kernels normalize q and k in-kernel
(``use_qk_l2norm_in_kernel=True``), and for FLA's ``l2norm`` module function. The autograd saves y and rstd, not x,
as FLA's ``L2NormFunction`` and its chunk functions do:

    dx = rstd * (dy - sum(dy * y) * y)  in fp32, from the stored y

so the gradient reads y as stored: exact where y is fp32, with y's rounding where it is 16-bit (FLA's gradient).
The recurrence saves that same y (its q or k), so the norm keeps only the [...] inverse norms besides it, where
the norm as torch ops keeps x (docs/memory.md). On CUDA the op runs FLA's own kernels; elsewhere the torch
formulas below.
"""
from __future__ import annotations

from typing import Optional

import torch

from la_compiler.kernels.fla.autotune_searches import searched
from la_compiler.kernels.fla.backward_ahead import compile_backward_ahead, describe

Tensor = torch.Tensor


def l2_norm_formula(x: Tensor, eps: float, output_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = 1.0 / torch.sqrt(xf.square().sum(-1) + eps)
    y = (xf * rstd.unsqueeze(-1)).to(x.dtype if output_dtype is None else output_dtype)
    return y, rstd


def l2_norm_backward_formula(dy: Tensor, y: Tensor, rstd: Tensor) -> Tensor:
    dyf, yf, rstd = dy.float(), y.float(), rstd.float().unsqueeze(-1)
    return dyf * rstd - (dyf * yf).sum(-1, keepdim=True) * yf * rstd


@torch.library.custom_op("laqat::l2_norm", mutates_args=())
def l2_norm(x: Tensor, eps: float, output_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        from fla.modules.norm.l2norm import l2norm_fwd

        y, rstd = searched(l2norm_fwd)(x.contiguous(), eps=eps, output_dtype=output_dtype)
        compile_backward_ahead("l2_norm", describe(y, rstd, eps), x.device,
                               lambda: _fla_backward(torch.empty_like(y), y, rstd, eps))
        return y, rstd
    y, rstd = l2_norm_formula(x, eps, output_dtype)
    return y.contiguous(), rstd.contiguous()


@l2_norm.register_fake
def _(x, eps, output_dtype):
    y = torch.empty_like(x, dtype=x.dtype if output_dtype is None else output_dtype,
                         memory_format=torch.contiguous_format)
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


def _fla_backward(dy: Tensor, y: Tensor, rstd: Tensor, eps: float) -> Tensor:
    from fla.modules.norm.l2norm import l2norm_bwd

    return searched(l2norm_bwd)(y=y, rstd=rstd, dy=dy.contiguous(), eps=eps)


@torch.library.custom_op("laqat::l2_norm_backward", mutates_args=())
def l2_norm_backward(dy: Tensor, y: Tensor, rstd: Tensor, eps: float, x_dtype: torch.dtype) -> Tensor:
    if y.is_cuda:
        return _fla_backward(dy, y, rstd, eps).to(x_dtype).contiguous()
    return l2_norm_backward_formula(dy, y, rstd).to(x_dtype).contiguous()


@l2_norm_backward.register_fake
def _(dy, y, rstd, eps, x_dtype):
    return torch.empty_like(y, dtype=x_dtype, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, eps, _ = inputs
    y, rstd = output
    ctx.save_for_backward(y, rstd)
    ctx.options = (eps, x.dtype)


def _backward(ctx, dy, _drstd):
    y, rstd = ctx.saved_tensors
    return torch.ops.laqat.l2_norm_backward(dy, y, rstd, *ctx.options), None, None


l2_norm.register_autograd(_backward, setup_context=_setup_context)


def l2norm(x: Tensor, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None) -> Tensor:
    """FLA's ``l2norm`` (``L2NormFunction``), traced: y."""
    return torch.ops.laqat.l2_norm(x, float(eps), output_dtype)[0]
