"""laqat's block regions inlined back into the Dynamo graph, before the passes (passes/frontends/fla/block_regions.py).

Dynamo writes each call of a nested compile region as an ``invoke_subgraph`` node over one shared body, traced at the
first call: the body's nodes carry the module paths of that first block (``model.layers.0.attn``). Each call of a
laqat block region (its ``stack_trace`` runs through block_regions.py; other regions stay as they are) is replaced by
a copy of the body's nodes on the call's operands, each copy's module paths moved under the calling block's
(``model.layers.3.attn``), so that module names, the policy's rules and the hand-off's layer runs are those of the
graph Dynamo traces without regions. Every copy keeps the body's example values (Dynamo's fake tensors of the first
block's trace): one block's values, for blocks whose inputs' metadata are that block's.
"""
from __future__ import annotations

import operator
import os

import torch
import torch.fx

from la_compiler.error_base import LaqatError


class RegionInlineError(LaqatError, RuntimeError):
    """A block region whose module paths do not nest as Dynamo writes them: its nodes could not be named."""


# where laqat's block regions are called from (not imported: it imports FLA)
REGION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frontends", "fla", "block_regions.py")


def is_block_region(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
            and f'File "{REGION_FILE}"' in (node.meta.get("stack_trace") or ""))


def inline_block_regions(gm: torch.fx.GraphModule) -> int:
    """Inlines every laqat block region of ``gm`` (in place); -> how many calls."""
    calls = [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
             if is_block_region(n)] if hasattr(torch.ops.higher_order, "invoke_subgraph") else []
    bodies = set()
    for call in calls:
        body_attr = call.args[0]
        bodies.add(body_attr.target)
        _inline(gm, call, getattr(gm, body_attr.target))
        if not body_attr.users:
            gm.graph.erase_node(body_attr)
    for target in bodies:
        if not any(n.target == target for n in gm.graph.find_nodes(op="get_attr")):
            delattr(gm, target)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return len(calls)


def _inline(gm: torch.fx.GraphModule, call: torch.fx.Node, body: torch.fx.GraphModule) -> None:
    call_stack = call.meta.get("nn_module_stack") or {}
    env = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:]))
    outputs = ()
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = tuple(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
                break
            if node.op == "call_module":
                raise RegionInlineError(f"laqat block region: a call_module node ({node.target}) in the region's body")
            copied = gm.graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":  # the body of a higher-order op in the region (an autograd.Function's)
                copied.target = _attribute_of(gm, body, call.args[0].target, node.target)
            copied.meta = dict(node.meta)
            copied.meta["nn_module_stack"] = rebased_module_stack(node.meta.get("nn_module_stack") or {}, call_stack)
            env[node] = copied
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise RegionInlineError(f"laqat block region: its call is used by {user.format_node()}, not an item")
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)


def _attribute_of(gm: torch.fx.GraphModule, body: torch.fx.GraphModule, body_name: str, target: str) -> str:
    """``gm``'s name for the body's attribute ``target``, set once per body (every copy reads the same object)."""
    name = f"{body_name}_{target}"
    if not hasattr(gm, name):
        setattr(gm, name, getattr(body, target))
    return name


def rebased_module_stack(body_stack: dict, call_stack: dict) -> dict:
    """A body node's ``nn_module_stack`` moved under the call's: the call's own entries (down to the calling block),
    then the body's entries below the block it was traced in, their paths moved from that block's to the calling
    block's (keyed by the new path)."""
    depth = len(call_stack)
    body = list(body_stack.items())
    out = dict(call_stack)
    if depth == 0 or len(body) <= depth:
        return out
    traced_block, traced_type = body[depth - 1][1]
    calling_block, calling_type = list(call_stack.values())[-1]
    if traced_type != calling_type:
        raise RegionInlineError(f"laqat block region traced in {traced_block} ({traced_type.__name__}) called from "
                                f"{calling_block} ({calling_type.__name__})")
    for _, (path, module_type) in body[depth:]:
        if not path.startswith(traced_block + "."):
            raise RegionInlineError(f"laqat block region: module {path} is not inside {traced_block}")
        moved = calling_block + path[len(traced_block):]
        out[moved] = (moved, module_type)
    return out
