"""GDN/KDA recurrences as people write them: hand-written spellings for the torch frontend
tests (the FLA naive references and the transformers fallbacks are tested as they ship).

Each function takes q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV] (g [B, T, HV, K]
for KDA) and an optional initial state [B, HV, K, V]; returns (o [B, T, HV, V], state).
"""
import torch
import torch.nn.functional as F


def gdn_list_stack_matmul_preexp(q, k, v, g, beta, h0=None):
    """[B, T, H, D]; decay pre-exponentiated outside the loop; matmul for the read, einsum
    for the readout; outputs collected in a list and stacked; no initial state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q = q * K ** -0.5
    alpha = g.exp()
    S = torch.zeros(B, H, K, V, dtype=q.dtype)
    outs = []
    for t in range(T):
        S = S * alpha[:, t, :, None, None]
        kv = (k[:, t].unsqueeze(-2) @ S).squeeze(-2)  # [B, H, V]
        u = (v[:, t] - kv) * beta[:, t].unsqueeze(-1)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def kda_bhtd_setitem_bmm(q, k, v, g, beta, h0=None):
    """[B, H, T, D] inside; l2norm via F.normalize and the scale inside; grouped heads via
    repeat_interleave; bmm on flattened heads; o[:, :, t] = ...; initial and final state."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q = F.normalize(q.float(), dim=-1).repeat_interleave(HV // H, dim=2)
    k = F.normalize(k.float(), dim=-1).repeat_interleave(HV // H, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    q = q * (K ** -0.5)
    S = h0.float().clone()
    o = torch.zeros(B, HV, T, V)
    for t in range(T):
        S = S * torch.exp(g[:, :, t]).unsqueeze(-1)
        St = S.reshape(B * HV, K, V)
        kt = k[:, :, t].reshape(B * HV, 1, K)
        read = torch.bmm(kt, St).reshape(B, HV, V)
        u = beta[:, :, t, None] * (v[:, :, t] - read)
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = (q[:, :, t].unsqueeze(-1) * S).sum(-2)
    return o.transpose(1, 2), S


def gdn_unbind_cat(q, k, v, g, beta, h0=None):
    """unbind over time; broadcast multiply + sum everywhere; outputs unsqueezed and cat-ed;
    initial state read, final state returned."""
    K = q.shape[-1]
    S = h0
    outs = []
    for qt, kt, vt, gt, bt in zip(q.unbind(1), k.unbind(1), v.unbind(1), g.unbind(1), beta.unbind(1)):
        S = gt.exp()[..., None, None] * S
        u = bt[..., None] * (vt - (S * kt[..., None]).sum(-2))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(((S * qt[..., None]).sum(-2) * K ** -0.5).unsqueeze(1))
    return torch.cat(outs, dim=1), S


def gdn_chunked_solve(q, k, v, g, beta, h0=None, chunk_size=4, causal=True, beta_scale=None, state_clamp=None,
                      mask_diagonal=0):
    """Kimi/Qwen-style chunked WY form in [B, T, H, D], triangular inverse with
    linalg.solve_triangular, T padded to the chunk size; ``causal=False`` lets the intra-chunk
    attention see later tokens of the chunk (a near miss); ``beta_scale`` multiplies the padded beta;
    ``state_clamp`` clamps the state after every chunk (a near miss); ``mask_diagonal=1`` lets every token see the
    next one through the decay mask (a near miss differing from the causal form in one literal)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    if beta_scale is not None:
        beta = beta * beta_scale
    N = (T + pad) // C
    q = q * K ** -0.5
    q, k, v = (x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(B, N, C, H).permute(0, 3, 1, 2) for x in (g, beta))  # [B, H, N, C]
    gc = g.cumsum(-1)
    log_decay = (gc[..., :, None] - gc[..., None, :]).tril()
    decay = log_decay.exp().tril(mask_diagonal)
    kb = k * beta[..., None]
    A = torch.eye(C) + (kb @ k.transpose(-1, -2) * decay).tril(-1)
    u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    qk = q @ k.transpose(-1, -2) * (decay if causal else log_decay.exp())
    S = h0 if h0 is not None else q.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for n in range(N):
        vn = u[:, :, n] - w[:, :, n] @ S
        o[:, :, n] = (q[:, :, n] * gc[:, :, n, :, None].exp()) @ S + qk[:, :, n] @ vn
        kd = k[:, :, n] * (gc[:, :, n, -1:] - gc[:, :, n]).exp()[..., None]
        S = S * gc[:, :, n, -1, None, None].exp() + kd.transpose(-1, -2) @ vn
        if state_clamp is not None:
            S = S.clamp(-state_clamp, state_clamp)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, S


def gdn_inplace_state(q, k, v, g, beta, h0=None):
    """The state updated in place: ``S.mul_(decay)``, ``S.add_(k u^T)`` on a clone of h0 (inference
    code: autograd refuses to differentiate reads of a state that is overwritten afterwards)."""
    K = q.shape[-1]
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        kt = k[:, t]
        S.mul_(g[:, t].exp()[..., None, None])
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S.add_(kt[..., None] * u[..., None, :])
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def gdn_bmm_flat_state(q, k, v, g, beta, h0=None):
    """Every per-step contraction a ``bmm`` over flattened B*H, the state kept as [B*H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = h0.reshape(B * H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().reshape(B * H, 1, 1)
        kt = k[:, t].reshape(B * H, 1, K)
        u = (v[:, t].reshape(B * H, 1, V) - torch.bmm(kt, S)) * beta[:, t].reshape(B * H, 1, 1)
        S = S + torch.bmm(kt.transpose(1, 2), u)
        outs.append(torch.bmm(q[:, t].reshape(B * H, 1, K), S).reshape(B, H, V) * K ** -0.5)
    return torch.stack(outs, 1), S.reshape(B, H, K, V)


def gdn_head_first(q, k, v, g, beta, h0=None):
    """Inputs already [B, H, T, D] (and g, beta [B, H, T]), so with T = K = V every input has the
    state's shape [B, H, K, V]: roles come from the dataflow, not from the sizes."""
    K = q.shape[-1]
    S = h0
    o = torch.zeros_like(v)
    for t in range(q.shape[2]):
        kt = k[:, :, t]
        S = S * g[:, :, t, None, None].exp()
        u = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)) * beta[:, :, t, None]
        S = S + torch.einsum("bhk,bhv->bhkv", kt, u)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) * K ** -0.5
    return o, S


def gdn_clone_inplace(q, k, v, g, beta, h0=None):
    """In-place methods on a fresh clone, read through their result (``S.clone().mul_(decay)``)."""
    K = q.shape[-1]
    S = h0
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = S.clone().mul_(g[:, t].exp()[..., None, None])
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S.clone().add_(kt[..., None] * u[..., None, :])
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S
