"""Entry chains: what the region does to each input before its first real use.

The region grows backwards over layout ops, casts and multiplications by a Python number
(``rules.py``), and a loop reads its inputs through per-step slices, so an input often enters
its first real use through a chain such as
``beta -> beta * 2.0 -> transpose -> to(float32) -> F.pad`` (OLMo-Hybrid's ``allow_neg_eigval``)
or ``sigmoid(x) -> -5.0 * _ -> to(dtype) -> transpose`` (the KDA lower-bound gate). Layout ops
do not change values; the casts and scalar multiplications do, and the delta rule the region
computes is the one of the *scaled* input (beta in [0, 2], g = -5 sigmoid(x)).

``entry_chains`` follows every frontier tensor forward through such ops and records the value
ops in graph order. The semantic check then compares the region with the delta rule of the
scaled input, and the replacement replays the same ops, in the same order and dtypes, as
ordinary torch ops in front of the IR node: the IR node gets bit for bit what the region's
recurrence read. An input whose uses disagree (one use scaled, another not) has no chain
(``None``): the check then sees the unscaled input and fails, and the region is not rewritten.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from la_compiler.passes.frontends.torch_recurrence import rules
from la_compiler.passes.frontends.torch_recurrence.dataflow import tensor_value

# readers that use a tensor only for its dtype, device or shape (``h0.to(v)``, ``v.new_zeros(...)``)
TEMPLATE_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "type_as", "size", "dim"}
TEMPLATE_FUNCTIONS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
# reshapes: values unchanged, only re-indexed (they are not per-token rules, so they sit inside)
RESHAPE_METHODS = {"reshape", "view", "flatten", "unflatten", "expand", "unsqueeze", "squeeze", "contiguous"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze}
# slices: a step's slice of a scaled input is the scaled slice (``b_t = beta[:, t] * 2.0`` in the loop)
SLICES = {"getitem", "select", "narrow"}


@dataclasses.dataclass(frozen=True)
class EntryChain:
    """The value ops between a frontier tensor and its first real use, in graph order:
    ``("cast", dtype)``, ``("mul", c)``, ``("div", c)``."""

    ops: tuple = ()

    @property
    def factor(self) -> float:
        f = 1.0
        for kind, c in self.ops:
            f = f * c if kind == "mul" else f / c if kind == "div" else f
        return f

    def split_query(self):
        """(replayed, folded) for the query: scalar ops after the last cast fold into the IR's
        ``scale`` (they act in the compute dtype, as the kernel's scale does); the rest is replayed."""
        last = max((i for i, (kind, _) in enumerate(self.ops) if kind == "cast"), default=-1)
        return EntryChain(self.ops[:last + 1]), EntryChain(self.ops[last + 1:])

    def apply_native(self, x):
        """The chain's value ops in their own dtypes, as the replay in front of the IR node runs them."""
        for kind, c in self.ops:
            if kind == "cast":
                x = x.to(c)
            else:
                x = x * c if kind == "mul" else x / c
        return x

    def apply64(self, x):
        """The chain on a float64 probe: casts to fp32 lifted (as the probe lifts the region's),
        casts to bf16 / fp16 rounding, as they do in the probe and in the replay."""
        for kind, c in self.ops:
            if kind == "cast":
                x = x.to(c).double() if c in (torch.bfloat16, torch.float16) else x
            else:
                x = x * c if kind == "mul" else x / c
        return x


IDENTITY = EntryChain()


def _tensor_arg(n: torch.fx.Node):
    a = n.args[0] if n.args else None
    return a if isinstance(a, torch.fx.Node) else None


def _is_template_use(r: torch.fx.Node, x: torch.fx.Node) -> bool:
    if r.op == "call_method" and r.target in TEMPLATE_METHODS:
        return True
    if r.op == "call_function" and r.target in TEMPLATE_FUNCTIONS:
        return True
    # x.to(other) / other.to(x): ``other`` lends only its dtype and device
    name = r.target if r.op == "call_method" else getattr(r.target, "__name__", None)
    return name == "to" and _tensor_arg(r) is not x


def _step(r: torch.fx.Node, x: torch.fx.Node):
    """The value op of chain node ``r`` reading ``x``: () for a pure layout op, a 1-tuple for a
    cast or a scalar multiplication, None when ``r`` is a real use (the chain ends there)."""
    if rules.scalar_operand(r) is not None:
        y, kind, c = rules.scalar_operand(r)
        if y is not x or c == 0.0:
            return None
        return ((kind, c),)
    if _tensor_arg(r) is not x:
        return None
    name = r.target if r.op == "call_method" else getattr(r.target, "__name__", None)
    if name == "unbind" or (name == "getitem" and tensor_value(x) is None):
        return ()  # the per-step items of ``x.unbind(1)``
    reshape = (r.op == "call_method" and r.target in RESHAPE_METHODS) or \
        (r.op == "call_function" and r.target in RESHAPE_FUNCTIONS)
    if not (rules.is_layout(r) or reshape or name in SLICES):
        return None
    vin, vout = tensor_value(x), tensor_value(r)
    if vin is None or vout is None:
        return None
    return (("cast", vout.dtype),) if vout.dtype != vin.dtype else ()


def entry_chain(x: torch.fx.Node, inside: set):
    """The chain of frontier node ``x`` into the region ``inside``: the same value ops on every
    path to a real use, else None. Also returns the chain's nodes."""
    ends, nodes = set(), set()
    stack = [(x, ())]
    while stack:
        cur, ops = stack.pop()
        for r in cur.users:
            if r not in inside or _is_template_use(r, cur):
                continue
            step = _step(r, cur)
            if step is None:
                ends.add(ops)
                continue
            nodes.add(r)
            stack.append((r, ops + step))
    if len(ends) > 1:
        return None, nodes
    return EntryChain(ends.pop() if ends else ()), nodes


def entry_chains(frontier, inside: set) -> tuple[dict, set]:
    """(frontier node -> EntryChain, or None when its uses disagree; every chain node)."""
    chains, nodes = {}, set()
    for x in frontier:
        chains[x], more = entry_chain(x, inside)
        nodes |= more
    return chains, nodes


def replay(emit, node, chain: EntryChain):
    """Emits the chain's value ops on ``node`` (already permuted to the IR layout) with ``emit(op,
    target, args)``; layout ops are the caller's, so only the casts and scalar ops are replayed."""
    for kind, c in chain.ops:
        if kind == "cast":
            if tensor_value(node).dtype != c:
                node = emit("call_method", "to", [node, c])
        else:
            node = emit("call_function", operator.mul if kind == "mul" else operator.truediv, [node, c])
    return node
