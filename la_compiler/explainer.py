"""``la_compiler.explain``: what laqat rewrote, with which numerics and kernel, and why.

    report = la_compiler.explain(model, batch, policy="state_fp8")
    report.matches       # every rewritten site: .kind .frontend .module .spec .kernel
    report.near_misses   # candidate regions left untouched, with the check that failed
    report.policy        # "state_fp8 (attached to MyModel)": the policy used and where it came from
    print(report)        # a readable report with the rewritten graphs
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from la_compiler.record import CompileRecord, GraphRecord, Match, NearMiss


class NothingMatchedWarning(UserWarning):
    """explain() found no GDN/KDA recurrence to rewrite."""


_SOURCES = {"default exact": "default exact: no policy option, none attached"}


@dataclasses.dataclass
class ExplainReport:
    graphs: list[GraphRecord]
    graph_breaks: int
    output: object = None  # what the model returned on the explained call

    @property
    def matches(self) -> list[Match]:
        return [m for g in self.graphs for m in g.matches]

    @property
    def near_misses(self) -> list[NearMiss]:
        return [n for g in self.graphs for n in g.near_misses]

    @property
    def graph_break_reasons(self) -> list[str]:
        """For each graph Dynamo ended at a graph break: why, and at which user line."""
        return [g.graph_break for g in self.graphs if g.graph_break]

    @property
    def policy(self) -> str:
        """The policy the graphs were compiled with and its source: "<name> (option)", "<name> (attached to
        <module class>)" or "exact (default exact: ...)"."""
        used = dict.fromkeys(f"{g.policy} ({_SOURCES.get(g.policy_source, g.policy_source)})"
                             for g in self.graphs if g.policy_source)
        return "; ".join(used) or "none (no graph was compiled)"

    @property
    def hand_off(self) -> str:
        """What ran the rewritten graphs and why: "eager (options['compiler'])", "inductor (default: the graph's
        tensors are on cuda)", ..."""
        used = dict.fromkeys(f"{g.hand_off} ({g.hand_off_reason})" for g in self.graphs if g.hand_off)
        return "; ".join(used) or "none (no graph was compiled)"

    @property
    def notes(self) -> list[str]:
        return [n for g in self.graphs for n in g.notes]

    def __str__(self) -> str:
        out = [f"laqat explain: {len(self.matches)} recurrence(s) rewritten in {len(self.graphs)} graph(s), "
               f"{self.graph_breaks} graph break(s)", f"policy: {self.policy}", f"hand-off: {self.hand_off}"]
        for i, m in enumerate(self.matches):
            out.append(f"\n[{i}] {m.kind.upper()} at {m.module or '<top>'} (frontend: {m.frontend}, node {m.node}"
                       + (f", replaced {m.region_size} nodes" if m.region_size else "") + ")")
            out.append(f"    spec:   {m.spec}")
            out.append(f"    kernel: {m.kernel_reason.splitlines()[0] if m.kernel_reason else m.kernel}")
            for line in m.kernel_reason.splitlines()[1:]:
                out.append(f"          {line.strip()}")
            for rule in m.policy_rules:
                out.append(f"    policy: {rule}")
        breaks = [g for g in self.graphs if g.graph_break]
        if breaks:
            out.append("\nGraph breaks (where Dynamo ended a graph, and why):")
            out.extend(f"  - after graph {g.graph_id}: {g.graph_break}" for g in breaks)
        if self.near_misses:
            out.append("\nNear misses (left untouched):")
            for n in self.near_misses:
                out.append(f"  - {n.frontend} at {n.module or '<top>'}: {n.reason}")
        if self.notes:
            out.append("\nNotes:")
            out.extend(f"  - {note}" for note in self.notes)
        for g in self.graphs:
            out.append(f"\n--- rewritten graph {g.graph_id} ---")
            out.append(g.readable.rstrip())
        return "\n".join(out)


def _unwrap(model_or_fn):
    if isinstance(model_or_fn, torch._dynamo.eval_frame.OptimizedModule):
        return model_or_fn._orig_mod
    return getattr(model_or_fn, "_torchdynamo_orig_callable", model_or_fn)


def explain(model_or_fn, *args, policy=None, compiler: str = "eager", tuning=None, **kwargs) -> ExplainReport:
    """Compiles ``model_or_fn`` with the laqat backend, runs it once on ``args``/``kwargs`` and
    reports every rewritten site. ``compiler`` picks what runs the rest of the graph ("eager"
    by default: the laqat passes, and so the report, are the same under Inductor; None: the backend's choice by
    device). ``policy=None``: the policy attached to the module (``la_compiler.attach_policy``), else exact
    numerics. ``tuning``: the backend's ``options["tuning"]``."""
    from la_compiler.backend import laqat_backend
    from la_compiler.backend_mark import mark_laqat_backend

    record = CompileRecord()
    counters = torch._dynamo.utils.counters["graph_break"]
    breaks_before = sum(counters.values())
    options = {"policy": policy, "compiler": compiler, "tuning": tuning}

    @mark_laqat_backend
    def backend(gm, example_inputs):
        return laqat_backend(gm, example_inputs, options=options, _record=record)

    compiled = torch.compile(_unwrap(model_or_fn), backend=backend)
    output = compiled(*args, **kwargs)
    report = ExplainReport(graphs=record.graphs, graph_breaks=sum(counters.values()) - breaks_before, output=output)
    if not report.matches:
        reasons = "; ".join(n.reason for n in report.near_misses) or "no candidate region found"
        warnings.warn(f"laqat found no GDN/KDA recurrence to rewrite ({reasons})", NothingMatchedWarning,
                      stacklevel=2)
    return report
