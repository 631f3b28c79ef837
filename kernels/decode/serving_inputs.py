"""What a GDN serving profile's recurrence receives: the server's pre-processing of the raw q, k, gate and beta
(docs/serving.md, "The server's pre-processing"), as ops that the serving pass (passes/serving_inputs.py) puts in
place of the model's own.

    laqat::serving_prefix(q, cu_seqlens?, prefill_lengths, valid_lengths) -> prefix [B, T] int8 (1: a prefix token)
    laqat::serving_l2norm(x [B, T, H, K], prefix) -> fp32           q or k
    laqat::serving_gdn_gate(a [B, T, HV], A_log, dt_bias?, prefix) -> fp32
    laqat::serving_sigmoid(b [B, T, HV]) -> fp32                      beta

vLLM prefills a prefix through ``fused_post_conv_prep`` (q, k normalized and stored in the model's dtype, the gate
and beta in fp32) and decodes every later token with the packed decode kernel, which normalizes q and k and
computes the gate inside the step, in fp32, with other formulas (serving_inputs_kernels.py). So a prefix token's
q and k hold model-dtype values, a decode token's full fp32 ones, and the recurrence takes fp32 q and k.

Backward: the exact derivative of each formula in fp32, straight through the prefix's rounding of q and k:
``dx = r (dy - y sum(y dy))`` with ``r = 1 / sqrt(sum(x²) + eps)``, ``y = r x``; the gate's from its output
(laqat::softplus_gate_backward); ``db = dy y (1 - y)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from la_compiler.kernels.common.server_gate import SOFTPLUS_THRESHOLD
from la_compiler.kernels.decode import serving_inputs_kernels as kernels
from la_compiler.kernels.fla import softplus_gate_op  # noqa: F401  (registers laqat::softplus_gate_backward)

Tensor = torch.Tensor
L2NORM_EPS = 1e-6  # both of vLLM's formulas (the prefill's L2NORM_EPS, the decode's literal)
PREFILL_BLOCK_T = 16  # fused_post_conv_prep's BLOCK_T
BLOCK = 1024


@torch.library.custom_op("laqat::serving_prefix", mutates_args=())
def serving_prefix(q: Tensor, cu_seqlens: Optional[Tensor], prefill_lengths: Tensor, valid_lengths: Tensor) -> Tensor:
    """1 where a stored token is in its sequence's prefix (the server prefills it), else 0 (decoded, or padding)."""
    B, T = q.shape[:2]
    starts = [b * T for b in range(B)] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()[:-1]]
    prefix = torch.zeros(B * T, dtype=torch.int8)
    for start, length in zip(starts, prefill_lengths.tolist()):
        prefix[start:start + int(length)] = 1
    return prefix.view(B, T).to(q.device)


@serving_prefix.register_fake
def _(q, cu_seqlens, prefill_lengths, valid_lengths):
    return q.new_empty(q.shape[:2], dtype=torch.int8)


def l2norm_by_phase(x: Tensor, prefix: Tensor, launch) -> Tensor:
    """x [B, T, H, K] normalized per token as the server does: ``launch(x, prefill, decode)`` writes the prefill's
    formula and the decode's into two fp32 buffers; prefix tokens take the prefill's, rounded to x's dtype (the
    prefill stores q and k in the model's dtype, round to nearest even as the GPU's store), the others the decode's."""
    x = x.contiguous()
    prefill = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    decode = torch.empty_like(prefill)
    if x.numel():
        launch(x, prefill, decode)
    return torch.where(prefix.bool()[:, :, None, None], prefill.to(x.dtype).float(), decode)


def _launch_l2norms(x: Tensor, prefill: Tensor, decode: Tensor) -> None:
    """fused_post_conv_prep's norm (16 tokens, 4 warps) and the packed decode's (one token, 1 warp)."""
    B, T, H, K = x.shape
    n, BK = B * T, triton.next_power_of_2(K)
    kernels.l2norm_prefill_kernel[(triton.cdiv(n, PREFILL_BLOCK_T), H)](
        x, prefill, n, H=H, K=K, EPS=L2NORM_EPS, BLOCK_T=PREFILL_BLOCK_T, BK=BK, num_warps=4, num_stages=2)
    kernels.l2norm_decode_kernel[(n, H)](x, decode, H=H, K=K, BK=BK, num_warps=1)


def _l2norm_forward(x: Tensor, prefix: Tensor) -> Tensor:
    return l2norm_by_phase(x, prefix, _launch_l2norms)


@torch.library.custom_op("laqat::serving_l2norm", mutates_args=())
def serving_l2norm(x: Tensor, prefix: Tensor) -> Tensor:
    return _l2norm_forward(x, prefix)


@serving_l2norm.register_fake
def _(x, prefix):
    return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _l2norm_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    xf = x.float()
    r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)
    y = xf * r
    dx = r * (dy.float() - y * (y * dy.float()).sum(-1, keepdim=True))
    return dx.to(x.dtype), None


serving_l2norm.register_autograd(_l2norm_backward, setup_context=_l2norm_setup)


@torch.library.custom_op("laqat::serving_gdn_gate", mutates_args=())
def serving_gdn_gate(a: Tensor, A_log: Tensor, dt_bias: Optional[Tensor], prefix: Tensor) -> Tensor:
    HV = a.shape[-1]
    a = a.contiguous()
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        A_flat = A_log.contiguous().view(-1)
        kernels.gdn_gate_kernel[(triton.cdiv(n, BLOCK),)](
            a, A_flat, A_flat if dt_bias is None else dt_bias.contiguous().view(-1), prefix.contiguous(), out, n,
            HV=HV, HAS_DT_BIAS=dt_bias is not None, THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK=BLOCK)
    return out


@serving_gdn_gate.register_fake
def _(a, A_log, dt_bias, prefix):
    return torch.empty_like(a, dtype=torch.float32, memory_format=torch.contiguous_format)


def _gate_setup(ctx, inputs, output):
    a, A_log, dt_bias, _ = inputs
    ctx.save_for_backward(output, A_log)
    ctx.options = (dt_bias is not None, a.dtype)
    ctx.dt_bias_meta = None if dt_bias is None else (dt_bias.shape, dt_bias.dtype)


def _gate_backward(ctx, dout):
    out, A_log = ctx.saved_tensors
    da, dA_log, ddt_bias = torch.ops.laqat.softplus_gate_backward(dout, out, A_log, *ctx.options)
    if ctx.dt_bias_meta is None:
        return da, dA_log, None, None
    shape, dtype = ctx.dt_bias_meta
    return da, dA_log, ddt_bias.reshape(shape).to(dtype), None


serving_gdn_gate.register_autograd(_gate_backward, setup_context=_gate_setup)


@torch.library.custom_op("laqat::serving_sigmoid", mutates_args=())
def serving_sigmoid(b: Tensor) -> Tensor:
    b = b.contiguous()
    out = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    n = b.numel()
    if n:
        kernels.sigmoid_kernel[(triton.cdiv(n, BLOCK),)](b, out, n, BLOCK=BLOCK)
    return out


@serving_sigmoid.register_fake
def _(b):
    return torch.empty_like(b, dtype=torch.float32, memory_format=torch.contiguous_format)


def _sigmoid_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.b_dtype = inputs[0].dtype


def _sigmoid_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return (dy.float() * y * (1.0 - y)).to(ctx.b_dtype)


serving_sigmoid.register_autograd(_sigmoid_backward, setup_context=_sigmoid_setup)
