"""The decode-phase IR: a laqat node whose sequences split into a prefix and a decode suffix.

    laqat::phase_lengths(q, cu_seqlens?) -> (prefill_lengths, valid_lengths)     int32 [N], on q's device
    laqat::delta_rule_phased(q, k, v, g, beta, initial_state?, cu_seqlens?,
                             prefill_lengths, valid_lengths, scale, spec, A_log?, dt_bias?) -> (o, final_state)

(a composite, as ``laqat::delta_rule``: ``laqat::delta_rule_phased_train`` where a gradient can flow, which also
returns the residual the kernel variant keeps for its backward, else ``laqat::delta_rule_phased_eval``).

With ``A_log`` the node takes its gate raw: ``g`` is KDA's gate projection [B, T, HV, K] in the model's dtype and
the node's log-decay is ``-exp(A_log) * softplus(g + dt_bias)`` per key channel, computed inside (a KDA serving
profile only: vLLM's prefill sums that product inside its chunk cumsum, docs/serving.md, "The server's
pre-processing"); the backward returns the gradients of the raw gate, A_log and dt_bias.

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

from la_compiler.ir.checks import IRInputError
from la_compiler.ir.delta_rule import (_no_residual, _no_state_grad, _num_sequences, _state_shape, _variant_for,
                                       check_forward_inputs, empty_grads, empty_outputs, pack_grads, pack_outputs)
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
                "Tensor prefill_lengths, Tensor valid_lengths, float scale, str spec, Tensor? A_log=None, "
                "Tensor? dt_bias=None)")
_LIB = torch.library.Library("laqat", "FRAGMENT")
_LIB.define(f"delta_rule_phased{_PHASED_ARGS} -> (Tensor, Tensor)")


def delta_rule_phased(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec,
                      A_log=None, dt_bias=None):
    """The phased node (a composite op, as ``laqat::delta_rule``): where a gradient can flow,
    ``laqat::delta_rule_phased_train``, which also returns what the variant keeps for its backward (the decode
    suffix's checkpoints); else ``laqat::delta_rule_phased_eval``, which keeps nothing."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state, A_log, dt_bias)):
        o, ht, _ = torch.ops.laqat.delta_rule_phased_train(q, k, v, g, beta, initial_state, cu_seqlens,
                                                            prefill_lengths, valid_lengths, scale, spec, A_log,
                                                            dt_bias)
        return o, ht
    return torch.ops.laqat.delta_rule_phased_eval(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths,
                                                  valid_lengths, scale, spec, A_log, dt_bias)


_LIB.impl("delta_rule_phased", delta_rule_phased, "CompositeImplicitAutograd")


def _raw_gate(op: str, parsed: RecurrenceSpec, variant, g, A_log, dt_bias) -> dict:
    """The variant's keyword for a raw gate (``gate=(A_log, dt_bias)``), {} without one; refuses a raw gate where
    the variant or the kind takes none."""
    if A_log is None:
        if dt_bias is not None:
            raise IRInputError(f"laqat::{op}: dt_bias is given without A_log (a raw gate needs A_log)")
        return {}
    if parsed.kind != "kda" or not variant.raw_gate:
        raise IRInputError(f"laqat::{op}: A_log (a raw gate) is given, but kernel variant {variant.name!r} of a "
                           f"{parsed.kind} node takes its log-decay computed (only a KDA serving profile's "
                           f"decode_serving computes it)")
    HV, K = g.shape[2], g.shape[3] if g.dim() == 4 else None
    if g.dim() != 4 or A_log.numel() != HV or (dt_bias is not None and dt_bias.numel() != HV * K):
        raise IRInputError(f"laqat::{op}: a raw KDA gate needs g [B, T, HV, K], A_log of HV and dt_bias of HV * K "
                           f"elements; got g {tuple(g.shape)}, A_log {tuple(A_log.shape)}, dt_bias "
                           f"{None if dt_bias is None else tuple(dt_bias.shape)}")
    return {"gate": (A_log, dt_bias)}


@torch.library.custom_op("laqat::delta_rule_phased_eval", mutates_args=(),
                         schema=f"{_PHASED_ARGS} -> (Tensor, Tensor)")
def delta_rule_phased_eval(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec,
                           A_log=None, dt_bias=None):
    check_forward_inputs("delta_rule_phased_eval", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    gate = _raw_gate("delta_rule_phased_eval", parsed, variant, g, A_log, dt_bias)
    return pack_outputs(*variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                         prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, **gate))


@delta_rule_phased_eval.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec, A_log=None,
      dt_bias=None):
    return empty_outputs(q, v, cu_seqlens, spec)


