"""The annotate pass: the policy table -> a quant spec for every site of every laqat node."""
from __future__ import annotations

import torch

from la_compiler.ir import is_delta_rule
from la_compiler.policy import Policy
from la_compiler.record import GraphRecord


def annotate(gm: torch.fx.GraphModule, policy: Policy, record: GraphRecord) -> int:
    """Rewrites each node's spec argument to what the policy resolves for its module. Returns
    how many nodes changed numerics."""
    changed = 0
    seen = []
    for node in gm.graph.nodes:
        if not is_delta_rule(node):
            continue
        meta = node.meta["laqat"]
        seen.append((meta.module, meta.kind))
        res = policy.resolve(meta.module, meta.kind)
        spec = meta.spec.replace(quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                                 chunk=res.chunk, phase=res.phase, extra=res.extra)
        if spec != meta.spec:
            changed += 1
        meta.spec = spec
        meta.policy_rules = list(res.rules)
        meta.requested_backend = res.backend
        _set_spec_arg(node, spec.to_string())
    record.notes.extend(policy.unmatched_rules(seen))
    return changed


def _set_spec_arg(node: torch.fx.Node, spec: str) -> None:
    if len(node.args) > 8:
        node.args = (*node.args[:8], spec, *node.args[9:])
    else:
        node.kwargs = {**node.kwargs, "spec": spec}
