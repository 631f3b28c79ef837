"""``laqat::softplus_gate``: the log-decay FLA's GDN and KDA kernels compute from the raw gate in-kernel
(``use_gate_in_kernel``), as one op.

    laqat::softplus_gate(g [..., HV] or [..., HV, K], A_log [HV], dt_bias? [HV] or [HV * K]) -> log-decay fp32, g's shape

    u   = g + dt_bias                 (fp32; dt_bias viewed [HV] or [HV, K])
    out = -exp(A_log) * softplus(u)   (A_log per value head, broadcast over K)

(fla/ops/gated_delta_rule/gate.py, fla/ops/kda/gate.py). The autograd saves the output and A_log, not the raw gate:
the recurrence saves that output anyway (its g), and the derivative follows from it,

    softplus(u) = s = -out / exp(A_log),   sigmoid(u) = 1 - exp(-s) = -expm1(-s)
    du = -exp(A_log) * sigmoid(u) * dout,   dA_log = sum(out * dout),   ddt_bias = sum(du)

in fp32 (expm1 keeps sigmoid(u) accurate where it is small). Left to torch ops, the graph keeps the raw gate for
softplus's backward beside the fp32 output: [..., HV, K] in the model's dtype per KDA layer (docs/memory.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _per_head(t: Tensor, g: Tensor) -> Tensor:
    """A per-value-head [HV] tensor broadcast against g ([..., HV] or [..., HV, K])."""
    return t.float().view(-1) if g.dim() == 3 else t.float().view(-1, 1)


def _bias(dt_bias: Tensor, g: Tensor) -> Tensor:
    return dt_bias.float().view(g.shape[-1]) if g.dim() == 3 else dt_bias.float().view(g.shape[-2:])


def softplus_gate_formula(g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor]) -> Tensor:
    u = g.float() if dt_bias is None else g.float() + _bias(dt_bias, g)
    return -_per_head(A_log, g).exp() * F.softplus(u)


@torch.library.custom_op("laqat::softplus_gate", mutates_args=())
def softplus_gate(g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor]) -> Tensor:
    return softplus_gate_formula(g, A_log, dt_bias).contiguous()


@softplus_gate.register_fake
def _(g, A_log, dt_bias):
    return torch.empty_like(g, dtype=torch.float32, memory_format=torch.contiguous_format)


@torch.library.custom_op("laqat::softplus_gate_backward", mutates_args=())
def softplus_gate_backward(dout: Tensor, out: Tensor, A_log: Tensor, has_dt_bias: bool,
                           g_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dg in g_dtype, dA_log in A_log's dtype, ddt_bias fp32 [HV] or [HV * K]; empty without a dt_bias)."""
    a = _per_head(A_log, out).exp()
    sigmoid_u = -torch.expm1(out / a)
    du = -a * sigmoid_u * dout.float()
    lead = tuple(range(out.dim() - (1 if out.dim() == 3 else 2)))
    dA_log = (out * dout.float()).sum(lead)
    dA_log = (dA_log if out.dim() == 3 else dA_log.sum(-1)).to(A_log.dtype).reshape(A_log.shape)
    ddt_bias = du.sum(lead).reshape(-1) if has_dt_bias else du.new_empty((0,))
    return du.to(g_dtype).contiguous(), dA_log.contiguous(), ddt_bias.contiguous()


@softplus_gate_backward.register_fake
def _(dout, out, A_log, has_dt_bias, g_dtype):
    HV = out.shape[-1] if out.dim() == 3 else out.shape[-2] * out.shape[-1]
    return (torch.empty_like(out, dtype=g_dtype, memory_format=torch.contiguous_format),
            torch.empty_like(A_log, memory_format=torch.contiguous_format),
            out.new_empty((HV,) if has_dt_bias else (0,)))


def gate_setup_context(ctx, inputs, output):
    g, A_log, dt_bias = inputs
    ctx.save_for_backward(output, A_log)
    ctx.options = (dt_bias is not None, g.dtype)
    ctx.dt_bias_meta = None if dt_bias is None else (dt_bias.shape, dt_bias.dtype)


def gate_backward(ctx, dout):
    out, A_log = ctx.saved_tensors
    dg, dA_log, ddt_bias = torch.ops.laqat.softplus_gate_backward(dout, out, A_log, *ctx.options)
    if ctx.dt_bias_meta is None:
        return dg, dA_log, None
    shape, dtype = ctx.dt_bias_meta
    return dg, dA_log, ddt_bias.reshape(shape).to(dtype)


softplus_gate.register_autograd(gate_backward, setup_context=gate_setup_context)
