"""The "decode_serving" kernel variant: decode-phase training as a serving profile (``x.serving``) computes it.

What a server computes for each sequence n (docs/serving.md), and what runs it here:

    initial state   a cache: rounded on load (codec, then the cache dtype)        round_state_kernel
    prefix [0, p)   the chunked prefill, from that state                         the chunk kernels (kernels/chunk)
    handoff         the prefix's state rounded to the cache                       \\
    suffix [p, L)   one decode step per token in the server's order of            decode_fused's kernels, V-first
                    operations, the state rounded to the cache at every write     / tile, every sequence from p

The chunk kernels run the exact spec of the recurrence: for 16-bit inputs they keep FLA's 16-bit
intermediates (W, U, the chunk states, V_new), as vLLM's Triton prefill, a copy of FLA's chunk kernels,
does. The suffix launch packs every sequence's suffix and starts it from the state the prefix handed off
(``round_initial_state=False``: that state is rounded by the handoff only, as in a decode spec).

Backward: the decode kernels' backward over the suffixes gives the gradient of each handoff state, which
is the chunk kernels' final-state gradient over the prefixes (identity through every rounding). The suffix
gradients are exact in fp32 for the emulated forward; the prefix gradients are the chunk kernels' (their
16-bit intermediates for 16-bit inputs, as FLA's backward).
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.decode import fused
from la_compiler.kernels.decode.options import decode_options, decode_reason, require_lengths
from la_compiler.kernels.registry import SelectionContext, get_variant, register_variant, spec_of
from la_compiler.spec import RecurrenceSpec


def prefill_spec(spec: RecurrenceSpec) -> RecurrenceSpec:
    """The prefix's spec: the same recurrence, exact, no phase (the decode phase rounds the state only)."""
    return spec.replace(phase="none", quant=(), extra=(), kernel="chunk")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which stored tokens are whose prefix and suffix, packed one sequence after another."""

    n: int
    prefix_seqs: list[int]
    prefix_rows: torch.Tensor
    prefix_cu: torch.Tensor
    suffix_seqs: list[int]
    suffix_rows: torch.Tensor
    suffix_cu: torch.Tensor


def _plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, device) -> _Plan:
    if cu_seqlens is None:
        starts, stored = [b * T for b in range(B)], [T] * B
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        starts, stored = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    n = len(starts)
    pre = [int(x) for x in prefill_lengths.tolist()]
    val = [int(x) for x in valid_lengths.tolist()]
    if len(pre) != n or len(val) != n:
        raise ValueError(f"decode_serving: need {n} prefill/valid lengths, got {len(pre)}/{len(val)}")
    for i in range(n):
        if not 0 <= pre[i] <= val[i] <= stored[i]:
            raise ValueError(f"decode_serving: sequence {i} needs 0 <= prefill {pre[i]} <= valid {val[i]} <= "
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
    return _Plan(n, prefix_seqs, prefix_rows, prefix_cu, suffix_seqs, suffix_rows, suffix_cu)


def _tokens(x, rows):
    """x [B, T, ...] as one packed sequence of the given stored tokens: [1, len(rows), ...]."""
    return x.reshape(1, -1, *x.shape[2:])[:, rows].contiguous()


def _prefix_and_handoff(spec, plan: _Plan, q, k, v, g, beta, initial_state, scale):
    """(o of the prefix tokens, state entering each suffix [len(suffix_seqs), ...], state after each
    sequence's prefix [n, ...]: the rounded initial state (or zeros) where there is no prefix)."""
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    shape = (plan.n, HV, K, V) if spec.state == "kv" else (plan.n, HV, V, K)
    if initial_state is not None:
        after_prefix = fused.round_state(spec, initial_state, v.dtype)
    else:
        after_prefix = torch.zeros(shape, dtype=torch.float32, device=q.device)
    o_prefix = None
    if plan.prefix_seqs:
        seqs = torch.tensor(plan.prefix_seqs, device=q.device)
        h0 = after_prefix[seqs] if initial_state is not None else None
        o_prefix, ht = get_variant("chunk").forward(
            prefill_spec(spec), *(_tokens(x, plan.prefix_rows) for x in (q, k, v, g, beta)), h0, plan.prefix_cu,
            scale)
        after_prefix = after_prefix.index_copy(0, seqs, ht.to(torch.float32))
    handoff = after_prefix[torch.tensor(plan.suffix_seqs, dtype=torch.long, device=q.device)]
    return o_prefix, handoff, after_prefix


def _suffix_lengths(plan: _Plan):
    lengths = plan.suffix_cu[1:] - plan.suffix_cu[:-1]
    return torch.zeros_like(lengths), lengths


def decode_serving_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                           valid_lengths=None):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    plan = _plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, q.device)
    o_prefix, handoff, final = _prefix_and_handoff(spec, plan, q, k, v, g, beta, initial_state, scale)
    o = torch.zeros(B * T, HV, V, dtype=q.dtype, device=q.device)
    if o_prefix is not None:
        o[plan.prefix_rows] = o_prefix[0].to(q.dtype)
    if plan.suffix_seqs:
        zero, lengths = _suffix_lengths(plan)
        o_suffix, ht = fused.decode_fused_forward(
            spec, *(_tokens(x, plan.suffix_rows) for x in (q, k, v, g, beta)), handoff, plan.suffix_cu, scale,
            prefill_lengths=zero, valid_lengths=lengths, round_initial_state=False)
        o[plan.suffix_rows] = o_suffix[0]
        final = final.index_copy(0, torch.tensor(plan.suffix_seqs, device=q.device), ht)
    return o.view(B, T, HV, V), final


