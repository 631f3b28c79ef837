"""A recurrence found in a DDP-compiled graph must lie in one of DDPOptimizer's pieces.

Under ``torch.compile`` a model inside ``DistributedDataParallel`` goes through DDPOptimizer
(torch/_dynamo/backends/distributed.py): it splits each Dynamo graph at DDP's gradient-bucket
boundaries and calls the backend once per piece. Buckets fill with the parameters a graph reads,
counted from its end backwards; a piece therefore starts at a parameter read (the one that filled the
bucket) or a little before it. A recurrence that the FLA frontend substitutes is one node and never
splits, and a torch-code recurrence reads no parameter itself; but where the code reads a parameter
between two parts of one recurrence (an output gate projected between a chunked recurrence's
intra-chunk solve and its chunk loop), the cut can fall inside it. Neither piece then holds the
recurrence: the graph frontend would leave the parts as they are (the policy silently not applied),
or rewrite a part that happens to be a shorter recurrence of its own (a quantized state then rounded
at the cut, which the single-process run does not do).

``check_pieces(root)`` is called for every graph the backend compiles. Inside DDPOptimizer it runs the
graph frontends once on a copy of the whole graph and raises ``RecurrenceSplitError`` if the nodes of
a recurrence they rewrite fall in more than one piece.
"""
from __future__ import annotations

import sys

import torch

from la_compiler.errors import LaqatError
from la_compiler.hand_off.module_specialized_graph import _pristine_copy as pristine_copy
from la_compiler.ir.delta_rule import is_delta_rule
from la_compiler.passes.frontends import GRAPH_FRONTENDS
from la_compiler.passes.module_names import graph_module_names, root_prefixes
from la_compiler.record import GraphRecord


class RecurrenceSplitError(LaqatError, ValueError):
    """DDPOptimizer split the graph inside a GDN/KDA recurrence."""


_CHECKED = "_laqat_recurrences_within_buckets"  # set on the whole graph once it has been checked


def check_pieces(root: torch.nn.Module | None) -> None:
    """Raises ``RecurrenceSplitError`` when this compile is one of DDPOptimizer's pieces and a recurrence of
    the whole graph spans two of them."""
    found = _ddp_optimizer_split()
    if found is None:
        return
    whole, buckets = found
    if getattr(whole, _CHECKED, False):
        return
    piece_of = {node.name: i for i, bucket in enumerate(buckets) for node in bucket.nodes}
    for module, kind, region in _recurrences(whole, root):
        pieces = sorted({piece_of[name] for name in region if name in piece_of})
        if len(pieces) > 1:
            raise RecurrenceSplitError(_message(module, kind, pieces, buckets))
    setattr(whole, _CHECKED, True)


def _ddp_optimizer_split():
    """(the whole Dynamo graph, DDPOptimizer's buckets) when called from inside DDPOptimizer with more than
    one bucket, else None."""
    backends = sys.modules.get("torch._dynamo.backends.distributed")
    if backends is None:
        return None
    code = backends.DDPOptimizer.compile_fn.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return None
    buckets = frame.f_locals.get("buckets") or []
    return (frame.f_locals["gm"], buckets) if len(buckets) > 1 else None


def _recurrences(whole: torch.fx.GraphModule, root) -> list[tuple[str, str, list[str]]]:
    """(module, kind, the names of the nodes it replaces) of every recurrence a graph frontend rewrites in a
    copy of ``whole``."""
    copy = pristine_copy(whole)
    record = GraphRecord(graph_id=-1)
    with graph_module_names(root_prefixes(whole, root)):
        for frontend in GRAPH_FRONTENDS:
            frontend(copy, record)
    rewritten = [node.meta.get("laqat") for node in copy.graph.nodes if is_delta_rule(node)]
    # trace-time (FLA) nodes have no meta yet, and no region: one node is never split
    return [(meta.module, meta.kind, list(meta.region)) for meta in rewritten if meta is not None and meta.region]


def _message(module: str, kind: str, pieces: list[int], buckets) -> str:
    # imported here: the torch frontend's modules import networkx, which a run without DDP never needs
    from la_compiler.passes.frontends.torch_recurrence.allowed_ops import where_from

    first = buckets[pieces[1]].nodes[-1]  # bucket nodes are listed from the graph's end backwards
    at = f" (piece {pieces[1]} starts at {where_from(first)})"
    return (f"DDPOptimizer split the {kind.upper()} recurrence at module {module or '<top>'!r} across the graph "
            f"pieces {pieces} of DistributedDataParallel's gradient buckets{at}: a parameter is read between its "
            f"parts, and laqat cannot rewrite a recurrence that is not whole. Read the parameter before or after "
            f"the recurrence, give DDP a larger bucket_cap_mb, or set torch._dynamo.config.optimize_ddp = False "
            f"(DDP then all-reduces after the whole backward).")
