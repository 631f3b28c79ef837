"""KDA's backward dg stage (``chunk_bwd_kernel_dg``), the last kernel of the exact solve's split backward: the
forward takes G = cumsum(g) within each chunk, so dg is the reverse cumsum of dG (the complete gradient of G
that the intra and pairs kernels summed) within the chunk, per key channel. One program per chunk x value head x
key block. GDN takes its dg inside the intra kernel (only KDA's exact solve splits its backward), so the kernel
has no kind of its own. docs/kernels-chunk.md lists the backward's stages.
"""
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import chunk_program
from la_compiler.kernels.chunk.launch import launch

if TYPE_CHECKING:
    from la_compiler.kernels.chunk.layout import ChunkLayout
    from la_compiler.kernels.chunk.plan import ChunkPlan


@triton.jit(do_not_specialize=['T'])
def chunk_bwd_kernel_dg(
    dG,
    dg,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """g -> G = cumsum(g) within the chunk: dg = the reverse cumsum of dG (grid: chunks, value heads, key blocks)."""
    i_c, i_bh, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, seq_len, i_chunk, i_h = chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV, H, C,
                                                         IS_VARLEN, INDEX_64)
    o_c = tl.arange(0, C)
    t_c = i_t * C + o_c
    m_c = t_c < seq_len
    # token rows of this chunk in the [B, T, HV, K] gradients
    r_hv = (bos + t_c) * HV + i_hv
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    b_dg = tl.cumsum(tl.load(dG + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0), 0, reverse=True)
    tl.store(dg + r_hv[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty), mask=m_ck)


KERNELS = {"dg": chunk_bwd_kernel_dg}


def chunk_bwd_dg(plan: "ChunkPlan", *, layout: "ChunkLayout", dG, dg):
    """KDA's dg: the reverse cumsum of dG within every chunk."""
    launch(plan.bwd_dg, dict(dG=dG, dg=dg, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
                             T=layout.T))
