"""Chain discovery: unrolled loops, their steps, the loop-carried state and the step outputs.

Dynamo unrolls ``for i in range(n)``: iteration ``i`` becomes a contiguous run of nodes (a
*window*) that reads ``x[..., i, ...]`` slices (``slices.py``). A loop is found from its
slice families alone (linear in the graph); its windows are then compared position by
position with the previous window, which is an exact step isomorphism: same ops, same
shapes, same loop invariants, literals equal except the time index (which must advance by
exactly one), and references to the previous window only through loop-carried values.
The last window is aligned as a subsequence (Dynamo drops a dead last state update when
the final state is not used); a last step that computes something more (``if t == T - 1: ...``) is not
one of them. A literal that changes from step to step anywhere but in a time index (``/ max(t, 1)``)
makes the steps different programs: a near miss naming the step, the value and its line.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

import torch

from la_compiler.error_base import LaqatError
from la_compiler.passes.frontends.torch_recurrence.allowed_ops import op_name, where_from
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, is_inplace_write, static_int, tensor_value
from la_compiler.passes.frontends.torch_recurrence.slices import time_slices, TimeSlice, _index_dims


class NotARecurrence(LaqatError):
    """A loop that fails a check; ``candidate`` says whether to report it. Internal: the frontend turns it into a
    near miss, it never reaches the user."""

    def __init__(self, reason: str, candidate: bool = True, nodes=()):
        super().__init__(reason)
        self.reason, self.candidate, self.nodes = reason, candidate, tuple(nodes)


@dataclasses.dataclass
class Loop:
    first: int  # index range first..last
    last: int
    starts: dict  # index -> min graph position of its slices
    ends: dict  # index -> max graph position of its slices
    slices: list  # TimeSlice


@dataclasses.dataclass
class LoopBody:
    loop: Loop
    windows: list  # list[list[Node | None]] aligned to the template offsets (None: dead in the last step)
    state_offset: int
    init: torch.fx.Node  # the state entering the first step
    o_offset: int  # offset of the per-step output value
    o_buffer: torch.fx.Node | None  # the tensor written by `o[..., t] = ...`, or None
    o_collector: torch.fx.Node | None  # stack/cat of the per-step outputs, or None
    o_time_dim: int  # time dim of the collected output (buffer or collector)
    final_state: torch.fx.Node | None  # the last state, when read after the loop

    @property
    def steps(self) -> int:
        return len(self.windows)

    @property
    def states(self):
        return [w[self.state_offset] for w in self.windows]

    @property
    def outputs(self):
        return [w[self.o_offset] for w in self.windows]

    def nodes(self):
        return [n for w in self.windows for n in w if n is not None]

    def external_inputs(self) -> list[torch.fx.Node]:
        inside = set(self.nodes())
        seen, out = set(), []
        for n in self.nodes():
            for a in n.all_input_nodes:
                if a not in inside and a not in seen:
                    seen.add(a)
                    out.append(a)
        return out


def marker(flow: Dataflow, s: TimeSlice) -> int:
    """Where step ``s.index`` reads the slice: the slice itself, or for the items of an
    ``unbind`` (which Dynamo emits all at once before the loop) their first reader."""
    if s.key[3] == "unbind":
        readers = [flow.pos[r] for r in s.node.users]
        return min(readers) if readers else flow.pos[s.node]
    return flow.pos[s.node]


def find_loops(flow: Dataflow) -> list[Loop]:
    """Unrolled loops of at least two iterations, outermost first (linear in the graph)."""
    families: dict[tuple, list[TimeSlice]] = defaultdict(list)
    for n in flow.nodes:
        for s in time_slices(n):
            families[s.key].append(s)
    valid = []
    for fam in families.values():
        fam.sort(key=lambda s: marker(flow, s))
        run = [fam[0]]  # one source read by two loops (two layers) gives two runs 0..n-1
        for s in fam[1:] + [None]:
            # the next step's read, or the same step reading the same slice once more
            if s is not None and s.index in (run[-1].index + 1, run[-1].index):
                run.append(s)
                continue
            if run[-1].index > run[0].index:
                valid.append(run)
            run = [s]
    valid.sort(key=lambda f: marker(flow, f[0]))
    loops: list[Loop] = []
    for fam in valid:
        a, b = fam[0].index, fam[-1].index
        lo, hi = {}, {}
        for s in fam:
            m = marker(flow, s)
            lo[s.index], hi[s.index] = min(lo.get(s.index, m), m), max(hi.get(s.index, m), m)
        for lp in loops:
            if (lp.first, lp.last) != (a, b):
                continue
            starts = {i: min(lp.starts[i], lo[i]) for i in lo}
            ends = {i: max(lp.ends[i], hi[i]) for i in hi}
            if all(ends[i] < starts[i + 1] for i in range(a, b)):
                lp.starts, lp.ends = starts, ends
                lp.slices.extend(fam)
                break
        else:
            loops.append(Loop(a, b, dict(lo), dict(hi), list(fam)))
    loops.sort(key=lambda lp: (lp.starts[lp.first], -(lp.last - lp.first)))
    return loops


def _flatten(x, out):
    if isinstance(x, (tuple, list)):
        out.append(("seq", type(x).__name__, len(x)))
        for y in x:
            _flatten(y, out)
    elif isinstance(x, dict):
        out.append(("dict", tuple(sorted(x))))
        for k in sorted(x):
            _flatten(x[k], out)
    elif isinstance(x, slice):
        out.append(("slice",))
        for y in (x.start, x.stop, x.step):
            _flatten(y, out)
    else:
        out.append(x)
    return out


class _Windows:
    """Where each node sits: (window index, offset); and each node's flattened arguments."""

    def __init__(self):
        self.where: dict[torch.fx.Node, tuple[int, int]] = {}
        self.flat: dict[torch.fx.Node, list] = {}

    def flat_args(self, node: torch.fx.Node) -> list:
        flat = self.flat.get(node)
        if flat is None:  # each node is compared twice: as the later and as the earlier step
            flat = self.flat[node] = _flatten((node.args, node.kwargs), [])
        return flat

    def classify(self, leaf, w: int):
        at = self.where.get(leaf)
        if at is None:
            return ("ext", leaf)
        if at[0] == w:
            return ("loc", at[1])
        if at[0] == w - 1:
            return ("prev", at[1])
        return ("far", at)


