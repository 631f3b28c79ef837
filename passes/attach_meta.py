"""Give every laqat IR node its ``node.meta["laqat"]`` (frontends that substitute at trace time
cannot write node metadata themselves: their spec's ``src`` names them)."""
from __future__ import annotations

import torch

from la_compiler.ir.delta_rule import LaqatMeta, is_delta_rule, node_spec
from la_compiler.passes.module_names import module_name


def attach_meta(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in gm.graph.nodes:
        if is_delta_rule(node) and "laqat" not in node.meta:
            spec = node_spec(node)
            node.meta["laqat"] = LaqatMeta(spec=spec, frontend=spec.src, module=module_name(node))
            count += 1
    return count
