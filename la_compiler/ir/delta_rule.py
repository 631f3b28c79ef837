"""The laqat IR: one custom op per GDN/KDA recurrence call.

    laqat::delta_rule(q, k, v, g, beta, initial_state?, cu_seqlens?, scale, spec) -> (o, final_state)

(a composite: ``laqat::delta_rule_train`` where a gradient can flow, which also returns the residual the
kernel variant keeps for its backward, else ``laqat::delta_rule_eval``).

Inputs are canonical (docs/architecture.md, "The IR node"): q, k after any l2norm, [B, T, H, K];
v [B, T, HV, V]; g the log-decay after gate activation, [B, T, HV] (GDN) or [B, T, HV, K]
(KDA); beta after its activation, [B, T, HV]; initial_state [N, HV, K, V] (or [N, HV, V, K]
with ``state=vk``), any float dtype. Outputs: o [B, T, HV, V] in q's dtype, final_state
[N, HV, K, V] (or V-first) in fp32 (fp64 for fp64 inputs, which only the fp64 variants take), always
computed. Inputs are checked before any kernel runs (la_compiler/ir/checks.py).

``spec`` is the canonical string of a ``RecurrenceSpec``; its ``kernel=`` field names the
kernel variant (``auto`` = choose by the kernel-selection table at run time). Everything
the frontends and passes know about a node sits in ``node.meta["laqat"]`` as a ``LaqatMeta``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from la_compiler.ir.checks import check_cu_seqlens_values, check_tensors
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.canonical_inputs import final_state_dtype
from la_compiler.kernels.registry import get_variant
from la_compiler.kernels.selection import KernelSelectionError, select_kernel

Tensor = torch.Tensor


@dataclasses.dataclass
class LaqatMeta:
    """What ``node.meta["laqat"]`` holds for every laqat IR node."""

    spec: RecurrenceSpec
    frontend: str  # "fla", "torch", "user"
    module: str  # fully qualified module name ("" at top level)
    region: list[str] = dataclasses.field(default_factory=list)  # what the node replaced
    policy_rules: list[str] = dataclasses.field(default_factory=list)  # which policy rules applied
    kernel_reason: str = ""  # why the lower pass chose spec.kernel
    requested_backend: str | None = None  # a policy's explicit kernel choice
    requested_family: str | None = None  # a policy's `implementation:` ("triton" | "torch")

    @property
    def kind(self) -> str:
        return self.spec.kind


def _num_sequences(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_shape(spec: RecurrenceSpec, n, hv, k_dim, v_dim):
    return (n, hv, v_dim, k_dim) if spec.state == "vk" else (n, hv, k_dim, v_dim)


def _variant_for(spec: RecurrenceSpec, q: Tensor, v: Tensor):
    name = spec.kernel
    if name == "auto":
        name = select_kernel(spec, device=q.device.type, dtype=q.dtype, head_k=q.shape[-1], head_v=v.shape[-1],
                             seq_len=q.shape[1] if isinstance(q.shape[1], int) else None).variant
    variant = get_variant(name)
    why_not = variant.unapplied_numerics(spec)
    if why_not:  # a spec naming its kernel: never run numerics options that kernel ignores
        raise KernelSelectionError(f"spec {spec}: {why_not}")
    return variant


# the arguments of every forward op (one schema: the composite node and the two ops it resolves to)
_FORWARD_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, Tensor? cu_seqlens, "
                 "float scale, str spec)")
_LIB = torch.library.Library("laqat", "FRAGMENT")
_LIB.define(f"delta_rule{_FORWARD_ARGS} -> (Tensor, Tensor)")


def delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    """The IR node (a composite op: graphs and passes see ``laqat::delta_rule``; tracing for autograd and
    running it resolve it here). Where a gradient can flow, ``laqat::delta_rule_train``, which also returns what
    the variant keeps for its backward; else ``laqat::delta_rule_eval``, which keeps nothing."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state)):
        o, ht, _ = torch.ops.laqat.delta_rule_train(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec)
        return o, ht
    return torch.ops.laqat.delta_rule_eval(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec)


_LIB.impl("delta_rule", delta_rule, "CompositeImplicitAutograd")


