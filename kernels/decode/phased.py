"""Decode-phase training of one laqat node: each sequence's prefix on the chunk kernels, its suffix on the decode
kernels (docs/decode_phase.md). What both decode variants (``decode_fused``, ``decode_serving``) run:

    initial state   a cache: rounded on load (codec, then a serving cache's dtype)   suffix.round_state
    prefix [0, p)   the exact recurrence, chunked, from that state                    the chunk kernels (kernels/chunk)
    handoff         the prefix's state rounded by the codec                           \\
    suffix [p, L)   one decode step per token, the state rounded at every write        / suffix.suffix_forward
    padding         zero output, no state change, zero gradient

The chunk kernels run the prefix's spec (the same recurrence, exact, no phase): for 16-bit inputs they keep FLA's
16-bit intermediates, as FLA's (and vLLM's Triton) chunked prefill does. Every sequence's suffix is packed one
after another and starts from the state its prefix handed off.

Training: the forward stores the suffix's checkpoints in the buffer ``save_to`` (``residual_numel`` elements; the
op ``laqat::delta_rule_phased_train`` keeps it for the backward), so the suffix runs forward once. Backward: the
suffix's gradients (suffix.suffix_backward) give the gradient of every handoff state, which is the chunk kernels'
final-state gradient over the prefixes (identity through every rounding).
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.decode_phase import require_lengths
from la_compiler.kernels.decode import suffix
from la_compiler.kernels.decode.serving_kda_inputs import raw_gate_grads, raw_gate_log_decay
from la_compiler.kernels.chunk.variant import chunk_forward
from la_compiler.kernels.registry import get_variant, spec_of


def prefill_spec(spec: RecurrenceSpec) -> RecurrenceSpec:
    """The prefix's spec: the same recurrence, exact, no phase (the decode phase rounds the state only)."""
    return spec.replace(phase="none", quant=(), extra=(), kernel="chunk")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which stored tokens are whose prefix and suffix, packed one sequence after another."""

    n: int
    prefix_seqs: list[int]
    prefix_rows: torch.Tensor
    prefix_cu: torch.Tensor
    suffix_seqs: list[int]
    suffix_rows: torch.Tensor
    suffix_cu: torch.Tensor


def plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, device) -> Plan:
    if cu_seqlens is None:
        starts, stored = [b * T for b in range(B)], [T] * B
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        starts, stored = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    n = len(starts)
    pre = [int(x) for x in prefill_lengths.tolist()]
    val = [int(x) for x in valid_lengths.tolist()]
    if len(pre) != n or len(val) != n:
        raise ValueError(f"decode phase: need {n} prefill/valid lengths, got {len(pre)}/{len(val)}")
    for i in range(n):
        if not 0 <= pre[i] <= val[i] <= stored[i]:
            raise ValueError(f"decode phase: sequence {i} needs 0 <= prefill {pre[i]} <= valid {val[i]} <= "
                             f"stored {stored[i]}")

    def packed(seqs, lo, hi):
        rows = [torch.arange(starts[i] + lo[i], starts[i] + hi[i]) for i in seqs]
        lengths = torch.tensor([0] + [hi[i] - lo[i] for i in seqs])
        return (torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device),
                lengths.cumsum(0).to(device=device, dtype=torch.int32))

    prefix_seqs = [i for i in range(n) if pre[i] > 0]
    suffix_seqs = [i for i in range(n) if val[i] > pre[i]]
    prefix_rows, prefix_cu = packed(prefix_seqs, [0] * n, pre)
    suffix_rows, suffix_cu = packed(suffix_seqs, pre, val)
    return Plan(n, prefix_seqs, prefix_rows, prefix_cu, suffix_seqs, suffix_rows, suffix_cu)


def _tokens(x, rows):
    """x [B, T, ...] as one packed sequence of the given stored tokens: [1, len(rows), ...]."""
    return x.reshape(1, -1, *x.shape[2:])[:, rows].contiguous()


def _index(seqs: list[int], device) -> torch.Tensor:
    return torch.tensor(seqs, dtype=torch.long, device=device)


def _loaded_state(spec, plan_: Plan, q, v, initial_state):
    """The state every sequence starts from: the initial state rounded as a cache on load, or zeros."""
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if initial_state is not None:
        return suffix.round_state(spec, initial_state, v.dtype)
    shape = (plan_.n, HV, K, V) if spec.state == "kv" else (plan_.n, HV, V, K)
    return torch.zeros(shape, dtype=torch.float32, device=q.device)


def _chunk_operands(q, k, v):
    """q, k for the chunk kernels, which take one input dtype: a serving profile's fp32 q, k (passes/serving_inputs.py)
    hold v's dtype's values on prefix tokens, so the cast to it is exact there."""
    return (q, k) if q.dtype == v.dtype else (q.to(v.dtype), k.to(v.dtype))


def _server_gate(spec) -> bool:
    """A serving profile's KDA prefix runs its decays as vLLM's Kimi-K3 prefill does: G / ln 2, exp2 (forward only;
    the backward's recompute keeps laqat's exp, docs/serving.md section 3)."""
    return spec.kind == "kda" and suffix.options_of(spec).serving is not None


def _prefix_forward(spec, plan_: Plan, q, k, v, g, beta, loaded, has_initial_state: bool, scale, raw_gate=None):
    """(o of the prefix tokens or None, the state after each sequence's prefix [n, ...]: the loaded state where
    there is no prefix). ``raw_gate`` = (the raw gate, A_log, dt_bias): the chunk kernels sum vLLM's gate of it
    (its prefill's order) in place of the log-decay g."""
    after_prefix = loaded
    o_prefix = None
    if plan_.prefix_seqs:
        seqs = _index(plan_.prefix_seqs, q.device)
        q, k = _chunk_operands(q, k, v)
        g, gate = (g, None) if raw_gate is None else (raw_gate[0], raw_gate[1:])
        o_prefix, ht = chunk_forward(
            prefill_spec(spec), *(_tokens(x, plan_.prefix_rows) for x in (q, k, v, g, beta)),
            loaded[seqs] if has_initial_state else None, plan_.prefix_cu, scale, gate_exp2=_server_gate(spec),
            raw_gate=gate)
        after_prefix = after_prefix.index_copy(0, seqs, ht.to(torch.float32))
    return o_prefix, after_prefix


def residual_numel(spec, q, v, cu_seqlens) -> int:
    """Elements of the fp32 buffer a training forward keeps for its backward: the suffix's checkpoints."""
    return suffix.checkpoint_numel(spec, q, v, cu_seqlens)


def phased_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                   valid_lengths=None, save_to: torch.Tensor | None = None, gate=None):
    """(o [B, T, HV, V] in q's dtype, final states fp32). ``save_to``: a buffer of ``residual_numel`` elements
    that receives what the backward needs (``saved=``). ``gate``: (A_log, dt_bias) where g is KDA's raw gate
    (a serving profile's node, ir/delta_rule_phased.py)."""
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    raw_gate = None if gate is None else (g, *gate)  # the prefix sums the raw gate, the suffix takes its log-decay
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    p = plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, q.device)
    loaded = _loaded_state(spec, p, q, v, initial_state)
    o_prefix, final = _prefix_forward(spec, p, q, k, v, g, beta, loaded, initial_state is not None, scale, raw_gate)
    o = torch.zeros(B * T, HV, V, dtype=q.dtype, device=q.device)
    if o_prefix is not None:
        o[p.prefix_rows] = o_prefix[0].to(q.dtype)
    if p.suffix_seqs:
        seqs = _index(p.suffix_seqs, q.device)
        o_suffix, ht = suffix.suffix_forward(
            spec, *(_tokens(x, p.suffix_rows) for x in (q, k, v)), raw_gate_log_decay(_tokens(g, p.suffix_rows), gate),
            _tokens(beta, p.suffix_rows), final[seqs], p.suffix_cu, scale, checkpoints=save_to)
        o[p.suffix_rows] = o_suffix[0]
        final = final.index_copy(0, seqs, ht)
    elif save_to is not None:  # the op returns the buffer: no element of it left unwritten
        save_to.zero_()
    return o.view(B, T, HV, V), final


