"""The delta rule on probe tensors, with the deliberate mistakes that near-miss reports name.

    S <- Diag(exp(g_t)) S ;  u_t = beta_t (v_t - S^T k_t) ;  S <- S + k_t u_t^T ;  o_t = S^T q_t

``Variant`` flips one piece of that algebra; a region that matches a variant (and not the
delta rule itself) is reported with the variant's name.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Variant:
    reason: str = ""  # "" = the delta rule itself
    sign: float = -1.0  # u = beta (v + sign * S^T k)
    beta_one: bool = False  # beta missing (= 1)
    decay_after: bool = False  # S <- Diag(exp g) (S + k u^T), u read from the undecayed state
    read_before: bool = False  # o_t = S_{t-1}^T q_t (readout before the update)
    no_decay: bool = False


EXACT = Variant()
NEAR_MISSES = (
    Variant("missing beta: the update is not scaled by beta (the algebra matches with beta = 1)", beta_one=True),
    Variant("wrong sign: the delta is v + S^T k instead of v - S^T k", sign=1.0),
    Variant("decay applied after the update instead of before it", decay_after=True),
    Variant("output reads the state before the step's update", read_before=True),
    Variant("no decay: the state is never multiplied by exp(g)", no_decay=True),
)


def delta_rule_steps(q, k, v, decay, beta, h0, variant: Variant = EXACT):
    """q, k [B, T, HV, K] (heads already expanded), v [B, T, HV, V], decay (multiplicative)
    [B, T, HV] or [B, T, HV, K], beta [B, T, HV], h0 [B, HV, K, V] -> (o, S), float64."""
    S = h0.clone()
    outs = []
    for t in range(q.shape[1]):
        d = decay[:, t]
        d = d[..., None, None] if d.dim() == 2 else d[..., None]
        if variant.no_decay:
            d = torch.ones_like(d)
        b = torch.ones_like(beta[:, t]) if variant.beta_one else beta[:, t]
        kt = k[:, t]
        S_prev = S if variant.decay_after else S * d
        read = (S_prev * kt[..., :, None]).sum(-2)  # S^T k: [B, HV, V]
        u = b[..., None] * (v[:, t] + variant.sign * read)
        S_new = S_prev + kt[..., :, None] * u[..., None, :]
        if variant.decay_after:
            S_new = S_new * d
        state = S_prev if variant.read_before else S_new
        outs.append((state * q[:, t][..., :, None]).sum(-2))
        S = S_new
    return torch.stack(outs, 1), S
