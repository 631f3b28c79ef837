"""The torch frontend: GDN/KDA recurrences written in plain PyTorch -> one laqat IR node.

    rewrite_torch_recurrences(gm, record, verify=False) -> number of rewritten recurrences

``record.pass_seconds["torch_recurrence.check"]`` is the time the rewrite check took (part of the frontend's);
``record.pass_counts["torch_recurrence.shared_check"]`` counts the regions that took the algebra check of an
identical region before them.

Steps (one module each): ``dataflow`` (networkx DiGraph with mutation edges), ``slices`` and
``loops`` (chain discovery and step isomorphism of unrolled loops), ``region`` + ``rules``
(what the IR node replaces, and its inputs), ``allowed_ops`` (every op accounted for), ``steps``
(every step of a token loop reads its own token: constants and indices included), ``scan`` (a
``torch._higher_order_ops.scan`` unrolled into the loop it stands for, and settled after), ``semantics``
(role assignment and the algebra check on fp64 probes, near-miss diagnosis), ``repeats`` (identical regions,
a model's layers, share one algebra check), ``replace`` (emit the IR node),
``verify_mode`` (the rewrite check: the IR node against the region on random inputs; bounded by default,
the whole region with ``verify=True``), ``one_step`` (loops unrolled to one step: reported
only). docs/torch_frontend.md explains the design.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.passes.frontends.torch_recurrence.allowed_ops import OpRefused, check_region_ops
from la_compiler.passes.frontends.torch_recurrence.dataflow import (Dataflow, fold_symbolic_scalars,
                                                                    sizes_marked_dynamic, specialize, symbols_of,
                                                                    tensor_value)
from la_compiler.passes.frontends.torch_recurrence.inplace import functionalize_inplace
from la_compiler.passes.frontends.torch_recurrence.loops import NotARecurrence, analyze_loop, find_loops
from la_compiler.passes.frontends.torch_recurrence.one_step import find_one_step_loops
from la_compiler.passes.frontends.torch_recurrence.region import Region, build_region
from la_compiler.passes.frontends.torch_recurrence.repeats import carried_over, region_key, reproduces
from la_compiler.passes.frontends.torch_recurrence.replace import check_replaceable, replace_region
from la_compiler.passes.frontends.torch_recurrence.scan import restore_scans, unroll_scans
from la_compiler.passes.frontends.torch_recurrence.semantics import Assignment
from la_compiler.passes.frontends.torch_recurrence import semantics, steps, verify_mode  # by module: tests replace these
from la_compiler.passes.module_names import module_name
from la_compiler.record import GraphRecord, NearMiss

CHECK_SECONDS = "torch_recurrence.check"  # GraphRecord.pass_seconds: the rewrite check's part of the frontend's time
# GraphRecord.pass_counts: regions that took the algebra check of an identical region before them (repeats.py)
SHARED_CHECKS = "torch_recurrence.shared_check"


def rewrite_torch_recurrences(gm: torch.fx.GraphModule, record: GraphRecord, *, verify: bool = False) -> int:
    # the pass allocates many small objects next to Dynamo's large heap: cyclic GC passes would
    # dominate its time (measured: docs/torch_frontend.md, "Rewrite time"); nothing it creates is cyclic garbage
    # the float64 probes are small: one thread, so that OpenMP workers spinning next to other
    # processes do not turn milliseconds into seconds
    enabled, threads = gc.isenabled(), torch.get_num_threads()
    gc.disable()
    torch.set_num_threads(1)
    try:
        return _rewrite(gm, record, verify=verify)
    finally:
        torch.set_num_threads(threads)
        if enabled:
            gc.enable()


def _rewrite(gm: torch.fx.GraphModule, record: GraphRecord, *, verify: bool) -> int:

    unrolled = unroll_scans(gm, record)  # a scan is analysed as the loop it unrolls to
    try:
        return _rewrite_loops(gm, record, verify=verify)
    finally:
        if unrolled:
            restore_scans(gm, unrolled)
            gm.recompile()


def _rewrite_loops(gm: torch.fx.GraphModule, record: GraphRecord, *, verify: bool) -> int:

    flow = Dataflow(gm)
    loops = find_loops(flow)
    if loops and any(isinstance(s, torch.SymInt) for n in flow.nodes if tensor_value(n) is not None
                     for s in tensor_value(n).shape):
        if _refuse_sizes_marked_dynamic(flow, loops, record):
            return 0
        # a graph with an unrolled loop under dynamic shapes: its sizes and symbolic scalars pinned to their values
        specialize(flow.nodes)
        if fold_symbolic_scalars(gm):
            flow = Dataflow(gm)
            loops = find_loops(flow)
    # S.mul_(d) chains inside unrolled loops -> out-of-place ops (provably equal values)
    if functionalize_inplace(gm, [_span(lp) for lp in loops]):
        flow = Dataflow(gm)
        loops = find_loops(flow)
    # outermost first: a loop nested in an accepted one is part of its region
    loops.sort(key=lambda lp: -(lp.starts[lp.last] - lp.starts[lp.first]) * (lp.last - lp.first + 1))
    accepted, taken, refused = [], set(), []
    solved: dict = {}  # region key -> (an accepted assignment, its region's nodes): repeats.py
    for loop in loops:
        if any(s.node in taken for s in loop.slices):
            continue
        where = loop.slices[0].node
        span = (loop.starts[loop.first], loop.ends[loop.last])
        # a loop inside a refused one is analysed (a token loop per head may still match), but its
        # failure is not reported: the outer loop's reason is the true one
        inner = any(a <= span[0] and span[1] <= b for a, b in refused)
        try:
            body = analyze_loop(flow, loop)
            region = build_region(flow, body)
            if region.nodes & taken:
                raise NotARecurrence("overlaps a recurrence already matched", candidate=False)
            try:  # every op accounted for, before any probe runs
                check_region_ops(flow, region, {s for s in body.states if s is not None} | {body.init},
                                 region.chain_nodes)
            except OpRefused as e:
                raise NotARecurrence(e.reason, nodes=[e.node.name]) from None
            steps.check_step_inputs(flow, region)  # every step reads its own token (constants and indices included)
            assignment = _solve_once(flow, region, solved, record)
            spec = RecurrenceSpec(kind=assignment.kind, src="torch", state=assignment.state)
            check_replaceable(region)
            # the IR node against the region on random inputs: bounded by default, the whole region with verify
            start = time.perf_counter()
            why = verify_mode.check_rewrite(flow, region, assignment, spec, thorough=verify)
            record.pass_seconds[CHECK_SECONDS] = record.pass_seconds.get(CHECK_SECONDS, 0.0) + \
                time.perf_counter() - start
            if why:
                raise NotARecurrence(why, nodes=[where.name])
        except NotARecurrence as e:
            if e.candidate and not inner:
                refused.append(span)
                record.near_misses.append(NearMiss(frontend="torch", module=module_name(where), reason=e.reason,
                                                   nodes=e.nodes or (where.name,)))
            continue
        except Exception as e:  # a bug in the analysis leaves the graph untouched, and says so
            record.near_misses.append(NearMiss(
                frontend="torch", module=module_name(where), nodes=(where.name,),
                reason=f"torch frontend internal error while analysing the loop at {where.name}: "
                       f"{type(e).__name__}: {e}"))
            continue
        taken |= region.nodes
        accepted.append((region, assignment, spec))
    _report_one_step_loops(flow, loops, taken, record)
    # graph positions of the original nodes keep their relative order while others are inserted
    renamed: dict = {}
    accepted.sort(key=lambda item: flow.pos[item[0].body.windows[0][0]])
    for region, assignment, spec in accepted:
        replace_region(gm, flow, region, assignment, spec, renamed)
    if accepted:
        gm.recompile()  # the pipeline lints and recompiles again after all passes; a direct caller needs this
    return len(accepted)


def _solve_once(flow: Dataflow, region: Region, solved: dict, record: GraphRecord) -> Assignment:
    """``solve``, once per distinct loop over chunks: a region with the key of one accepted before (a model's next
    layer) that computes what that one computed on its probe inputs gets its assignment on its own nodes
    (repeats.py)."""
    keyed = region_key(flow, region) if region.chunk > 1 else None
    if keyed is not None and keyed[0] in solved:
        accepted, nodes = solved[keyed[0]]
        assignment = carried_over(accepted, dict(zip(nodes, keyed[1])), region)
        if reproduces(flow, region, assignment):
            record.pass_counts[SHARED_CHECKS] = record.pass_counts.get(SHARED_CHECKS, 0) + 1
            return assignment
    assignment = semantics.solve(flow, region)
    if keyed is not None:  # a copy: the rewrite check drops the probe runs of the assignment it is given
        solved[keyed[0]] = (dataclasses.replace(assignment), keyed[1])
    return assignment


def _refuse_sizes_marked_dynamic(flow, loops, record: GraphRecord) -> bool:
    """An unrolled loop is rewritten at fixed sizes (``dataflow.specialize``); a size the user marked dynamic
    cannot be pinned (Dynamo refuses the compile), so every loop of the graph is left as it is, and says why."""

    marked = sizes_marked_dynamic(flow.nodes)
    pinned = {sym for n in flow.nodes if tensor_value(n) is not None for sym in symbols_of(tensor_value(n))}
    sizes = sorted({marked[sym] for sym in marked.keys() & pinned})
    if not sizes:
        return False
    outer = [lp for lp in loops if not any(_inside(lp, other) for other in loops if other is not lp)]
    for loop in outer:
        where = loop.slices[0].node
        record.near_misses.append(NearMiss(
            frontend="torch", module=module_name(where), nodes=(where.name,),
            reason=f"the loop runs on sizes marked dynamic with torch._dynamo.mark_dynamic ({', '.join(sizes)}): an "
                   f"unrolled loop is rewritten at fixed sizes (one compile per size), and pinning a size marked "
                   f"dynamic fails the compile; mark it with torch._dynamo.maybe_mark_dynamic, or not at all, to "
                   f"have the loop rewritten"))
    return True


def _inside(loop, other) -> bool:
    """Whether ``loop`` lies within the steps of ``other`` (a loop nested in it) and is not ``other`` itself."""
    a, b = _span(loop)
    c, d = _span(other)
    return c <= a and b <= d and (a, b) != (c, d)


def _span(loop) -> tuple[int, int]:
    """Graph positions of an unrolled loop, one step's length before and after its slice reads."""
    period = loop.starts[loop.first + 1] - loop.starts[loop.first]
    return loop.starts[loop.first] - period, loop.ends[loop.last] + period


def _report_one_step_loops(flow, loops, taken: set, record: GraphRecord) -> None:
    """Loops unrolled to a single step are not rewritten (``one_step.py``), but explain says so."""

    try:
        found = find_one_step_loops(flow, loops, taken)
    except Exception as e:  # a bug in the detection only costs the report, and says so
        first = flow.nodes[0] if flow.nodes else None
        record.near_misses.append(NearMiss(
            frontend="torch", module=module_name(first) if first is not None else "", nodes=(),
            reason=f"torch frontend internal error while looking for one-step loops: {type(e).__name__}: {e}"))
        return
    for one in found:
        where = one.slices[0].node
        record.near_misses.append(NearMiss(frontend="torch", module=module_name(where), reason=one.reason(),
                                           nodes=tuple(s.node.name for s in one.slices)))
