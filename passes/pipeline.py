"""The laqat pipeline over one Dynamo graph: frontends -> annotate -> verify -> lower."""
from __future__ import annotations

import time

import torch

from la_compiler.ir.delta_rule import is_delta_rule
from la_compiler.ir.delta_rule_phased import is_delta_rule_phased
from la_compiler.options import DEFAULT_TUNING, TuningOptions
from la_compiler.passes.annotate import annotate
from la_compiler.passes.attach_meta import attach_meta
from la_compiler.passes.frontends import GRAPH_FRONTENDS
from la_compiler.passes.lower import lower
from la_compiler.passes.module_names import graph_module_names
from la_compiler.passes.phase import split_phases
from la_compiler.passes.serving_inputs import rewrite_serving_inputs
from la_compiler.passes.verify import verify_ir
from la_compiler.policy.resolution import Policy
from la_compiler.record import GraphRecord, Match


def run_pipeline(gm: torch.fx.GraphModule, policy: Policy, record: GraphRecord, *, verify: bool = False,
                 module_prefixes: dict[str, str] | None = None, tuning: TuningOptions = DEFAULT_TUNING) -> None:
    """``module_prefixes``: the full names of the traced frame's roots (passes/module_names.py), so that a
    graph resumed inside a block names its modules as the model does; ``tuning``: the compile's tuning options,
    written into every node's spec."""
    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        count = fn(*args, **kwargs)
        record.pass_seconds[name] = record.pass_seconds.get(name, 0.0) + time.perf_counter() - start
        record.pass_counts[name] = record.pass_counts.get(name, 0) + count
        return count

    with graph_module_names(module_prefixes or {}):
        for frontend in GRAPH_FRONTENDS:
            timed(getattr(frontend, "__name__", str(frontend)), frontend, gm, record, verify=verify)
        timed("attach_meta", attach_meta, gm)
    timed("annotate", annotate, gm, policy, record, part_of_model=any((module_prefixes or {}).values()),
          tuning=tuning)
    timed("verify", verify_ir, gm)
    timed("lower", lower, gm, record)
    timed("phase", split_phases, gm)
    timed("serving", rewrite_serving_inputs, gm)
    gm.graph.lint()
    gm.recompile()
    _record_matches(gm, record)
    record.readable = gm.print_readable(print_output=False)


def _record_matches(gm: torch.fx.GraphModule, record: GraphRecord) -> None:
    for node in gm.graph.nodes:
        if is_delta_rule(node) or is_delta_rule_phased(node):
            meta = node.meta["laqat"]
            record.matches.append(Match(
                kind=meta.kind, frontend=meta.frontend, module=meta.module, spec=meta.spec.to_string(),
                kernel=meta.spec.kernel, kernel_reason=meta.kernel_reason, policy_rules=tuple(meta.policy_rules),
                region_size=len(meta.region), node=node.name,
            ))
