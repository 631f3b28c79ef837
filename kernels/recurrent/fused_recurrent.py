"""The fused recurrent (token-by-token) kernels of GDN / KDA, forward and backward, each with its launcher.

One ``@triton.jit`` kernel per direction, specialized by ``tl.constexpr`` flags. The spec fixes two of them
(``FusedRecurrentParams.constexprs()``): ``IS_KDA`` (the decay is a scalar per value head for GDN, one per
key channel for KDA) and ``STATE_V_FIRST`` (h0 / ht / dht / dh0 are [V, K] in memory instead of [K, V]).
The inputs fix the rest at launch: ``USE_INITIAL_STATE``, ``USE_FINAL_STATE_GRADIENT``, ``IS_VARLEN``.
The state is fp32 in registers, exact numerics. docs/kernels-fused-recurrent.md derives the backward and
its memory cost.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from la_compiler.kernels.common.canonical_inputs import check_canonical_inputs
from la_compiler.kernels.recurrent.params import FusedRecurrentParams

CHECKPOINT_INTERVAL = 64  # tokens between stored states in the backward (docs: memory cost)


# ---- device functions: one token's step, shared by the forward and both passes of the backward ----------
@triton.jit
def sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First token and length of sequence i_n, int64 (token offsets may pass 2**31)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        seq_len = T.to(tl.int64)
    return bos, seq_len


@triton.jit
def state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Where the [key channel, value] register tile lies in a state tensor in memory ([K, V] or [V, K])."""
    if STATE_V_FIRST:
        o_h = o_k[:, None] + o_v[None, :] * K
    else:
        o_h = o_k[:, None] * V + o_v[None, :]
    return o_h


@triton.jit
def token_pointers(q, k, v, g, beta, bos, i_h, i_hv, o_k, o_v, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, IS_KDA: tl.constexpr):
    """Pointers to the sequence's first token in q, k (its q/k head), v, beta, g (its value head), and g's step
    between tokens."""
    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_beta = beta + bos * HV + i_hv
    if IS_KDA:
        p_g = g + (bos * HV + i_hv) * K + o_k
        g_step = HV * K
    else:
        p_g = g + bos * HV + i_hv
        g_step = HV
    return p_q, p_k, p_v, p_beta, p_g, g_step


@triton.jit
def load_token(p_k, p_v, p_beta, p_g, m_k, m_v, IS_KDA: tl.constexpr):
    """A token's k, v, beta and log-decay g (a [BK] vector for KDA, a scalar for GDN), in fp32."""
    b_k = tl.load(p_k, mask=m_k, other=0).to(tl.float32)
    b_v = tl.load(p_v, mask=m_v, other=0).to(tl.float32)
    b_beta = tl.load(p_beta).to(tl.float32)
    if IS_KDA:
        b_g = tl.load(p_g, mask=m_k, other=0).to(tl.float32)
    else:
        b_g = tl.load(p_g).to(tl.float32)
    return b_k, b_v, b_beta, b_g


@triton.jit
def decayed(b_h, b_g, IS_KDA: tl.constexpr):
    """exp(g) applied to a [BK, BV] tile: per key channel (row) for KDA, one scalar for GDN."""
    if IS_KDA:
        b_h *= tl.exp(b_g)[:, None]
    else:
        b_h *= tl.exp(b_g)
    return b_h


@triton.jit
def delta_update(b_h, b_k, b_v, b_beta):
    """S = S' + k u^T with u = beta (v - S'^T k): the delta-rule correction and the rank-1 write."""
    b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_u[None, :]
    return b_h


