"""Recurrences written with ``torch._higher_order_ops.scan``: the scan unrolled into the outer graph for the analysis.

Dynamo records ``scan(step, init, xs, dim=d)`` as one ``torch.ops.higher_order.scan`` node over a subgraph (the
step) with ``xs`` moved to dim 0. ``unroll_scans`` copies the step once per index ``t`` in front of the scan, each
copy reading ``x[t]`` of every scanned input and the carries of the copy before; the per-step outputs are
stacked on dim 0. That is the graph a Python loop ``for t in range(T)`` over the same step gives Dynamo, so the
loop analysis finds the recurrence as it finds a hand-written loop. ``restore_scans`` then settles each scan:
where the unrolled copy was rewritten into the IR node the scan leaves the graph; where it was not, the scan's
readers read the scan again and the copy is erased (a scan that is no recurrence costs compile time only).

Only scans that carry a floating tensor of rank >= 3 (a state) are unrolled, at a fixed length: a symbolic
length is pinned to its value like a Python loop's trip count (each length its own compile), except where the
user marked it dynamic (``mark_dynamic``) or where it exceeds ``MAX_STEPS``: then a near miss says so.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import (resolved_expr, sizes_marked_dynamic, static_int,
                                                                  tensor_value)
from la_compiler.record import GraphRecord, NearMiss
from torch.fx.experimental.symbolic_shapes import guard_int
from la_compiler.passes.frontends.torch_recurrence.allowed_ops import where_from
from la_compiler.passes.module_names import module_name

SCAN = torch.ops.higher_order.scan
MAX_STEPS = 1024  # the analysis grows with the unrolled graph (a step of ~20 nodes: 20k nodes at this length)
STEP_OPS = ("placeholder", "call_function", "call_method", "output")
COPIED_META = ("example_value", "stack_trace", "source_fn_stack")


@dataclasses.dataclass
class UnrolledScan:
    scan: torch.fx.Node
    values: dict  # each reader of the scan's results (a getitem) -> the unrolled node that now stands for it
    users: dict  # each reader -> the nodes that read it before the unrolling
    nodes: list  # every node of the unrolled copy, in graph order


def unroll_scans(gm: torch.fx.GraphModule, record: GraphRecord) -> list[UnrolledScan]:
    """Every scan of the graph that carries a state, unrolled in front of it (the scan stays, unread)."""
    unrolled = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SCAN or not _carries_a_state(node):
            continue
        steps, why = (0, _not_unrollable(gm, node))
        if not why:  # the length is pinned only for a scan that can be unrolled
            steps, why = _length(gm, node)
        if why:
            record.near_misses.append(NearMiss(frontend="torch", module=module_name(node), nodes=(node.name,),
                                               reason=f"the scan at {_where(node)} is not analysed: {why}"))
        elif steps >= 2:
            unrolled.append(_unroll(gm, node, steps))
    return unrolled


def restore_scans(gm: torch.fx.GraphModule, unrolled: list[UnrolledScan]) -> None:
    """A scan whose unrolled copy became an IR node leaves the graph; any other scan is read again, and its copy
    leaves."""
    for scan in unrolled:
        alive = set(gm.graph.nodes)
        if any(v in alive for v in scan.values.values()):
            _put_back(gm, scan, alive)
        else:
            _erase_scan(gm, scan, alive)


def _carries_a_state(node: torch.fx.Node) -> bool:
    return any((v := tensor_value(c)) is not None and v.dim() >= 3 and v.dtype.is_floating_point
               for c in node.args[1])


def _length(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, str]:
    """The number of steps, pinned by a guard where it is symbolic and the scan is unrolled; or a reason not to
    unroll."""

    xs = node.args[2]
    if not xs or tensor_value(xs[0]) is None:
        return 0, "it scans no tensor"
    size = tensor_value(xs[0]).shape[0]
    symbolic = isinstance(size, torch.SymInt) and not getattr(resolved_expr(size), "is_Integer", False)
    if symbolic:
        marked = sizes_marked_dynamic(gm.graph.nodes)
        named = sorted({marked[s] for s in resolved_expr(size).free_symbols if s in marked})
        if named:
            return 0, (f"its length is marked dynamic ({', '.join(named)}): a scan is unrolled at a fixed length "
                       f"(one compile per length); mark it with torch._dynamo.maybe_mark_dynamic, or not at all")
    length = static_int(size)
    if length is None:
        return 0, "its length has no value at compile time"
    if length > MAX_STEPS:
        return 0, f"it has {length} steps; scans of at most {MAX_STEPS} steps are unrolled for the analysis"
    if symbolic and length >= 2:
        guard_int(size)
    return length, ""


def _not_unrollable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """Why the scan's step cannot be copied into the outer graph ("" where it can)."""
    step = _step_graph(gm, node)
    if step is None:
        return "its step function is not a graph of this module"
    for n in step.graph.nodes:
        if n.op not in STEP_OPS:
            return f"its step holds a {n.op} node ({n.name})"
        if isinstance(n.target, torch._ops.HigherOrderOperator):
            return f"its step holds another higher-order op ({n.target.name()})"
        if n.op != "output" and "example_value" not in n.meta:
            return f"its step's node {n.name} has no example value"
    if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
        return "its results are read other than one by one"
    return ""


