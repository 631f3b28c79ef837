"""The fp64 torch reference of the CHUNKED (WY) GDN/KDA algorithm, with every rounding site.

Written from docs/numerics.md, independently of the kernels; docs/kernels-chunk.md derives it.
Per (sequence, value head, chunk of C tokens), G = within-chunk cumsum of g:

    A     = strict_tril(diag(beta) (K K^T ⊙ Γ))        Γ_ij = exp(G_i - G_j) (KDA: per channel)
    T     = (I + A)^-1                                 (or the Neumann sum_{i<=d} (-A)^i)
    W     = T diag(beta) (exp(G) ⊙ K)                  then the W quantizer (per token over K)
    U     = T diag(beta) V
    A_qk  = scale tril(Q K^T ⊙ Γ)                      (diagonal included)
    for each chunk n, with the (rounded) incoming state S_n:
    V_new = U - W S_n
    O     = scale (Q ⊙ exp G) S_n + A_qk V_new
    S_n+1 = exp(G_C) S_n + (K ⊙ exp(G_C - G))^T V_new  then the state quantizer

KDA pairwise decays exp(G_id - G_jd) come from prefix differences (masked to j <= i before
the exp), never from exp(G) * exp(-G). A sequence whose length is not a multiple of C is
padded with zero tokens (q = k = v = beta = g = 0: decay 1, no update), exactly what a
kernel's masked loads read.

Rounding order inside one chunk (each step reads the rounded results of the steps before):
 1. key_interaction (lhs K, rhs K | KDA: rhs the pairwise-decayed keys) -> A
 2. solve -> T
 3. wy_key (lhs T, rhs beta exp(G) K) -> W, then w (= state_read.lhs)
 4. wy_value (lhs T, rhs beta V) -> U
 5. output_score (lhs Q, rhs K | KDA: pairwise-decayed keys) -> A_qk
 6. state_read (lhs W, rhs S_n) -> V_new = U - W S_n
 7. output_state (lhs Q exp G, rhs S_n), output_value (lhs A_qk, rhs V_new) -> O
 8. state_update (lhs (K exp(G_C - G))^T, rhs V_new) -> S_n+1, then the state quantizer.
The initial state is rounded once when loaded; chunks past a sequence's end (padding of
varlen batches) leave its state untouched (no extra rounding).

Every GEMM goes through ``_gemm``: operands rounded with the reduction dim last (one scale
per row of the reduction), then the product, optionally accumulated in fp16/bf16 block by
block of the reduction (round after every block's add; straight-through gradient).
"""
from __future__ import annotations

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.canonical_inputs import check_shapes
from la_compiler.kernels.reference.recurrent import expand_heads, sequence_bounds
from la_compiler.kernels.reference.rounding import ChunkRounding
from la_compiler.kernels.reference.rounding_from_spec import rounding_from_spec

Tensor = torch.Tensor


