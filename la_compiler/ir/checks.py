"""Checks of a laqat node's inputs, at the door: before any kernel runs.

``check_tensors`` looks at what is known at compile time (ranks, dtypes, devices; the verify pass runs it
on the graph's example values, so a bad input is an error while compiling). ``check_cu_seqlens_values``
looks at the offsets themselves; the forward ops run it before their kernel (every variant copies the
offsets to the host anyway), so offsets that run past T or do not start at 0 never reach a kernel.
"""
from __future__ import annotations

import torch

from la_compiler.errors import LaqatError


class IRInputError(LaqatError, ValueError):
    """An input of a laqat node that the IR cannot take; the message names the argument."""


def check_tensors(where: str, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    problem = tensor_problem(where, q, k, v, g, beta, initial_state, cu_seqlens)
    if problem is not None:
        raise _unwrapped_by_dynamo(IRInputError(problem))


def _unwrapped_by_dynamo(error: IRInputError) -> IRInputError:
    """Raised while Dynamo runs a traced call of a laqat op on fake tensors, an error would reach the user wrapped
    in Dynamo's ``TorchRuntimeError``. There it is raised as Dynamo's ``Unsupported`` too (a subclass of both,
    same name and message): Dynamo ends the graph before the call, which then runs as it is and raises the same
    ``IRInputError``; with ``fullgraph=True`` Dynamo re-raises this one. Either way ``except IRInputError``
    (``except la_compiler.LaqatError``) catches it. The trace-time frontends check before they emit the op
    (``tensor_problem``), so their calls never get here."""
    from torch._dynamo.utils import get_current_node

    if get_current_node() is None:  # not Dynamo's fake propagation of a traced node
        return error
    from torch._dynamo.exc import Unsupported

    cls = _GRAPH_BREAKING.get(type(error))
    if cls is None:
        cls = _GRAPH_BREAKING[type(error)] = type(type(error).__name__, (type(error), Unsupported),
                                                  {"__module__": type(error).__module__,
                                                   "__qualname__": type(error).__qualname__})
    out = cls.__new__(cls, *error.args)
    Unsupported.__init__(out, str(error), gb_type="laqat op input refused")
    return out


_GRAPH_BREAKING: dict = {}


def tensor_problem(where: str, q, k, v, g, beta, initial_state, cu_seqlens) -> str | None:
    """What ``check_tensors`` refuses, as a message (None: nothing); plain Python on the inputs' metadata, so that a
    trace-time frontend can check before it emits the node (Dynamo traces it)."""
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
        if t.dim() != rank:
            return (f"{where}: {name} must have {rank} dims ([B, T, H, D] / [B, T, HV]), got shape "
                    f"{tuple(t.shape)}")
    if g.dim() not in (3, 4):
        return f"{where}: g must be [B, T, HV] (GDN) or [B, T, HV, K] (KDA), got {tuple(g.shape)}"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and not t.dtype.is_floating_point:
            return f"{where}: {name} must be a floating tensor, got {t.dtype}"
    if k.dtype != q.dtype:
        return f"{where}: q and k must have one dtype, got q {q.dtype} and k {k.dtype}"
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            return f"{where}: {name} is on {t.device}, q on {q.device}"
    if cu_seqlens is None:
        return None
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        return f"{where}: cu_seqlens must be int32 or int64 offsets, got {cu_seqlens.dtype}"
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        return f"{where}: cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}"
    if cu_seqlens.device != q.device:
        return f"{where}: cu_seqlens is on {cu_seqlens.device}, q on {q.device}"
    return None


def check_cu_seqlens_values(where: str, cu_seqlens, tokens: int) -> None:
    """Offsets start at 0, never decrease and end at T (q.shape[1])."""
    if cu_seqlens is None:
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != tokens or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise IRInputError(f"{where}: cu_seqlens must start at 0, never decrease and end at T={tokens}; got "
                           f"{offsets if len(offsets) <= 16 else offsets[:8] + ['...'] + offsets[-4:]}")