def _same_step(cur: torch.fx.Node, prev: torch.fx.Node, w: int, first: int, where: _Windows, carried: dict,
               slice_of: dict, step0: int = 0) -> str | None:
    """None when ``cur`` (window w) is ``prev`` (window w-1) one step later; else what differs."""
    if cur.op != prev.op or cur.target != prev.target:
        return f"op {cur.format_node()} vs {prev.format_node()}"
    vc, vp = tensor_value(cur), tensor_value(prev)
    if (vc is None) != (vp is None) or (vc is not None and (vc.shape != vp.shape or vc.dtype != vp.dtype)):
        return f"shape of {cur.name} differs from {prev.name}"
    lc, lp = where.flat_args(cur), where.flat_args(prev)
    if len(lc) != len(lp):
        return f"arguments of {cur.name} differ from {prev.name}"
    for i, (a, b) in enumerate(zip(lc, lp)):
        if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
            if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
                return f"arguments of {cur.name} differ from {prev.name}"
            ca, cb = where.classify(a, w), where.classify(b, w - 1)
            if ca[0] == "far":
                return f"{cur.name} reads {a.name} from an earlier step than the previous one"
            if ca == cb:
                continue
            if ca[0] == "prev" and cb[0] == "ext" and w - 1 == first:
                if carried.setdefault(ca[1], b) is not b:
                    return f"loop-carried value at offset {ca[1]} enters the first step as two different nodes"
                continue
            if ca[0] == "prev" and cb[0] == "prev" and ca[1] == cb[1]:
                continue
            sa, sb = slice_of.get(a), slice_of.get(b)
            if ca[0] == cb[0] == "ext" and sa is not None and sb is not None and sa.key == sb.key \
                    and sa.index == sb.index + 1:
                continue  # the items of an unbind over time, read one per step
            return f"{cur.name} reads {a.name} where the previous step read {b.name}"
        elif a != b:
            if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a - b == 1 \
                    and _is_time_index(cur, i, where, w):
                continue  # the time index of a per-step slice or output write advances by one
            return _literal_differs(cur, a, b, step0 + w - 1)
    return None


def _literal_differs(cur: torch.fx.Node, a, b, prev_step: int) -> str:

    return (f"it reads the value {a!r} at {where_from(cur)} where step {prev_step} reads {b!r} (a constant, literal "
            f"or index that depends on the step; every step must compute the same function of its own token's "
            f"inputs)")


