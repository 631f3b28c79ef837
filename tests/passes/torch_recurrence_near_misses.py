"""Near misses: token-loop GDNs with one deliberate mistake each (and one chunked one).

``gdn_with_mistake(name)`` returns a function with the same signature as the spellings in
``torch_recurrence_spellings.py``; ``MISTAKES`` maps each name to the phrase the torch
frontend's near-miss report must contain.
"""
import functools

import torch

from tests.passes.torch_recurrence_spellings import gdn_chunked_solve

MISTAKES = {
    "no_beta": "missing beta",
    "plus_sign": "wrong sign",
    "decay_after_update": "decay applied after the update",
    "read_before_update": "output reads the state before",
    "other_head": "reads another head",
    "previous_token": "not the step's own index",
    "leaked_intermediate": "read outside the recurrence",
    "two_states": "2 loop-carried values",
    "no_decay": "no decay",
    "bias_in_step": "which is no q, k, v, g, beta or state",  # a bias tensor passed in
    "constant_in_step": "does not compute the GDN/KDA delta rule",  # a bias made inside
    "decayed_key": "does not compute the GDN/KDA delta rule",
    "non_causal_chunk": "non-causal",
}


def _gdn(q, k, v, g, beta, h0=None, mistake="", bias=None):
    B, T, H, K = q.shape
    S = h0 if h0 is not None else torch.zeros(B, H, K, v.shape[-1])
    acc = torch.zeros(B, H, v.shape[-1])
    if mistake == "constant_in_step":
        bias = torch.ones(v.shape[-1]) * 0.5
    o = torch.zeros_like(v)
    leaked = []
    for t in range(T):
        kt = k[:, t - 1] if mistake == "previous_token" else k[:, t]
        if mistake == "other_head":
            kt = kt.roll(1, dims=1)
        d = g[:, t].exp()[..., None, None]
        if mistake not in ("decay_after_update", "no_decay", "decayed_key"):
            S = S * d
        if mistake == "decayed_key":
            kt = kt * g[:, t].exp()[..., None]
        read = (S * kt[..., None]).sum(-2)
        delta = v[:, t] + read if mistake == "plus_sign" else v[:, t] - read
        if mistake != "no_beta":
            delta = delta * beta[:, t, :, None]
        S_before = S
        S = S + kt[..., None] * delta[..., None, :]
        if mistake == "decay_after_update":
            S = S * d
        if mistake == "two_states":
            acc = acc + delta
        if mistake == "leaked_intermediate":
            leaked.append(read)
        state = S_before if mistake == "read_before_update" else S
        ot = (state * q[:, t, ..., None]).sum(-2) * K ** -0.5
        if bias is not None:
            ot = ot + bias
        if mistake == "two_states":
            ot = ot + acc
        o[:, t] = ot
    if mistake == "leaked_intermediate":
        return o, S, torch.stack(leaked, 1)
    return o, S


def gdn_with_mistake(name):
    if name == "non_causal_chunk":
        return functools.partial(gdn_chunked_solve, causal=False)
    if name == "bias_in_step":
        return functools.partial(_gdn, mistake=name, bias=torch.full((4,), 0.5))
    return functools.partial(_gdn, mistake=name)
