"""Time slices: the nodes that read one index of a loop-invariant tensor along one dim.

An unrolled ``for i in range(n)`` reads its per-step inputs with one of
    x[:, i]  x[..., i, :]  x[:, :, i, -1, None]     getitem with an int in the index tuple
    x[:, i:i + 1]                                    getitem with a one-wide slice (keepdim)
    x.select(d, i)  torch.select(x, d, i)
    x.unbind(d)[i]                                   getitem of an unbind
Each such read is a ``TimeSlice(node, source, dim, index, key)``; ``key`` identifies the
family of reads that differ only in ``index`` (the other literals of the index tuple are part
of it, so ``k[:, :, i, j]`` belongs to one family per ``j`` along dim 2 and one per ``i``
along dim 3: nested loops are found separately).
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import static_int, tensor_value


@dataclasses.dataclass(frozen=True)
class TimeSlice:
    node: torch.fx.Node
    source: torch.fx.Node
    dim: int  # dim of ``source`` that is indexed
    index: int  # non-negative
    keepdim: bool  # x[:, i:i+1] keeps the indexed dim
    key: tuple  # family key: (source, dim, keepdim, the other literals)


def _index_dims(index: tuple, rank: int):
    """Yields (position in the index tuple, source dim or None) for every item of ``index``."""
    consumed = sum(1 for it in index if it is not None and it is not Ellipsis)
    dim = 0
    for p, item in enumerate(index):
        if item is Ellipsis:
            dim += rank - consumed
            yield p, None
        elif item is None:
            yield p, None
        else:
            yield p, dim
            dim += 1


def _freeze(item):
    if isinstance(item, slice):
        return ("slice", item.start, item.stop, item.step)
    if isinstance(item, torch.fx.Node):
        return ("node", item)
    return item


def time_slices(node: torch.fx.Node) -> list[TimeSlice]:
    """Every way ``node`` can be read as a time slice (one per int in its index)."""
    if node.op == "call_function" and node.target is operator.getitem:
        src, index = node.args
        if not isinstance(src, torch.fx.Node):
            return []
        if src.op in ("call_method", "call_function") and getattr(src.target, "__name__", src.target) == "unbind" \
                and isinstance(index, int):
            sv = tensor_value(src.args[0])
            if sv is None:
                return []
            d = src.kwargs.get("dim", src.args[1] if len(src.args) > 1 else 0) % sv.dim()
            size = static_int(sv.shape[d])
            if size is None:
                return []
            return [TimeSlice(node, src.args[0], d, index % size, False, (src.args[0], d, False, "unbind"))]
        sv = tensor_value(src)
        if sv is None:
            return []
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(it, (torch.fx.Node, list)) or (isinstance(it, torch.Tensor)) for it in index):
            return []
        out = []
        items = list(_index_dims(index, sv.dim()))
        for p, d in items:
            item = index[p]
            if d is None or d >= sv.dim():
                continue
            size = static_int(sv.shape[d])
            if size is None:
                continue
            if isinstance(item, int) and not isinstance(item, bool):
                keep, i = False, item % size
            elif isinstance(item, slice) and isinstance(item.start, int) and item.stop == item.start + 1 \
                    and item.step in (None, 1) and item.start >= 0:
                keep, i = True, item.start
            else:
                continue
            rest = tuple(_freeze(it) if q != p else "#" for q, it in enumerate(index))
            out.append(TimeSlice(node, src, d, i, keep, (src, d, keep, rest)))
        return out
    if node.op in ("call_method", "call_function") and getattr(node.target, "__name__", node.target) == "select":
        src = node.args[0]
        sv = tensor_value(src) if isinstance(src, torch.fx.Node) else None
        if sv is None or len(node.args) < 3 or not isinstance(node.args[2], int):
            return []
        d = node.args[1] % sv.dim()
        size = static_int(sv.shape[d])
        if size is None:
            return []
        return [TimeSlice(node, src, d, node.args[2] % size, False, (src, d, False, "select"))]
    return []