def check_forward_inputs(op: str, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Before any kernel runs: ranks, dtypes, devices, and the offsets' values (la_compiler/ir/checks.py)."""
    check_tensors(f"laqat::{op}", q, k, v, g, beta, initial_state, cu_seqlens)
    check_cu_seqlens_values(f"laqat::{op}", cu_seqlens, q.shape[1])


@torch.library.custom_op("laqat::delta_rule_eval", mutates_args=(), schema=f"{_FORWARD_ARGS} -> (Tensor, Tensor)")
def delta_rule_eval(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    check_forward_inputs("delta_rule_eval", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    return pack_outputs(*_variant_for(parsed, q, v).forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale))


@torch.library.custom_op("laqat::delta_rule_train", mutates_args=(),
                         schema=f"{_FORWARD_ARGS} -> (Tensor, Tensor, Tensor)")
def delta_rule_train(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    """(o, final_state, residual): the residual is the fp32 buffer the variant keeps for its backward (empty where
    it keeps nothing; kernels/registry.py)."""
    check_forward_inputs("delta_rule_train", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    size = variant.residual_numel(parsed, q, v, cu_seqlens)
    if not size:
        return (*pack_outputs(*variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale)),
                _no_residual(q))
    residual = torch.empty((size,), dtype=torch.float32, device=q.device)
    o, ht = variant.forward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, save_to=residual)
    return (*pack_outputs(o, ht), residual)


def empty_outputs(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], spec: str) -> tuple[Tensor, Tensor]:
    """(o, final_state) of the right shapes and dtypes: the fake implementation of the forward ops."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    shape = _state_shape(RecurrenceSpec.parse(spec), _num_sequences(q, cu_seqlens), HV, K, V)
    return o, q.new_empty(shape, dtype=final_state_dtype(q.dtype))


def _contiguous_like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def empty_grads(q, k, v, g, beta, initial_state) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dbeta, dh0): the fake implementation of the backward ops. Contiguous, in each input's
    dtype, whatever the inputs' strides: what ``pack_grads`` returns."""
    return (*(_contiguous_like(x) for x in (q, k, v, g, beta)),
            _no_state_grad(q) if initial_state is None else _contiguous_like(initial_state))


def _no_state_grad(q: Tensor) -> Tensor:
    """A custom op cannot return None: an empty tensor stands for "no initial state"."""
    return q.new_empty((0,), dtype=torch.float32)


def pack_grads(grads, inputs) -> tuple[Tensor, ...]:
    """A variant's (dq, dk, dv, dg, dbeta, dh0 or None) as a custom op's outputs: contiguous, each in its input's
    dtype (``inputs`` = (q, k, v, g, beta, initial_state)), as ``empty_grads`` states."""
    *grads, dh0 = grads
    *tensors, initial_state = inputs
    packed = [dx.to(x.dtype).contiguous() for dx, x in zip(grads, tensors)]
    if initial_state is None:
        packed.append(_no_state_grad(packed[0]))
    else:
        packed.append(dh0.to(initial_state.dtype).contiguous())
    return tuple(packed)


def pack_outputs(o: Tensor, final_state: Tensor) -> tuple[Tensor, Tensor]:
    """A variant's (o, final_state) as the forward ops return them: contiguous, as ``empty_outputs`` states."""
    return o.contiguous(), final_state.contiguous()


def _no_residual(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


@delta_rule_eval.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    check_tensors("laqat::delta_rule_eval", q, k, v, g, beta, initial_state, cu_seqlens)
    return empty_outputs(q, v, cu_seqlens, spec)


@delta_rule_train.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    check_tensors("laqat::delta_rule_train", q, k, v, g, beta, initial_state, cu_seqlens)
    parsed = RecurrenceSpec.parse(spec)
    size = _variant_for(parsed, q, v).residual_numel(parsed, q, v, cu_seqlens)
    return (*empty_outputs(q, v, cu_seqlens, spec), q.new_empty((size,), dtype=torch.float32))


@torch.library.custom_op("laqat::delta_rule_backward", mutates_args=())
def delta_rule_backward(
    do: Tensor,
    dht: Tensor,
    residual: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    scale: float,
    spec: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    parsed = RecurrenceSpec.parse(spec)
    variant = _variant_for(parsed, q, v)
    kept = {"saved": residual} if residual.numel() else {}
    return pack_grads(variant.backward(parsed, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, **kept),
                      (q, k, v, g, beta, initial_state))


@delta_rule_backward.register_fake
def _(do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, scale, spec):
    return empty_grads(q, k, v, g, beta, initial_state)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, spec = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # else autograd fills a zero gradient of the residual (0.06 ms at 268 MB)
    ctx.scale, ctx.spec = scale, spec


def _backward(ctx, do, dht, _residual_grad):
    q, k, v, g, beta, initial_state, cu_seqlens, residual = ctx.saved_tensors
    if dht is None:
        dht = q.new_zeros(_state_shape(RecurrenceSpec.parse(ctx.spec), _num_sequences(q, cu_seqlens),
                                       v.shape[2], q.shape[-1], v.shape[-1]), dtype=final_state_dtype(q.dtype))
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.laqat.delta_rule_backward(
        do, dht, residual, q, k, v, g, beta, initial_state, cu_seqlens, ctx.scale, ctx.spec)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None


delta_rule_train.register_autograd(_backward, setup_context=_setup_context)

DELTA_RULE = torch.ops.laqat.delta_rule.default


def is_delta_rule(node: torch.fx.Node) -> bool:
    """True for a laqat IR node in a Dynamo graph (torch.ops.laqat.delta_rule, with or without .default)."""
    return node.op == "call_function" and node.target in (DELTA_RULE, torch.ops.laqat.delta_rule)


def node_spec(node: torch.fx.Node) -> RecurrenceSpec:
    return RecurrenceSpec.parse(node.args[8] if len(node.args) > 8 else node.kwargs["spec"])
