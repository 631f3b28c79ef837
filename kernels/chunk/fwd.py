"""The chunked (WY) forward: a recipe of the stage launchers, in launch order.

    chunk_fwd_cumsum / pair_amax / pairs  -> KDA: g_cum, (NVFP4 pair amaxes), P, P_qk   (by sub-chunk)
    chunk_fwd_intra_gdn / _kda  -> g_cum (GDN), W, U, A_qk, kd (KDA)   (all chunks in parallel; one per kind,
                                   forms.fwd_intra_form; chunk_fwd_wu: W, U, kd alone, from a kept residual)
    chunk_fwd_h      -> h (chunk-start states), V_new, final state   (sequential over chunks)
    chunk_fwd_o      -> o                      (all chunks in parallel)

Intermediates are fp32 and dots IEEE fp32 for fp32 inputs (the exact-numerics contract: relative
error <= 1e-5 against the fp64 reference). For 16-bit inputs the GEMMs over values and states run in
the input dtype with W, U, h, V_new kept in it, as FLA's do, unless the spec rounds GEMM operands;
the pair products and the solve multiply in TF32 (chunk/precision.py). Every block size, precision and launch
configuration is the launch plan's (chunk/plan.py).
"""
from __future__ import annotations

import functools

import torch

from la_compiler.kernels.chunk.forms import max_head_k
from la_compiler.kernels.chunk.fwd_h import chunk_fwd_h
from la_compiler.kernels.chunk.fwd_intra import chunk_fwd_wu
from la_compiler.kernels.chunk.fwd_intra_gdn import chunk_fwd_intra_gdn
from la_compiler.kernels.chunk.fwd_intra_kda import chunk_fwd_intra_kda
from la_compiler.kernels.chunk.fwd_o import chunk_fwd_o
from la_compiler.kernels.chunk.fwd_pairs import chunk_fwd_cumsum, chunk_fwd_pair_amax, chunk_fwd_pairs
from la_compiler.kernels.chunk.layout import ChunkLayout, chunk_layout
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.plan import ChunkPlan, ChunkShape, chunk_plan
from la_compiler.kernels.chunk.residual import clear_gaps, residual_views
from la_compiler.kernels.common.canonical_inputs import check_canonical_inputs
from la_compiler.options import DEFAULT_TUNING, TuningOptions


def check_inputs(p: ChunkParams, q, k, v, g, beta, initial_state, cu_seqlens):
    max_k, why = max_head_k(p)
    return check_canonical_inputs("the chunk kernels", p.kind, p.state, q, k, v, g, beta, initial_state, cu_seqlens,
                                  max_k=max_k, max_v=256, why_max=f" ({why})")


def plan_of(p: ChunkParams, q, k, v, g, beta, initial_state, cu_seqlens,
            tuning: TuningOptions) -> tuple[ChunkPlan, ChunkLayout, tuple]:
    """The launch plan and chunk layout of inputs checked against ``p``, and the final state's shape."""
    B, T, H, K, HV, V, N, state_shape = check_inputs(p, q, k, v, g, beta, initial_state, cu_seqlens)
    layout = chunk_layout(B, T, p.chunk, cu_seqlens)
    shape = ChunkShape(B, T, H, HV, K, V, N, layout.NT, cu_seqlens is not None)
    return chunk_plan(p, shape, q.dtype, tuning), layout, state_shape