def _step_graph(gm: torch.fx.GraphModule, node: torch.fx.Node):
    fn = node.args[0]
    target = getattr(gm, fn.target, None) if isinstance(fn, torch.fx.Node) and fn.op == "get_attr" else None
    return target if isinstance(target, torch.fx.GraphModule) else None


def _unroll(gm: torch.fx.GraphModule, node: torch.fx.Node, steps: int) -> UnrolledScan:
    step = _step_graph(gm, node)
    init, xs, extra = (list(a) for a in node.args[1:4])
    inputs = [n for n in step.graph.nodes if n.op == "placeholder"]
    results = list(step.graph.output_node().args[0])
    copy = _Copier(gm, node)
    carries, outputs = init, [[] for _ in results[len(init):]]
    for t in range(steps):
        env = dict(zip(inputs, carries))
        for p, x in zip(inputs[len(init):], xs):  # step t reads x[t], on the scan's line
            env[p] = copy.emit("call_function", operator.getitem, (x, t), {}, meta_from=p, line_from=node)
        env.update(zip(inputs[len(init) + len(xs):], extra))
        for n in step.graph.nodes:
            if n.op in ("call_function", "call_method"):
                args, kwargs = torch.fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = copy.emit(n.op, n.target, args, kwargs, meta_from=n, line_from=n)
        step_results = [env[r] if isinstance(r, torch.fx.Node) else r for r in results]
        carries = step_results[:len(init)]
        for collected, y in zip(outputs, step_results[len(init):]):
            collected.append(y)
    values, users = {}, {}
    for reader in node.users:
        i = reader.args[1]
        values[reader] = carries[i] if i < len(init) else \
            copy.emit("call_function", torch.stack, (outputs[i - len(init)], 0), {}, meta_from=reader, line_from=node)
        users[reader] = list(reader.users)
    for reader, unrolled in values.items():
        reader.replace_all_uses_with(unrolled)
    return UnrolledScan(node, values, users, copy.created)


class _Copier:
    """Creates the unrolled nodes in front of the scan, each with the example value of the node it stands for, a
    source line, and the scan's module."""

    def __init__(self, gm: torch.fx.GraphModule, scan: torch.fx.Node):
        self.graph, self.scan, self.created = gm.graph, scan, []

    def emit(self, op: str, target, args: tuple, kwargs: dict, *, meta_from: torch.fx.Node,
             line_from: torch.fx.Node) -> torch.fx.Node:
        with self.graph.inserting_before(self.scan):
            new = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        for key in COPIED_META:
            if key in meta_from.meta:
                new.meta[key] = meta_from.meta[key]
        if "stack_trace" in line_from.meta:
            new.meta["stack_trace"] = line_from.meta["stack_trace"]
        if "nn_module_stack" in self.scan.meta:
            new.meta["nn_module_stack"] = self.scan.meta["nn_module_stack"]
        self.created.append(new)
        return new


def _put_back(gm: torch.fx.GraphModule, scan: UnrolledScan, alive: set) -> None:
    for reader, unrolled in scan.values.items():
        for user in scan.users[reader]:
            if user in alive:
                user.replace_input_with(unrolled, reader)
    for n in reversed(scan.nodes):
        if n in alive and not n.users:
            gm.graph.erase_node(n)


def _erase_scan(gm: torch.fx.GraphModule, scan: UnrolledScan, alive: set) -> None:
    for n in reversed(scan.nodes):
        if n in alive and not n.users:
            gm.graph.erase_node(n)
    fn = scan.scan.args[0]
    for reader in scan.values:
        gm.graph.erase_node(reader)
    gm.graph.erase_node(scan.scan)
    if isinstance(fn, torch.fx.Node) and not fn.users:
        target = fn.target
        gm.graph.erase_node(fn)
        gm.delete_submodule(target)


def _where(node: torch.fx.Node) -> str:
    return where_from(node)

