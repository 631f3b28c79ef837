"""One-step loops: a recurrence whose loop Dynamo unrolled to a single iteration.

A chunked function called with T <= chunk size (one chunk), or a token loop with T = 1, reads
its inputs at index 0 of a size-1 dim and writes (or stacks) its output at index 0 of a
size-1 dim. With one step there is no second step to compare it with, so ``loops.py`` cannot
find the loop-carried state or the step boundary: such a loop is not rewritten, only reported
(``explain`` shows why). A candidate is a cluster of such reads of at least ``MIN_SOURCES``
distinct floating rank >= 3 tensors (q, k, v, ... of a GDN/KDA step) that all feed one such write.
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, is_inplace_write, tensor_value
from la_compiler.passes.frontends.torch_recurrence.loops import Loop, time_slices_of_index
from la_compiler.passes.frontends.torch_recurrence.slices import TimeSlice, time_slices

MIN_SOURCES = 3
CLUSTER_GAP = 32  # nodes between two reads of one step
REACH_LIMIT = 512


@dataclasses.dataclass
class OneStepLoop:
    slices: list  # TimeSlice, in graph order
    output: torch.fx.Node  # the write or stack of the single step's output
    chunk: int  # 1 for a token loop

    def reason(self) -> str:
        what = f"T <= chunk size {self.chunk}: one chunk" if self.chunk > 1 else "T = 1: one token"
        return (f"the loop unrolled to one step ({what}): with a single step there is no step-to-step "
                f"comparison to find the loop-carried state, so the recurrence is not rewritten "
                f"(call it with more than one {'chunk' if self.chunk > 1 else 'token'})")


def _single_index_read(s: TimeSlice) -> bool:
    sv, val = tensor_value(s.source), tensor_value(s.node)
    return sv is not None and val is not None and s.index == 0 and sv.shape[s.dim] == 1 and sv.dim() >= 3 \
        and sv.dtype.is_floating_point


def _single_index_output(n: torch.fx.Node) -> bool:
    """``o[..., 0, ...] = x`` into a size-1 dim, or a stack/cat of one item."""
    if is_inplace_write(n) and len(n.args) >= 2 and isinstance(n.args[0], torch.fx.Node):
        bv = tensor_value(n.args[0])
        try:
            hits = time_slices_of_index(n.args[0], n.args[1]) if bv is not None else []
        except Exception:  # an index the helper does not model (tensor, list): not an output write
            return False
        return any(i == 0 and bv.shape[d] == 1 for d, i in hits)
    name = getattr(n.target, "__name__", n.target)
    return n.op in ("call_function", "call_method") and name in ("stack", "cat") and bool(n.args) \
        and isinstance(n.args[0], (list, tuple)) and len(n.args[0]) == 1


def find_one_step_loops(flow: Dataflow, loops: list[Loop], taken: set) -> list[OneStepLoop]:
    """Clusters of single-index reads outside every multi-step loop and matched region."""
    spans = [(lp.starts[lp.first], lp.ends[lp.last]) for lp in loops]
    reads = [s for n in flow.nodes for s in time_slices(n) if _single_index_read(s)]
    reads = [s for s in reads if s.node not in taken and not any(a <= flow.pos[s.node] <= b for a, b in spans)]
    clusters, cur = [], []
    for s in reads:
        if cur and flow.pos[s.node] - flow.pos[cur[-1].node] > CLUSTER_GAP:
            clusters.append(cur)
            cur = []
        cur.append(s)
    if cur:
        clusters.append(cur)
    outputs = [n for n in flow.nodes if _single_index_output(n) and n not in taken]
    found = []
    for cl in clusters:
        if len({s.source for s in cl}) < MIN_SOURCES:
            continue
        first = flow.pos[cl[0].node]
        for out in (o for o in outputs if flow.pos[o] > first):
            feeding = [s for s in cl if flow.reaches(s.node, out, limit=REACH_LIMIT)]
            if len({s.source for s in feeding}) >= MIN_SOURCES:
                chunked = [s for s in feeding if tensor_value(s.source).dim() == 5 and s.dim < 4]
                chunk = tensor_value(chunked[0].source).shape[chunked[0].dim + 1] if chunked else 1
                found.append(OneStepLoop(feeding, out, chunk))
                break
    return found