def chunk_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    spec: RecurrenceSpec | str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    rounding: ChunkRounding | None = None,
    record: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns (o [B, T, HV, V], final_state [N, HV, K, V] or V-first), both in ``dtype``.

    ``spec`` gives the kind, chunk size, solve, state layout and (unless ``rounding`` is
    passed) the quant sites. Differentiable with torch autograd; every QDQ passes gradients
    straight through (that comes from the rounding callables). ``record``, if given, receives
    the rounded intermediates the kernels also hold: "w" [N, HV, NC, C, K], "h" (the
    chunk-start states) [N, HV, NC, K, V], and the products of the pairwise sites "A" (strict,
    beta applied) and "A_qk" (causal, scaled) [N, HV, NC, C, C], for counting rounding flips in tests.
    """
    spec = spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
    if spec.phase != "none":
        raise ValueError(f"spec phase={spec.phase!r}: the chunk reference computes prefill only (phase=none)")
    rounding = rounding_from_spec(spec) if rounding is None else rounding
    kind, C = spec.kind, spec.chunk
    B, T, H, K, HV, V = check_shapes(kind, q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale

    seqs = sequence_bounds(B, T, cu_seqlens)
    lengths = [end - start for _, start, end in seqs]
    NC = max([(n + C - 1) // C for n in lengths] + [1])
    chunks = lambda x: _to_chunks(x.to(dtype), seqs, NC, C)  # noqa: E731  [N, HV, NC, C, ...]
    Q, Kc = chunks(expand_heads(q, HV)), chunks(expand_heads(k, HV))
    Vc, bc, gc = chunks(v), chunks(beta), chunks(g)
    N = len(seqs)

    G = gc.cumsum(3)  # [N, HV, NC, C] (GDN) or [N, HV, NC, C, K] (KDA)
    G_last = G[:, :, :, -1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    b_col = bc[..., None]

    # 1-5: everything that does not depend on the state, all chunks at once.
    if kind == "gdn":
        Gam_strict, Gam_causal = _pair_decay(G, strict), _pair_decay(G, causal)
        A = b_col * _gemm(rounding, "key_interaction", Kc, Kc.transpose(-1, -2)) * Gam_strict
        decay_G = G.exp()[..., None]  # [.., C, 1]
        decay_last = G_last.exp()[..., None, None]  # [N, HV, NC, 1, 1]
        k_to_end = Kc * (G_last[..., None] - G).exp()[..., None]
    else:
        pairs_strict = Kc[..., None, :, :] * _pair_decay(G, strict)  # [.., i, j, K]
        pairs_causal = Kc[..., None, :, :] * _pair_decay(G, causal)
        A = b_col * _pairwise(rounding, "key_interaction", Kc, pairs_strict)
        decay_G = G.exp()
        decay_last = G_last.exp()[..., None]  # [N, HV, NC, K, 1]
        k_to_end = Kc * (G_last[..., None, :] - G).exp()
    A = A.masked_fill(~strict, 0.0)
    Tm = _solve(A, spec)
    W = _gemm(rounding, "wy_key", Tm, b_col * decay_G * Kc)
    if rounding.w is not None:
        W = rounding.w(W)
    U = _gemm(rounding, "wy_value", Tm, b_col * Vc)
    if kind == "gdn":
        A_qk = scale * _gemm(rounding, "output_score", Q, Kc.transpose(-1, -2)) * Gam_causal
    else:
        A_qk = scale * _pairwise(rounding, "output_score", Q, pairs_causal)
    A_qk = A_qk.masked_fill(~causal, 0.0)
    Q_decayed = Q * decay_G

    # 6-8: the state recurrence, chunk by chunk.
    S = _load_state(initial_state, spec, N, HV, K, V, dtype, q.device)
    if rounding.state is not None:
        S = rounding.state(S)
    active = torch.tensor([[c * C < n for c in range(NC)] for n in lengths], device=q.device)
    outputs, starts = [], []
    for c in range(NC):
        starts.append(S)
        W_c = W[:, :, c]
        v_new = U[:, :, c] - _gemm(rounding, "state_read", W_c, S, lhs_rounded=True)
        o_c = scale * _gemm(rounding, "output_state", Q_decayed[:, :, c], S) \
            + _gemm(rounding, "output_value", A_qk[:, :, c], v_new)
        outputs.append(o_c)
        S_next = decay_last[:, :, c] * S + _gemm(rounding, "state_update", k_to_end[:, :, c].transpose(-1, -2), v_new)
        if rounding.state is not None:
            S_next = rounding.state(S_next)
        S = torch.where(active[:, c, None, None, None], S_next, S)

    O = torch.stack(outputs, 2)  # [N, HV, NC, C, V]
    if record is not None:
        record.update(w=W, h=torch.stack(starts, 2), A=A, A_qk=A_qk)
    o = _from_chunks(O, seqs, B, T)
    final = S.transpose(-1, -2) if spec.state == "vk" else S
    return o, final


# ---- pieces ---------------------------------------------------------------------------------

def _to_chunks(x: Tensor, seqs, NC: int, C: int) -> Tensor:
    """[B, T, HV, ...] -> [N, HV, NC, C, ...], every sequence zero-padded to NC * C tokens."""
    parts = []
    for b, start, end in seqs:
        xs = x[b, start:end]
        pad = xs.new_zeros((NC * C - (end - start),) + tuple(xs.shape[1:]))
        xs = torch.cat([xs, pad]).reshape((NC, C) + tuple(xs.shape[1:]))
        parts.append(xs.movedim(2, 0))
    return torch.stack(parts)


def _from_chunks(O: Tensor, seqs, B: int, T: int) -> Tensor:
    """[N, HV, NC, C, V] -> [B, T, HV, V] (varlen: sequences concatenated along T, B == 1)."""
    N, HV, NC, C, V = O.shape
    flat = O.reshape(N, HV, NC * C, V).transpose(1, 2)  # [N, NC*C, HV, V]
    if len(seqs) == B and all(s == 0 and e == T for _, s, e in seqs):
        return flat[:, :T]
    pieces = [flat[n, : end - start] for n, (_, start, end) in enumerate(seqs)]
    return torch.cat(pieces)[None] if pieces else O.new_zeros(1, 0, HV, V)


def _pair_decay(G: Tensor, mask: Tensor) -> Tensor:
    """exp(G_i - G_j) where mask[i, j], else 0: [.., C, C] (GDN) or [.., C, C, K] (KDA)."""
    if G.dim() == 4:  # GDN [N, HV, NC, C]
        diff = G[..., :, None] - G[..., None, :]
        return torch.where(mask, diff, torch.zeros_like(diff)).exp() * mask
    diff = G[..., :, None, :] - G[..., None, :, :]  # [.., i, j, K]
    m = mask[..., None]
    return torch.where(m, diff, torch.zeros_like(diff)).exp() * m


def _solve(A: Tensor, spec: RecurrenceSpec) -> Tensor:
    """(I + A)^-1 for strictly lower triangular A: exact, or the Neumann polynomial of spec.degree."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    if spec.solve == "exact":
        return torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    T = eye
    for _ in range(spec.degree):  # Horner: I - A (I - A (... I)) = sum_{i=0}^{degree} (-A)^i
        T = eye - A @ T
    return T


