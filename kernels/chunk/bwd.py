"""The chunked (WY) backward: a recipe of the stage launchers, in launch order.

    chunk_fwd (recomputed)  -> g_cum, W (rounded), A_qk, T (exact solve), h (rounded chunk-start states), V_new
    chunk_bwd_dh            -> dh (state gradient at every chunk's end), dV_new, dh0   (reverse over chunks)
    chunk_bwd_intra_<form>  -> dq, dk, dv, dbeta, dg                                 (all chunks in parallel)
                               (forms.bwd_intra_form: split_pairs (KDA exact: dP, dP_qk and its shares of dq,
                               dk, dG to the pairs kernel), key_blocks (GDN, exact pairs and solve) or rows)
    chunk_bwd_pairs         -> KDA exact: the pair products' share of dq, dk, dG    (sub-chunks x key blocks)
    chunk_bwd_dg            -> KDA exact: dg = reverse cumsum of dG within each chunk (chunks x key blocks)

Exact gradients of the emulated forward with identity straight-through at every QDQ; the
derivation and what is recomputed rather than stored are in docs/kernels-chunk.md. Every block size, precision and
launch configuration is the launch plan's (chunk/plan.py), the forward's recompute included.
"""
from __future__ import annotations

import functools

import torch

from la_compiler.kernels.chunk.bwd_dg import chunk_bwd_dg
from la_compiler.kernels.chunk.bwd_dh import chunk_bwd_dh
from la_compiler.kernels.chunk.bwd_intra_key_blocks import chunk_bwd_intra_key_blocks
from la_compiler.kernels.chunk.bwd_intra_rows import chunk_bwd_intra_rows
from la_compiler.kernels.chunk.bwd_intra_split_pairs import chunk_bwd_intra_split_pairs
from la_compiler.kernels.chunk.bwd_pairs import chunk_bwd_pairs
from la_compiler.kernels.chunk.fwd import chunk_fwd, plan_of, scratch
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.options import DEFAULT_TUNING, TuningOptions


def chunk_bwd(p: ChunkParams, q, k, v, g, beta, scale, do, dht=None, initial_state=None, cu_seqlens=None,
              saved: torch.Tensor | None = None, tuning: TuningOptions = DEFAULT_TUNING):
    """Returns (dq, dk, dv, dg, dbeta, dh0 or None), each in its input's dtype (dh0 in h0's). ``saved``: the
    residual a training forward of the same inputs and ``tuning`` filled (chunk_fwd's ``save_to``), so the
    recompute skips the pairs and the solve (t.keep_residual=all: every forward kernel)."""
    plan, layout, state_shape = plan_of(p, q, k, v, g, beta, initial_state, cu_seqlens, tuning)
    shape, C = plan.shape, p.chunk
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    if tuple(do.shape) != (B, T, HV, V):
        raise ValueError(f"do must be {(B, T, HV, V)}, got {tuple(do.shape)}")
    if dht is not None and tuple(dht.shape) != state_shape:
        raise ValueError(f"dht must be {state_shape}, got {tuple(dht.shape)}")
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    dht = None if dht is None else dht.contiguous()
    parts: dict = {}
    chunk_fwd(p, q, k, v, g, beta, scale, initial_state, cu_seqlens, intermediates=parts, need_output=False,
              saved=saved, tuning=tuning)

    f32, mid = torch.float32, plan.intermediate_dtype  # mid: of dh, dV_new (and the forward's W, U, h, V_new)
    buffer = functools.partial(scratch, device=q.device, fill=plan.nan_fill)
    dh = buffer((max(layout.NT, 1), HV, K, V), mid)
    dv_new = buffer((B, T, HV, V), mid)
    dh0 = buffer(state_shape, f32) if initial_state is not None else None
    group = HV // H
    # per value head; summed over a group of value heads (HV > H) in fp32, else written in the input dtype
    dq = buffer((B, T, HV, K), f32 if group > 1 else q.dtype)
    dk = buffer((B, T, HV, K), f32 if group > 1 else k.dtype)
    dv = buffer(v.shape, v.dtype)
    dbeta = buffer((B, T, HV), beta.dtype)
    dg = buffer(g.shape, g.dtype)
    chunk_bwd_dh(plan, layout=layout, q=q, k=k, kd=parts["kd"], w=parts["w"], g_cum=parts["g_cum"],
                 A_qk=parts["A_qk"], do=do, dht=dht, dh=dh, dv_new=dv_new, dh0=dh0, scale=scale)
    if layout.NT:
        t_solved = parts["t_solved"] if parts["t_solved"] is not None else parts["A_qk"]  # unread for Neumann
        split = plan.bwd_pairs is not None
        inputs = dict(layout=layout, q=q, k=k, v=v, beta=beta, g=g, t_solved=t_solved, h=parts["h"], dh=dh,
                      v_new=parts["v_new"], dv_new=dv_new, do=do, dv=dv, dbeta=dbeta, scale=scale)
        if split:  # the intra kernel hands dP, dP_qk and the other shares of dq, dk, dG (fp32) to the pairs kernel
            # dq's share goes into W's buffer (same shape), which nothing reads after the dh stage, where it is fp32
            # and not the forward's kept W (a second backward of the same graph reads that again)
            own_w = saved is None or tuning.keep_residual != "all"
            dq_rest = _fp32_or_new(parts["w"], plan.nan_fill) if own_w else buffer((B, T, HV, K), f32)
            dk_rest, dg_rest = buffer((B, T, HV, K), f32), buffer((B, T, HV, K), f32)
            dpair = buffer((B, T, HV, 2 * C), f32)
            chunk_bwd_intra_split_pairs(plan, **inputs, p_pairs=parts["p_pairs"], dq=dq_rest, dk=dk_rest, dg=dg_rest,
                                        dpair=dpair)
        elif plan.backward_intra_form == "key_blocks":
            chunk_bwd_intra_key_blocks(plan, **inputs, dq=dq, dk=dk, dg=dg)
        else:
            chunk_bwd_intra_rows(plan, **inputs, g_cum=parts["g_cum"], dq=dq, dk=dk, dg=dg)
        if split:  # per sub-chunk: dq, dk and the complete dG (into its share's buffer); then dg = its reverse cumsum
            chunk_bwd_pairs(plan, layout=layout, q=q, k=k, g_cum=parts["g_cum"], dpair=dpair, dq_rest=dq_rest,
                            dk_rest=dk_rest, dg_rest=dg_rest, dq=dq, dk=dk, pair_amax=parts["pair_amax"])
            chunk_bwd_dg(plan, layout=layout, dG=dg_rest, dg=dg)
    if group > 1:
        dq = dq.view(B, T, H, group, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, group, K).sum(3).to(k.dtype)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def _fp32_or_new(buffer: torch.Tensor, fill: bool) -> torch.Tensor:
    """``buffer`` to be reused as fp32 scratch of its shape, or a new one where it is 16-bit (16-bit GEMMs)."""
    return buffer if buffer.dtype == torch.float32 else scratch(buffer.shape, torch.float32, buffer.device, fill)
