"""Launchers of the generated fused recurrent (token-by-token) kernels, and their variant.

The kernels are generated per spec by ``recurrent/codegen.py`` from
``recurrent/templates/fused_recurrent_*.tmpl`` and loaded from the code cache; see
docs/kernels-fused-recurrent.md for the backward's math and its memory cost.
"""
from __future__ import annotations


import torch
import triton

from la_compiler.kernels.common.canonical_inputs import check_canonical_inputs
from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.recurrent.codegen import FusedRecurrentParams, fused_recurrent_module
from la_compiler.kernels.registry import SelectionContext, register_variant, spec_of
from la_compiler.spec import RecurrenceSpec

CHECKPOINT_INTERVAL = 64  # tokens between stored states in the backward (docs: memory cost)


def _check_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, state):
    return check_canonical_inputs("fused_recurrent", kind, state, q, k, v, g, beta, initial_state, cu_seqlens,
                                  max_k=256, max_v=256)


def _contiguous(*xs):
    return [None if x is None else x.contiguous() for x in xs]


def fused_recurrent_fwd(params: FusedRecurrentParams, q, k, v, g, beta, scale, initial_state=None,
                        cu_seqlens=None, block_v: int | None = None):
    """Returns (o [B, T, HV, V] in q.dtype, final state fp32 in the params' layout)."""
    B, T, H, K, HV, V, N, state_shape = _check_inputs(params.kind, q, k, v, g, beta, initial_state, cu_seqlens,
                                                      params.state)
    q, k, v, g, beta, initial_state, cu_seqlens = _contiguous(q, k, v, g, beta, initial_state, cu_seqlens)
    BK = triton.next_power_of_2(K)
    BV = block_v or min(8, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    o = torch.full((B, T, HV, V), float("nan"), dtype=q.dtype, device=q.device)
    ht = torch.full(state_shape, float("nan"), dtype=torch.float32, device=q.device)
    fused_recurrent_module(params).fused_recurrent_fwd_kernel[(NV * N * HV,)](
        q, k, v, g, beta, o, initial_state, ht, cu_seqlens, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=1,
    )
    return o, ht


def _chunk_offsets(T: int, N: int, cu_seqlens, C: int, device):
    """Start of every sequence's checkpoints in the checkpoint buffer, and their total count."""
    if cu_seqlens is None:
        return None, N * triton.cdiv(T, C)
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + C - 1) // C
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return offsets, int(offsets[-1].item())


def fused_recurrent_bwd(params: FusedRecurrentParams, q, k, v, g, beta, scale, do, dht=None,
                        initial_state=None, cu_seqlens=None, block_v: int | None = None,
                        checkpoint_interval: int = CHECKPOINT_INTERVAL):
    """Returns (dq, dk, dv, dg, dbeta, dh0 or None), each in its input's dtype (dh0 fp32)."""
    B, T, H, K, HV, V, N, state_shape = _check_inputs(params.kind, q, k, v, g, beta, initial_state, cu_seqlens,
                                                      params.state)
    if tuple(do.shape) != (B, T, HV, V):
        raise ValueError(f"do must be {(B, T, HV, V)}, got {tuple(do.shape)}")
    if dht is not None and tuple(dht.shape) != state_shape:
        raise ValueError(f"dht must be {state_shape}, got {tuple(dht.shape)}")
    q, k, v, g, beta, do, dht, initial_state, cu_seqlens = _contiguous(
        q, k, v, g, beta, do, dht, initial_state, cu_seqlens)
    BK = triton.next_power_of_2(K)
    BV = block_v or min(32, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    C = checkpoint_interval
    chunk_offsets, total_chunks = _chunk_offsets(T, N, cu_seqlens, C, q.device)
    dev = dict(device=q.device)
    nan = float("nan")
    checkpoints = torch.empty((total_chunks, HV, K, V), dtype=torch.float32, **dev)
    scratch = torch.empty((NV * N * HV, C, BK, BV), dtype=torch.float32, **dev)
    dq = torch.full((NV, B, T, HV, K), nan, dtype=torch.float32, **dev)
    dk = torch.full((NV, B, T, HV, K), nan, dtype=torch.float32, **dev)
    dg = torch.full((NV, *g.shape), nan, dtype=torch.float32, **dev)
    dbeta = torch.full((NV, B, T, HV), nan, dtype=torch.float32, **dev)
    dv = torch.full_like(v, nan)
    dh0 = torch.full(state_shape, nan, dtype=torch.float32, **dev) if initial_state is not None else None
    fused_recurrent_module(params).fused_recurrent_bwd_kernel[(NV * N * HV,)](
        q, k, v, g, beta, initial_state, do, dht,
        dq, dk, dv, dg, dbeta, dh0,
        checkpoints, scratch, chunk_offsets, cu_seqlens, scale, T, B * T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, C=C,
        USE_INITIAL_STATE=initial_state is not None, USE_FINAL_STATE_GRADIENT=dht is not None,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=4 if BK * BV >= 2048 else 1,
    )
    group = HV // H
    # partial sums over value blocks, then over the value heads that share a q/k head
    dq = dq.sum(0).view(B, T, H, group, K).sum(3)
    dk = dk.sum(0).view(B, T, H, group, K).sum(3)
    dg, dbeta = dg.sum(0), dbeta.sum(0)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0


# ---- the kernel variant ----------------------------------------------------------------------
def fused_recurrent_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    params = FusedRecurrentParams.from_spec(spec_of(spec))
    return fused_recurrent_fwd(params, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def fused_recurrent_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    params = FusedRecurrentParams.from_spec(spec_of(spec))
    return fused_recurrent_bwd(params, q, k, v, g, beta, scale, do, dht, initial_state, cu_seqlens)


# On CUDA the token-by-token kernel is faster than the chunked ones only for short sequences: it runs T
# dependent steps where the chunk kernels run T / 64 (FLA's layers switch to fused_recurrent at 64 tokens).
FUSED_RECURRENT_MAX_TOKENS_ON_CUDA = 64


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    short = ctx.device != "cuda" or (ctx.seq_len is not None and ctx.seq_len <= FUSED_RECURRENT_MAX_TOKENS_ON_CUDA)
    return needs(
        (spec.is_exact, "the generated recurrent kernel has no quant sites, solve or phase support yet"),
        triton_runs(ctx),
        not_float64(ctx),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "head dims above 256 exceed one register tile"),
        (short, f"on CUDA the chunk kernels are faster beyond {FUSED_RECURRENT_MAX_TOKENS_ON_CUDA} tokens per "
                f"sequence (T is {'symbolic' if ctx.seq_len is None else ctx.seq_len})"),
    )


def source_modules(spec: RecurrenceSpec) -> dict:
    return {"forward and backward": fused_recurrent_module(FusedRecurrentParams.from_spec(spec))}


register_variant(
    "fused_recurrent",
    fused_recurrent_forward,
    fused_recurrent_backward,
    "generated token-by-token Triton kernel, fp32 state (forward and backward; exact numerics)",
    supports=supports,
    summary="generated token-by-token Triton kernel, fp32 state",
    source_modules=source_modules,
)
