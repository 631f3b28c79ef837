"""The dataflow graph of a Dynamo FX graph, as a networkx DiGraph with mutation edges.

FX records ``o[:, t] = x`` as an ``operator.setitem`` node with no users: the write is a
mutation-only dependency. Here every in-place write to a tensor becomes an edge from the
writing node to every later reader of that tensor (its base node), so that reachability
and "who reads this value" queries see the data that really flows.
"""
from __future__ import annotations

import operator

import torch

INPLACE_WRITERS = {operator.setitem}  # call_function targets that write into args[0]


def value(node):
    """The example value (a fake tensor, a tuple, a scalar) Dynamo recorded for ``node``."""
    if not isinstance(node, torch.fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_value(node):
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def is_inplace_write(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in INPLACE_WRITERS:
        return True
    return node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_") \
        and node.target not in ("requires_grad_",) and bool(node.users) is False


def written_base(node: torch.fx.Node):
    """The node whose tensor an in-place write mutates."""
    base = node.args[0]
    return base if isinstance(base, torch.fx.Node) else None


class Dataflow:
    """Positions, users with mutation edges, and the networkx DiGraph of one FX graph."""

    def __init__(self, gm: torch.fx.GraphModule):
        import networkx as nx

        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(self.nodes)
        self.writers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        latest_write: dict[torch.fx.Node, torch.fx.Node] = {}
        edges = []
        for n in self.nodes:
            writes = is_inplace_write(n)
            for a in n.all_input_nodes:
                edges.append((a, n))
                if not writes and a in latest_write:
                    edges.append((latest_write[a], n))  # reads the mutated tensor
            if writes:
                base = written_base(n)
                if base is not None:
                    if base in latest_write:  # writes to one tensor stay ordered (and reach its readers)
                        edges.append((latest_write[base], n))
                    latest_write[base] = n
                    self.writers.setdefault(base, []).append(n)
        self.graph.add_edges_from(edges)
        # pure nodes nobody reads (Dynamo keeps e.g. a zeros state that a later branch replaces)
        self.dead: set = set()
        for n in reversed(self.nodes):
            if n.op in ("call_function", "call_method") and all(r in self.dead for r in self.graph.successors(n)) \
                    and not is_inplace_write(n) and not n.is_impure():
                self.dead.add(n)

    def readers(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Every live node that reads ``node``'s value, including through a mutation it undergoes."""
        return [r for r in self.graph.successors(node) if r not in self.dead]

    def dead_readers(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return [r for r in self.graph.successors(node) if r in self.dead]

    def reaches(self, src: torch.fx.Node, dst: torch.fx.Node, limit: int = 64) -> bool:
        """Whether ``dst`` depends on ``src``, looking back at most ``limit`` nodes from ``dst``."""
        lo = self.pos[src]
        seen, stack = {dst}, [dst]
        while stack and len(seen) <= limit:
            n = stack.pop()
            if n is src:
                return True
            for a in self.graph.predecessors(n):
                if a not in seen and self.pos[a] >= lo:
                    seen.add(a)
                    stack.append(a)
        return False
