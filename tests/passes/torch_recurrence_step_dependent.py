"""Token loops whose steps are not one program: a constant, literal or index that depends on the step.

Dynamo unrolls the loop; step t then reads a value that changes with t (a context-length cap, a per-position
schedule, a division by ``max(t, 1)``, a shift by t). Most of them agree with the delta rule on the first two
steps, the ones the algebra check runs, so ``loops.py`` (literals) and ``steps.py`` (the slices a step reads)
must refuse them. ``STEP_DEPENDENT`` maps each name to phrases its near-miss reason must contain: the step,
the value and the source line; ``NATIVE`` the spellings that only their own dtypes tell from the delta rule.

``gdn_step_dependent(name)`` returns ``(q, k, v, g, beta, h0) -> (o, final state)``.
"""
import functools

import torch

STEP_DEPENDENT = {  # name -> phrases of the reason (the step, the value, the line)
    "context_cap": ("step 3 reads keep[3] = 0", "where step 0 reads 1", "keep = (torch.arange(T) < T // 2)"),
    "divide_by_max_t_1": ("step 2 is not isomorphic to step 1", "reads the value 2", "ot = ot / max(t, 1)"),
    "fixed_position_reset": ("step 3 reads reset[3] = 0", "S = S * reset[t]"),
    "beta_schedule_from_step_2": ("step 2 reads sched[2] = 0.5", "where step 0 reads 1", "bt = bt * sched[t]"),
    "beta_literal_from_step_2": ("step 2 is not isomorphic to step 1", "reads the value 0.5", "bt = bt * ("),
    "key_roll_by_t": ("step 1 is not isomorphic to step 0", "reads the value 1", "kt = kt.roll(t, -1)"),
    "correction_from_step_2": ("step 2 reads corr[2] = 1", "where step 0 reads 0", "corr = torch.arange(T)"),
    "gate_schedule_from_step_2": ("step 2 reads g[2]", "computed from the constant", "differ by position",
                                  "w = torch.ones"),
    "kda_context_cap": ("step 3 reads keep[3] = 0", "keep = (torch.arange(T) < T // 2)"),
}
NATIVE = {  # name -> phrase: numerics that float64 probes do not see
    "state_round_to_integer": "not in its own dtypes",
}
ROUND_TRIPS = {  # name -> the op the reason names
    "state_fp16_round_trip": "`half`",
    "state_fp16_round_trip_first": "`half`",
    "readout_bf16_round_trip": "`bfloat16`",
    "readout_to_bf16_and_back": "`to(torch.bfloat16)`",
}
MAGIC = 1.5 * 2 ** 23  # fp32: x + MAGIC - MAGIC rounds x to an integer


def _gdn(q, k, v, g, beta, h0=None, mistake=""):
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    keep = (torch.arange(T) < T // 2).float()
    reset = torch.ones(T)
    reset[3] = 0.0
    sched = torch.ones(T)
    sched[2:] = 0.5
    corr = torch.arange(T).float() * (torch.arange(T).float() - 1) / 2
    w = torch.ones(1, T, 1)
    w[:, 2:] = 0.5
    if mistake == "gate_schedule_from_step_2":
        g = g * w  # a per-token product inside the region, with a constant that changes at token 2
    for t in range(T):
        if mistake == "state_fp16_round_trip_first":
            S = S.half().float()
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        if mistake == "key_roll_by_t":
            kt = kt.roll(t, -1)
        if mistake == "beta_schedule_from_step_2":
            bt = bt * sched[t]
        if mistake == "beta_literal_from_step_2":
            bt = bt * (1.0 if t < 2 else 0.5)
        S = S * g[:, t].exp()[..., None, None]
        if mistake == "fixed_position_reset":
            S = S * reset[t]
        u = (vt - (S * kt[..., None]).sum(-2)) * bt[..., None]
        if mistake == "correction_from_step_2":
            u = u * (1 + 0.1 * corr[t])
        upd = kt[..., None] * u[..., None, :]
        if mistake == "context_cap":
            upd = keep[t] * upd
        S = S + upd
        if mistake == "state_fp16_round_trip":
            S = S.half().float()
        if mistake == "state_round_to_integer":
            S = (S + MAGIC) - MAGIC
        ot = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
        if mistake == "divide_by_max_t_1":
            ot = ot / max(t, 1)
        if mistake == "readout_bf16_round_trip":
            ot = ot.bfloat16().float()
        if mistake == "readout_to_bf16_and_back":
            ot = ot.to(torch.bfloat16).to(torch.float32)
        o[:, t] = ot
    return o, S


def _kda_context_cap(q, k, v, g, beta, h0=None):
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    keep = (torch.arange(T) < T // 2).float()
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + keep[t] * (kt[..., None] * u[..., None, :])
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def gdn_uniform_constant(q, k, v, g, beta, h0=None):
    """A constant sliced per step that is the same at every step: the delta rule (rewritten)."""
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    one = torch.ones(T)
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + one[t] * (kt[..., None] * u[..., None, :])
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def gdn_shifted_key_outside(q, k, v, g, beta, h0=None):
    """A key shifted by one position from token 2 on, computed before the loop: not a per-token op, so it stays
    outside the region and is the IR node's k (rewritten, equal to eager)."""
    k = torch.cat([k[:, :2], k[:, 1:-1]], 1)
    return _gdn(q, k, v, g, beta, h0)


def gdn_unit_sphere_renorm(q, k, v, g, beta, h0=None):
    """A key renormalization ``k / |k|^2``: the identity exactly on the unit sphere, nowhere else."""
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        kt = k[:, t]
        kt = kt / (kt * kt).sum(-1, keepdim=True)
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def gdn_clamp_on_last_step(q, k, v, g, beta, h0=None):
    """The last step clamps the state: not one recurrence, and the reason says so (not "does not write its
    output")."""
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        if t == T - 1:
            S = S.clamp(-1e3, 1e3)
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def gdn_step_dependent(name):
    if name == "kda_context_cap":
        return _kda_context_cap
    return functools.partial(_gdn, mistake=name)



def gdn_into_callers_buffer(q, k, v, g, beta, h0=None, o=None):
    """The outputs written into a buffer the caller passed: the caller sees that mutation, an IR node would not
    make it (refused as an in-place write into an input, not "cannot probe")."""
    B, T, H, K = q.shape
    S = h0.clone()
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S
