"""What a training forward of the chunk kernels keeps for its backward (its residual), and where it sits in one
fp32 buffer (docs/kernels-chunk.md, "What the backward recomputes and what it keeps").

The tuning option ``t.keep_residual`` (``la_compiler.options.TuningOptions``; the spec carries it, so a forward
and its backward read the same mode):
    intra (default)  T = (I + A)^-1, A_qk, and G (GDN) or the pair products P (KDA): the backward's recompute runs
                     only W / U (KDA: after its cumsum) and the h stage
    all              also W, U, the chunk-start states h, V_new and KDA's G and decayed keys: the backward runs no
                     forward kernel (FLA's KDA calls this trade ``disable_recompute``)
    none             nothing: the backward recomputes the pairs, the whole intra stage and h

T and A_qk are kept in the GEMM operand dtype (``intermediate_dtype``: the input dtype for 16-bit GEMMs, else
fp32), as FLA keeps its solved A and A_qk; G and KDA's P stay fp32. With 16-bit GEMMs every GEMM rounds T
(W = T (beta e^G K), U = T (beta V), T^T dW, T^T dU) and A_qk (the output stage's A_qk V_new, the dh stage's
A_qk^T dO) to that dtype anyway, so the forward, the recompute's W, U, and dq, dv, dh0 are unchanged bit for bit.
The solve's gradient dA = -T^T dT T^T, the one fp32 reader of T, first refines the rounded T against A (one Newton
step, chunk/bwd_intra.py ``refined_t``; KDA's A from the kept fp32 P). A backward without a residual (``none``)
keeps its recomputed T in the same dtype (chunk/fwd.py), so every mode computes the same gradients
(docs/kernels-chunk.md, "What the backward recomputes and what it keeps").

Every part is a view of the buffer at an offset aligned to ALIGN fp32 elements; 16-bit parts (T, A_qk, W, U, h,
V_new, kd with 16-bit GEMMs) reinterpret their share of it. The chunk-start states of a varlen batch are counted
up to a bound that needs only the number of sequences (a fake tensor has no values): ceil(T / C) + N.

The buffer is an op's output (``laqat::delta_rule_train``): every element of it is written, so that two calls of
the same inputs return the same buffer (opcheck, AOTAutograd compare it). The kernels write every part's elements
(KDA's pairs kernel zeros P's blocks above the diagonal); what no kernel writes is zeroed, and only that:
``clear_gaps`` the alignment padding after each part (fewer than ALIGN elements, none for most shapes), the
forward the chunk states past a varlen batch's count (at most N).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.launch import cdiv
from la_compiler.kernels.chunk.precision import gemm_precision, intermediate_dtype
from la_compiler.options import DEFAULT_TUNING, KEEP_RESIDUAL

ALIGN = 16  # fp32 elements (64 bytes) between the starts of two parts
DEFAULT_KEEP = DEFAULT_TUNING.keep_residual


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    shape: tuple
    dtype: torch.dtype
    offset: int  # fp32 elements from the buffer's start

    def numel(self) -> int:
        return math.prod(self.shape)

    def fp32_elements(self) -> int:
        return -(-self.numel() * self.dtype.itemsize // 4)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def residual_layout(p: ChunkParams, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    keep: str = DEFAULT_KEEP) -> tuple[list[Part], int]:
    """The parts kept under ``keep`` (t.keep_residual) and the buffer's size in fp32 elements."""
    if keep not in KEEP_RESIDUAL:
        raise ValueError(f"residual_layout: keep must be one of {list(KEEP_RESIDUAL)}, got {keep!r}")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if keep == "none" or B * T == 0:
        return [], 0
    C, f32 = p.chunk, torch.float32
    mid = intermediate_dtype(gemm_precision(p, q.dtype), q.dtype)
    rows = (B, T, HV)
    # T and A_qk in the GEMM operand dtype, P in fp32 (module docstring)
    shapes = [("t_solved", (*rows, C), mid), ("A_qk", (*rows, C), mid)]
    shapes.append(("g_cum", rows, f32) if p.kind == "gdn" else ("p_pairs", (*rows, C), f32))
    if keep == "all":
        chunks = B * cdiv(T, C) if cu_seqlens is None else cdiv(T, C) + cu_seqlens.shape[0] - 1
        shapes += [("w", (*rows, K), mid), ("u", (*rows, V), mid), ("h", (chunks, HV, K, V), mid),
                   ("v_new", (*rows, V), mid)]
        if p.kind == "kda":
            shapes += [("g_cum", (*rows, K), f32), ("kd", (*rows, K), mid)]
    parts, offset = [], 0
    for name, shape, dtype in shapes:
        part = Part(name, shape, dtype, offset)
        parts.append(part)
        offset += _align(part.fp32_elements())
    return parts, offset


def residual_gaps(parts: list[Part], size: int) -> list[tuple[int, int]]:
    """The fp32 elements [start, end) of the buffer that no part's elements cover: each part's alignment padding,
    from the fp32 element holding its last element's end (a 16-bit part of odd length shares that one with the
    padding) to the next part's start."""
    ends = [part.offset + part.numel() * part.dtype.itemsize // 4 for part in parts]
    starts = [part.offset for part in parts[1:]] + [size]
    return [(a, b) for a, b in zip(ends, starts) if b > a]


def clear_gaps(p: ChunkParams, residual: torch.Tensor, q: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor | None, keep: str = DEFAULT_KEEP) -> None:
    """Zeros the alignment padding of ``residual`` (before the kernels fill the parts: a 16-bit part of odd
    length writes half of its last fp32 element). One small fill per part that has padding (none where a part's
    size is a multiple of ALIGN, as with C = 64 for T, A_qk and P), never a pass over the buffer."""
    for start, end in residual_gaps(*residual_layout(p, q, v, cu_seqlens, keep)):
        residual[start:end].zero_()


def residual_size(p: ChunkParams, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                  keep: str = DEFAULT_KEEP) -> int:
    """Elements of the fp32 buffer a training forward fills for the backward (0: nothing is kept)."""
    return residual_layout(p, q, v, cu_seqlens, keep)[1]


def residual_views(p: ChunkParams, residual: torch.Tensor, q: torch.Tensor, v: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, keep: str = DEFAULT_KEEP) -> dict:
    """The kept parts as views of ``residual`` by name (chunk_fwd's buffer names)."""
    parts, size = residual_layout(p, q, v, cu_seqlens, keep)
    if not parts:
        raise ValueError(f"the chunk kernels keep no residual with t.keep_residual={keep}")
    if residual.dtype != torch.float32 or residual.numel() != size:
        raise ValueError(f"residual must be fp32 with {size} elements for {p.kind} {list(q.shape)} under "
                         f"t.keep_residual={keep}, got {residual.dtype} with {residual.numel()}")
    views = {}
    for part in parts:
        flat = residual[part.offset: part.offset + part.fp32_elements()]
        views[part.name] = (flat if part.dtype == torch.float32 else flat.view(part.dtype)[: part.numel()]).view(
            part.shape)
    return views
