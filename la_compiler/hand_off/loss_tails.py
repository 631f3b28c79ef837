"""A loss that overwrites its logits with their gradient, run outside the compiled graph (FLA's in-place
cross-entropy backward).

FLA's causal LMs compute their loss with ``FusedCrossEntropyLoss(inplace_backward=True)``: the backward writes the
logits' gradient into the logits' own storage, so that one [tokens, vocabulary] tensor serves both (500 MiB at 8192
tokens and a vocabulary of 32000 in bf16, docs/memory.md). A compiled graph cannot do that: the graph returns the
logits too, and AOTAutograd refuses a backward that mutates a tensor the forward returned. So the hand-off moves the
loss out of the graph where it is safe to:

- a ``laqat::cross_entropy`` node with ``inplace_backward=True`` reads, through view ops only, a linear output y
  worth handing back (``linear_outputs``'s conditions: the weight a graph input, y needing a gradient, at least
  ``MIN_RATIO`` times larger than its input x);
- y and its views have no other user than those views, the loss node and the graph's outputs (no other part of the
  graph reads the logits, so none can read them after the backward overwrote them).

The nodes computed from y (the views, the loss, its reductions) form the tail. The compiled graph returns y
detached, x and the values the tail reads from the rest of the graph; the tail runs eagerly as an ``fx``
GraphModule on y re-attached through ``LinearOutputFunction``, with ``CrossEntropyInplaceBackward`` in place of the
loss op: the same op forward, the same gradient formula, written into the logits (kernels/fla/cross_entropy_op.py).
The values and gradients are the graph's; as with FLA's loss, the logits returned to the caller hold their gradient
once the backward ran (their version counter moves on, so a backward that saved them too raises autograd's
in-place error instead of reading it).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx

from la_compiler.hand_off.linear_outputs import LinearOutputFunction, linear_output_operands
from la_compiler.kernels.fla.cross_entropy_op import cross_entropy_inplace_backward

CROSS_ENTROPY_TARGETS = (torch.ops.laqat.cross_entropy, torch.ops.laqat.cross_entropy.default)
VIEW_METHODS = ("view", "reshape", "flatten", "view_as", "reshape_as")
VIEW_FUNCTIONS = (torch.reshape, torch.flatten)
INPLACE_BACKWARD_ARG = 7  # laqat::cross_entropy's argument inplace_backward


@dataclasses.dataclass
class LossTail:
    """The graph's outputs ``tail_outputs`` come from ``tail`` (called with y and the head's values ``reads``);
    ``logits_outputs`` are y itself; the compiled head returns the rest (``kept``), then y detached and x."""
    tail: torch.fx.GraphModule
    count: int  # the graph's outputs before
    kept: list[int]
    tail_outputs: list[int]
    logits_outputs: list[int]
    reads: int  # values the head returns for the tail, after y and x
    weight: int
    bias: Optional[int]


def _is_view(node: torch.fx.Node) -> bool:
    return ((node.op == "call_method" and node.target in VIEW_METHODS)
            or (node.op == "call_function" and node.target in VIEW_FUNCTIONS))


def _inplace_cross_entropy(node) -> bool:
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in CROSS_ENTROPY_TARGETS):
        return False
    flag = node.args[INPLACE_BACKWARD_ARG] if len(node.args) > INPLACE_BACKWARD_ARG else \
        node.kwargs.get("inplace_backward", False)
    return flag is True


def _logits_source(node: torch.fx.Node) -> tuple[Optional[torch.fx.Node], list[torch.fx.Node]]:
    """(the node the loss's logits are a view chain of, the chain's nodes)."""
    chain, logits = [], node.args[0]
    while isinstance(logits, torch.fx.Node) and _is_view(logits):
        chain.append(logits)
        logits = logits.args[0]
    return (logits if isinstance(logits, torch.fx.Node) else None), chain


def _descendants(node: torch.fx.Node, output_node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user is not output_node and user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _find(graph: torch.fx.Graph, output_node: torch.fx.Node):
    """(y, its linear operands, the tail's nodes) of the first loss that qualifies; None if none does."""
    for loss in graph.nodes:
        if not _inplace_cross_entropy(loss):
            continue
        y, chain = _logits_source(loss)
        operands = linear_output_operands(graph, y)
        if operands is None:
            continue
        aliases = {y, *chain}
        if any(user not in aliases and user is not loss and user is not output_node
               for alias in aliases for user in alias.users):
            continue
        return y, operands, _descendants(y, output_node)
    return None


def split_loss_tail(gm: torch.fx.GraphModule) -> Optional[LossTail]:
    """Rewrites ``gm`` into the head the module docstring describes; -> the tail, or None (``gm`` unchanged)."""
    graph = gm.graph
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = output_node.args[0]
    if not isinstance(outputs, (tuple, list)):
        return None
    found = _find(graph, output_node)
    if found is None:
        return None
    y, (x, weight, bias), tail_nodes = found
    outputs = list(outputs)
    reads = []
    for node in graph.nodes:
        if node in tail_nodes:
            reads += [a for a in node.all_input_nodes if a is not y and a not in tail_nodes and a not in reads]
    tail_graph = torch.fx.Graph()
    env = {y: tail_graph.placeholder("logits")}
    for i, node in enumerate(reads):
        env[node] = tail_graph.placeholder(f"read_{i}")
    for node in graph.nodes:
        if node in tail_nodes:
            env[node] = tail_graph.node_copy(node, lambda a: env[a])
            if _inplace_cross_entropy(node):
                env[node].target = cross_entropy_inplace_backward
    tail_outputs = [i for i, o in enumerate(outputs) if isinstance(o, torch.fx.Node) and o in tail_nodes]
    tail_graph.output(tuple(env[outputs[i]] for i in tail_outputs))
    tail = torch.fx.GraphModule(gm, tail_graph)

    logits_outputs = [i for i, o in enumerate(outputs) if o is y]
    kept = [i for i in range(len(outputs)) if i not in tail_outputs and i not in logits_outputs]
    with graph.inserting_before(output_node):
        detached = graph.call_method("detach", (y,))
    detached.meta.update(y.meta)
    value = y.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        detached.meta["example_value"] = value.detach()
    output_node.args = ([outputs[i] for i in kept] + [detached, x] + reads,)
    for node in reversed(list(graph.nodes)):
        if node in tail_nodes:
            graph.erase_node(node)
    gm.recompile()
    return LossTail(tail=tail, count=len(outputs), kept=kept, tail_outputs=tail_outputs,
                    logits_outputs=logits_outputs, reads=len(reads), weight=weight, bias=bias)


def with_loss_tail(compiled: Callable, plan: LossTail) -> Callable:
    """``compiled`` (the head's callable, called with the graph's inputs) returning the graph's original outputs."""
    head = len(plan.kept)

    def run(*args):
        weight, bias = args[plan.weight], None if plan.bias is None else args[plan.bias]
        outs = list(compiled(*args))
        y, x, reads = outs[head], outs[head + 1], outs[head + 2:head + 2 + plan.reads]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            y = LinearOutputFunction.apply(x, weight, bias, [y])
        results = [None] * plan.count
        for position, value in zip(plan.kept, outs[:head]):
            results[position] = value
        for position in plan.logits_outputs:
            results[position] = y
        for position, value in zip(plan.tail_outputs, plan.tail(y, *reads)):
            results[position] = value
        return results

    return run
