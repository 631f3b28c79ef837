"""In-place state updates, made functional: ``S.mul_(decay); S.add_(k u^T)`` -> ``S1 = S * decay``...

Dynamo records ``S.mul_(d)`` as a ``mul_`` node with no users; later reads of ``S`` name the
same node, so every step reads one unchanging node and the loop carries no visible value.
``functionalize_inplace`` rewrites such a chain into out-of-place ops (``mul_`` -> ``mul``,
``clamp_`` -> ``clamp``, ...) and points every later read at the latest version, so that the
loop analysis sees the carried state and the op check (``allowed_ops.py``) sees what each step
does (a ``clamp_`` is then refused by name, with ``node.meta["laqat_inplace"]`` naming the
original in-place method).

The rewrite is applied only where it provably computes the same values: the mutated tensor is
freshly allocated in the graph (a clone, a factory, an out-of-place arithmetic result: never a
graph input or a possible alias of one), it is mutated only by these methods called on it
directly, and no view of it is read after a later mutation.
"""
from __future__ import annotations

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import tensor_value
import operator

FUNCTIONAL = {  # in-place method -> its out-of-place twin
    "mul_": "mul", "add_": "add", "sub_": "sub", "div_": "div", "neg_": "neg", "exp_": "exp",
    "clamp_": "clamp", "clamp_min_": "clamp_min", "clamp_max_": "clamp_max", "clip_": "clip",
    "nan_to_num_": "nan_to_num", "masked_fill_": "masked_fill", "abs_": "abs", "tanh_": "tanh",
    "sigmoid_": "sigmoid", "relu_": "relu", "round_": "round", "detach_": "detach",
}
# results that are always a new tensor (never an alias of an argument)
FRESH_METHODS = {"clone", "mul", "add", "sub", "div", "neg", "exp", "sum", "new_zeros", "new_ones", "new_full",
                 "new_empty", "matmul", "bmm", "cumsum"}
FRESH_FUNCTIONS = {"clone", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
                   "mul", "add", "sub", "truediv", "neg", "exp", "matmul", "bmm", "einsum", "eye"}
# results that may share storage with their first argument
ALIASING = {"view", "reshape", "transpose", "permute", "t", "getitem", "select", "narrow", "unsqueeze", "squeeze",
            "expand", "expand_as", "flatten", "unflatten", "view_as", "contiguous", "to", "type", "float",
            "detach", "unbind", "split", "chunk", "as_strided", "diagonal", "movedim", "swapaxes", "mT", "T"}
MIN_WRITES = 2  # a loop: one write per step, at least two steps


def _name(n: torch.fx.Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))


def _is_fresh(n: torch.fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in FRESH_METHODS
    return n.op == "call_function" and _name(n) in FRESH_FUNCTIONS


def _writer(n: torch.fx.Node, base: torch.fx.Node) -> bool:
    return n.op == "call_method" and n.target in FUNCTIONAL and n.args and n.args[0] is base and not n.users


def _mutates(n: torch.fx.Node) -> bool:
    if n.op == "call_function" and n.target is operator.setitem:
        return True
    return n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("_")


def _safe(base: torch.fx.Node, pos: dict) -> bool:
    """Only direct functional writers mutate ``base``, and no alias of it is read across a write."""
    writes = sorted(pos[u] for u in base.users if _writer(u, base))
    stack, aliases = [base], []
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if cur is base and _writer(u, base):
                continue
            if _mutates(u) and u.args and u.args[0] is cur:
                return False  # mutated through another method or through a view
            if u.op in ("call_method", "call_function") and _name(u) in ALIASING and u.args and u.args[0] is cur:
                aliases.append(u)
                stack.append(u)
    for a in aliases:
        nxt = next((w for w in writes if w > pos[a]), None)
        if nxt is not None and any(pos[u] > nxt for u in _alias_users(a)):
            return False
    return True


def _alias_users(a: torch.fx.Node):
    stack, out = [a], []
    while stack:
        cur = stack.pop()
        for u in cur.users:
            out.append(u)
            if u.op in ("call_method", "call_function") and _name(u) in ALIASING:
                stack.append(u)
    return out


def functionalize_inplace(gm: torch.fx.GraphModule, spans=None) -> int:
    """Rewrites the in-place update chains of fresh floating rank >= 3 tensors whose in-place
    nodes all lie in one of ``spans`` (graph position ranges of unrolled loops; None: anywhere);
    returns how many in-place nodes became out-of-place."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    done = 0

    def in_loop(ws):
        return spans is None or any(all(a <= pos[w] <= b for w in ws) for a, b in spans)

    for base in nodes:
        v = tensor_value(base)
        if v is None or v.dim() < 3 or not v.dtype.is_floating_point or not _is_fresh(base):
            continue
        (only,) = base.users if len(base.users) == 1 else (None,)
        if only is not None and only.op == "call_method" and only.target in FUNCTIONAL and only.args \
                and only.args[0] is base and only.users and in_loop([only]):
            # x.clone().mul_(d), read through its result: nobody else sees the fresh tensor
            only.meta["laqat_inplace"] = only.target
            only.target = FUNCTIONAL[only.target]
            done += 1
            continue
        writers = [u for u in base.users if _writer(u, base)]
        if len(writers) < MIN_WRITES or not in_loop(writers) or not _safe(base, pos):
            continue
        done += _rewrite_chain(gm, base, sorted(writers, key=pos.__getitem__), pos)
    if done:
        gm.graph.lint()
    return done


def _rewrite_chain(gm, base, writers, pos) -> int:
    readers = sorted((u for u in base.users if u not in writers), key=pos.__getitem__)
    versions = []  # (position of the write, the new node)
    for w in writers:
        current = versions[-1][1] if versions else base
        with gm.graph.inserting_before(w):
            new = gm.graph.create_node("call_method", FUNCTIONAL[w.target], (current, *w.args[1:]), dict(w.kwargs))
        new.meta.update(w.meta)
        new.meta["laqat_inplace"] = w.target
        versions.append((pos[w], new))
        gm.graph.erase_node(w)
    for r in readers:
        latest = [node for p, node in versions if p < pos[r]]
        if latest:
            r.replace_input_with(base, latest[-1])
    return len(writers)
