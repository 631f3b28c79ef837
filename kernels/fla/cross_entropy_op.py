"""``laqat::cross_entropy``: FLA's fused cross-entropy as one opaque custom op.

``FusedCrossEntropyLoss`` (what FLA's causal LMs use with ``fuse_cross_entropy=True``) calls
``fla.modules.fused_cross_entropy.cross_entropy_loss``, a ``torch.compiler.disable``'d dispatcher
around an ``autograd.Function`` with Triton kernels. The FLA frontend substitutes it with a call
to this op.

    laqat::cross_entropy(logits [N, V], target [N] (int), label_smoothing, logit_scale, lse_square_scale,
                         logit_softcapping?, ignore_index, inplace_backward=False)
        -> (loss [N] fp32, z_loss [N] fp32, lse [N] fp32)

    z      = logit_scale * logits                       (fp32; then c * tanh(z / c) with softcapping c)
    lse    = logsumexp(z)
    loss   = lse - (1 - eps) * z[target] - eps * sum(z) / V + z_loss,   z_loss = lse_square_scale * lse^2
    loss = z_loss = 0 where target == ignore_index                     (eps: label_smoothing)

as ``cross_entropy_fwd_kernel`` computes it (fla/modules/fused_cross_entropy/ops.py); the loss
includes the z-loss, z_loss is returned for logging and gets no gradient. The backward is
``cross_entropy_bwd_kernel``'s

    dlogits = logit_scale * dloss * (p * (1 + 2 * lse_square_scale * lse) - (1 - eps) * onehot - eps / V)
              (* (1 - tanh^2) with softcapping),   p = exp(z - lse);  0 where target == ignore_index

stored in the logits' dtype. On CUDA the op runs FLA's own ``cross_entropy_fwd`` /
``cross_entropy_bwd``; elsewhere the same formulas in fp32 torch below.

``inplace_backward`` is FLA's argument, carried so that the hand-off sees it: the op's own backward allocates the
gradient (inside a compiled graph it cannot overwrite the logits, which the graph also returns). Where the logits
come from a linear layer of the graph and only reach this op, the hand-off runs the loss outside the compiled graph
through ``CrossEntropyInplaceBackward``, whose backward writes the gradient into the logits as FLA does
(la_compiler/hand_off/loss_tails.py).
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _scaled_logits(logits: Tensor, logit_scale: float, logit_softcapping: Optional[float]):
    """(z, tanh(z / c) or None): the fp32 logits the loss reads."""
    z = logits.float() * logit_scale
    if logit_softcapping is None:
        return z, None
    t = torch.tanh(z / logit_softcapping)
    return logit_softcapping * t, t


def cross_entropy_forward_reference(logits, target, label_smoothing: float, logit_scale: float,
                                    lse_square_scale: float, logit_softcapping: Optional[float], ignore_index: int):
    """-> (loss, z_loss, lse), each [N] fp32."""
    z, _ = _scaled_logits(logits, logit_scale, logit_softcapping)
    lse = torch.logsumexp(z, -1)
    valid = target != ignore_index
    z_target = z.gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1)
    loss = -z_target
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss - label_smoothing * z.sum(-1) / z.shape[-1]
    z_loss = lse_square_scale * lse * lse
    loss = torch.where(valid, loss + lse + z_loss, 0.0)
    return loss, torch.where(valid, z_loss, 0.0), lse


def cross_entropy_backward_reference(dloss, logits, target, lse, label_smoothing: float, logit_scale: float,
                                     lse_square_scale: float, logit_softcapping: Optional[float],
                                     ignore_index: int) -> Tensor:
    """-> dlogits [N, V] in the logits' dtype."""
    z, t = _scaled_logits(logits, logit_scale, logit_softcapping)
    lse = lse.float().unsqueeze(-1)
    p = torch.exp(z - lse)
    d = p + 2.0 * lse_square_scale * lse * p
    onehot = torch.arange(z.shape[-1], device=z.device) == target.unsqueeze(-1)
    if label_smoothing > 0:
        d = d - torch.where(onehot, 1 - label_smoothing, 0.0) - label_smoothing / z.shape[-1]
    else:
        d = d - onehot.float()
    if t is not None:
        d = d * (1.0 - t * t)
    dloss = torch.where(target != ignore_index, dloss.float(), 0.0).unsqueeze(-1)
    return (d * (dloss * logit_scale)).to(logits.dtype)


