"""The gate and beta pre-processing FLA's recurrence kernels do in-kernel.

The FLA frontend emits these in front of the laqat IR node; the node itself only sees canonical inputs
(docs/numerics.md, "Frontend pre-processing"). The l2 norm of q and k is ``laqat::l2_norm``
(kernels/fla/l2_norm_op.py) and the softplus gates ``laqat::softplus_gate`` (kernels/fla/softplus_gate_op.py), ops
whose autograd saves their outputs, which the recurrence saves anyway, not their inputs; KDA's lower-bounded gate
and beta are torch ops, which autograd differentiates and Inductor fuses. Formulas follow fla 0.6:

- GDN gate      ``-exp(A_log) * softplus(g + dt_bias)``            (fla/ops/gated_delta_rule/gate.py)
- KDA gate      the same per key channel, dt_bias viewed [HV, K]; with ``lower_bound``:
                ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``exp(A_log)`` dropped
                when A_log is None                                 (fla/ops/kda/gate.py)
- beta          ``sigmoid(b)``, or ``2 * sigmoid(b)`` with allow_neg_eigval (fla/ops/common/gate.py)

All results are fp32, as FLA's kernels produce them.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.fla import softplus_gate_op  # noqa: F401  (registers laqat::softplus_gate)


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Raw gate [B, T, HV] -> per-token log-decay [B, T, HV] (fp32): ``laqat::softplus_gate``."""
    return torch.ops.laqat.softplus_gate(g, A_log, dt_bias)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """Raw gate [..., HV, K] -> per-channel log-decay [..., HV, K] (fp32)."""
    if lower_bound is None:
        return torch.ops.laqat.softplus_gate(g, A_log, dt_bias)
    HV, K = g.shape[-2:]
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(HV, K)
    if A_log is not None:
        g = A_log.float().view(HV, 1).exp() * g
    return lower_bound * torch.sigmoid(g)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """Raw beta logits -> beta in (0, 1), or (0, 2) with allow_neg_eigval (fp32)."""
    beta = torch.sigmoid(beta.float())
    return beta * 2.0 if allow_neg_eigval else beta
