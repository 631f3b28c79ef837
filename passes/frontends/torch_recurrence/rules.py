"""Which nodes around a recurrence belong to it: the frontier rules, as data.

The region grows backwards from the loop over nodes whose every reader is already in the
region. A *per-token* node (a tensor with a sequence dim, rank <= 4) joins only when it is
one of the operations below; anything else (an l2norm, an activation, a projection, a head
split) stops the growth and becomes an input of the IR node. Nodes that are not per-token
(chunked intermediates, masks, eye, zeros) always join: only the recurrence reads them.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

# per-token layout and dtype changes: f(x) is x re-indexed, re-typed or padded on the time dim
LAYOUT_METHODS = {
    "transpose", "permute", "contiguous", "to", "float", "double", "half", "bfloat16", "type", "clone",
    "unsqueeze", "squeeze", "repeat_interleave",  # grouped heads: head j of HV reads head j // G
}
LAYOUT_FUNCTIONS = {
    torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.clone, torch.repeat_interleave,
    F.pad, torch._C._nn.pad,  # zero padding of T to a chunk multiple
}
# x * c, x / c with a Python number c: the query scale, folded into the IR's `scale`
SCALAR_OPS = {operator.mul: "mul", torch.mul: "mul", "mul": "mul", operator.truediv: "div", torch.div: "div",
              "div": "div"}
# x * y of two per-token tensors where neither is computed from the other: v * beta, k * beta
# (an l2norm x * rsqrt(sum(x * x)) reads x on both sides and stops here)
PAIR_MULS = {operator.mul, torch.mul, "mul"}


def op_key(node: torch.fx.Node):
    return node.target if node.op == "call_function" else node.target if node.op == "call_method" else None


def is_layout(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in LAYOUT_METHODS
    if node.op != "call_function":
        return False
    if node.target in LAYOUT_FUNCTIONS:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(it is None or it is Ellipsis or it == slice(None) for it in index)
    return False


def scalar_operand(node: torch.fx.Node):
    """For x * c or x / c with a Python number c: (x, "mul"|"div", c); else None."""
    kind = SCALAR_OPS.get(op_key(node))
    if kind is None or len(node.args) != 2:
        return None
    x, c = node.args
    if kind == "mul" and isinstance(x, (int, float)) and isinstance(c, torch.fx.Node):
        x, c = c, x
    if isinstance(x, torch.fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
        return x, kind, float(c)
    return None


def is_pair_mul(node: torch.fx.Node) -> bool:
    return op_key(node) in PAIR_MULS and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args)


def is_time_unbind(node: torch.fx.Node) -> bool:
    """x.unbind(d): the tuple of per-step slices a ``for x_t in x.unbind(1)`` loop reads."""
    return node.op in ("call_method", "call_function") and getattr(node.target, "__name__", node.target) == "unbind"
