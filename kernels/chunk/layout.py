"""Where every chunk of a (possibly packed) batch lives: what the stage launchers index the chunks with."""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.kernels.chunk.launch import cdiv


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    B: int
    T: int
    N: int  # sequences
    NT: int  # chunks over all sequences
    cu_seqlens: torch.Tensor | None  # [N + 1]: where each packed sequence starts, varlen only
    chunk_indices: torch.Tensor | None  # [NT, 2] int32: (sequence, chunk within it), varlen only
    chunk_offsets: torch.Tensor | None  # [N + 1] int32: first chunk of every sequence, varlen only


def chunk_layout(B: int, T: int, C: int, cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    if cu_seqlens is None:
        return ChunkLayout(B, T, B, B * cdiv(T, C), None, None, None)
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={B}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [(n + C - 1) // C for n in lengths]
    rows = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    dev = cu_seqlens.device
    indices = torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=dev).reshape(-1, 2)
    return ChunkLayout(B, T, len(lengths), len(rows), cu_seqlens, indices,
                       torch.tensor(offsets, dtype=torch.int32, device=dev))
