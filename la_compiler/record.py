"""What one compilation did, kept for ``explain``: matches, near misses, policy notes, graphs."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Match:
    """One rewritten recurrence site."""

    kind: str  # "gdn" | "kda"
    frontend: str  # "fla" | "torch" | "user"
    module: str  # fully qualified module name
    spec: str  # the canonical spec string on the node
    kernel: str  # the kernel variant the lower pass chose
    kernel_reason: str = ""
    policy_rules: tuple[str, ...] = ()
    region_size: int = 0  # graph nodes the IR node replaced (0 for trace-time frontends)
    node: str = ""  # the IR node's name in the graph


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A candidate region a frontend examined and left untouched, with the check that failed."""

    frontend: str
    module: str
    reason: str
    nodes: tuple[str, ...] = ()


@dataclasses.dataclass
class GraphRecord:
    graph_id: int
    readable: str = ""  # gm.print_readable() after the laqat passes
    matches: list[Match] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. policy rules matching no site
    graph_break: str = ""  # why Dynamo ended this graph at a graph break, and where ("" if it did not)
    policy: str = ""  # the name of the policy the graph was compiled with
    policy_source: str = ""  # "option", "attached to <module class>" or "default exact"
    hand_off: str = ""  # what runs the rewritten graph: "inductor" | "eager"
    hand_off_reason: str = ""  # "options['compiler']", or the devices the default was chosen by
    regions: str = ""  # Inductor: how many pieces the graph was split into and compiled, or why it compiled whole
    pass_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CompileRecord:
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)

    def new_graph(self) -> GraphRecord:
        graph = GraphRecord(graph_id=len(self.graphs))
        self.graphs.append(graph)
        return graph
