"""The pre-processing FLA's recurrence kernels do in-kernel, written as ordinary torch ops.

The FLA frontend emits these in front of the laqat IR node so that autograd differentiates
them and Inductor fuses them; the node itself only sees canonical inputs (docs/numerics.md,
"Frontend pre-processing"). Formulas follow fla 0.6:

- l2norm        ``x * rsqrt(sum(x^2, -1) + 1e-6)`` in fp32        (fla/modules/norm/l2norm.py;
                the fused_recurrent kernels compute ``x / sqrt(sum(x^2) + 1e-6)``, the same in fp32)
- GDN gate      ``-exp(A_log) * softplus(g + dt_bias)``            (fla/ops/gated_delta_rule/gate.py)
- KDA gate      the same per key channel, dt_bias viewed [HV, K]; with ``lower_bound``:
                ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``exp(A_log)`` dropped
                when A_log is None                                 (fla/ops/kda/gate.py)
- beta          ``sigmoid(b)``, or ``2 * sigmoid(b)`` with allow_neg_eigval (fla/ops/common/gate.py)

All results are fp32, as FLA's kernels produce them, except l2norm in chunk mode, which
FLA writes back in the input dtype before the chunk kernel reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, *, keep_fp32: bool = False, eps: float = L2NORM_EPS) -> torch.Tensor:
    """FLA's l2norm over the last dim; ``keep_fp32`` for the fused_recurrent kernels, which
    normalize in registers and never round the result to the input dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y if keep_fp32 else y.to(x.dtype)


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Raw gate [..., HV] -> per-token log-decay [..., HV] (fp32)."""
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float()
    return -A_log.float().exp() * F.softplus(g)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """Raw gate [..., HV, K] -> per-channel log-decay [..., HV, K] (fp32)."""
    HV, K = g.shape[-2:]
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(HV, K)
    if lower_bound is None:
        return -A_log.float().view(HV, 1).exp() * F.softplus(g)
    if A_log is not None:
        g = A_log.float().view(HV, 1).exp() * g
    return lower_bound * torch.sigmoid(g)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """Raw beta logits -> beta in (0, 1), or (0, 2) with allow_neg_eigval (fp32)."""
    beta = torch.sigmoid(beta.float())
    return beta * 2.0 if allow_neg_eigval else beta