def phased_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *, prefill_lengths=None,
                    valid_lengths=None, saved: torch.Tensor | None = None, gate=None):
    """(dq, dk, dv, dg, dbeta, dh0 or None), each in its input's dtype. ``saved``: what a training forward of the
    same inputs stored (``save_to``); without it the suffix's forward runs again first. With a raw gate
    (``gate`` = (A_log, dt_bias)), dg is the raw gate's and (dA_log, ddt_bias or None) follow."""
    if gate is None:
        return _backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, prefill_lengths,
                         valid_lengths, saved)
    log_decay = raw_gate_log_decay(g, gate)
    *grads, dh0 = _backward(spec, q, k, v, log_decay, beta, initial_state, cu_seqlens, scale, do, dht,
                            prefill_lengths, valid_lengths, saved, raw_gate=(g, *gate))
    dg, dA_log, ddt_bias = raw_gate_grads(grads[3], log_decay, g, gate)
    return (*grads[:3], dg, grads[4], dh0, dA_log, ddt_bias)


def _backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, prefill_lengths, valid_lengths,
              saved, raw_gate=None):
    """phased_backward of the log-decay g; ``raw_gate`` (the raw gate, A_log, dt_bias): the prefix's forward, where
    it runs again, sums its gate as the forward did."""
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    B, T = q.shape[:2]
    dev = q.device
    p = plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, dev)
    loaded = _loaded_state(spec, p, q, v, initial_state)
    grads = [torch.zeros(x.reshape(-1, *x.shape[2:]).shape, dtype=torch.float32, device=dev)
             for x in (q, k, v, g, beta)]
    d_after_prefix = dht.to(torch.float32).clone()  # a sequence without a suffix ends with its prefix's state
    if p.suffix_seqs:
        seqs = _index(p.suffix_seqs, dev)
        packed = [_tokens(x, p.suffix_rows) for x in (q, k, v, g, beta)]
        if saved is None:
            _, after_prefix = _prefix_forward(spec, p, q, k, v, g, beta, loaded, initial_state is not None, scale,
                                              raw_gate)
            saved = torch.empty(residual_numel(spec, q, v, cu_seqlens), dtype=torch.float32, device=dev)
            suffix.suffix_forward(spec, *packed, after_prefix[seqs], p.suffix_cu, scale, checkpoints=saved)
        *token_grads, d_handoff = suffix.suffix_backward(spec, *packed, p.suffix_cu, scale,
                                                         _tokens(do, p.suffix_rows), dht[seqs], saved)
        for grad, part in zip(grads, token_grads):
            grad[p.suffix_rows] = part[0]
        d_after_prefix = d_after_prefix.index_copy(0, seqs, d_handoff)
    d_initial = d_after_prefix  # no prefix: the state after it is the (rounded) initial state itself
    if p.prefix_seqs:
        seqs = _index(p.prefix_seqs, dev)
        *token_grads, dh0 = get_variant("chunk").backward(
            prefill_spec(spec), *(_tokens(x, p.prefix_rows) for x in (*_chunk_operands(q, k, v), v, g, beta)),
            loaded[seqs] if initial_state is not None else None, p.prefix_cu, scale, _tokens(do, p.prefix_rows),
            d_after_prefix[seqs].contiguous())
        for grad, part in zip(grads, token_grads):
            grad[p.prefix_rows] = part[0].to(torch.float32)
        if dh0 is not None:
            d_initial = d_initial.index_copy(0, seqs, dh0.to(torch.float32))
    dq, dk, dv, dg, dbeta = (grad.view(x.shape).to(x.dtype) for grad, x in zip(grads, (q, k, v, g, beta)))
    dh0 = d_initial.to(initial_state.dtype) if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dh0


def prefill_reason(spec, ctx) -> str | None:
    """Why the chunk kernels cannot run the prefix of ``spec`` on ``ctx``, or None."""
    why = get_variant("chunk").supports(prefill_spec(spec), ctx)
    return None if why is None else f"its prefix runs on the chunk kernels, which cannot: {why}"
