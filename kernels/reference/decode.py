"""The fp64 torch reference of decode-phase training (token and replay modes).

Written from docs/decode_phase.md ("Numerics"), independently of every kernel. Each
sequence n is split into a prefix [0, p_n) (prefill: exact state, no internal rounding), a
recurrent suffix [p_n, L_n) that runs as the serving decoder would, and padding [L_n, end)
(zero output, no state change, zero gradient). Per suffix token t, in this order:

    handoff (first suffix token only): S <- codec(S)           replay: S is the anchor
    g_t <- round(g_t / d) * d                                   if decay_log_step d
    S_a = Diag(exp g_t) S;  u = beta_t (v_t - S_a^T k_t)
    token:  S_b = S_a + k_t u^T;  S' = codec(S_b)
    replay: S_b = S_a + fq(k_t) fq(u)^T  (factors rounded once, when written);
            S' = codec(S_b) when `window` tokens have passed since the anchor, else S_b
    o_t = R^T (scale q_t) with R = S_b (readout=working) or S' (readout=stored);  S <- S'

An initial state is a quantized cache: rounded once, on load. The final state is the state
after the last valid token (the handoff is applied only if the suffix is non-empty).
Every rounding has an identity (straight-through) gradient.

A serving profile (``x.serving``, token mode) adds its state cache's dtype (``x.state_dtype``) to the
codec: ``codec(S)`` is then the format's QDQ (if any) followed by the round to nearest even to
bfloat16 / float16 (of the fp32 value, as the kernels hold it), at every place above where the codec
applies. The order of operations inside a step does not matter here (fp64).

Codecs (state tiles [K x BV] per sequence and head; docs/numerics.md, "Formats"):
    fp8_e4m3  s = amax/448 (1 if amax = 0); E4M3 round-to-nearest-even of clamp(x/s, ±448); * s
    int8      s = amax/127 (1 if amax = 0); clamp(round_half_even(x/s), ±127) * s
    fp8_e4m3 / int8 with block<N> groups: the same, one scale per key row and N values along V
    int8_h32  y = x H32 (per key row, 32 values); s = fp16(max(amax_32/127, 6e-8));
              clamp(round_half_away(y/s), ±127) * s, then H32 (orthonormal, its own inverse)
Factor rounding (replay, x.replay_factor_qdq): k_t one scale over K; u_t one scale per BV tile of V.
"""
from __future__ import annotations

import math

import torch

from la_compiler.kernels.common.canonical_inputs import check_shapes
from la_compiler.kernels.reference.recurrent import expand_heads, sequence_bounds
from la_compiler.options import DecodeOptions

FP8_MAX = 448.0
INT8_MAX = 127.0
H32_MIN_SCALE = 6e-8


# ---- rounding functions (forward values; `ste` gives them the identity gradient) ----------
def ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return x + (rounded - x).detach()


def _amax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Nearest-even E4M3 value of y (|y| <= 448), computed exactly in y's dtype."""
    mant, exp = torch.frexp(y)  # |y| = |mant| 2^exp, |mant| in [0.5, 1)
    e = torch.clamp(exp - 1, min=-6)  # floor(log2|y|), subnormals share the step of 2^-6
    step = torch.ldexp(torch.ones_like(y), (e - 3).to(torch.int32))
    return torch.round(y / step) * step  # torch.round: half to even; y/step is exact


def qdq_fp8(x: torch.Tensor, dims) -> torch.Tensor:
    s = _amax_scale(x.abs().amax(dim=dims, keepdim=True), FP8_MAX)
    return round_e4m3(torch.clamp(x / s, -FP8_MAX, FP8_MAX)) * s


def qdq_int8(x: torch.Tensor, dims) -> torch.Tensor:
    s = _amax_scale(x.abs().amax(dim=dims, keepdim=True), INT8_MAX)
    return torch.clamp(torch.round(x / s), -INT8_MAX, INT8_MAX) * s