# ---- forward --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=['T'])
def fused_recurrent_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_KDA: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """o_t = S_t^T (scale q_t) token by token; one program per (value block, sequence x value head)."""
    # value block i_v, sequence i_n, value head i_hv, its q/k head i_h (grouped heads)
    i_pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v, i_nh = i_pid % NV, i_pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = state_offsets(o_k, o_v, K, V, STATE_V_FIRST)

    p_q, p_k, p_v, p_beta, p_g, g_step = token_pointers(q, k, v, g, beta, bos, i_h, i_hv, o_k, o_v,
                                                        H, HV, K, V, IS_KDA)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_h, mask=m_h, other=0).to(tl.float32)

    p_o = o + (bos * HV + i_hv) * V + o_v
    for i_t in range(0, seq_len):
        b_k, b_v, b_beta, b_g = load_token(p_k + i_t * (H * K), p_v + i_t * (HV * V), p_beta + i_t * HV,
                                           p_g + i_t * g_step, m_k, m_v, IS_KDA)
        b_h = delta_update(decayed(b_h, b_g, IS_KDA), b_k, b_v, b_beta)
        b_q = tl.load(p_q + i_t * (H * K), mask=m_k, other=0).to(tl.float32) * scale
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o + i_t * (HV * V), b_o.to(p_o.dtype.element_ty), mask=m_v)

    tl.store(ht + i_nh * K * V + o_h, b_h, mask=m_h)


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
    fused_recurrent_fwd_kernel[(NV * N * HV,)](
        q, k, v, g, beta, o, initial_state, ht, cu_seqlens, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **params.constexprs(),
        USE_INITIAL_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=1,
    )
    return o, ht


