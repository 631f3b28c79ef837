"""``laqat::fused_linear_cross_entropy``: FLA's fused LM head + cross-entropy as one opaque custom op.

``FusedLinearCrossEntropyLoss`` (what FLA's KDA causal LM trains with by default, and every FLA
causal LM with ``fuse_linear_cross_entropy=True``) has a ``torch.compiler.disable``'d forward;
``fused_linear_cross_entropy_loss`` runs an ``autograd.Function`` whose forward computes the loss
*and* the gradients, chunk by chunk over the tokens, so that the [N, V] logits never exist at once.
The FLA frontend substitutes both with a call to this op.

    laqat::fused_linear_cross_entropy(x [N, H], target [N], weight [V, H], bias? [V], ignore_index,
                                      label_smoothing, logit_scale, logit_softcapping?, num_chunks, reduction,
                                      use_l2warp, l2_penalty_factor, accumulate_grad_in_fp32)
        -> (loss [] fp32, dx [N, H] in x.dtype, dweight [V, H] in weight.dtype, dbias [V] in bias.dtype or [0])

per ``fused_linear_cross_entropy_fwd`` (fla/modules/fused_linear_cross_entropy/ops.py): token chunks of
``C = next_power_of_2(cdiv(N, min(num_chunks, cdiv(V, H))))`` rows; per chunk the logits
``linear(x_c, weight, bias)`` in x's dtype, FLA's cross-entropy forward and backward on them
(``cross_entropy_op``: the per-token loss, and dlogits for ``dloss = 1 / #valid`` ("mean") or 1
("sum"), stored in the logits' dtype), with ``use_l2warp`` the L2Wrap gradient
``l2_penalty_factor / N * max(logits)`` at each row's argmax, then ``dx_c = dlogits @ weight`` and
``dweight += dlogits^T @ x_c``, ``dbias += sum(dlogits)`` (fp32 accumulators with
``accumulate_grad_in_fp32``). The loss is ``sum(loss) / max(#valid, 1)`` ("mean") or the sum.
The precomputed gradients are outputs, saved for the backward, which scales them by the loss's
gradient (``elementwise_mul_kernel``: fp32 product stored in each gradient's dtype) as torch ops.

On CUDA the op runs FLA's own ``fused_linear_cross_entropy_fwd``; elsewhere the torch transcription
below (same chunks, same rounding points).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from la_compiler.kernels.fla.cross_entropy_op import (
    cross_entropy_backward_reference,
    cross_entropy_forward_reference,
)

Tensor = torch.Tensor
REDUCTIONS = ("mean", "sum")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fused_linear_cross_entropy_reference(x, target, weight, bias, ignore_index: int, label_smoothing: float,
                                         logit_scale: float, logit_softcapping: Optional[float], num_chunks: int,
                                         reduction: str, use_l2warp: bool, l2_penalty_factor: float,
                                         accumulate_grad_in_fp32: bool):
    """-> (loss, dx, dweight, dbias or None), as FLA's forward computes them."""
    N, H = x.shape
    V = weight.shape[0]
    C = _next_power_of_2(_cdiv(N, min(num_chunks, _cdiv(V, H))))
    grad_dtype = torch.float32 if accumulate_grad_in_fp32 else weight.dtype
    dx = torch.zeros_like(x, memory_format=torch.contiguous_format)
    dw = weight.new_zeros(weight.shape, dtype=grad_dtype)
    db = None if bias is None else bias.new_zeros(bias.shape,
                                                  dtype=torch.float32 if accumulate_grad_in_fp32 else bias.dtype)
    loss = x.new_zeros(N, dtype=torch.float32)
    total = target.ne(ignore_index).sum().clamp_min(1)
    dloss = total.float().reciprocal() if reduction == "mean" else x.new_ones((), dtype=torch.float32)
    for start in range(0, N, C):
        end = min(start + C, N)
        c_x, c_target = x[start:end], target[start:end]
        c_logits = F.linear(c_x, weight, bias)
        c_x = c_x.to(grad_dtype)
        c_loss, _, c_lse = cross_entropy_forward_reference(c_logits, c_target, label_smoothing, logit_scale, 0.0,
                                                           logit_softcapping, ignore_index)
        loss[start:end] = c_loss
        if use_l2warp:
            c_max, c_ids = torch.max(c_logits, -1, keepdim=True)
        c_dlogits = cross_entropy_backward_reference(dloss.expand(end - start), c_logits, c_target, c_lse,
                                                     label_smoothing, logit_scale, 0.0, logit_softcapping,
                                                     ignore_index)
        dx_c = torch.mm(c_dlogits, weight)
        if use_l2warp:
            g_l2 = torch.zeros_like(c_logits).scatter_(-1, c_ids, c_max * (l2_penalty_factor / N))
            dw = torch.addmm(dw, g_l2.t().to(grad_dtype), c_x)
            if db is not None:
                db = db + g_l2.sum(0, dtype=db.dtype)
            dx_c = dx_c + torch.mm(g_l2, weight)
        dx[start:end] = dx_c
        dw = torch.addmm(dw, c_dlogits.t().to(grad_dtype), c_x)
        if db is not None:
            db = db + c_dlogits.sum(0, dtype=db.dtype)
    loss = loss.sum()
    if reduction == "mean":
        loss = loss / total
    return loss, dx, dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,))


@torch.library.custom_op("laqat::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(
    x: Tensor,
    target: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ignore_index: int,
    label_smoothing: float,
    logit_scale: float,
    logit_softcapping: Optional[float],
    num_chunks: int,
    reduction: str,
    use_l2warp: bool,
    l2_penalty_factor: float,
    accumulate_grad_in_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, logit_scale=logit_scale,
                   logit_softcapping=logit_softcapping, num_chunks=num_chunks, reduction=reduction,
                   use_l2warp=use_l2warp, l2_penalty_factor=l2_penalty_factor,
                   accumulate_grad_in_fp32=accumulate_grad_in_fp32)
    if x.is_cuda:
        from fla.modules.fused_linear_cross_entropy.ops import fused_linear_cross_entropy_fwd

        loss, dx, dw, db = fused_linear_cross_entropy_fwd(x=x.contiguous(), target=target.contiguous(),
                                                          weight=weight.contiguous(),
                                                          bias=None if bias is None else bias.contiguous(),
                                                          **options)
    else:
        loss, dx, dw, db = fused_linear_cross_entropy_reference(x, target, weight, bias, **options)
    return loss, dx.contiguous(), dw.contiguous(), _empty(x) if db is None else db.contiguous()


@fused_linear_cross_entropy.register_fake
def _(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, logit_softcapping, num_chunks, reduction,
      use_l2warp, l2_penalty_factor, accumulate_grad_in_fp32):
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return (x.new_empty((), dtype=torch.float32), like(x), like(weight), _empty(x) if bias is None else like(bias))


def _setup_context(ctx, inputs, output):
    _, dx, dw, db = output
    ctx.save_for_backward(dx, dw, db)
    ctx.has_bias = inputs[3] is not None
    ctx.mark_non_differentiable(dx, dw, db)


def _scaled(grad: Tensor, dloss: Tensor) -> Tensor:
    return (grad.float() * dloss.float()).to(grad.dtype)


def _backward(ctx, dloss, ddx, ddw, ddb):
    dx, dw, db = ctx.saved_tensors
    return (_scaled(dx, dloss), None, _scaled(dw, dloss), _scaled(db, dloss) if ctx.has_bias else None,
            *([None] * 9))


fused_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
