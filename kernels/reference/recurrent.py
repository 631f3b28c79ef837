"""The fp64 torch reference of the GDN and KDA recurrences (token by token).

This is the oracle every kernel is tested against, and the "reference" kernel variant the
lower pass can select. It is written from docs/numerics.md, independently of every kernel:

    S <- Diag(exp(g_t)) S            (GDN: g_t is a scalar per value head; KDA: g_t in R^K)
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T (scale * q_t)

Shapes (the IR's canonical layout): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] for
GDN or [B, T, HV, K] for KDA; beta [B, T, HV]; state [N, HV, K, V] ("kv") or [N, HV, V, K]
("vk"). HV must be a multiple of H (grouped heads: value head j reads q/k head j // (HV/H)).
With ``cu_seqlens`` (B == 1), the N sequences are packed along T.
"""
from __future__ import annotations

import torch

from la_compiler.kernels.common.canonical_inputs import check_shapes


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, T, HV, ...] for grouped heads (value head j uses head j // (HV/H))."""
    h = x.shape[2]
    if hv % h:
        raise ValueError(f"HV={hv} must be a multiple of H={h}")
    return x if hv == h else x.repeat_interleave(hv // h, dim=2)


def sequence_bounds(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={batch}")
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_layout: str = "kv",
    dtype: torch.dtype = torch.float64,
    state_hook=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V], final_state [N, HV, K, V] or [N, HV, V, K]), both in ``dtype``.

    Differentiable with torch autograd. ``state_hook(state, seq_index, t_end)`` -- if given --
    is called after the update and readout of every token (``t_end`` = tokens consumed so
    far in that sequence) and returns the state to carry on with; the quantization references use it to
    round the state where a policy says so.
    """
    B, T, H, K, HV, V = check_shapes(kind, q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    qe, ke = (expand_heads(x, HV).to(dtype) for x in (q, k))
    ve, ge, be = v.to(dtype), g.to(dtype), beta.to(dtype)

    seqs = sequence_bounds(B, T, cu_seqlens)
    outputs = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
            S = S.transpose(-1, -2) if state_layout == "vk" else S
        else:
            S = q.new_zeros(HV, K, V, dtype=dtype)
        for t in range(start, end):
            decay = ge[b, t].exp()
            S = S * (decay[:, None, None] if kind == "gdn" else decay[:, :, None])
            kt = ke[b, t]
            u = be[b, t][:, None] * (ve[b, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            outputs[b][t] = torch.einsum("hkv,hk->hv", S, qe[b, t] * scale)
            if state_hook is not None:
                S = state_hook(S, n, t - start + 1)
        finals.append(S.transpose(-1, -2) if state_layout == "vk" else S)
    zero = q.new_zeros(HV, V, dtype=dtype)
    o = torch.stack([torch.stack([x if x is not None else zero for x in row]) for row in outputs])
    return o, torch.stack(finals)
