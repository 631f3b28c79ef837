"""``laqat::log_decay(decay, where)``: the log of a decay a rewritten region multiplied into its state, checked
positive at run time.

The IR node takes the log-decay g. A torch region that multiplies its state by a decay it receives already
exponentiated (computed outside the compiled function, or by an op that is not exp / sigmoid / softplus) is
rewritten with ``g = log(decay)`` in front of the node; where the frontend cannot prove the decay positive at
compile time, this op takes that log. A zero or negative decay is an ``IRInputError`` naming the decay and the
line the region reads it at (the delta rule would multiply the state by it; the IR node cannot: its log is not
a number); otherwise it returns ``log(decay)``, with the gradient ``grad / decay``. A NaN passes through (the
region would propagate it). The check is one reduction and, on a GPU, one host synchronization per call.
"""
from __future__ import annotations

import torch

from la_compiler.ir.checks import IRInputError


@torch.library.custom_op("laqat::log_decay", mutates_args=())
def log_decay(decay: torch.Tensor, where: str) -> torch.Tensor:
    bad = decay <= 0
    if bool(bad.any()):
        raise IRInputError(
            f"laqat::log_decay: the decay {where} must be positive: the rewritten recurrence takes its log (the IR "
            f"node's g); got {int(bad.sum())} of {decay.numel()} values <= 0 (smallest {float(decay.min()):g}). "
            f"Pass a positive decay, or the log-decay with exp(g) inside the compiled function")
    return torch.log(decay)


@log_decay.register_fake
def _(decay, where):
    return torch.empty_like(decay)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (decay,) = ctx.saved_tensors
    return grad / decay, None


log_decay.register_autograd(_backward, setup_context=_setup_context)

LOG_DECAY = torch.ops.laqat.log_decay.default