@torch.library.custom_op("laqat::cross_entropy", mutates_args=())
def cross_entropy(
    logits: Tensor,
    target: Tensor,
    label_smoothing: float,
    logit_scale: float,
    lse_square_scale: float,
    logit_softcapping: Optional[float],
    ignore_index: int,
    inplace_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    if logits.is_cuda:
        from fla.modules.fused_cross_entropy.ops import cross_entropy_fwd

        loss, z_loss, lse, _, _ = cross_entropy_fwd(logits=logits.contiguous(), target=target.contiguous(),
                                                    label_smoothing=label_smoothing, logit_scale=logit_scale,
                                                    lse_square_scale=lse_square_scale,
                                                    logit_softcapping=logit_softcapping, ignore_index=ignore_index)
    else:
        loss, z_loss, lse = cross_entropy_forward_reference(logits, target, label_smoothing, logit_scale,
                                                            lse_square_scale, logit_softcapping, ignore_index)
    return loss.contiguous(), z_loss.contiguous(), lse.contiguous()


@cross_entropy.register_fake
def _(logits, target, label_smoothing, logit_scale, lse_square_scale, logit_softcapping, ignore_index,
      inplace_backward=False):
    return tuple(logits.new_empty(logits.shape[:1], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("laqat::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    dloss: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    label_smoothing: float,
    logit_scale: float,
    lse_square_scale: float,
    logit_softcapping: Optional[float],
    ignore_index: int,
) -> Tensor:
    """-> dlogits [N, V], contiguous, in the logits' dtype."""
    if logits.is_cuda:
        from fla.modules.fused_cross_entropy.ops import cross_entropy_bwd

        return cross_entropy_bwd(logits=logits.contiguous(), target=target.contiguous(), lse=lse.contiguous(),
                                 dloss=dloss.contiguous(), label_smoothing=label_smoothing, logit_scale=logit_scale,
                                 lse_square_scale=lse_square_scale, logit_softcapping=logit_softcapping,
                                 ignore_index=ignore_index, inplace_backward=False)
    return cross_entropy_backward_reference(dloss, logits, target, lse, label_smoothing, logit_scale,
                                            lse_square_scale, logit_softcapping, ignore_index).contiguous()


@cross_entropy_backward.register_fake
def _(dloss, logits, target, lse, label_smoothing, logit_scale, lse_square_scale, logit_softcapping, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, *options = inputs
    ctx.save_for_backward(logits, target, output[2])
    ctx.options = options[:5]
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, dloss, dz_loss, dlse):
    logits, target, lse = ctx.saved_tensors
    dlogits = torch.ops.laqat.cross_entropy_backward(dloss, logits, target, lse, *ctx.options)
    return dlogits, None, None, None, None, None, None, None


cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy_backward_into_logits(dloss, logits, target, lse, label_smoothing: float, logit_scale: float,
                                       lse_square_scale: float, logit_softcapping: Optional[float],
                                       ignore_index: int) -> Tensor:
    """The logits' gradient written into the logits' own storage, as FLA's ``inplace_backward=True`` does; -> the
    logits, now holding it. Their version counter moves on, so that a backward that saved them too and runs after
    raises autograd's in-place error instead of reading the gradient as logits."""
    if logits.is_cuda and logits.is_contiguous():
        from fla.modules.fused_cross_entropy.ops import cross_entropy_bwd

        cross_entropy_bwd(logits=logits, target=target.contiguous(), lse=lse.contiguous(), dloss=dloss.contiguous(),
                          label_smoothing=label_smoothing, logit_scale=logit_scale, lse_square_scale=lse_square_scale,
                          logit_softcapping=logit_softcapping, ignore_index=ignore_index, inplace_backward=True)
    else:
        with torch.no_grad():
            logits.copy_(torch.ops.laqat.cross_entropy_backward(dloss, logits, target, lse, label_smoothing,
                                                                logit_scale, lse_square_scale, logit_softcapping,
                                                                ignore_index))
    torch.autograd.graph.increment_version(logits)
    return logits


class CrossEntropyInplaceBackward(torch.autograd.Function):
    """``laqat::cross_entropy`` whose backward overwrites the logits with their gradient (FLA's
    ``FusedCrossEntropyLoss(inplace_backward=True)``, its causal LMs' loss): no [N, V] tensor beside the logits.
    The loss tail of a compiled graph runs it outside the graph (la_compiler/hand_off/loss_tails.py): a graph's
    backward cannot write into a tensor that the graph also returns."""
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, logit_scale, lse_square_scale, logit_softcapping, ignore_index,
                inplace_backward=True):
        options = (label_smoothing, logit_scale, lse_square_scale, logit_softcapping, ignore_index)
        loss, z_loss, lse = torch.ops.laqat.cross_entropy(logits, target, *options)
        ctx.save_for_backward(logits, target, lse)
        ctx.options = options
        ctx.mark_non_differentiable(z_loss, lse)
        return loss, z_loss, lse

    @staticmethod
    def backward(ctx, dloss, dz_loss, dlse):
        logits, target, lse = ctx.saved_tensors
        dlogits = cross_entropy_backward_into_logits(dloss, logits, target, lse, *ctx.options)
        return dlogits, None, None, None, None, None, None, None


def cross_entropy_inplace_backward(*args, **kwargs):
    """What the loss tail calls in place of ``laqat::cross_entropy`` (the same arguments)."""
    return CrossEntropyInplaceBackward.apply(*args, **kwargs)
