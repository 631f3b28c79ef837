"""Ops whose output the backward recomputes from their inputs instead of keeping it, under the Inductor hand-off.

``laqat::softplus_gate`` turns a 16-bit raw gate into the fp32 log-decay that the recurrence's backward reads. Kept,
that fp32 output costs 4 bytes per element; recomputed in the backward from the raw gate (2 bytes, which is what
FLA's ``ChunkKDAFunction`` keeps with its gate computed in-kernel) it costs one elementwise pass. AOTAutograd's
partitioner recomputes an op only from its allowlist, which a custom op is not in; a node tagged
``recompute = PREFER_RECOMPUTE`` (the tag activation checkpointing writes) it recomputes in the backward, and the tag
travels from Dynamo's graph into the joint graph with the node's metadata (docs/memory.md).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

RECOMPUTED_OPS = ("laqat::softplus_gate",)


def _widens(node: torch.fx.Node) -> bool:
    """Whether the op's output takes more bytes per element than its first input (otherwise keeping the output costs
    what keeping the input would, and recomputing only costs time)."""
    raw, out = node.args[0], node.meta.get("example_value")
    raw = raw.meta.get("example_value") if isinstance(raw, torch.fx.Node) else None
    if not isinstance(raw, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return out.element_size() > raw.element_size()


def _op_name(target) -> str | None:
    """``namespace::name`` of an op overload or packet (Dynamo's graph calls the packet)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def tag_recomputed_ops(graph: torch.fx.GraphModule) -> int:
    """Tags every call of a ``RECOMPUTED_OPS`` op whose output is wider than its input; returns how many."""
    tagged = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and _op_name(node.target) in RECOMPUTED_OPS and _widens(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            tagged += 1
    return tagged
