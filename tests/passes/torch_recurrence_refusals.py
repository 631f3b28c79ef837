"""Token-loop GDNs that are *almost* the delta rule: one op that acts only on some values, on
the gradient only, or that rounds (``REFUSALS`` maps each to the op its near-miss reason must
name). At small random inputs most of them compute what the delta rule computes, which is why
the torch frontend checks every op of the region (``allowed_ops.py``) before probing it.

``gdn_refusal(name)`` returns a function with the signature of the spellings in
``torch_recurrence_spellings.py``: (q, k, v, g, beta, h0) -> (o, final state).
"""
import functools

import torch
import torch.nn.functional as F

from tests.passes.torch_recurrence_spellings import gdn_chunked_solve

C = 1e3  # a bound that small probes never reach

REFUSALS = {  # name -> (op named in the reason, phrase of the reason)
    "state_clamp": ("`clamp`", "saturates"),
    "state_where": ("`where`", "value-dependent"),
    "delta_clamp": ("`clamp`", "saturates"),
    "state_nan_to_num": ("`nan_to_num`", "non-finite"),
    "state_bf16_round_trip": ("`bfloat16`", "narrower dtype"),
    "state_to_bf16": ("`to(torch.bfloat16)`", "narrower dtype"),
    "state_bf16_ste": ("`bfloat16`", "narrower dtype"),
    "state_detach": ("`detach`", "cuts the gradient"),
    "key_detach_in_delta": ("`detach`", "cuts the gradient"),
    "readout_fp16_round_trip": ("`half`", "narrower dtype"),
    "state_inplace_clamp": ("`clamp_`", "saturates"),
    "no_grad_decay": ("`torch.no_grad()`", "cuts the gradient"),
    "dropout_on_delta": ("`dropout`", "random"),
    "noise_on_state": ("`randn_like`", "random"),
    "beta_threshold_mask": ("`gt`", "value-dependent"),
    "state_relu": ("`relu`", "saturates"),
    "state_row_write": ("`setitem`", "in place"),
    "state_norm_cap": ("`norm`", "not an op of the delta-rule algebra"),
    "chunk_state_clamp": ("`clamp`", "saturates"),
    "decay_in_bf16": ("`exp`", "computes in bfloat16"),
    "double_read_clamp": ("`clamp`", "saturates"),  # and no report about the step's time index
}


def _gdn(q, k, v, g, beta, h0=None, mistake=""):
    B, T, H, K = q.shape
    S = h0.clone() if h0 is not None else torch.zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    gb = g.bfloat16()
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        d = g[:, t].exp()[..., None, None]
        if mistake == "double_read_clamp":  # g[:, t] read twice in one step, and a clamp
            d = (0.5 * g[:, t] + 0.5 * g[:, t]).exp()[..., None, None]
        if mistake == "decay_in_bf16":  # g rounded before the loop (pre-processing), exp computed in bf16
            d = gb[:, t].exp().float()[..., None, None]
        if mistake == "no_grad_decay":
            with torch.no_grad():
                S = S * d
        elif mistake == "state_inplace_clamp":
            S.mul_(d)
        else:
            S = S * d
        if mistake == "key_detach_in_delta":
            read = (S * kt.detach()[..., None]).sum(-2)
        else:
            read = (S * kt[..., None]).sum(-2)
        u = (vt - read) * bt[..., None]
        if mistake == "delta_clamp":
            u = u.clamp(-C, C)
        if mistake == "dropout_on_delta":
            u = F.dropout(u, p=0.1, training=True)
        if mistake == "beta_threshold_mask":
            u = u * (bt > 0.05)[..., None]
        if mistake == "state_inplace_clamp":
            S.add_(kt[..., None] * u[..., None, :])
            S.clamp_(-C, C)
        else:
            S = S + kt[..., None] * u[..., None, :]
        if mistake in ("state_clamp", "double_read_clamp"):
            S = S.clamp(-C, C)
        elif mistake == "state_where":
            S = torch.where(S > C, torch.full_like(S, C), S)
        elif mistake == "state_nan_to_num":
            S = torch.nan_to_num(S)
        elif mistake == "state_bf16_round_trip":
            S = S.bfloat16().float()
        elif mistake == "state_to_bf16":
            S = S.to(torch.bfloat16).to(torch.float32)
        elif mistake == "state_bf16_ste":
            S = S + (S.bfloat16().float() - S).detach()
        elif mistake == "state_detach":
            S = S.detach()
        elif mistake == "noise_on_state":
            S = S + 1e-3 * torch.randn_like(S)
        elif mistake == "state_relu":
            S = torch.relu(S + C) - C
        elif mistake == "state_row_write":
            S[:, :, 0] = S[:, :, 0] * 0.5
        elif mistake == "state_norm_cap":
            S = S * (C / S.norm().clamp_min(C))
        ot = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
        if mistake == "readout_fp16_round_trip":
            ot = ot.half().float()
        o[:, t] = ot
    return o, S


def _chunk_state_clamp(q, k, v, g, beta, h0=None):
    return gdn_chunked_solve(q, k, v, g, beta, h0, state_clamp=C)


def gdn_refusal(name):
    if name == "chunk_state_clamp":
        return _chunk_state_clamp
    return functools.partial(_gdn, mistake=name)


def gdn_mutating_input_state(q, k, v, g, beta, h0=None):
    """The caller's initial state decayed in place (``h0 *= d``): the caller sees that mutation."""
    K = q.shape[-1]
    S = h0
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        kt = k[:, t]
        S *= g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S
