"""Checks of the IR's canonical tensors: their shapes (every kernel and reference), and at a
Triton launcher also the device, head-dim limits and state shape."""
from __future__ import annotations

from la_compiler.options import interpreter


def check_shapes(kind: str, q, k, v, g, beta) -> tuple[int, int, int, int, int, int]:
    """Returns (B, T, H, K, HV, V); raises naming the tensor whose shape breaks the IR contract."""
    if kind not in ("gdn", "kda"):
        raise ValueError(f"kind must be 'gdn' or 'kda', got {kind!r}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T) or HV % H:
        raise ValueError(f"v must be [B, T, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
    g_shape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"{kind.upper()} g must be {g_shape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be {(B, T, HV)}, got {tuple(beta.shape)}")
    return B, T, H, K, HV, V


def check_canonical_inputs(kernel: str, kind: str, state: str, q, k, v, g, beta, initial_state, cu_seqlens, *,
                           max_k: int, max_v: int, why_max: str = ""):
    """Returns (B, T, H, K, HV, V, N, state_shape); raises naming the offending argument."""
    if q.device.type != "cuda" and not interpreter():
        raise RuntimeError(f"{kernel} runs Triton kernels: it needs CUDA tensors (got {q.device}), "
                           "or TRITON_INTERPRET=1 set before triton is imported")
    B, T, H, K, HV, V = check_shapes(kind, q, k, v, g, beta)
    if K > max_k or V > max_v:
        raise ValueError(f"{kernel} supports K <= {max_k} and V <= {max_v}{why_max}, got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    state_shape = (N, HV, K, V) if state == "kv" else (N, HV, V, K)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {state_shape} (state={state}), got {tuple(initial_state.shape)}")
    return B, T, H, K, HV, V, N, state_shape


def final_state_dtype(q_dtype):
    """The IR's final state is fp32, and fp64 where the inputs are fp64 (computed by the fp64 variants only)."""
    import torch

    return torch.float64 if q_dtype == torch.float64 else torch.float32