# ---- backward -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=['T', 'total_tokens'])
def fused_recurrent_bwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    h0,
    do,
    dht,
    dq,
    dk,
    dv,
    dg,
    dbeta,
    dh0,
    checkpoints,
    scratch,
    chunk_offsets,
    cu_seqlens,
    scale,
    T,
    total_tokens,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    IS_KDA: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Exact gradients of the recurrence, one program per (value block, sequence x value head).

    Pass 1 reruns the forward and stores the state at the start of every C-token chunk.
    Pass 2 walks the chunks backwards: it recomputes the chunk's decayed states S'_t from
    the checkpoint into this program's scratch, then runs the adjoint dS token by token in
    reverse (docs/kernels-fused-recurrent.md). dq, dk, dg and dbeta are partial sums over
    this value block, written at [i_v] and summed by the launcher.
    """
    # value block i_v, sequence i_n, value head i_hv, its q/k head i_h (grouped heads)
    i_pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v, i_nh = i_pid % NV, i_pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = state_offsets(o_k, o_v, K, V, STATE_V_FIRST)

    p_q, p_k, p_v, p_beta, p_g, g_step = token_pointers(q, k, v, g, beta, bos, i_h, i_hv, o_k, o_v,
                                                        H, HV, K, V, IS_KDA)

    NC = tl.cdiv(seq_len, C)
    if IS_VARLEN:
        boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        boc = i_n * tl.cdiv(T, C)
    o_ck = o_k[:, None] * V + o_v[None, :]
    p_ck = checkpoints + (boc * HV + i_hv) * K * V + o_ck
    o_s = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    p_s = scratch + i_pid * C * BK * BV + o_s

    # pass 1: the forward states at chunk starts
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    for i_c in range(0, NC):
        tl.store(p_ck + i_c * (HV * K * V), b_h, mask=m_h)
        for i_t in range(i_c * C, tl.minimum(i_c * C + C, (NC - 1) * C)):  # the last chunk: pass 2
            b_k, b_v, b_beta, b_g = load_token(p_k + i_t * (H * K), p_v + i_t * (HV * V), p_beta + i_t * HV,
                                               p_g + i_t * g_step, m_k, m_v, IS_KDA)
            b_h = delta_update(decayed(b_h, b_g, IS_KDA), b_k, b_v, b_beta)
    tl.debug_barrier()

    # pass 2: the adjoint dS of the state, from the last token back to the first
    p_do = do + (bos * HV + i_hv) * V + o_v
    p_dq = dq + (i_v * total_tokens * HV + bos * HV + i_hv) * K + o_k
    p_dk = dk + (i_v * total_tokens * HV + bos * HV + i_hv) * K + o_k
    p_dv = dv + (bos * HV + i_hv) * V + o_v
    p_dbeta = dbeta + i_v * total_tokens * HV + bos * HV + i_hv
    if IS_KDA:
        p_dg = dg + (i_v * total_tokens * HV + bos * HV + i_hv) * K + o_k
    else:
        p_dg = dg + i_v * total_tokens * HV + bos * HV + i_hv
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    for i_r in range(0, NC):
        i_c = NC - 1 - i_r
        t_end = tl.minimum(i_c * C + C, seq_len)
        # recompute the chunk: scratch[j] = S'_t, the state after the decay of token t = i_c*C + j
        b_h = tl.load(p_ck + i_c * (HV * K * V), mask=m_h, other=0)
        for i_t in range(i_c * C, t_end):
            b_k, b_v, b_beta, b_g = load_token(p_k + i_t * (H * K), p_v + i_t * (HV * V), p_beta + i_t * HV,
                                               p_g + i_t * g_step, m_k, m_v, IS_KDA)
            b_h = decayed(b_h, b_g, IS_KDA)
            tl.store(p_s + (i_t - i_c * C) * (BK * BV), b_h)
            b_h = delta_update(b_h, b_k, b_v, b_beta)
        tl.debug_barrier()
        for i_j in range(0, t_end - i_c * C):
            i_t = t_end - 1 - i_j
            b_k, b_v, b_beta, b_g = load_token(p_k + i_t * (H * K), p_v + i_t * (HV * V), p_beta + i_t * HV,
                                               p_g + i_t * g_step, m_k, m_v, IS_KDA)
            b_hd = tl.load(p_s + (i_t - i_c * C) * (BK * BV))
            b_q = tl.load(p_q + i_t * (H * K), mask=m_k, other=0).to(tl.float32) * scale
            b_do = tl.load(p_do + i_t * (HV * V), mask=m_v, other=0).to(tl.float32)
            b_r = b_v - tl.sum(b_hd * b_k[:, None], 0)
            b_u = b_beta * b_r
            # o_t = S_t^T (scale q_t) with S_t = S'_t + k_t u_t^T
            b_dq = scale * (tl.sum(b_hd * b_do[None, :], 1) + b_k * tl.sum(b_u * b_do))
            b_dh += b_q[:, None] * b_do[None, :]
            # S_t = S'_t + k_t u_t^T,  u_t = beta_t (v_t - S'_t^T k_t)
            b_du = tl.sum(b_dh * b_k[:, None], 0)
            b_dv = b_beta * b_du
            b_dbeta = tl.sum(b_du * b_r)
            b_dk = tl.sum(b_dh * b_u[None, :], 1) - tl.sum(b_hd * b_dv[None, :], 1)
            b_dh -= b_k[:, None] * b_dv[None, :]
            # S'_t = decay_t S_{t-1}: dg from dS'_t * S'_t (KDA: per key channel), then carry dS_{t-1}
            if IS_KDA:
                tl.store(p_dg + i_t * g_step, tl.sum(b_dh * b_hd, 1), mask=m_k)
            else:
                tl.store(p_dg + i_t * g_step, tl.sum(tl.sum(b_dh * b_hd, 1), 0))
            b_dh = decayed(b_dh, b_g, IS_KDA)
            tl.store(p_dq + i_t * (HV * K), b_dq, mask=m_k)
            tl.store(p_dk + i_t * (HV * K), b_dk, mask=m_k)
            tl.store(p_dv + i_t * (HV * V), b_dv.to(p_dv.dtype.element_ty), mask=m_v)
            tl.store(p_dbeta + i_t * HV, b_dbeta)
        tl.debug_barrier()

    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh * K * V + o_h, b_dh.to(dh0.dtype.element_ty), mask=m_h)


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
    fused_recurrent_bwd_kernel[(NV * N * HV,)](
        q, k, v, g, beta, initial_state, do, dht,
        dq, dk, dv, dg, dbeta, dh0,
        checkpoints, scratch, chunk_offsets, cu_seqlens, scale, T, B * T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, C=C, **params.constexprs(),
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