def _load_state(initial_state, spec, N, HV, K, V, dtype, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=dtype, device=device)
    want = (N, HV, V, K) if spec.state == "vk" else (N, HV, K, V)
    if tuple(initial_state.shape) != want:
        raise ValueError(f"initial_state must be {list(want)} (state={spec.state}), got {list(initial_state.shape)}")
    S = initial_state.to(dtype)
    return S.transpose(-1, -2) if spec.state == "vk" else S


def _gemm(rounding: ChunkRounding, site: str, lhs: Tensor, rhs: Tensor, lhs_rounded: bool = False) -> Tensor:
    """lhs [.., M, R] @ rhs [.., R, N] with the site's operand rounding and accumulator.

    ``lhs_rounded``: the lhs already went through its quantizer (state_read.lhs is W, rounded
    by the W quantizer when W is made)."""
    if not lhs_rounded:
        lhs = rounding.operand(site, "lhs", lhs)
    rhs = rounding.operand(site, "rhs", rhs.transpose(-1, -2)).transpose(-1, -2)
    acc = rounding.accumulate(site)
    if acc is None:
        return lhs @ rhs
    R = lhs.shape[-1]
    return _blocked(lambda a, b: lhs[..., a:b] @ rhs[..., a:b, :], lhs @ rhs, R, *acc)


def _pairwise(rounding: ChunkRounding, site: str, lhs: Tensor, pairs: Tensor) -> Tensor:
    """out[.., i, j] = sum_d lhs[.., i, d] * pairs[.., i, j, d] (KDA's per-channel-decay products)."""
    lhs = rounding.operand(site, "lhs", lhs)
    pairs = rounding.operand(site, "rhs", pairs, tile_dims=3)
    product = lambda a, b: torch.einsum("...id,...ijd->...ij", lhs[..., a:b], pairs[..., a:b])  # noqa: E731
    acc = rounding.accumulate(site)
    R = lhs.shape[-1]
    return product(0, R) if acc is None else _blocked(product, product(0, R), R, *acc)


def _blocked(product, exact: Tensor, R: int, acc_dtype: torch.dtype, block: int) -> Tensor:
    """Accumulate ``product(a, b)`` over reduction blocks in ``acc_dtype``: the running sum is
    rounded to acc_dtype after every block's add. Gradient: that of the exact product."""
    with torch.no_grad():
        total = None
        for a in range(0, R, block):
            part = product(a, min(a + block, R))
            total = part if total is None else total + part
            total = total.to(acc_dtype).to(exact.dtype)
    return exact + (total - exact).detach()
