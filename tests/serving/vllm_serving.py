"""vLLM's serving of a batch of sequences, step by step, with its own kernels (the oracle's modules).

``serve`` does what vLLM 0.33's GDN layer (``qwen_gdn_linear_attn.py``, ``_forward_core``) and Kimi's KDA
layers (``kimi_k3/nvidia/kda.py``, ``kimi_gdn_linear_attn.py``) do for their Triton backends, given the
canonical operands (q, k after l2norm, the log-decay g, beta after its sigmoid):

1. the state cache: one slot per sequence (slot 0 is vLLM's NULL block), ``[slots, HV, V, K]`` in the cache
   dtype (``mamba_ssm_cache_dtype``); an initial state is written into it (``.to(cache dtype)``);
2. prefill: the prefixes of every sequence with one, packed, through the chunk kernel
   (``chunk_gated_delta_rule`` / ``chunk_kda_with_fused_gate``'s stages) with the cached states as initial
   states; the final states go back into the cache with ``.to(cache dtype)``
   (``ssm_state[idx] = last_recurrent_state.to(...)``);
3. decode: one token per sequence per step, every active sequence in one launch of the recurrent kernel
   (``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda_fwd``) reading and writing the cache in
   place; the kernel stores the state with ``b_h.to(cache dtype)`` after the output is read from the fp32
   working state.

Inputs are laqat's: ``[B, T, H, K]`` (or packed ``[1, T, H, K]`` with ``cu_seqlens``), states ``[N, HV, K, V]``.
Outputs come back the same way: ``o`` in the input dtype (zero past each valid length) and the final
states as the cache holds them, in fp32, ``[N, HV, K, V]``.
"""
from __future__ import annotations

import torch


def _bounds(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, b * T) for b in range(B)], B
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n]) for n in range(len(cu) - 1)], len(cu) - 1


def _packed(x, rows):
    """x [B, T, ...] flattened to one token axis, then the given token rows: [1, len(rows), ...]."""
    return x.reshape(-1, *x.shape[2:])[rows].unsqueeze(0).contiguous()


def _shared_token_stride(*xs):
    """The tensors side by side in one buffer (vLLM's packed q|k|v projection): views with one token stride."""
    flat = torch.cat([x.flatten(2) for x in xs], dim=-1)
    out, at = [], 0
    for x in xs:
        width = x.shape[2] * x.shape[3]
        out.append(flat[..., at:at + width].unflatten(-1, x.shape[2:]))
        at += width
    return out


def _kda_prefill(chunk, q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """Kimi's layers prefill through ``chunk_kda_with_fused_gate``, whose gate kernel sums the gate within each chunk
    (``tl.cumsum``, times 1 / ln 2) where ``chunk_kda`` sums it with a masked dot. From the log-decay g: that kernel
    on the raw gate -g with A_log 0 and a softplus linear everywhere (threshold -inf), its gate ``-exp(0) * -g`` = g
    exactly, then the chunk stages it feeds."""
    chunk_indices = chunk.prepare_chunk_indices(cu_seqlens, 64)
    g_cum, _ = chunk.fused_kda_gate_chunk_cumsum(-g, raw_beta=beta, A_log=torch.zeros(g.shape[2], device=g.device),
                                                 threshold=float("-inf"), cu_seqlens=cu_seqlens,
                                                 chunk_indices=chunk_indices)
    return chunk._chunk_kda_fwd_with_cumulative_g(q, k, v, g_cum, beta, scale, initial_state, True,
                                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def serve(vllm, kind, q, k, v, g, beta, *, prefill_lengths, valid_lengths, cache_dtype, scale=None,
          initial_state=None, cu_seqlens=None):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    starts, n = _bounds(B, T, cu_seqlens)
    pre = [int(x) for x in prefill_lengths]
    val = [int(x) for x in valid_lengths]
    dev = q.device
    cache = torch.zeros(n + 1, HV, V, K, dtype=cache_dtype, device=dev)
    if initial_state is not None:
        cache[1:] = initial_state.transpose(-1, -2).to(cache_dtype)
    o = torch.zeros(B * T, HV, V, dtype=q.dtype, device=dev)

    # prefill: the sequences with a prefix, packed
    with_prefix = [i for i in range(n) if pre[i] > 0]
    if with_prefix:
        rows = [starts[i][1] + t for i in with_prefix for t in range(pre[i])]
        cu = torch.tensor([0] + list(torch.tensor([pre[i] for i in with_prefix]).cumsum(0).tolist()),
                          dtype=torch.int32, device=dev)
        slots = torch.tensor([i + 1 for i in with_prefix], device=dev)
        h0 = cache[slots].clone()
        args = [_packed(x, rows) for x in (q, k, v, g, beta)]
        if kind == "gdn":
            o_pre, ht = vllm.gdn_chunk.chunk_gated_delta_rule(*args, scale=scale, initial_state=h0,
                                                               output_final_state=True, cu_seqlens=cu)
        else:
            o_pre, ht = _kda_prefill(vllm.kda_chunk, *args, scale=scale, initial_state=h0, cu_seqlens=cu)
        o[rows] = o_pre[0].to(q.dtype)
        cache[slots] = ht.to(cache_dtype)

    # decode: one token per active sequence per step
    for step in range(max((val[i] - pre[i] for i in range(n)), default=0)):
        active = [i for i in range(n) if pre[i] + step < val[i]]
        rows = [starts[i][1] + pre[i] + step for i in active]
        A = len(active)
        cu = torch.arange(A + 1, dtype=torch.int32, device=dev)
        slots = torch.tensor([i + 1 for i in active], dtype=torch.int32, device=dev)
        q_t, k_t, v_t, g_t, beta_t = (_packed(x, rows) for x in (q, k, v, g, beta))
        if kind == "gdn":
            o_t, _ = vllm.gdn_recurrent.fused_recurrent_gated_delta_rule(
                q_t, k_t, v_t, g_t, beta_t, scale=scale, initial_state=cache, inplace_final_state=True,
                cu_seqlens=cu, ssm_state_indices=slots, use_qk_l2norm_in_kernel=False)
        else:
            q_t, k_t, v_t = _shared_token_stride(q_t, k_t, v_t)
            o_t, _ = vllm.kda_recurrent.fused_recurrent_kda_fwd(
                q_t, k_t, v_t, g_t, beta_t, scale=scale, initial_state=cache, inplace_final_state=True,
                cu_seqlens=cu, ssm_state_indices=slots, use_qk_l2norm_in_kernel=False)
        o[rows] = o_t[0].to(q.dtype)
    return o.view(B, T, HV, V), cache[1:].float().transpose(-1, -2).contiguous()