def _flat_paths(x, path, out):
    """The path of every item of ``_flatten(x)``, in the same order."""
    out.append(path)
    if isinstance(x, (tuple, list)):
        for i, y in enumerate(x):
            _flat_paths(y, path + (i,), out)
    elif isinstance(x, dict):
        for k in sorted(x):
            _flat_paths(x[k], path + (k,), out)
    elif isinstance(x, slice):
        for i, y in enumerate((x.start, x.stop, x.step)):
            _flat_paths(y, path + (i,), out)
    return out


def _index_paths(index, prefix: tuple) -> set:
    """Paths of the int items (and one-wide slices' bounds) of a getitem / setitem index."""
    if isinstance(index, int):
        return {prefix}
    if not isinstance(index, tuple):
        return set()
    out = set()
    for p, item in enumerate(index):
        if isinstance(item, int) and not isinstance(item, bool):
            out.add(prefix + (p,))
        elif isinstance(item, slice) and isinstance(item.start, int) and item.stop == item.start + 1:
            out |= {prefix + (p, 0), prefix + (p, 1)}
    return out


def _is_time_index(cur: torch.fx.Node, position: int, where: "_Windows", w: int) -> bool:
    """Whether the literal at ``position`` of ``cur``'s flattened arguments sits where a step's time index does:
    the index of a per-step slice of a tensor computed outside the loop (``x[:, t]``, ``x[:, t:t + 1]``,
    ``x.select(1, t)``, an unbind's item ``t``), or of a step's write into an outside buffer (``o[:, t] = ...``).
    Anything else that changes from step to step (``/ max(t, 1)``, ``roll(t)``, ``full(..., t)``) makes the steps
    different programs."""
    allowed = set()
    if cur.op == "call_function" and cur.target is operator.getitem:
        src = cur.args[0]
        if isinstance(src, torch.fx.Node) and where.classify(src, w)[0] == "ext" and time_slices(cur):
            allowed = _index_paths(cur.args[1], (0, 1))
    elif cur.op == "call_function" and cur.target is operator.setitem:
        base = cur.args[0]
        if isinstance(base, torch.fx.Node) and where.classify(base, w)[0] == "ext":
            allowed = _index_paths(cur.args[1], (0, 1))
    elif time_slices(cur) and isinstance(cur.args[0], torch.fx.Node) and where.classify(cur.args[0], w)[0] == "ext":
        allowed = {(0, 2)}  # select(x, dim, t)
    if not allowed:
        return False
    return _flat_paths((cur.args, cur.kwargs), (), [])[position] in allowed


MAX_ROTATION = 8


def analyze_loop(flow: Dataflow, loop: Loop) -> LoopBody:
    """Windows, step isomorphism, carried state, outputs; raises ``NotARecurrence``.

    A step's first node is not always a slice (``s = s * a + x[:, t]`` evaluates ``s * a``
    first), so the step boundary is tried a few nodes earlier as well: the first boundary
    at which the loop analyses as one recurrence wins; else the first boundary's failure."""
    starts = _rotate(flow, [loop.starts[i] for i in range(loop.first, loop.last + 1)])
    first_error = None
    for extra in range(MAX_ROTATION + 1):
        try:
            return _analyze(flow, loop, [st - extra for st in starts])
        except NotARecurrence as e:
            first_error = first_error or e
        if not _belongs_to_next_step(flow, [st - extra for st in starts]):
            break
    raise first_error


def _belongs_to_next_step(flow: Dataflow, starts) -> bool:
    """Whether the node before each step's start is read only within that step."""
    for i, st in enumerate(starts[:-1]):
        p = st - 1
        if p < 0 or not flow.nodes[p].users or \
                not all(p < flow.pos[u] < starts[i + 1] - 1 for u in flow.nodes[p].users):
            return False
    return True