def hadamard32(dtype=torch.float64, device=None) -> torch.Tensor:
    """The orthonormal 32-point Sylvester Hadamard matrix (symmetric: its own inverse)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < 32:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(32.0)


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    t = torch.floor(a)
    return torch.sign(y) * (t + (a - t >= 0.5).to(y.dtype))


def qdq_int8_h32(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] with V a multiple of 32: Hadamard-32 INT8 codec along the last axis."""
    *lead, V = x.shape
    if V % 32:
        raise ValueError(f"int8_h32 needs the value dim to be a multiple of 32, got V={V}")
    h = hadamard32(x.dtype, x.device)
    y = x.reshape(*lead, V // 32, 32) @ h
    s = torch.clamp(y.abs().amax(dim=-1, keepdim=True) / INT8_MAX, min=H32_MIN_SCALE)
    s = s.to(torch.float16).to(x.dtype)
    yq = torch.clamp(round_half_away(y / s), -INT8_MAX, INT8_MAX) * s
    return (yq @ h).reshape(*lead, V)


def qdq_state(S: torch.Tensor, codec: str, block_v: int, codec_block: int = 0) -> torch.Tensor:
    """Round a state [HV, K, V] with one codec scale group per [K x block_v] tile per head, or (``codec_block``
    N > 0) per key row and N values along V."""
    HV, K, V = S.shape
    if codec == "int8_h32":
        return qdq_int8_h32(S)  # its groups (32 values of one key row) lie inside every tile
    fn = qdq_fp8 if codec == "fp8_e4m3" else qdq_int8
    width, dims = (codec_block, (2,)) if codec_block else (block_v, (1, 2))
    tiles = [fn(S[..., j:j + width], dims=dims) for j in range(0, V, width)]
    return torch.cat(tiles, dim=-1)


def qdq_factor(x: torch.Tensor, fmt: str, block: int | None) -> torch.Tensor:
    """Round a replay factor [HV, D]: one scale per head (block=None) or per `block` values."""
    fn = {"fp8_e4m3": qdq_fp8, "int8": qdq_int8}[fmt]
    if block is None:
        return fn(x, dims=(-1,))
    return torch.cat([fn(x[..., j:j + block], dims=(-1,)) for j in range(0, x.shape[-1], block)], dim=-1)


def round_log_decay(g: torch.Tensor, step: float) -> torch.Tensor:
    return torch.round(g / step) * step


def round_to_cache(x: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """x rounded to nearest even in the cache dtype ("float32": unchanged), back in x's dtype."""
    if dtype_name == "float32":
        return x
    return x.to(torch.float32).to(getattr(torch, dtype_name)).to(x.dtype)


# ---- the recurrence -------------------------------------------------------------------------
def delta_rule_decode_reference(
    q, k, v, g, beta, *, kind: str, options: DecodeOptions, prefill_lengths, valid_lengths,
    scale: float | None = None, initial_state=None, cu_seqlens=None, state_layout: str = "kv",
    dtype: torch.dtype = torch.float64,
):
    """Returns (o [B, T, HV, V], final_state [N, HV, K, V] or V-first), both in ``dtype``.

    ``prefill_lengths`` / ``valid_lengths``: one int per sequence (lists or int tensors).
    Differentiable with torch autograd (identity gradient through every rounding).
    """
    B, T, H, K, HV, V = check_shapes(kind, q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    qe, ke = (expand_heads(x, HV).to(dtype) for x in (q, k))
    ve, ge, be = v.to(dtype), g.to(dtype), beta.to(dtype)
    seqs = sequence_bounds(B, T, cu_seqlens)
    prefill = [int(x) for x in (prefill_lengths.tolist() if torch.is_tensor(prefill_lengths) else prefill_lengths)]
    valid = [int(x) for x in (valid_lengths.tolist() if torch.is_tensor(valid_lengths) else valid_lengths)]
    if len(prefill) != len(seqs) or len(valid) != len(seqs):
        raise ValueError(f"need one prefill/valid length per sequence ({len(seqs)}), got {len(prefill)}/{len(valid)}")

    cache = options.cache_dtype(kind, v.dtype) if options.serving else "float32"

    def codec(S):
        if options.codec is not None:
            S = ste(S, qdq_state(S.detach(), options.codec, options.block_v, options.codec_block))
        return S if cache == "float32" else ste(S, round_to_cache(S.detach(), cache))

    def factor(x, block):
        if options.mode != "replay" or options.factor_format == "none":
            return x
        return ste(x, qdq_factor(x.detach(), options.factor_format, block))

    outputs = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        p, L = prefill[n], valid[n]
        if not (0 <= p <= L <= end - start):
            raise ValueError(f"sequence {n}: need 0 <= prefill {p} <= valid {L} <= stored {end - start}")
        if initial_state is not None:
            S = initial_state[n].to(dtype)
            S = codec(S.transpose(-1, -2) if state_layout == "vk" else S)  # a quantized cache, rounded on load
        else:
            S = q.new_zeros(HV, K, V, dtype=dtype)
        since_anchor = 0
        for i in range(L):
            t = start + i
            suffix = i >= p
            if i == p:
                S = codec(S)  # the handoff (replay: the first anchor)
                since_anchor = 0
            gt = ge[b, t]
            if suffix and options.decay_log_step is not None:
                gt = ste(gt, round_log_decay(gt.detach(), options.decay_log_step))
            decay = gt.exp()
            S_a = S * (decay[:, None, None] if kind == "gdn" else decay[:, :, None])
            kt = ke[b, t]
            u = be[b, t][:, None] * (ve[b, t] - torch.einsum("hkv,hk->hv", S_a, kt))
            if suffix:
                S_b = S_a + factor(kt, None)[:, :, None] * factor(u, options.block_v)[:, None, :]
                since_anchor += 1
                if options.mode == "token" or since_anchor == options.window:
                    S_new, since_anchor = codec(S_b), 0
                else:
                    S_new = S_b
                R = S_new if options.readout == "stored" else S_b
            else:
                S_b = S_a + kt[:, :, None] * u[:, None, :]
                S_new = R = S_b
            outputs[b][t] = torch.einsum("hkv,hk->hv", R, qe[b, t] * scale)
            S = S_new
        finals.append(S.transpose(-1, -2) if state_layout == "vk" else S)
    zero = q.new_zeros(HV, V, dtype=dtype)
    o = torch.stack([torch.stack([x if x is not None else zero for x in row]) for row in outputs])
    return o, torch.stack(finals)
