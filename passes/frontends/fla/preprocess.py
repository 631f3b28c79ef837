"""The gate and beta pre-processing FLA's recurrence kernels do in-kernel, written as ordinary torch ops.

The FLA frontend emits these in front of the laqat IR node so that autograd differentiates
them and Inductor fuses them; the node itself only sees canonical inputs (docs/numerics.md,
"Frontend pre-processing"). The l2 norm of q and k is ``laqat::l2_norm`` (kernels/fla/l2_norm_op.py), whose
autograd saves what FLA's saves. Formulas follow fla 0.6:

- GDN gate      ``-exp(A_log) * softplus(g + dt_bias)``            (fla/ops/gated_delta_rule/gate.py)
- KDA gate      the same per key channel, dt_bias viewed [HV, K]; with ``lower_bound``:
                ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``exp(A_log)`` dropped
                when A_log is None                                 (fla/ops/kda/gate.py)
- beta          ``sigmoid(b)``, or ``2 * sigmoid(b)`` with allow_neg_eigval (fla/ops/common/gate.py)

All results are fp32, as FLA's kernels produce them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