def decode_serving_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *,
                            prefill_lengths=None, valid_lengths=None):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    B, T = q.shape[:2]
    plan = _plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, q.device)
    _, handoff, _ = _prefix_and_handoff(spec, plan, q, k, v, g, beta, initial_state, scale)
    dev = q.device
    grads = [torch.zeros(x.reshape(-1, *x.shape[2:]).shape, dtype=torch.float32, device=dev)
             for x in (q, k, v, g, beta)]
    d_after_prefix = dht.to(torch.float32).clone()  # a sequence without a suffix ends with its prefix's state
    if plan.suffix_seqs:
        zero, lengths = _suffix_lengths(plan)
        seqs = torch.tensor(plan.suffix_seqs, device=dev)
        *token_grads, d_handoff = fused.decode_fused_backward(
            spec, *(_tokens(x, plan.suffix_rows) for x in (q, k, v, g, beta)), handoff, plan.suffix_cu, scale,
            _tokens(do, plan.suffix_rows), dht[seqs], prefill_lengths=zero, valid_lengths=lengths,
            round_initial_state=False)
        for grad, part in zip(grads, token_grads):
            grad[plan.suffix_rows] = part[0].to(torch.float32)
        d_after_prefix = d_after_prefix.index_copy(0, seqs, d_handoff.to(torch.float32))
    d_initial = d_after_prefix  # no prefix: the state after it is the (rounded) initial state itself
    if plan.prefix_seqs:
        seqs = torch.tensor(plan.prefix_seqs, device=dev)
        h0 = fused.round_state(spec, initial_state, v.dtype)[seqs] if initial_state is not None else None
        *token_grads, dh0 = get_variant("chunk").backward(
            prefill_spec(spec), *(_tokens(x, plan.prefix_rows) for x in (q, k, v, g, beta)), h0, plan.prefix_cu,
            scale, _tokens(do, plan.prefix_rows), d_after_prefix[seqs].contiguous())
        for grad, part in zip(grads, token_grads):
            grad[plan.prefix_rows] = part[0].to(torch.float32)
        if dh0 is not None:
            d_initial = d_initial.index_copy(0, seqs, dh0.to(torch.float32))
    dq, dk, dv, dg, dbeta = (grad.view(x.shape).to(x.dtype) for grad, x in zip(grads, (q, k, v, g, beta)))
    dh0 = d_initial.to(initial_state.dtype) if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dh0


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    reason = decode_reason(spec, "triton")
    if reason is not None:
        return reason
    if decode_options(spec).serving is None:
        return "a serving profile's kernel: the spec has no x.serving"
    return (needs(triton_runs(ctx), not_float64(ctx)) or fused.unsupported_reason(spec, ctx.head_k, ctx.head_v)
            or _prefill_reason(spec, ctx))


def _prefill_reason(spec, ctx) -> str | None:
    why = get_variant("chunk").supports(prefill_spec(spec), ctx)
    return None if why is None else f"its prefix runs on the chunk kernels, which cannot: {why}"


def _constexprs(spec) -> dict:
    """The chunked prefix's constexprs (named "prefix <NAME>") and the decode suffix's."""
    prefix = get_variant("chunk").constexprs(prefill_spec(spec))
    return {**{f"prefix {name}": value for name, value in prefix.items()}, **fused.constexprs(spec)}


def _source_modules(spec) -> dict:
    spec = spec_of(spec)
    prefix = {f"prefix (chunk) {role}": module
              for role, module in get_variant("chunk").source_modules(prefill_spec(spec)).items()}
    return {**prefix, **{f"suffix (decode) {role}": module for role, module in fused.source_modules(spec).items()}}


register_variant(
    "decode_serving",
    decode_serving_forward,
    decode_serving_backward,
    "decode-phase training under a serving profile: the prefix through the chunk kernels (the chunked prefill), "
    "the suffix through the decode kernels in the server's order of operations, the cache dtype at every write",
    supports=supports,
    summary="serving profile: chunked prefix + decode steps as the server computes them, fwd + bwd",
    source_modules=_source_modules,
    constexprs=_constexprs,
)