def _analyze(flow: Dataflow, loop: Loop, starts: list[int]) -> LoopBody:
    nodes, a, b = flow.nodes, loop.first, loop.last
    lengths = {starts[i + 1] - starts[i] for i in range(len(starts) - 1)}
    candidate = _has_state_like_carry(flow, nodes[starts[0]:starts[1]], starts[1], starts[-1] if len(starts) > 2 else None)
    if len(lengths) != 1:
        raise NotARecurrence(f"loop over index {a}..{b}: steps are not isomorphic (they have different node "
                             f"counts {sorted(lengths)[:4]})", candidate)
    period = lengths.pop()
    where = _Windows()
    slice_of = {s.node: s for s in loop.slices}
    windows = [nodes[starts[0]:starts[0] + period]]
    for off, n in enumerate(windows[0]):
        where.where[n] = (0, off)
    carried: dict[int, torch.fx.Node] = {}
    for w in range(1, len(starts) - 1):
        win = nodes[starts[w]:starts[w] + period]
        for off, n in enumerate(win):
            where.where[n] = (w, off)
        for off, n in enumerate(win):
            why = _same_step(n, windows[w - 1][off], w, 0, where, carried, slice_of, a)
            if why:
                raise NotARecurrence(f"step {a + w} is not isomorphic to step {a + w - 1}: {why}", candidate, [n.name])
        windows.append(win)
    # the last step, aligned as a subsequence of the one before (a dead final update may be missing)
    w, cursor, last, mismatch = len(starts) - 1, starts[-1], [], None
    for off, tmpl in enumerate(windows[-1]):
        if cursor < len(nodes) and nodes[cursor].op != "output":
            where.where[nodes[cursor]] = (w, off)
            why = _same_step(nodes[cursor], tmpl, w, 0, where, carried, slice_of, a)
            if why is None:
                last.append(nodes[cursor])
                cursor += 1
                continue
            mismatch = mismatch or (nodes[cursor], why)
            del where.where[nodes[cursor]]
        last.append(None)
    windows.append(last)
    if mismatch is not None and None in last and _reads_step(mismatch[0], set(n for n in last if n is not None)):
        # not a dead final update but a last step that computes something else (`if t == T - 1: S = S.clamp(...)`)
        raise NotARecurrence(f"step {a + w} is not isomorphic to step {a + w - 1}: {mismatch[1]}", candidate,
                             [mismatch[0].name])

    _check_time_indices(windows, loop, where)
    if len(carried) != 1:
        what = "no loop-carried value" if not carried else \
            f"{len(carried)} loop-carried values ({', '.join(windows[0][o].name for o in sorted(carried))})"
        raise NotARecurrence(f"loop over index {a}..{b}: {what}; a recurrence carries exactly one state",
                             candidate and bool(carried))
    (state_offset, init), = carried.items()
    sv = tensor_value(windows[0][state_offset])
    if sv is None or sv.dim() < 3 or not sv.dtype.is_floating_point:
        raise NotARecurrence("loop-carried value is not a floating tensor of rank >= 3", False)
    return _outputs(flow, loop, windows, state_offset, init)


def _reads_step(node: torch.fx.Node, step_nodes: set) -> bool:
    """Whether ``node``, which the last step's alignment could not place, computes on that step's values (a
    collector of the per-step outputs after the loop does not count)."""
    if getattr(node.target, "__name__", node.target) in ("stack", "cat"):
        return False
    return any(x in step_nodes for x in node.all_input_nodes)


def _rotate(flow: Dataflow, starts: list[int]) -> list[int]:
    """Moves every step's start back over slice reads that open the step before the first slice
    of a loop family (``kt = k[:, t - 1]`` as the first statement), by the same amount for all."""
    nodes, r = flow.nodes, 0
    while True:
        r1 = r + 1
        for i, st in enumerate(starts):
            p = st - r1
            end = starts[i + 1] - r1 if i + 1 < len(starts) else st + (st - starts[i - 1]) - r1
            if p < 0 or not time_slices(nodes[p]) or not nodes[p].users or \
                    not all(p <= flow.pos[u] < end for u in nodes[p].users):
                return [st - r for st in starts]
        r = r1


def _check_time_indices(windows, loop: Loop, where: _Windows):
    """Every read of an outside tensor at an int index, in step i, reads index i."""
    for w, win in enumerate(windows):
        step = loop.first + w
        for n in win:
            if n is None:
                continue
            reads = [s for s in time_slices(n) if s.source not in where.where and s.key[3] != "unbind"]
            if reads and not any(s.index == step for s in reads):
                s = reads[0]
                raise NotARecurrence(f"step {step} reads {s.source.name}[{s.index}] along dim {s.dim} at "
                                     f"{where_from(n)}, not the step's own index {step}", nodes=[n.name])


def _has_state_like_carry(flow, first_window, second_start, third_start) -> bool:
    """A floating rank >= 3 value of the first step read by the second, with the same shape at
    the same offset of the second step: worth a near-miss report if the loop is rejected."""
    inside = set(first_window)
    hi = third_start if third_start is not None else second_start + 4 * len(first_window)
    for off, n in enumerate(first_window):
        v = tensor_value(n)
        if v is None or v.dim() < 3 or not v.dtype.is_floating_point:
            continue
        twin = flow.nodes[second_start + off] if second_start + off < len(flow.nodes) else None
        tv = tensor_value(twin) if twin is not None else None
        if tv is None or tv.shape != v.shape:
            continue
        for r in flow.readers(n):
            if r not in inside and second_start <= flow.pos[r] < hi and not is_inplace_write(r):
                return True
    return False


