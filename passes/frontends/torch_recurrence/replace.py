"""Replacement: the region becomes one ``laqat.delta_rule`` node.

Emitted in front of the IR node, as ordinary torch ops: the permutes of the inputs to
[B, T, H, D], casts to the dtype the region computed in, ``neg`` of a negated query (a negative fitted
scale: the IR node's scale is positive), and ``log`` of a pre-exponentiated decay (``laqat::log_decay`` where
the decay is not provably positive: it checks it at run time).
Behind it: ``getitem`` 0/1, the permute of o back to the region's output layout and
casts to the dtypes the region produced. Every new node gets ``example_value`` (computed by
running the op on the graph's fake tensors) and the module metadata of the region.
"""
from __future__ import annotations

import operator

import torch

from la_compiler.ir.delta_rule import DELTA_RULE, LaqatMeta
from la_compiler.ir.log_decay import LOG_DECAY
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.passes.frontends.torch_recurrence.allowed_ops import where_from
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, tensor_value, value
from la_compiler.passes.frontends.torch_recurrence.entry import replay
from la_compiler.passes.frontends.torch_recurrence.loops import NotARecurrence
from la_compiler.passes.frontends.torch_recurrence.region import Region
from la_compiler.passes.frontends.torch_recurrence.semantics import Assignment, positive
from la_compiler.passes.module_names import module_name


def _fake_mode(region: Region):
    for n in region.frontier + [region.output]:
        mode = getattr(tensor_value(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


class _Emitter:
    def __init__(self, gm, anchor: torch.fx.Node, meta_from: torch.fx.Node, fake_mode):
        self.graph, self.anchor, self.meta_from, self.fake_mode = gm.graph, anchor, meta_from, fake_mode
        self.created = []

    def _fake(self, op, target, args):
        def load(a):
            if isinstance(a, torch.fx.Node):
                return value(a)
            if isinstance(a, (tuple, list)):
                return type(a)(load(x) for x in a)
            return a

        fargs = load(args)
        ctx = self.fake_mode if self.fake_mode is not None else torch._subclasses.fake_tensor.FakeTensorMode()
        with ctx:
            if op == "call_method":
                return getattr(fargs[0], target)(*fargs[1:])
            return target(*fargs)

    def emit(self, op, target, args):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, tuple(args))
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        node.meta["example_value"] = self._fake(op, target, args)
        self.created.append(node)
        return node

    def permute(self, node, perm):
        return node if tuple(perm) == tuple(range(len(perm))) else self.emit("call_method", "permute", [node, *perm])

    def cast(self, node, dtype):
        return node if tensor_value(node).dtype == dtype else self.emit("call_method", "to", [node, dtype])


def replace_region(gm: torch.fx.GraphModule, flow: Dataflow, region: Region, a: Assignment, spec: RecurrenceSpec,
                   renamed: dict) -> torch.fx.Node:
    """Rewrites the graph; returns the IR node. ``renamed`` maps outputs of regions replaced
    before (an earlier layer's final state feeding this one) to their replacements, and gets
    this region's outputs added."""
    body = region.body
    check_replaceable(region)
    new = lambda n: renamed.get(n, n)  # noqa: E731
    # new nodes go right after the last frontier node: every input exists there, and every reader of
    # the region's outputs comes later (they follow the loop)
    inputs = {new(n) for n in region.frontier}
    last_input = None
    for n in gm.graph.nodes:
        if n in inputs:
            last_input = n
    anchor = last_input.next if last_input is not None else min(region.nodes, key=flow.pos.__getitem__)
    meta_from = body.windows[0][body.state_offset]
    em = _Emitter(gm, anchor, meta_from, _fake_mode(region))
    # the dtype the recurrence runs in: its state's (an output buffer may be narrower; the output
    # cast behind the IR node rounds once, as the write into that buffer does)
    compute = tensor_value(body.states[0]).dtype
    if not compute.is_floating_point:
        compute = torch.float32
    # each input: to [B, T, H, D], its entry chain's casts and scalars replayed (entry.py), the compute dtype
    q, k, v, g, beta = (em.cast(replay(em.emit, em.permute(new(lay.node), lay.perm), a.chain(role)), compute)
                        for role, lay in (("q", a.q), ("k", a.k), ("v", a.v), ("g", a.g), ("beta", a.beta)))
    if a.query_sign < 0:
        q = em.emit("call_function", torch.neg, [q])
    if a.decay_form == "exp":  # the log of a pre-exponentiated decay; checked positive at run time where not proven
        g = em.emit("call_function", torch.log, [g]) if decay_is_positive(a) else \
            em.emit("call_function", LOG_DECAY, [g, decay_where(flow, region, a)])
    h0 = em.cast(replay(em.emit, new(a.h0), a.chain("h0")), compute) if a.h0 is not None else None
    B, HV = tensor_value(v).shape[0], tensor_value(v).shape[2]
    if h0 is not None and tensor_value(h0).dim() == 3:  # a flattened [B*HV, K, V] state
        h0 = em.emit("call_method", "reshape", [h0, B, HV, *tensor_value(h0).shape[-2:]])
    ir = em.emit("call_function", DELTA_RULE, [q, k, v, g, beta, h0, None, abs(float(a.scale)), spec.to_string()])
    ir.meta["laqat"] = LaqatMeta(spec=spec, frontend="torch", module=module_name(meta_from),
                                 region=[n.name for n in sorted(region.nodes, key=flow.pos.__getitem__)])
    o = em.emit("call_function", operator.getitem, [ir, 0])
    inverse = [0] * 4
    for i, d in enumerate(a.out_perm):
        inverse[d] = i
    o = em.cast(em.permute(o, inverse), tensor_value(region.output).dtype)
    _redirect(flow, region, region.output, o)
    renamed[region.output] = o
    if region.final_state is not None:
        s = em.emit("call_function", operator.getitem, [ir, 1])
        want = tensor_value(region.final_state)
        if tuple(want.shape) != tuple(tensor_value(s).shape):
            s = em.emit("call_method", "reshape", [s, *want.shape])
        s = em.cast(s, want.dtype)
        _redirect(flow, region, region.final_state, s)
        renamed[region.final_state] = s
    for n in sorted(region.nodes, key=flow.pos.__getitem__, reverse=True):
        gm.graph.erase_node(n)
    return ir


def decay_is_positive(a: Assignment) -> bool:
    """A pre-exponentiated decay provably positive at compile time: exp / sigmoid / softplus through layout ops,
    scaled by a positive factor on its way in."""
    return positive(a.g.node) and a.chain("g").factor > 0


def decay_where(flow: Dataflow, region: Region, a: Assignment) -> str:
    """The decay, named for ``laqat::log_decay``'s error: its node and the line the region first reads it at."""
    readers = sorted((u for u in a.g.node.users if u in region.nodes), key=flow.pos.__getitem__)
    return f"{a.g.node.name}" + (f" (read at {where_from(readers[0])})" if readers else "")


def check_replaceable(region: Region) -> None:
    """Only the output and the final state may be read from outside the region (checked before
    the graph is touched)."""
    for n in region.nodes:
        if n is region.output or n is region.final_state:
            continue
        outside = [u for u in n.users if u not in region.nodes]
        if outside:
            raise NotARecurrence(f"{n.name} inside the recurrence is read outside it by {outside[0].name}",
                                 nodes=[n.name, outside[0].name])


def _redirect(flow: Dataflow, region: Region, old: torch.fx.Node, new: torch.fx.Node):
    for user in list(old.users):
        if user not in region.nodes:
            user.replace_input_with(old, new)
