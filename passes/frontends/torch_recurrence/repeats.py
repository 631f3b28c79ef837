"""Identical recurrences share one algebra check: a region's structure as a key, and an accepted role assignment
carried over to a later region with the same key.

A model's layers unroll the same recurrence code on tensors of their own: their regions are the same ops on
inputs of the same metadata, in the same order, and ``semantics.solve`` (fp64 probe runs of the whole region, most
of the frontend's time on a loop over chunks: docs/torch_frontend.md, "Rewrite time") reaches the same verdict on
each, since it reads the region's structure and its example values' metadata, never the values of the graph's
tensors (its probes draw their own). The key holds what ``solve`` reads: every live and dead node of the region and
of its entry chains in graph order (op, target, constants, the example value's dtype, shape and strides, whether
the node is dead, its in-place record), which node reads which (region nodes by position; the tensors the region
reads from outside numbered by first appearance, with their metadata), the loop's geometry and the nodes of its
roles (steps, state, output, final state, the sliced sources), the entry chains and the inputs the initial state
is computed from. The order in which ``solve`` tries role assignments follows the graph around the region (which
input reaches the state, through earlier layers too) and is not in the key: an assignment it accepts passes the
same probes on every region with the key. A region holding anything else (a graph attribute, a symbolic size, an
argument of another type) has no key and is checked on its own.

Only loops over chunks share (a token loop's check runs two steps, whatever T). The key's claim is confirmed on
every region that takes another's assignment: the region runs once on the first region's generic probe inputs
and must compute its output and final state bit for bit (the same ops on the same inputs); where it does not,
``solve`` checks the region on its own. The rewrite check (``verify_mode.check_rewrite``) still runs on every
region, on the first region's probe runs carried over.
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.error_base import LaqatError
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, tensor_value
from la_compiler.passes.frontends.torch_recurrence.region import Region
from la_compiler.passes.frontends.torch_recurrence.probe import ProbeError
from la_compiler.passes.frontends.torch_recurrence.semantics import (Assignment, Evidence, Layout, Probe,
                                                                     initial_state_inputs)

_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, type(Ellipsis))


class _NoKey(LaqatError, LookupError):
    """Something in the region the key cannot describe: the region is checked on its own."""


class _Numbering:
    """Positions of the region's nodes (``("r", i)``) and first-appearance numbers of what it reads from outside
    (``("x", j)``, their metadata kept in ``outside``)."""

    def __init__(self, nodes: list):
        self.nodes = nodes
        self.inside = {n: i for i, n in enumerate(nodes)}
        self.outside: dict = {}

    def __call__(self, node):
        if node is None:
            return None
        if node in self.inside:
            return ("r", self.inside[node])
        if node not in self.outside:
            self.outside[node] = len(self.outside)
        return ("x", self.outside[node])

    def order(self) -> list:
        """Every node the key names, in the order the key names them (the pairing of two regions with one key)."""
        return self.nodes + list(self.outside)


def region_key(flow: Dataflow, region: Region) -> tuple[tuple, list] | None:
    """(key, nodes): regions with equal keys get the same verdict from ``solve``, and ``nodes`` pair up position by
    position; None where the region holds something the key cannot describe."""
    try:
        key, nodes = _region_key(flow, region)
        hash(key)  # a target that cannot be hashed
    except (_NoKey, TypeError):
        return None
    return key, nodes


def _region_key(flow: Dataflow, region: Region) -> tuple[tuple, list]:
    nodes = sorted(region.nodes | region.chain_nodes, key=flow.pos.__getitem__)
    number = _Numbering(nodes)
    ops = tuple(_node(n, number, n in flow.dead) for n in nodes)
    body, loop = region.body, region.body.loop
    first = loop.starts[loop.first]
    geometry = (
        region.seq_len, region.padded_len, region.chunk, number(region.output), number(region.final_state),
        tuple(tuple(number(n) for n in window) for window in body.windows), body.state_offset, number(body.init),
        body.o_offset, number(body.o_buffer), number(body.o_collector), body.o_time_dim, number(body.final_state),
        loop.first, loop.last,
        tuple(sorted((i, p - first) for i, p in loop.starts.items())),
        tuple(sorted((i, p - first) for i, p in loop.ends.items())),
        tuple((number(s.node), number(s.source), s.dim, s.index, s.keepdim, _arg(s.key, number))
              for s in loop.slices),
    )
    frontier = tuple(number(n) for n in region.frontier)
    chains = tuple((number(n), None if chain is None else _arg(chain.ops, number))
                   for n, chain in region.chains.items())
    roles = tuple(number(n) for n in initial_state_inputs(region))
    outside = tuple(_meta(tensor_value(n)) for n in number.outside)
    return (ops, geometry, frontier, chains, roles, outside), number.order()


def _node(n: torch.fx.Node, number: _Numbering, dead: bool) -> tuple:
    if n.op not in ("call_function", "call_method"):
        raise _NoKey(n.op)
    return (n.op, n.target, _arg(n.args, number), _arg(n.kwargs, number), _meta(tensor_value(n)), dead,
            _arg(n.meta.get("laqat_inplace"), number))


def _arg(a, number: _Numbering):
    if isinstance(a, torch.fx.Node):
        return number(a)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_arg(x, number) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((_arg(k, number), _arg(v, number)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _arg(a.start, number), _arg(a.stop, number), _arg(a.step, number))
    if isinstance(a, float):
        return ("float", repr(a))  # 0.0 and -0.0, 1 and 1.0 and True are equal keys otherwise
    if isinstance(a, _PLAIN):
        return (type(a).__name__, a)
    raise _NoKey(type(a).__name__)


def _meta(v):
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        shape, stride = tuple(v.shape), tuple(v.stride())
        if not all(type(s) is int for s in shape + stride):  # read as ints, a symbolic size would be guarded on
            raise _NoKey("a symbolic size")
        return ("tensor", v.dtype, v.device, shape, stride)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_meta(x) for x in v))
    if isinstance(v, (bool, int, float)):
        return _arg(v, None)
    raise _NoKey(type(v).__name__)


def carried_over(accepted: Assignment, pairing: dict, region: Region) -> Assignment:
    """The assignment ``solve`` accepted for a region with this region's key, on this region's nodes (``pairing``:
    that region's node -> this region's), with its probe runs for the rewrite check."""

    def node(n):
        return None if n is None else pairing[n]

    def layout(lay: Layout) -> Layout:
        return Layout(node(lay.node), lay.perm)

    evidence = accepted.evidence
    if evidence is not None:
        vjp = evidence.vjp
        if vjp is not None:
            env, cotangent, steps, grads = vjp
            vjp = ({node(n): x for n, x in env.items()}, cotangent, steps, {node(n): x for n, x in grads.items()})
        evidence = Evidence(runs=[(what, {node(n): x for n, x in env.items()}, got)
                                  for what, env, got in evidence.runs], vjp=vjp)
    return dataclasses.replace(accepted, q=layout(accepted.q), k=layout(accepted.k), v=layout(accepted.v),
                               g=layout(accepted.g), beta=layout(accepted.beta), h0=node(accepted.h0),
                               chains=region.chains, evidence=evidence)


def reproduces(flow: Dataflow, region: Region, carried: Assignment) -> bool:
    """Whether ``region``, run on the generic probe inputs of the region ``carried`` was accepted for, computes that
    region's output and final state bit for bit."""
    evidence = carried.evidence
    if evidence is None or not evidence.runs:
        return False
    _, env, (o, state, _) = evidence.runs[0]
    try:
        got_o, got_state = Probe(flow, region)(env)
    except ProbeError:
        return False
    if (state is None) != (got_state is None):
        return False
    return torch.equal(got_o, o) and (state is None or torch.equal(got_state, state))