def _outputs(flow: Dataflow, loop: Loop, windows, state_offset, init) -> LoopBody:
    a = loop.first
    members = {n: (w, off) for w, win in enumerate(windows) for off, n in enumerate(win) if n is not None}
    loop_end = max(flow.pos[n] for n in members)
    tmpl = windows[0]
    writes = [off for off, n in enumerate(tmpl) if is_inplace_write(n) and n.args[0] not in members]
    o_offset, o_buffer, o_collector, o_time_dim = None, None, None, None
    if writes:
        if len(writes) != 1:
            raise NotARecurrence(f"each step writes {len(writes)} outside tensors; expected one output write")
        o_offset = writes[0]
        o_buffer = tmpl[o_offset].args[0]
        for w, win in enumerate(windows):
            if win[o_offset] is None:
                raise NotARecurrence(f"step {a + w} does not write its output")
        o_time_dim = _write_time_dim(windows, o_offset, a)
    escaping = defaultdict(list)  # offset -> readers after the loop
    for n, (w, off) in members.items():
        for r in flow.readers(n):
            if r not in members:
                if flow.pos[r] < loop_end and not (r.op == "output"):
                    raise NotARecurrence(f"intermediate {n.name} of step {a + w} is read by {r.name} inside the loop "
                                         f"but outside the recurrence", nodes=[n.name, r.name])
                escaping[off].append((w, r))
    final_state = None
    for off, rs in escaping.items():
        if off == state_offset and all(w == len(windows) - 1 for w, _ in rs):
            final_state = windows[-1][state_offset]
            continue
        if off == o_offset:
            continue
        collectors = {r for _, r in rs}
        if o_buffer is None and o_offset is None and len(collectors) == 1:
            (col,), steps = collectors, sorted(w for w, _ in rs)
            if steps == list(range(len(windows))) and _is_collector(col, [win[off] for win in windows]):
                o_offset, o_collector = off, col
                o_time_dim = _collector_dim(col)
                continue
        w, r = rs[0]
        n = windows[w][off]
        if is_inplace_write(n):
            raise NotARecurrence(f"`{op_name(n)}` at {where_from(n)} modifies {n.args[0].name} in place inside the "
                                 f"step (an in-place or partial update of the state is not the delta rule)",
                                 nodes=[n.name])
        raise NotARecurrence(f"intermediate {n.name} of step {a + w} is read outside the recurrence "
                             f"by {r.name}", nodes=[n.name, r.name])
    if o_offset is None:
        raise NotARecurrence("the steps produce no per-step output (no `o[:, t] = ...` and no stacked list)")
    return LoopBody(loop, windows, state_offset, init, o_offset, o_buffer, o_collector, o_time_dim, final_state)


def _write_time_dim(windows, off, first) -> int:
    """The dim of the buffer that ``o[..., t] = x`` indexes with the step index."""
    dims = None
    for w, win in enumerate(windows):
        n = win[off]
        here = {d for d, i in time_slices_of_index(n.args[0], n.args[1]) if i == first + w}
        dims = here if dims is None else dims & here
    if not dims or len(dims) != 1:
        raise NotARecurrence(f"output write {windows[0][off].name} does not index the buffer with the step index")
    return dims.pop()


def time_slices_of_index(buf: torch.fx.Node, index) -> list[tuple[int, int]]:
    """(dim, index) of every int in a setitem index."""

    bv = tensor_value(buf)
    index = index if isinstance(index, tuple) else (index,)
    out = []
    for p, d in _index_dims(index, bv.dim()):
        item = index[p]
        if d is not None and isinstance(item, int) and not isinstance(item, bool):
            out.append((d, item % static_int(bv.shape[d])))
        elif d is not None and isinstance(item, slice) and isinstance(item.start, int) and item.stop == item.start + 1:
            out.append((d, item.start))
    return out


def _is_collector(col: torch.fx.Node, items) -> bool:
    name = getattr(col.target, "__name__", col.target)
    if name not in ("stack", "cat") or not col.args or list(col.args[0]) != list(items):
        return False
    if name == "cat":
        d = _collector_dim(col)
        return all(tensor_value(x) is not None and tensor_value(x).shape[d] == 1 for x in items)
    return True


def _collector_dim(col: torch.fx.Node) -> int:
    d = col.kwargs.get("dim", col.args[1] if len(col.args) > 1 else 0)
    return d % tensor_value(col).dim()
