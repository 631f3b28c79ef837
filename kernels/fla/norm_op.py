"""``laqat::layer_norm_gated`` and ``laqat::layer_norm``: FLA's (gated) RMSNorm / LayerNorm as opaque ops.

``FusedRMSNormGated`` (the output norm of FLA's GDN and KDA layers) calls
``fla.modules.norm.fused_norm_gate.rms_norm_gated``, an ``autograd.Function`` around autotuned
Triton kernels that Dynamo cannot trace. The FLA frontend substitutes ``rms_norm_gated`` and
``layer_norm_gated`` with a call to this op.

    laqat::layer_norm_gated(x [..., D], g [..., D], weight? [D], bias? [D], activation, eps, is_rms_norm)
        -> y [..., D] in x.dtype

    x_hat = x * rsqrt(mean(x^2) + eps)                 (RMSNorm; LayerNorm centres x first)
    y     = (x_hat * weight + bias) * act(g),  act = silu ("swish", "silu") or sigmoid ("sigmoid")

computed in fp32 (fla/modules/norm/fused_norm_gate.py, ``layer_norm_gated_fwd_kernel``).
On CUDA the op runs FLA's own ``layer_norm_gated_fwd`` / ``layer_norm_gated_bwd`` kernels
(the backward recomputes the row statistics with the forward kernel); elsewhere the fp32
torch reference below, differentiated by torch autograd. It is checked against FLA's own
torch reference ``fla.modules.norm.layernorm_gated.rms_norm_ref`` in the tests.

``laqat::layer_norm(x, weight?, bias?, eps, is_rms_norm)`` is the same without the gate: FLA's
``RMSNorm`` / ``LayerNorm`` modules (``fla.modules.norm.layernorm.rms_norm`` / ``layer_norm``;
GDN's output norm with ``use_gate=False``), on CUDA through FLA's ``layer_norm_fwd`` / ``layer_norm_bwd``.

``laqat::layer_norm_residual(x, residual, weight?, bias?, eps, is_rms_norm) -> (y, residual_out)`` is FLA's pre-norm
with its residual (the blocks' ``norm(x, residual, prenorm=True)``): y normalizes the fp32 sum x + residual and is
stored in x's dtype, residual_out is that sum in the residual's dtype. Its autograd saves residual_out, as FLA's
``LayerNormFunction`` saves its ``res_out``, not the fp32 sum: the backward normalizes the stored residual_out
(exact where the residual is fp32; with its rounding where it is 16-bit, as FLA's backward reads it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from la_compiler.kernels.common.autograd_inside_op import autograd_enabled
from la_compiler.kernels.fla.autotune_searches import searched
from la_compiler.kernels.fla.backward_ahead import compile_backward_ahead, describe

Tensor = torch.Tensor
ACTIVATIONS = ("swish", "silu", "sigmoid")


def layer_norm_gated_reference(x, g, weight, bias, activation: str, eps: float, is_rms_norm: bool) -> Tensor:
    """fp32 torch reference; ``g=None``: no output gate."""
    xf = x.float()
    if not is_rms_norm:
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if g is not None:
        gf = g.float()
        y = y * (F.silu(gf) if activation in ("swish", "silu") else torch.sigmoid(gf))
    return y.to(x.dtype)


def _fla_forward(x, g, weight, bias, activation, eps, is_rms_norm):
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd

    x2, g2 = x.reshape(-1, x.shape[-1]).contiguous(), g.reshape(-1, g.shape[-1]).contiguous()
    y, mean, rstd, _ = searched(layer_norm_gated_fwd)(
        x=x2, g=g2, weight=weight, bias=bias, activation=activation, eps=eps, is_rms_norm=is_rms_norm)
    return x2, g2, y, mean, rstd


@torch.library.custom_op("laqat::layer_norm_gated", mutates_args=())
def layer_norm_gated(
    x: Tensor,
    g: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    activation: str,
    eps: float,
    is_rms_norm: bool,
) -> Tensor:
    if x.is_cuda:
        y = _fla_forward(x, g, weight, bias, activation, eps, is_rms_norm)[2].reshape(x.shape)
        compile_backward_ahead(
            "layer_norm_gated", describe(x, g, weight, bias, activation, eps, is_rms_norm), x.device,
            lambda: _fla_backward(torch.empty_like(y), x, g, weight, bias, activation, eps, is_rms_norm))
        return y
    return layer_norm_gated_reference(x, g, weight, bias, activation, eps, is_rms_norm).contiguous()


@layer_norm_gated.register_fake
def _(x, g, weight, bias, activation, eps, is_rms_norm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fla_backward(dy, x, g, weight, bias, activation, eps, is_rms_norm):
    """-> (dx, dg, dw, db) from FLA's kernels; the statistics recomputed with the forward's kernel."""
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_bwd

    x2, g2, _, mean, rstd = _fla_forward(x, g, weight, bias, activation, eps, is_rms_norm)
    dx, dg, dw, db, _ = searched(layer_norm_gated_bwd)(
        dy=dy.reshape(x2.shape).contiguous(), x=x2, g=g2, weight=weight, bias=bias, activation=activation, eps=eps,
        mean=mean, rstd=rstd, is_rms_norm=is_rms_norm, x_dtype=x.dtype)
    return dx.reshape(x.shape), dg.reshape(g.shape), dw, db


@torch.library.custom_op("laqat::layer_norm_gated_backward", mutates_args=())
def layer_norm_gated_backward(
    dy: Tensor,
    x: Tensor,
    g: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    activation: str,
    eps: float,
    is_rms_norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dg, dweight, dbias); an empty tensor for an absent weight or bias."""
    if x.is_cuda:
        dx, dg, dw, db = _fla_backward(dy, x, g, weight, bias, activation, eps, is_rms_norm)
    else:
        inputs = [t.detach().requires_grad_(True) if t is not None else None for t in (x, g, weight, bias)]
        with autograd_enabled():
            y = layer_norm_gated_reference(*inputs, activation, eps, is_rms_norm)
            wrt = [t for t in inputs if t is not None]
            got = iter(torch.autograd.grad([y], wrt, [dy], allow_unused=True))
        grads = [None if t is None else next(got) for t in inputs]
        dx, dg, dw, db = [gr if gr is not None or t is None else torch.zeros_like(t) for gr, t in zip(grads, inputs)]
    return tuple(x.new_empty((0,)) if gr is None else gr.contiguous() for gr in (dx, dg, dw, db))


