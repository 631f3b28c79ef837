"""Checks of a laqat node's inputs, at the door: before any kernel runs.

``check_tensors`` looks at what is known at compile time (ranks, dtypes, devices; the verify pass runs it
on the graph's example values, so a bad input is an error while compiling). ``check_cu_seqlens_values``
looks at the offsets themselves; the forward ops run it before their kernel (every variant copies the
offsets to the host anyway), so offsets that run past T or do not start at 0 never reach a kernel.
"""
from __future__ import annotations

import torch


class IRInputError(ValueError):
    """An input of a laqat node that the IR cannot take; the message names the argument."""


def check_tensors(where: str, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
        if t.dim() != rank:
            raise IRInputError(f"{where}: {name} must have {rank} dims ([B, T, H, D] / [B, T, HV]), got shape "
                               f"{tuple(t.shape)}")
    if g.dim() not in (3, 4):
        raise IRInputError(f"{where}: g must be [B, T, HV] (GDN) or [B, T, HV, K] (KDA), got {tuple(g.shape)}")
    if k.dtype != q.dtype:
        raise IRInputError(f"{where}: q and k must have one dtype, got q {q.dtype} and k {k.dtype}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise IRInputError(f"{where}: {name} is on {t.device}, q on {q.device}")
    if cu_seqlens is None:
        return
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise IRInputError(f"{where}: cu_seqlens must be int32 or int64 offsets, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise IRInputError(f"{where}: cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape "
                           f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise IRInputError(f"{where}: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")


def check_cu_seqlens_values(where: str, cu_seqlens, tokens: int) -> None:
    """Offsets start at 0, never decrease and end at T (q.shape[1])."""
    if cu_seqlens is None:
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != tokens or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise IRInputError(f"{where}: cu_seqlens must start at 0, never decrease and end at T={tokens}; got "
                           f"{offsets if len(offsets) <= 16 else offsets[:8] + ['...'] + offsets[-4:]}")
