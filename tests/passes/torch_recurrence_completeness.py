"""Recurrences in spellings the loop analysis reaches only through another door: a step function run by
``torch._higher_order_ops.scan``, and a readout of the negated query ``S^T (-q)``; with near variants that are
not the delta rule (the frontend must leave them alone).

Each function takes q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H] and an initial state [B, H, K, V];
returns (o [B, T, H, V], final state).
"""
import torch
from torch._higher_order_ops.scan import scan


def _delta_step(S, kt, vt, gt, bt):
    S = S * gt.exp()[..., None, None]
    u = (vt - (S * kt[..., None]).sum(-2)) * bt[..., None]
    return S + kt[..., None] * u[..., None, :]


def gdn_scan(q, k, v, g, beta, h0, *, read_before_update=False, clamp=None):
    """The step of a token loop as scan's combine function; the sequence dim scanned (dim=1)."""
    scale = q.shape[-1] ** -0.5

    def step(S, x):
        qt, kt, vt, gt, bt = x
        before = S
        S = _delta_step(S, kt, vt, gt, bt)
        if clamp is not None:
            S = S.clamp(-clamp, clamp)
        read = before if read_before_update else S
        return S, (read * qt[..., None]).sum(-2) * scale

    S, o = scan(step, h0, (q, k, v, g, beta), dim=1)
    return o, S


def gdn_scan_reverse(q, k, v, g, beta, h0):
    """The sequence scanned from its end (``reverse=True``): the delta rule over the reversed tokens."""
    scale = q.shape[-1] ** -0.5

    def step(S, x):
        qt, kt, vt, gt, bt = x
        S = _delta_step(S, kt, vt, gt, bt)
        return S, torch.einsum("bhkv,bhk->bhv", S, qt) * scale

    S, o = scan(step, h0, (q, k, v, g, beta), dim=1, reverse=True)
    return o, S


def gdn_scan_read_before_update(q, k, v, g, beta, h0):
    """The output reads the state before the step's update: not the delta rule."""
    return gdn_scan(q, k, v, g, beta, h0, read_before_update=True)


def gdn_scan_state_clamp(q, k, v, g, beta, h0):
    """The state clamped after every step: the delta rule only where |S| <= 50."""
    return gdn_scan(q, k, v, g, beta, h0, clamp=50.0)


def gdn_negated_query(q, k, v, g, beta, h0, *, sign=None, subtract_update=False):
    """``o_t = S_t^T (-q_t)``; ``sign`` multiplies q per head instead (mixed signs: no single scale);
    ``subtract_update`` writes ``S - k u^T`` (not the delta rule, whatever the query's sign)."""
    scale = q.shape[-1] ** -0.5
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        update = kt[..., None] * u[..., None, :]
        S = S - update if subtract_update else S + update
        qt = -q[:, t] if sign is None else q[:, t] * sign[:, None]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, qt) * scale
    return o, S


def gdn_negated_query_matmul(q, k, v, g, beta, h0):
    """The readout as ``S^T @ (-q)`` on a column vector, no scale."""
    S = h0.clone()
    outs = []
    for t in range(q.shape[1]):
        S = _delta_step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append((S.transpose(-1, -2) @ (-q[:, t])[..., None]).squeeze(-1))
    return torch.stack(outs, 1), S


def gdn_negated_query_mixed_signs(q, k, v, g, beta, h0):
    """Head 0 reads q, head 1 reads -q: no single (negative or positive) scale makes it the delta rule."""
    sign = torch.tensor([1.0, -1.0])
    return gdn_negated_query(q, k, v, g, beta, h0, sign=sign)


def gdn_negated_query_subtracted_update(q, k, v, g, beta, h0):
    """``S^T (-q)`` read from a state that subtracts its update: not the delta rule."""
    return gdn_negated_query(q, k, v, g, beta, h0, subtract_update=True)


def gdn_negated_query_and_final_state(q, k, v, g, beta, h0):
    """``S^T (-q)`` read, and ``-S`` returned: the negation of the final state follows the loop (rewritten, the
    negation kept behind the IR node)."""
    o, S = gdn_negated_query(q, k, v, g, beta, h0)
    return o, -S