@layer_norm_gated_backward.register_fake
def _(dy, x, g, weight, bias, activation, eps, is_rms_norm):
    return tuple(x.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (x, g, weight, bias))


def _setup_context(ctx, inputs, output):
    x, g, weight, bias, activation, eps, is_rms_norm = inputs
    ctx.save_for_backward(x, g, weight, bias)
    ctx.options = (activation, eps, is_rms_norm)


def _backward(ctx, dy):
    x, g, weight, bias = ctx.saved_tensors
    dx, dg, dw, db = torch.ops.laqat.layer_norm_gated_backward(dy, x, g, weight, bias, *ctx.options)
    return dx, dg, dw if weight is not None else None, db if bias is not None else None, None, None, None


layer_norm_gated.register_autograd(_backward, setup_context=_setup_context)


# ---- without the gate -----------------------------------------------------------------------
def _fla_forward_plain(x, weight, bias, eps, is_rms_norm):
    from fla.modules.norm.layernorm import layer_norm_fwd

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y, mean, rstd, _ = searched(layer_norm_fwd)(x=x2, weight=weight, bias=bias, eps=eps, is_rms_norm=is_rms_norm)
    return x2, y, mean, rstd


@torch.library.custom_op("laqat::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, is_rms_norm: bool) -> Tensor:
    if x.is_cuda:
        y = _fla_forward_plain(x, weight, bias, eps, is_rms_norm)[1].reshape(x.shape)
        _backward_ahead_plain(y, x, weight, bias, eps, is_rms_norm)
        return y
    return layer_norm_gated_reference(x, None, weight, bias, "", eps, is_rms_norm).contiguous()


@layer_norm.register_fake
def _(x, weight, bias, eps, is_rms_norm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fla_backward_plain(dy, x, weight, bias, eps, is_rms_norm):
    """-> (dx, dw, db) from FLA's kernels; the statistics recomputed with the forward's kernel."""
    from fla.modules.norm.layernorm import layer_norm_bwd

    x2, _, mean, rstd = _fla_forward_plain(x, weight, bias, eps, is_rms_norm)
    dx, dw, db, _ = searched(layer_norm_bwd)(
        dy=dy.reshape(x2.shape).contiguous(), x=x2, weight=weight, bias=bias, mean=mean, rstd=rstd,
        is_rms_norm=is_rms_norm, x_dtype=x.dtype)
    return dx.reshape(x.shape), dw, db


def _backward_ahead_plain(y, x, weight, bias, eps, is_rms_norm) -> None:
    """``laqat::layer_norm_backward`` of (y's gradient, x) compiled ahead (kernels/fla/backward_ahead.py)."""
    compile_backward_ahead(
        "layer_norm", describe(y.dtype, x, weight, bias, eps, is_rms_norm), x.device,
        lambda: _fla_backward_plain(torch.empty_like(y), x, weight, bias, eps, is_rms_norm))


@torch.library.custom_op("laqat::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                        is_rms_norm: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx, dweight, dbias); an empty tensor for an absent weight or bias."""
    if x.is_cuda:
        dx, dw, db = _fla_backward_plain(dy, x, weight, bias, eps, is_rms_norm)
    else:
        inputs = [t.detach().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
        with autograd_enabled():
            y = layer_norm_gated_reference(inputs[0], None, inputs[1], inputs[2], "", eps, is_rms_norm)
            wrt = [t for t in inputs if t is not None]
            got = iter(torch.autograd.grad([y], wrt, [dy], allow_unused=True))
        grads = [None if t is None else next(got) for t in inputs]
        dx, dw, db = [gr if gr is not None or t is None else torch.zeros_like(t) for gr, t in zip(grads, inputs)]
    return tuple(x.new_empty((0,)) if gr is None else gr.contiguous() for gr in (dx, dw, db))


@layer_norm_backward.register_fake
def _(dy, x, weight, bias, eps, is_rms_norm):
    return tuple(x.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (x, weight, bias))


def _setup_context_plain(ctx, inputs, output):
    x, weight, bias, eps, is_rms_norm = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.options = (eps, is_rms_norm)


def _backward_plain(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.laqat.layer_norm_backward(dy, x, weight, bias, *ctx.options)
    return dx, dw if weight is not None else None, db if bias is not None else None, None, None


layer_norm.register_autograd(_backward_plain, setup_context=_setup_context_plain)


# ---- with the pre-norm residual add ------------------------------------------------------------
@torch.library.custom_op("laqat::layer_norm_residual", mutates_args=())
def layer_norm_residual(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                        is_rms_norm: bool) -> tuple[Tensor, Tensor]:
    """-> (y in x's dtype, residual_out = x + residual in the residual's dtype); y normalizes the fp32 sum."""
    total = x.float() + residual.float()
    if not x.is_cuda:
        y = layer_norm_gated_reference(total, None, weight, bias, "", eps, is_rms_norm)
        return y.to(x.dtype).contiguous(), total.to(residual.dtype).contiguous()
    y = _fla_forward_plain(total, weight, bias, eps, is_rms_norm)[1].reshape(x.shape).to(x.dtype).contiguous()
    residual_out = total.to(residual.dtype).contiguous()
    _backward_ahead_plain(y, residual_out, weight, bias, eps, is_rms_norm)  # the backward normalizes residual_out
    return y, residual_out


@layer_norm_residual.register_fake
def _(x, residual, weight, bias, eps, is_rms_norm):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


def _setup_context_residual(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms_norm = inputs
    ctx.save_for_backward(output[1], weight, bias)
    ctx.options = (eps, is_rms_norm)
    ctx.dtypes = (x.dtype, residual.dtype)


def _backward_residual(ctx, dy, dresidual_out):
    residual_out, weight, bias = ctx.saved_tensors
    dtotal, dw, db = torch.ops.laqat.layer_norm_backward(dy.contiguous(), residual_out, weight, bias, *ctx.options)
    dtotal = dtotal.float() if dresidual_out is None else dtotal.float() + dresidual_out.float()
    x_dtype, residual_dtype = ctx.dtypes
    return (dtotal.to(x_dtype), dtotal.to(residual_dtype), dw if weight is not None else None,
            db if bias is not None else None, None, None)


layer_norm_residual.register_autograd(_backward_residual, setup_context=_setup_context_residual)
