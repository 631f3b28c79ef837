"""FLA's gated-MLP activations (fla/modules/activations/ops.py) transcribed to torch ops.

What ``GatedMLP`` reaches: with ``fuse_swiglu=False`` ``swiglu`` / ``powglu``, i.e. ``SwiGLUFunction`` /
``PowGLUFunction``, ``autograd.Function``s that Dynamo traces as such, whose forward and backward call the
``torch.compiler.disable``'d kernel launchers ``swiglu_fwd`` / ``swiglu_fwdbwd`` / ``powglu_fwd`` /
``powglu_fwdbwd``; the FLA frontend substitutes those launchers with the functions below: elementwise torch ops
(Inductor fuses them), each the formula of FLA's kernel, computed in fp32 and stored in the input's dtype. With
``fuse_swiglu=True`` it reaches the dispatchers ``swiglu_linear`` / ``powglu_linear``, which become
``laqat::glu_linear`` (glu_linear_op.py): these formulas off CUDA, FLA's kernels on CUDA.

    swish(x)     = x * sigmoid(x)
    swiglu       z  = swish(x) * y
                 dx = g * s * (1 + x * (1 - s)) * y,  dy = g * swish(x),  s = sigmoid(x)
    powglu       z  = gate(x) * y,  gate(x) = x^p(x) * s for x > 0, swish(x) otherwise,  p(x) = power / (sqrt(x) + 1)
                 dgate = gate * (p'(x) * ln x + p(x) / x + 1 - s) for x > 0,  s * (1 + x * (1 - s)) otherwise,
                 p'(x) = -power / (2 * sqrt(x) * (sqrt(x) + 1)^2);  dx = g * y * dgate,  dy = g * gate
"""
from __future__ import annotations

import torch


def _swiglu_parts(x, y):
    xf, yf = x.float(), y.float()
    s = torch.sigmoid(xf)
    return xf, yf, s, xf * s


def swiglu_fwd(x, y, output_contiguous=False):
    _, yf, _, swish = _swiglu_parts(x, y)
    return (swish * yf).to(x.dtype)


def swiglu_fwdbwd(x, y, g, use_weight=False, output_contiguous=False):
    xf, yf, s, swish = _swiglu_parts(x, y)
    gf = g.float()
    dx = (gf * s * (1.0 + xf * (1.0 - s)) * yf).to(x.dtype)
    dy = (gf * swish).to(y.dtype)
    return (dx, dy, (swish * yf).to(x.dtype)) if use_weight else (dx, dy)


def _powglu_parts(x, power):
    xf = x.float()
    s = torch.sigmoid(xf)
    pos = xf > 0
    xp = torch.where(pos, xf, 1.0)  # only positive lanes reach log / sqrt, as in FLA's kernel
    sqrt = torch.sqrt(xp)
    log = torch.log(xp)
    p = power / (sqrt + 1.0)
    gate_pos = torch.exp(p * log) * s
    return xf, s, pos, xp, sqrt, log, p, gate_pos


def powglu_fwd(x, y, power=3.0, output_contiguous=False):
    xf, s, pos, _, _, _, _, gate_pos = _powglu_parts(x, power)
    return (torch.where(pos, gate_pos, xf * s) * y.float()).to(x.dtype)


def powglu_fwdbwd(x, y, g, power=3.0, use_weight=False, output_contiguous=False):
    xf, s, pos, xp, sqrt, log, p, gate_pos = _powglu_parts(x, power)
    yf, gf = y.float(), g.float()
    p_prime = -power / (2.0 * sqrt * (sqrt + 1.0) * (sqrt + 1.0))
    dgate_pos = gate_pos * (p_prime * log + p / xp + 1.0 - s)
    gate = torch.where(pos, gate_pos, xf * s)
    dgate = torch.where(pos, dgate_pos, s * (1.0 + xf * (1.0 - s)))
    dx = (gf * yf * dgate).to(x.dtype)
    dy = (gf * gate).to(y.dtype)
    return (dx, dy, (gate * yf).to(x.dtype)) if use_weight else (dx, dy)
