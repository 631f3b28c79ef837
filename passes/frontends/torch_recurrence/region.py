"""Region extraction: the loop, the nodes that only feed it, and the value it produces.

``grow`` adds, latest first, every node whose readers are all in the region and that the
frontier rules (``rules.py``) admit; what remains outside and is read by the region is the
frontier: the candidate q, k, v, g, beta and initial state. ``output_node`` follows the
collected output forward to the first per-token tensor of the unpadded length: the node
whose readers the IR node's ``o`` will feed.
"""
from __future__ import annotations

import dataclasses
import heapq
import operator

import torch

from la_compiler.passes.frontends.torch_recurrence import rules
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, is_inplace_write, static_int, tensor_value
from la_compiler.passes.frontends.torch_recurrence.entry import entry_chains
from la_compiler.passes.frontends.torch_recurrence.loops import LoopBody, NotARecurrence


@dataclasses.dataclass
class Region:
    body: LoopBody
    nodes: set  # every node the IR node replaces
    frontier: list  # external tensor nodes the region reads, in graph order
    seq_len: int  # T (unpadded)
    padded_len: int
    chunk: int  # 1 for token loops
    output: torch.fx.Node  # the node whose readers get the IR's o (the buffer, a stack, an unpad slice)
    final_state: torch.fx.Node | None
    chains: dict = dataclasses.field(default_factory=dict)  # frontier node -> EntryChain | None (entry.py)
    chain_nodes: set = dataclasses.field(default_factory=set)  # the nodes of those chains

    def ordered(self, flow: Dataflow):
        """The live region nodes in graph order (dead ones are only erased, never run)."""
        return sorted((n for n in self.nodes if n not in flow.dead), key=flow.pos.__getitem__)


def _per_token(v, lo, hi) -> bool:
    """[B, T, H, D]-like: rank 2..4 with a sequence-length dim (never the feature dim of a rank-4 one)."""
    if v is None or not 2 <= v.dim() <= 4:
        return False
    dims = v.shape[:-1] if v.dim() == 4 else v.shape
    return any((n := static_int(s)) is not None and lo < n <= hi for s in dims)


def chunk_geometry(body: LoopBody) -> tuple[int, int]:
    """(chunk size, padded length): 1 and n for a token loop; C and n*C for a loop over chunks
    (C is the dim after the indexed one in the sliced sources, the most common one)."""
    n = body.steps
    sizes = {}
    for s in body.loop.slices:
        sv = tensor_value(s.source)
        if s.node in body.windows[0] and sv is not None and not s.keepdim and s.dim + 1 < sv.dim() and sv.dim() >= 4:
            c = sv.shape[s.dim + 1]
            sizes[c] = sizes.get(c, 0) + 1
    # a token loop slices [B, T, H, D]-like sources (rank <= 4); a chunk loop [B, H, N, C, D] ones
    token = all(tensor_value(s.source) is None or tensor_value(s.source).dim() <= 4
                for s in body.loop.slices if s.node in body.windows[0])
    if token or not sizes:
        return 1, n
    c = max(sizes, key=sizes.get)
    return c, n * c


def grow(flow: Dataflow, body: LoopBody) -> tuple[set, list, int, int]:
    chunk, padded = chunk_geometry(body)
    lo, hi = padded - chunk, padded
    state_shape = tuple(tensor_value(body.states[0]).shape)
    region = set(body.nodes())
    if body.o_buffer is not None:
        region.add(body.o_buffer)
    if body.o_collector is not None:
        region.add(body.o_collector)
    heap = []
    queued = set()

    def push_inputs(n):
        # dataflow predecessors: the arguments and, for a read of a mutated tensor, its latest writer
        for a in flow.graph.predecessors(n):
            if a not in region and a not in queued:
                queued.add(a)
                heapq.heappush(heap, (-flow.pos[a], id(a), a))

    for n in list(region):
        _add_dead_readers(flow, n, region)
    for n in list(region):
        push_inputs(n)
    while heap:
        _, _, n = heapq.heappop(heap)
        if n.op in ("placeholder", "get_attr", "output") or not all(r in region for r in flow.readers(n)):
            continue
        if not is_inplace_write(n) and not rules.is_time_unbind(n):
            v = tensor_value(n)
            if v is None:
                continue
            if _per_token(v, lo, hi) and tuple(v.shape) != state_shape and n.all_input_nodes:
                ok = rules.is_layout(n) or rules.scalar_operand(n) is not None or \
                    (rules.is_pair_mul(n) and _independent(flow, *n.args) and
                     all(_per_token(tensor_value(a), lo, hi) for a in n.args))
                if not ok:
                    continue
        region.add(n)
        _add_dead_readers(flow, n, region)
        push_inputs(n)
    frontier = set()
    for n in region:
        if n not in flow.dead:
            frontier.update(a for a in n.all_input_nodes if a not in region)
    # graph order: the role search tries the arguments' order (q, k, v, ...) first
    return region, sorted(frontier, key=flow.pos.__getitem__), chunk, padded


def _add_dead_readers(flow: Dataflow, n, region: set):
    stack = flow.dead_readers(n)
    while stack:
        d = stack.pop()
        if d not in region:
            region.add(d)
            stack.extend(flow.dead_readers(d))


def _independent(flow: Dataflow, x, y) -> bool:
    return not flow.reaches(x, y, limit=48) and not flow.reaches(y, x, limit=48)


def seq_len_of(frontier, chunk: int, padded: int) -> list[int]:
    """Candidate unpadded lengths T, most likely first: sizes in (padded - chunk, padded] by how
    many frontier tensors have them (an initial state may have a head dim in that range too)."""
    counts: dict[int, int] = {}
    for n in frontier:
        v = tensor_value(n)
        if v is None or not _per_token(v, padded - chunk, padded):
            continue
        for size in {s for s in v.shape if padded - chunk < s <= padded}:
            counts[size] = counts.get(size, 0) + 1
    return sorted(counts, key=lambda s: (-counts[s], -s))


_CHAIN_METHODS = {"reshape", "view", "permute", "transpose", "contiguous", "flatten"}
_CHAIN_FUNCTIONS = {torch.reshape, torch.permute, torch.transpose, torch.flatten, operator.getitem}


def output_node(flow: Dataflow, body: LoopBody, region: set, seq_len: int) -> torch.fx.Node:
    cur = body.o_collector if body.o_collector is not None else body.o_buffer
    for _ in range(8):
        v = tensor_value(cur)
        if v is not None and v.dim() == 4 and seq_len in v.shape:
            return cur
        readers = [r for r in flow.readers(cur) if r not in region]
        if len(readers) != 1:
            break
        (r,) = readers
        if not ((r.op == "call_method" and r.target in _CHAIN_METHODS) or
                (r.op == "call_function" and r.target in _CHAIN_FUNCTIONS)):
            break
        region.add(r)
        cur = r
    raise NotARecurrence(f"the collected output {cur.name} does not reach a [.., T={seq_len}, .., V] tensor through "
                         f"reshapes and slices", nodes=[cur.name])


def build_region(flow: Dataflow, body: LoopBody) -> Region:
    nodes, frontier, chunk, padded = grow(flow, body)
    lens = seq_len_of(frontier, chunk, padded)
    if not lens:
        raise NotARecurrence("the recurrence's inputs have no common sequence length "
                             f"(looked for a dim in ({padded - chunk}, {padded}])")
    seq_len = lens[0]
    output = output_node(flow, body, nodes, seq_len)
    chains, chain_nodes = entry_chains(frontier, nodes)
    return Region(body, nodes, frontier, seq_len, padded, chunk, output, body.final_state, chains, chain_nodes)
