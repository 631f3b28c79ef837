"""The dataflow graph of a Dynamo FX graph, as a networkx DiGraph with mutation edges.

FX records ``o[:, t] = x`` as an ``operator.setitem`` node with no users: the write is a
mutation-only dependency. Here every in-place write to a tensor becomes an edge from the
writing node to every later reader of that tensor (its base node), so that reachability
and "who reads this value" queries see the data that really flows.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx.experimental.symbolic_shapes import guard_bool, guard_float, guard_int

INPLACE_WRITERS = {operator.setitem}  # call_function targets that write into args[0]


def value(node):
    """The example value (a fake tensor, a tuple, a scalar) Dynamo recorded for ``node``."""
    if not isinstance(node, torch.fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_value(node):
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def static_int(size):
    """A size as an int: an int, a symbolic size that Dynamo has specialized to a constant, or else the example
    value's size (its hint: an automatic-dynamic sequence length; ``specialize`` pins it before a loop is
    analysed); None where there is none."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = resolved_expr(size)
        if getattr(expr, "is_Integer", False):
            return int(expr)
        if size.node.has_hint():
            return int(size.node.hint)
    return None


def fold_symbolic_scalars(gm: torch.fx.GraphModule) -> int:
    """Every symbolic scalar (``q.size(3) ** -0.5`` under ``dynamic=True``: Dynamo emits it once, in the first step
    that needs it; a size Dynamo passes as a graph input, read by ``torch.zeros(s0, s1, ...)`` or ``F.pad``) replaced
    in its readers by its example value, pinned by a guard: the steps of an unrolled loop then read the same
    literal, and the region reads tensors only, as with static shapes. Returns how many."""

    pin = {torch.SymInt: guard_int, torch.SymFloat: guard_float, torch.SymBool: guard_bool}
    done = 0
    for n in list(gm.graph.nodes):
        v = value(n)
        if type(v) not in pin or not n.users or not v.node.has_hint():
            continue
        constant = pin[type(v)](v)
        for user in list(n.users):
            user.args = torch.fx.node.map_arg(user.args, lambda a: constant if a is n else a)
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: constant if a is n else a)
        done += 1
    # the scalar computations nobody reads any more (and the size() calls they read) leave the graph, so that the
    # steps' windows hold the same nodes
    for n in reversed(list(gm.graph.nodes)):
        if n.op in ("call_function", "call_method") and not n.users and tensor_value(n) is None \
                and not is_inplace_write(n) and not n.is_impure():
            gm.graph.erase_node(n)
    return done


def specialize(nodes) -> None:
    """Pins every symbolic size of these nodes' example values to its example value (a guard: the compiled graph
    then runs for those sizes only, and Dynamo recompiles for others). An unrolled Python loop is specialized to
    its trip count already; the sizes its region reads are pinned too, so that the analysis and the replacement
    see plain ints."""

    for n in nodes:
        v = tensor_value(n)
        if v is None or not any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride())):
            continue
        if not all(x.node.has_hint() for x in (*v.shape, *v.stride()) if isinstance(x, torch.SymInt)):
            continue
        shape = [guard_int(x) if isinstance(x, torch.SymInt) else x for x in v.shape]
        stride = [guard_int(x) if isinstance(x, torch.SymInt) else x for x in v.stride()]
        with v.fake_mode if getattr(v, "fake_mode", None) is not None else contextlib.nullcontext():
            static = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device,
                                         requires_grad=v.requires_grad)
        key = "example_value" if "example_value" in n.meta else "val"
        n.meta[key] = static


def sizes_marked_dynamic(nodes) -> dict:
    """The sizes the user marked dynamic with ``torch._dynamo.mark_dynamic`` that are still symbolic: their sympy
    symbol -> where they come from (``L['q'].size()[0]``). Dynamo refuses a compile that pins one of them
    (ConstraintViolationError), so ``specialize`` must not."""
    marked = {}
    for n in nodes:
        arg = n.meta.get("grapharg") if n.op == "placeholder" else None
        fake, example = tensor_value(n), _graph_arg_example(arg)
        if fake is None or example is None:
            continue
        for d in sorted(getattr(example, "_dynamo_dynamic_indices", ())):
            size = fake.shape[d] if d < fake.dim() else None
            if isinstance(size, torch.SymInt) and not getattr(resolved_expr(size), "is_Integer", False):
                for symbol in resolved_expr(size).free_symbols:
                    marked.setdefault(symbol, f"{arg.source.name}.size()[{d}]")
    return marked


def symbols_of(value) -> set:
    """The sympy symbols of a tensor's symbolic sizes and strides."""
    return {sym for x in (*value.shape, *value.stride()) if isinstance(x, torch.SymInt)
            for sym in resolved_expr(x).free_symbols}


def resolved_expr(size: torch.SymInt):
    """A symbolic size's sympy expression after the replacements its shape environment knows (an Integer where
    Dynamo has specialized it)."""
    node = size.node
    return node.shape_env.replace(node.expr) if getattr(node, "shape_env", None) is not None else node.expr


def _graph_arg_example(arg):
    """The real tensor Dynamo lifted into a placeholder (``mark_dynamic`` marks it), or None."""
    try:
        example = arg.example if arg is not None else None
    except Exception:  # a graph argument whose example tensor is gone
        return None
    return example if isinstance(example, torch.Tensor) else None


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
