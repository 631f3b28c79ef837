"""``laqat::glu_linear``: FLA's ``SwiGLULinearFunction`` / ``PowGLULinearFunction`` (the MLP of FLA's models with
``fuse_swiglu=True``, the default) as an opaque op.

    laqat::glu_linear(x [..., D], y [..., D], weight [O, D], bias? [O], activation, power) -> out [..., O]

    z   = act(x) * y          act: "swiglu" swish, "powglu" FLA's PowGLU gate with ``power`` (glu_formulas.py)
    out = linear(z in x's dtype, weight, bias)           in weight's dtype

Under autocast the substitution hands the op the weight and bias in the autocast dtype, as autocast hands them to
FLA's ``F.linear`` (``autocast_linear_operands``).

The autograd saves x, y and weight, not z: the backward recomputes z with the activation's gradient
(``swiglu_fwdbwd`` / ``powglu_fwdbwd``), as FLA's function does. Left to torch ops, AOTAutograd's partitioner
keeps z as well (the down projection's input), a [..., D] tensor per MLP (docs/memory.md). On CUDA the op runs
FLA's own activation kernels and ``F.linear``; elsewhere the torch formulas of glu_formulas.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from la_compiler.kernels.fla import glu_formulas
from la_compiler.kernels.fla.autotune_searches import searched
from la_compiler.kernels.fla.backward_ahead import compile_backward_ahead, describe

Tensor = torch.Tensor
ACTIVATIONS = ("swiglu", "powglu")


def _activation(x, y, activation: str, power: float) -> Tensor:
    if x.is_cuda:
        from fla.modules.activations.ops import powglu_fwd, swiglu_fwd

        x, y = x.contiguous(), y.contiguous()
        if activation == "swiglu":
            return searched(swiglu_fwd)(x=x, y=y, output_contiguous=True)
        return searched(powglu_fwd)(x=x, y=y, power=power, output_contiguous=True)
    if activation == "swiglu":
        return glu_formulas.swiglu_fwd(x, y)
    return glu_formulas.powglu_fwd(x, y, power)


def _activation_and_grads(x, y, dz, activation: str, power: float) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx, dy, z)."""
    if x.is_cuda:
        from fla.modules.activations.ops import powglu_fwdbwd, swiglu_fwdbwd

        if activation == "swiglu":
            return searched(swiglu_fwdbwd)(x=x, y=y, g=dz, use_weight=True, output_contiguous=True)
        return searched(powglu_fwdbwd)(x=x, y=y, g=dz, power=power, use_weight=True, output_contiguous=True)
    if activation == "swiglu":
        return glu_formulas.swiglu_fwdbwd(x, y, dz, use_weight=True)
    return glu_formulas.powglu_fwdbwd(x, y, dz, power, use_weight=True)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"laqat::glu_linear: activation {activation!r} is not one of {ACTIVATIONS}")


@torch.library.custom_op("laqat::glu_linear", mutates_args=())
def glu_linear(x: Tensor, y: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, power: float) -> Tensor:
    _check_activation(activation)
    out = F.linear(_activation(x, y, activation, power), weight, bias).contiguous()
    if x.is_cuda:  # the backward's activation kernel, on the down projection's input gradient dz (x's shape)
        compile_backward_ahead("glu_linear", describe(x, y, out.dtype, activation, power), x.device,
                               lambda: _activation_and_grads(x.contiguous(), y.contiguous(),
                                                             torch.empty(x.shape, dtype=out.dtype, device=x.device),
                                                             activation, power))
    return out


@glu_linear.register_fake
def _(x, y, weight, bias, activation, power):
    _check_activation(activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


@torch.library.custom_op("laqat::glu_linear_backward", mutates_args=())
def glu_linear_backward(dout: Tensor, x: Tensor, y: Tensor, weight: Tensor, has_bias: bool, activation: str,
                        power: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dy, dweight, dbias); dbias an empty tensor without a bias."""
    dout2 = dout.reshape(-1, dout.shape[-1])
    dz = F.linear(dout2, weight.t()).view(x.shape)
    dx, dy, z = _activation_and_grads(x.contiguous(), y.contiguous(), dz, activation, power)
    dweight = dout2.t() @ z.reshape(-1, z.shape[-1]).to(dout2.dtype)
    dbias = dout2.sum(0) if has_bias else dout.new_empty((0,))
    return dx.contiguous(), dy.contiguous(), dweight.to(weight.dtype), dbias


@glu_linear_backward.register_fake
def _(dout, x, y, weight, has_bias, activation, power):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(y, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format),
            dout.new_empty((weight.shape[0],) if has_bias else (0,)))


def _setup_context(ctx, inputs, output):
    x, y, weight, bias, activation, power = inputs
    ctx.save_for_backward(x, y, weight)
    ctx.options = (bias is not None, activation, power)


def _backward(ctx, dout):
    x, y, weight = ctx.saved_tensors
    has_bias = ctx.options[0]
    dx, dy, dweight, dbias = torch.ops.laqat.glu_linear_backward(dout.contiguous(), x, y, weight, *ctx.options)
    return dx, dy, dweight, dbias if has_bias else None, None, None


glu_linear.register_autograd(_backward, setup_context=_setup_context)


def autocast_linear_operands(x, weight, bias):
    """The weight and bias as autocast hands them to FLA's ``F.linear``: in the autocast dtype where autocast is on
    for x's device. FLA's function runs its backward under the forward's autocast state (``custom_bwd``); the op's
    backward runs without it, so the cast is made before the op, traced, and its own backward casts the weight's
    gradient back to the weight's dtype, as autograd does for FLA's."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return weight.to(dtype), (None if bias is None else bias.to(dtype))


def swiglu_linear(x, y, weight, bias):
    """FLA's ``swiglu_linear`` dispatcher, traced."""
    weight, bias = autocast_linear_operands(x, weight, bias)
    return torch.ops.laqat.glu_linear(x, y, weight, bias, "swiglu", 1.0)


def powglu_linear(x, y, weight, bias, power=3.0):
    """FLA's ``powglu_linear`` dispatcher, traced."""
    weight, bias = autocast_linear_operands(x, weight, bias)
    return torch.ops.laqat.glu_linear(x, y, weight, bias, "powglu", float(power))
