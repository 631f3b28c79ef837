"""The decode-phase IR: a laqat node whose sequences split into a prefix and a decode suffix.

    laqat::phase_lengths(q, cu_seqlens?) -> (prefill_lengths, valid_lengths)     int32 [N], on q's device
    laqat::delta_rule_phased(q, k, v, g, beta, initial_state?, cu_seqlens?,
                             prefill_lengths, valid_lengths, scale, spec) -> (o, final_state)

(a composite, as ``laqat::delta_rule``: ``laqat::delta_rule_phased_train`` where a gradient can flow, which also
returns the residual the kernel variant keeps for its backward, else ``laqat::delta_rule_phased_eval``).

``delta_rule`` keeps its signature; the phase pass (``passes/phase.py``) rewrites every
``delta_rule`` node whose spec has ``phase=token|replay`` into ``phase_lengths`` +
``delta_rule_phased``. Why this shape (docs/decode_phase.md):

- ``phase_lengths`` reads ``la_compiler.phase`` when it *runs*. It sits in the graph the
  backend compiles, below Dynamo, so Dynamo never sees (nor guards on) the lengths: changing
  them between steps recompiles nothing. It takes ``q`` only so that it is not a constant
  (Inductor would fold an op without runtime inputs).
- The lengths are ordinary inputs of ``delta_rule_phased``: its autograd saves them with the
  other inputs, so the backward uses the forward's lengths even after the context exited.
  A region recomputed in the backward (activation checkpointing) re-reads the context,
  which must then still be active (it is an error, not a silent change, if it is not).
"""
from __future__ import annotations

from typing import Optional

import torch

from la_compiler.ir.delta_rule import (_no_residual, _num_sequences, _state_shape, _variant_for, check_forward_inputs,
                            empty_grads, empty_outputs, pack_grads, pack_outputs)
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.canonical_inputs import final_state_dtype
from la_compiler.phase import PhaseError, current

Tensor = torch.Tensor


@torch.library.custom_op("laqat::phase_lengths", mutates_args=())
def phase_lengths(q: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    active = current()
    if active is None:
        raise PhaseError("a laqat node with spec phase=token|replay ran outside a phase context: wrap the "
                         "forward (and its backward) in "
                         "`with la_compiler.phase(prefill_lengths=[...], sequence_lengths=[...])`")
    if cu_seqlens is None:
        storage = [q.shape[1]] * q.shape[0]
    else:
        bounds = cu_seqlens.tolist()
        storage = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    prefill, valid = active.resolve(storage)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32).to(q.device)  # noqa: E731
    return as_tensor(prefill), as_tensor(valid)


@phase_lengths.register_fake
def _(q, cu_seqlens):
    n = _num_sequences(q, cu_seqlens)
    return q.new_empty((n,), dtype=torch.int32), q.new_empty((n,), dtype=torch.int32)


_PHASED_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, Tensor? cu_seqlens, "
                "Tensor prefill_lengths, Tensor valid_lengths, float scale, str spec)")
_LIB = torch.library.Library("laqat", "FRAGMENT")
_LIB.define(f"delta_rule_phased{_PHASED_ARGS} -> (Tensor, Tensor)")


def delta_rule_phased(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec):
    """The phased node (a composite op, as ``laqat::delta_rule``): where a gradient can flow,
    ``laqat::delta_rule_phased_train``, which also returns what the variant keeps for its backward (the decode
    suffix's checkpoints); else ``laqat::delta_rule_phased_eval``, which keeps nothing."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state)):
        o, ht, _ = torch.ops.laqat.delta_rule_phased_train(q, k, v, g, beta, initial_state, cu_seqlens,
                                                            prefill_lengths, valid_lengths, scale, spec)
        return o, ht
    return torch.ops.laqat.delta_rule_phased_eval(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths,
                                                  valid_lengths, scale, spec)


_LIB.impl("delta_rule_phased", delta_rule_phased, "CompositeImplicitAutograd")


@torch.library.custom_op("laqat::delta_rule_phased_eval", mutates_args=(),
                         schema=f"{_PHASED_ARGS} -> (Tensor, Tensor)")
def delta_rule_phased_eval(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec):
    check_forward_inputs("delta_rule_phased_eval", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    return pack_outputs(*_variant_for(parsed, q, v).forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                                            prefill_lengths=prefill_lengths,
                                                            valid_lengths=valid_lengths))


@delta_rule_phased_eval.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec):
    return empty_outputs(q, v, cu_seqlens, spec)


@torch.library.custom_op("laqat::delta_rule_phased_train", mutates_args=(),
                         schema=f"{_PHASED_ARGS} -> (Tensor, Tensor, Tensor)")
def delta_rule_phased_train(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale,
                            spec):
    """(o, final_state, residual): the residual is the fp32 buffer the variant keeps for its backward (empty where
    it keeps nothing; kernels/registry.py)."""
    check_forward_inputs("delta_rule_phased_train", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    lengths = dict(prefill_lengths=prefill_lengths, valid_lengths=valid_lengths)
    size = variant.residual_numel(parsed, q, v, cu_seqlens)
    if not size:
        return (*pack_outputs(*variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                               **lengths)), _no_residual(q))
    residual = torch.empty((size,), dtype=torch.float32, device=q.device)
    o, ht = variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, save_to=residual, **lengths)
    return (*pack_outputs(o, ht), residual)


@delta_rule_phased_train.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec):
    parsed = RecurrenceSpec.parse(spec)
    size = _variant_for(parsed, q, v).residual_numel(parsed, q, v, cu_seqlens)
    return (*empty_outputs(q, v, cu_seqlens, spec), q.new_empty((size,), dtype=torch.float32))


@torch.library.custom_op("laqat::delta_rule_phased_backward", mutates_args=())
def delta_rule_phased_backward(
    do: Tensor, dht: Tensor, residual: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    prefill_lengths: Tensor, valid_lengths: Tensor, scale: float, spec: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    parsed = RecurrenceSpec.parse(spec)
    kept = {"saved": residual} if residual.numel() else {}
    return pack_grads(_variant_for(parsed, q, v).backward(
        parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht,
        prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, **kept), (q, k, v, g, beta, initial_state))


@delta_rule_phased_backward.register_fake
def _(do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec):
    return empty_grads(q, k, v, g, beta, initial_state)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.spec = scale, spec


def _backward(ctx, do, dht, _residual_grad):
    q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, residual = ctx.saved_tensors
    if dht is None:
        dht = q.new_zeros(_state_shape(RecurrenceSpec.parse(ctx.spec), _num_sequences(q, cu_seqlens),
                                       v.shape[2], q.shape[-1], v.shape[-1]), dtype=final_state_dtype(q.dtype))
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.laqat.delta_rule_phased_backward(
        do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, ctx.scale,
        ctx.spec)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None, None


delta_rule_phased_train.register_autograd(_backward, setup_context=_setup_context)

DELTA_RULE_PHASED = torch.ops.laqat.delta_rule_phased.default
PHASE_LENGTHS = torch.ops.laqat.phase_lengths.default


def is_delta_rule_phased(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (DELTA_RULE_PHASED, torch.ops.laqat.delta_rule_phased)
