"""Random canonical inputs of the laqat IR op (fresh, never zeros)."""
import torch
import torch.nn.functional as F


def random_inputs(kind="gdn", B=1, T=6, H=2, HV=None, K=4, V=3, *, initial_state=False, dtype=torch.float32,
                  requires_grad=True, cu_seqlens=None, state_layout="kv"):
    HV = HV or H
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g_shape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    g = F.logsigmoid(torch.randn(g_shape, dtype=dtype)) * 0.5
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    tensors = [q, k, v, g, beta]
    n = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state:
        shape = (n, HV, V, K) if state_layout == "vk" else (n, HV, K, V)
        tensors.append(torch.randn(shape, dtype=dtype))
    else:
        tensors.append(None)
    if requires_grad:
        for t in tensors:
            if t is not None:
                t.requires_grad_(True)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long)
    return tensors, cu
