"""The phase pass: decode-phase nodes read their phase lengths at run time.

Every ``laqat::delta_rule`` node whose spec has ``phase=token|replay`` becomes

    lengths = laqat.phase_lengths(q, cu_seqlens)
    out     = laqat.delta_rule_phased(q, k, v, g, beta, h0, cu_seqlens, lengths[0], lengths[1], scale, spec)

(la_compiler/ir/delta_rule_phased.py says why). Runs after ``lower``, so the spec already names its
kernel variant; ``node.meta["laqat"]`` moves to the new node.
"""
from __future__ import annotations

import operator

import torch

from la_compiler.ir.delta_rule import is_delta_rule, node_spec
from la_compiler.ir.delta_rule_phased import DELTA_RULE_PHASED, PHASE_LENGTHS


def _arg(node: torch.fx.Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs[name]


def split_phases(gm: torch.fx.GraphModule) -> int:
    """Returns how many nodes were rewritten into ``delta_rule_phased``."""
    count = 0
    names = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "scale", "spec")
    for node in list(gm.graph.nodes):
        if not is_delta_rule(node) or node_spec(node).phase == "none":
            continue
        q, k, v, g, beta, h0, cu, scale, spec = (_arg(node, i, n) for i, n in enumerate(names))
        with gm.graph.inserting_before(node):
            lengths = gm.graph.call_function(PHASE_LENGTHS, (q, cu))
            prefill = gm.graph.call_function(operator.getitem, (lengths, 0))
            valid = gm.graph.call_function(operator.getitem, (lengths, 1))
            phased = gm.graph.call_function(DELTA_RULE_PHASED, (q, k, v, g, beta, h0, cu, prefill, valid, scale, spec))
        for key in ("laqat", "nn_module_stack", "stack_trace", "source_fn_stack", "example_value", "val"):
            if key in node.meta:
                phased.meta[key] = node.meta[key]
        node.replace_all_uses_with(phased)
        gm.graph.erase_node(node)
        count += 1
    return count