@torch.library.custom_op("laqat::delta_rule_phased_train", mutates_args=(),
                         schema=f"{_PHASED_ARGS} -> (Tensor, Tensor, Tensor)")
def delta_rule_phased_train(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale,
                            spec, A_log=None, dt_bias=None):
    """(o, final_state, residual): the residual is the fp32 buffer the variant keeps for its backward (empty where
    it keeps nothing; kernels/registry.py)."""
    check_forward_inputs("delta_rule_phased_train", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    kwargs = dict(prefill_lengths=prefill_lengths, valid_lengths=valid_lengths,
                  **_raw_gate("delta_rule_phased_train", parsed, variant, g, A_log, dt_bias))
    size = variant.residual_numel(parsed, q, v, cu_seqlens)
    if not size:
        return (*pack_outputs(*variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                               **kwargs)), _no_residual(q))
    residual = torch.empty((size,), dtype=torch.float32, device=q.device)
    o, ht = variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, save_to=residual, **kwargs)
    return (*pack_outputs(o, ht), residual)


@delta_rule_phased_train.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec, A_log=None,
      dt_bias=None):
    parsed = RecurrenceSpec.parse(spec)
    size = _variant_for(parsed, q, v).residual_numel(parsed, q, v, cu_seqlens)
    return (*empty_outputs(q, v, cu_seqlens, spec), q.new_empty((size,), dtype=torch.float32))


@torch.library.custom_op("laqat::delta_rule_phased_backward", mutates_args=())
def delta_rule_phased_backward(
    do: Tensor, dht: Tensor, residual: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    prefill_lengths: Tensor, valid_lengths: Tensor, scale: float, spec: str, A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias); an empty tensor for an input that is None."""
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    kept = {"saved": residual} if residual.numel() else {}
    gate = _raw_gate("delta_rule_phased_backward", parsed, variant, g, A_log, dt_bias)
    grads = variant.backward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht,
                             prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, **kept, **gate)
    return (*pack_grads(grads[:6], (q, k, v, g, beta, initial_state)),
            *_gate_grads(grads[6:], q, A_log, dt_bias))


def _gate_grads(grads, q, A_log, dt_bias) -> tuple[Tensor, Tensor]:
    """(dA_log, ddt_bias), each contiguous in its input's dtype and shape, an empty tensor for an absent input."""
    grads = list(grads) or [None, None]
    return tuple(_no_state_grad(q) if x is None else grad.reshape(x.shape).to(x.dtype).contiguous()
                 for grad, x in zip(grads, (A_log, dt_bias)))


@delta_rule_phased_backward.register_fake
def _(do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec,
      A_log=None, dt_bias=None):
    return (*empty_grads(q, k, v, g, beta, initial_state),
            *(_no_state_grad(q) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)
              for x in (A_log, dt_bias)))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, scale, spec, A_log,
     dt_bias) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, output[2],
                          A_log, dt_bias)
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.spec = scale, spec


def _backward(ctx, do, dht, _residual_grad):
    q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, residual, A_log, dt_bias = (
        ctx.saved_tensors)
    if dht is None:
        dht = q.new_zeros(_state_shape(RecurrenceSpec.parse(ctx.spec), _num_sequences(q, cu_seqlens),
                                       v.shape[2], q.shape[-1], v.shape[-1]), dtype=final_state_dtype(q.dtype))
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = torch.ops.laqat.delta_rule_phased_backward(
        do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, prefill_lengths, valid_lengths, ctx.scale,
        ctx.spec, A_log, dt_bias)
    present = lambda grad, x: grad if x is not None else None  # noqa: E731
    return (dq, dk, dv, dg, dbeta, present(dh0, initial_state), None, None, None, None, None,
            present(dA_log, A_log), present(ddt_bias, dt_bias))


delta_rule_phased_train.register_autograd(_backward, setup_context=_setup_context)

DELTA_RULE_PHASED = torch.ops.laqat.delta_rule_phased.default
PHASE_LENGTHS = torch.ops.laqat.phase_lengths.default


def is_delta_rule_phased(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (DELTA_RULE_PHASED, torch.ops.laqat.delta_rule_phased)