def scratch(shape, dtype, device, fill: bool) -> torch.Tensor:
    """An output/intermediate buffer, NaN-filled where ``fill`` (the plan's ``nan_fill``)."""
    if fill:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def chunk_fwd(p: ChunkParams, q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None,
              intermediates: dict | None = None, need_output: bool = True, save_to: torch.Tensor | None = None,
              saved: torch.Tensor | None = None, tuning: TuningOptions = DEFAULT_TUNING, raw_gate=None):
    """Returns (o [B, T, HV, V] in q.dtype, final state fp32 in the params' layout).

    ``intermediates``, if given, receives the buffers g_cum, w, u, A_qk, v_new, kd (KDA) [B, T, HV, ..] and h, the
    chunk-start states [chunks, HV, K, V] (tests count rounding flips in w and h): fp32, except W, U, h,
    V_new in the input dtype for 16-bit GEMMs (chunk/precision.py).
    ``need_output=False`` (the backward's recompute) skips the output stage and returns o = None.
    With ``intermediates`` and the exact solve, T = (I + A)^-1 is kept too (t_solved [B, T, HV, C], in W's dtype,
    as the residual keeps it): the backward's input-gradient stage loads it (and refines a 16-bit one) instead of
    solving again.
    ``save_to`` (a buffer of ``chunk.residual.residual_size``): the forward also stores there what the backward
    keeps (T, A_qk and G or P; with t.keep_residual=all W, U, h, V_new too). ``saved`` (such a buffer, filled by a
    forward of the same inputs and tuning): the recompute loads them and runs only the W / U half of the intra
    stage and the h stage (KDA: after its cumsum), or (all) no kernel but KDA's NVFP4 pair amaxes. ``tuning``: the
    spec's t.<name> options (residual mode, serial stages, autotuning, NaN fill). ``raw_gate`` = (A_log, dt_bias
    or None): KDA's g is the raw gate, and the cumsum stage computes vLLM's gate of it (a serving profile's prefix
    forward; not with ``saved``, whose W / U stage reads the log-decay)."""
    if save_to is not None and saved is not None:
        raise ValueError("chunk_fwd takes save_to or saved, not both")
    if saved is not None and need_output:
        raise ValueError("chunk_fwd's saved is for the backward's recompute (need_output=False)")
    if raw_gate is not None and (saved is not None or p.kind != "kda"):
        raise ValueError("chunk_fwd's raw_gate is KDA's, in a forward without saved")
    plan, layout, state_shape = plan_of(p, q, k, v, g, beta, initial_state, cu_seqlens, tuning)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    initial_state = None if initial_state is None else initial_state.contiguous()
    shape, C = plan.shape, p.chunk
    B, T, HV, K, V = shape.B, shape.T, shape.HV, shape.K, shape.V
    f32, mid = torch.float32, plan.intermediate_dtype  # mid: of W, U, h, V_new (the input dtype for 16-bit GEMMs)
    buffer = functools.partial(scratch, device=q.device, fill=plan.nan_fill)
    residual = saved if saved is not None else save_to
    keep = tuning.keep_residual
    kept = residual_views(p, residual, q, v, cu_seqlens, keep) if residual is not None else {}
    if save_to is not None:  # the op returns the buffer: no element of it left unwritten (chunk/residual.py)
        clear_gaps(p, save_to, q, v, cu_seqlens, keep)
        if "h" in kept and kept["h"].shape[0] > layout.NT:  # a varlen batch's chunk states past its count
            kept["h"][layout.NT:].zero_()
    rerun = saved is None or keep != "all"  # whether the intra (or W / U) and h stages run

    def take(name, shape, dtype):  # the kept part of that name, else a scratch buffer
        return kept[name] if name in kept else buffer(shape, dtype)

    g_cum = take("g_cum", g.shape, f32)
    w = take("w", (B, T, HV, K), mid)
    u = take("u", (B, T, HV, V), mid)
    A_qk = take("A_qk", (B, T, HV, C), f32)
    h = take("h", (max(layout.NT, 1), HV, K, V), mid)
    v_new = take("v_new", (B, T, HV, V), mid)
    kd = take("kd", (B, T, HV, K), mid) if p.kind == "kda" else None  # K ⊙ exp(G_C - G), intra -> h
    o = buffer((B, T, HV, V), q.dtype) if need_output else None
    keep_t = kept or (intermediates is not None and p.solve == "exact")
    # T as the backward reads it: in the GEMM operand dtype (mid), kept or in the recompute's scratch alike, so that
    # every t.keep_residual computes the same gradients (chunk/residual.py)
    t_solved = take("t_solved", (B, T, HV, C), mid) if keep_t else None
    p_pairs = take("p_pairs", (B, T, HV, C), f32) if plan.fwd_pairs is not None else None
    # NVFP4 pairwise operands: the chunk-wide amaxes (pk, pq, |K|, |Q|)
    pair_amax = buffer((plan.chunks_per_row, plan.heads, 4), f32) if plan.fwd_pair_amax is not None else None
    ht = buffer(state_shape, f32)

    # KDA's pairs kernel writes fp32 P_qk: into A_qk, which the intra stage finishes in place, unless A_qk is a
    # 16-bit part of the residual (then into scratch, from which the intra stage rounds A_qk into the part)
    p_qk = A_qk
    if plan.fwd_pairs is not None and saved is None and A_qk.dtype != f32:
        p_qk = buffer((B, T, HV, C), f32)
    if layout.NT and plan.fwd_pairs is not None:  # KDA: G = cumsum(g), then P and P_qk by sub-chunk
        if rerun:
            chunk_fwd_cumsum(plan, layout=layout, g=g, g_cum=g_cum, raw_gate=raw_gate)
        if pair_amax is not None:
            chunk_fwd_pair_amax(plan, layout=layout, q=q, k=k, g_cum=g_cum, pair_amax=pair_amax)
        if saved is None:  # else P and A_qk are the forward's
            chunk_fwd_pairs(plan, layout=layout, q=q, k=k, g_cum=g_cum, p_pairs=p_pairs, p_qk=p_qk,
                            pair_amax=pair_amax)
    if layout.NT and rerun and saved is not None:  # T, A_qk (GDN: and G) from the training forward: W and U alone
        chunk_fwd_wu(plan, layout=layout, q=q, k=k, v=v, g=g, beta=beta, g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk,
                     t_solved=t_solved, p_pairs=p_pairs, scale=scale)
    elif layout.NT and rerun and plan.forward_intra_form == "kda":
        chunk_fwd_intra_kda(plan, layout=layout, k=k, v=v, beta=beta, g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk,
                            t_out=t_solved, p_pairs=p_pairs, scale=scale, p_qk=p_qk)
    elif layout.NT and rerun:
        chunk_fwd_intra_gdn(plan, layout=layout, q=q, k=k, v=v, g=g, beta=beta, g_cum=g_cum, w=w, u=u, A_qk=A_qk,
                            t_out=t_solved, scale=scale)
    if rerun:
        chunk_fwd_h(plan, layout=layout, k=k, kd=kd, w=w, u=u, g_cum=g_cum, h=h, v_new=v_new, h0=initial_state, ht=ht)
    if layout.NT and need_output:
        chunk_fwd_o(plan, layout=layout, q=q, g_cum=g_cum, A_qk=A_qk, h=h, v_new=v_new, o=o, scale=scale)
    if intermediates is not None:
        intermediates.update(g_cum=g_cum, w=w, u=u, kd=kd, A_qk=A_qk, h=h[: layout.NT], v_new=v_new,
                             t_solved=t_solved, p_pairs=p_pairs, pair_amax=pair_amax)
    return o, (ht if rerun else None)
