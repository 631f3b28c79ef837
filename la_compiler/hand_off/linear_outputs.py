"""Graph outputs that a linear layer computes, handed back through their own autograd node.

AOTAutograd runs a compiled graph as one autograd node with one output per graph output, and autograd hands such a
node a zero tensor for every output that received no gradient in the backward. A causal LM's training step returns
its loss and its logits; the loss is differentiated and the logits, mostly, are not: the compiled step's backward
starts by allocating a zero gradient of the logits' size ([tokens, vocabulary]: 500 MiB at 8192 tokens and a
vocabulary of 32000 in bf16, docs/memory.md), which the uncompiled model never allocates (its logits come from the
head's matmul, a node with that one output).

Under the Inductor hand-off, every graph output ``y = linear(x, weight, bias)`` whose weight (and bias) are graph
inputs, that needs a gradient and that is at least ``MIN_RATIO`` times larger than x leaves the compiled graph
detached, and x leaves beside it. The compiled callable returns y through ``LinearOutputFunction``, whose backward
is the linear's (dx = dy weight, dweight = dy^T x, dbias = the sum of dy): it runs only when a gradient reaches y,
and x's gradient flows back into the compiled graph's backward like any output's. What autograd may materialize
then is x's zero gradient, ``MIN_RATIO`` or more times smaller. The values, the gradients and what the graph
computes are unchanged; the output's ``grad_fn`` is ``LinearOutputFunctionBackward``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx

from la_compiler.options import LINEAR_OUTPUT_MIN_RATIO as MIN_RATIO  # output elements per input element, at least
LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclasses.dataclass(frozen=True)
class LinearOutput:
    """Graph output ``output`` is ``linear(x, weight, bias)``; x is the compiled graph's extra output ``extra``."""
    output: int
    extra: int
    weight: int  # the graph input's position
    bias: Optional[int]


class LinearOutputFunction(torch.autograd.Function):
    """y as it is, differentiable as ``linear(x, weight, bias)``; nothing to do where no gradient reaches y. y comes
    in a box, not as an input: an input returned from ``forward`` would be a view, which forbids in-place ops on the
    output that the compiled graph's output allowed."""
    @staticmethod
    def forward(ctx, x, weight, bias, box: list):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.set_materialize_grads(False)
        return box.pop()

    @staticmethod
    def backward(ctx, dy):
        """In y's dtype, each gradient returned in its input's: under autocast the linear computed in the autocast
        dtype from x, weight and bias cast to it, and autocast's casts hand each gradient back in its input's dtype
        (the backward runs outside autocast)."""
        if dy is None:
            return None, None, None, None
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx = (dy @ weight.to(dy.dtype)).to(x.dtype) if needs[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dweight = (dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype) if needs[1] else None
        dbias = dy2.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and needs[2] else None
        return dx, dweight, dbias, None


def _placeholder_index(graph: torch.fx.Graph, node) -> Optional[int]:
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    return [n for n in graph.nodes if n.op == "placeholder"].index(node)


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def linear_output_operands(graph: torch.fx.Graph, node) -> Optional[tuple]:
    """(x, weight index, bias index) where ``node`` is a linear whose output is worth handing back; else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    x, weight, bias = args[0], args[1], args[2]
    weight_index = _placeholder_index(graph, weight)
    bias_index = _placeholder_index(graph, bias) if bias is not None else None
    y, xv = _value(node), _value(x)
    if (weight_index is None or (bias is not None and bias_index is None) or not isinstance(x, torch.fx.Node)
            or not isinstance(y, torch.Tensor) or not isinstance(xv, torch.Tensor) or not y.requires_grad):
        return None
    if y.numel() < MIN_RATIO * xv.numel():
        return None
    return x, weight_index, bias_index


def hand_back_linear_outputs(graph: torch.fx.GraphModule, positions: Optional[frozenset] = None
                             ) -> tuple[list[LinearOutput], int]:
    """Rewrites ``graph`` in place as the module docstring says, for the outputs at ``positions`` (None: any); -> the
    outputs handed back and the graph's count of outputs before (an empty list: ``graph`` unchanged)."""
    g = graph.graph
    output_node = next(n for n in reversed(g.nodes) if n.op == "output")
    outputs = output_node.args[0]
    if not isinstance(outputs, (tuple, list)):
        return [], 0
    outputs = list(outputs)
    count = len(outputs)
    plan: list[LinearOutput] = []
    seen = set()
    for i, node in enumerate(outputs[:count]):
        if positions is not None and i not in positions:
            continue
        found = linear_output_operands(g, node)
        if found is None or node in seen or outputs.count(node) > 1:
            continue
        seen.add(node)
        x, weight_index, bias_index = found
        with g.inserting_before(output_node):
            detached = g.call_method("detach", (node,))
        detached.meta.update(node.meta)
        if isinstance(_value(node), torch.Tensor):
            detached.meta["example_value"] = _value(node).detach()
        outputs[i] = detached
        outputs.append(x)
        plan.append(LinearOutput(output=i, extra=len(outputs) - 1, weight=weight_index, bias=bias_index))
    if not plan:
        return [], 0
    output_node.args = (type(output_node.args[0])(outputs),)
    graph.recompile()
    return plan, count


def with_linear_outputs(compiled: Callable, plan: list[LinearOutput], count: int) -> Callable:
    """``compiled`` (Inductor's callable of a graph ``hand_back_linear_outputs`` rewrote, called with the graph's
    inputs as arguments) returning the graph's original outputs."""
    def run(*args):
        weights = [(args[p.weight], None if p.bias is None else args[p.bias]) for p in plan]
        outs = list(compiled(*args))
        extras = outs[count:]
        del outs[count:]
        for p, (weight, bias) in zip(plan, weights):
            x = extras[p.extra - count]
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
                outs[p.output] = LinearOutputFunction.apply(x, weight, bias, [outs[p.output]])
        return outs

    return run
