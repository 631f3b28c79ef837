"""The "decode_fused" kernel variant: fused Triton decode-phase training, forward and backward.

One program per (sequence, value head, value tile of BV columns). BV is the state codec's
tile width, so every [K x BV] scale group (and every Hadamard-32 group) lies inside one
program and the rounding needs no cross-program reduction. Each program runs its
sequence token by token: the prefix exactly, then the decode suffix with the rounding of
kernels/reference/decode.py (the numerics contract; docs/decode_phase.md), in the same order.

Backward: the forward kernel, run again with ``SAVE_CKPT``, stores the state entering every
CK-th token; the backward kernel walks the blocks in reverse, recomputes the block's states
from its checkpoint into a per-program scratch, and then runs the reverse recurrence over
the block (identity gradient through every rounding). dq/dk/dg/dbeta are summed over value
tiles (and grouped heads) outside the kernel.

The kernels are the plain Triton of ``kernels.py``, specialized by ``tl.constexpr`` arguments: what
the spec fixes (kind, state layout, codec, readout, replay, factor rounding, a serving profile's order
and cache dtype) is ``DecodeParams.constants()``, passed by name at every launch (``laqat source SPEC``
shows the file and those values). What the inputs decide (initial state, varlen) stays a
``tl.constexpr`` argument too; the lengths, the replay window and the grid step are runtime values, so
changing the phase compiles nothing.

A decay grid (``decay_log_step``) does not depend on the state, so it is applied once before the
token loops (``decay_grid_kernel``, one elementwise pass writing an fp32 copy of g) rather than in
every step of the serial chain; its gradient is the identity, so dg needs no correction.
"""
from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

import torch
import triton

from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.decode import kernels
from la_compiler.kernels.decode.options import DecodeOptions, decode_options, decode_reason, require_lengths
from la_compiler.kernels.registry import SelectionContext, register_variant, spec_of
from la_compiler.spec import RecurrenceSpec

CODEC_IDS = {None: 0, "fp8_e4m3": 1, "int8": 2, "int8_h32": 3}
FACTOR_IDS = {"none": 0, "fp8_e4m3": 1, "int8": 2}
CACHE_IDS = {"float32": 0, "bfloat16": 1, "float16": 2}
CHECKPOINT_EVERY = 16
MAX_HEAD_DIM = 256
NUM_WARPS: int | None = None  # None: 4 up to 4096 state elements per program, else 8 (benchmarks may override)
# A serving profile's forward launches as vLLM 0.33 launches its decode kernels (value tiles of at most 32
# columns; fused_recurrent_gated_delta_rule_packed_decode: 1 warp, fused_recurrent_kda_packed_decode: 4), so
# that Triton lays the state tile out, and orders the sums over K, as it does for vLLM's kernels.
SERVING_BLOCK_V = 32
SERVING_NUM_WARPS = {"gdn": 1, "kda": 4}


def _num_warps(BK: int, BV: int) -> int:
    return NUM_WARPS if NUM_WARPS is not None else (4 if BK * BV <= 4096 else 8)


@functools.lru_cache(maxsize=1024)  # parsed once per spec, not on every launch
def _options(spec) -> DecodeOptions:
    return decode_options(spec)


def unsupported_reason(spec, head_k: int, head_v: int) -> str | None:
    if head_k > MAX_HEAD_DIM or head_v > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} exceed one register tile"
    opts = _options(spec_of(spec))
    if opts.codec == "int8_h32" and head_v % 32:
        return f"the int8_h32 codec needs the value head dim to be a multiple of 32, got {head_v}"
    return None


# ---- what a spec fixes of the kernels ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """What the decode kernels are specialized on (their ``tl.constexpr`` arguments, ``constants()``)."""

    kind: str
    state: str  # memory layout of h0 / ht / dht / dh0: "kv" or "vk" (V-first)
    codec: str | None
    readout: str
    mode: str
    factor: str
    vfirst: bool = False  # the state tile V-first in registers (a serving profile: vLLM's order of the sums)
    cache: str = "float32"  # the serving cache's dtype, rounded to after the codec (float32: not rounded)

    @classmethod
    def from_spec(cls, spec, model_dtype=None) -> "DecodeParams":
        """``model_dtype``: the dtype of v, which decides a serving profile's ``state_dtype: auto``."""
        spec = spec_of(spec)
        opts = _options(spec)
        cache = opts.cache_dtype(spec.kind, model_dtype) if opts.serving else "float32"
        return cls(kind=spec.kind, state=spec.state, codec=opts.codec, readout=opts.readout, mode=opts.mode,
                   factor=opts.factor_format, vfirst=opts.vllm_order, cache=cache)

    def constants(self, *names: str) -> dict[str, object]:
        """The ``tl.constexpr`` values of the kernels (kernels.py) that these params fix; only ``names`` if given
        (``round_state_kernel`` takes four of them)."""
        values = {"IS_KDA": self.kind == "kda", "STATE_VK": self.state == "vk", "CODEC": CODEC_IDS[self.codec],
                  "READ_STORED": self.readout == "stored", "REPLAY": self.mode == "replay",
                  "FACTOR": FACTOR_IDS[self.factor], "VFIRST": self.vfirst, "CACHE": CACHE_IDS[self.cache]}
        return {name: values[name] for name in names} if names else values


ROUND_STATE_CONSTEXPRS = ("STATE_VK", "CODEC", "VFIRST", "CACHE")  # round_state_kernel's; decay_grid_kernel: none


# ---- launchers ---------------------------------------------------------------------------------
def _tiles(K: int, V: int, opts: DecodeOptions) -> tuple[int, int]:
    """(BK, BV): the state tile of one program; BV is the codec's scale group where there is a codec."""
    BV = opts.block_v if V >= opts.block_v else triton.next_power_of_2(V)
    if opts.codec is None:
        BV = min(BV, SERVING_BLOCK_V if opts.serving else 64)
    return triton.next_power_of_2(K), BV


def _geometry(q, v, opts: DecodeOptions):
    K, V = q.shape[-1], v.shape[-1]
    BK, BV = _tiles(K, V, opts)
    return K, V, BK, BV, triton.cdiv(V, BV)


def _forward_warps(p: DecodeParams, BK: int, BV: int) -> int:
    if NUM_WARPS is None and p.vfirst:
        return SERVING_NUM_WARPS[p.kind]
    return _num_warps(BK, BV)


def _flags(initial_state, cu_seqlens):
    return dict(USE_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None)


def round_state(spec, state: torch.Tensor, model_dtype) -> torch.Tensor:
    """``state`` [N, HV, K, V] (or V-first, the spec's layout) as the decode kernels round a cache on load:
    the spec's state codec, then a serving profile's cache dtype (``model_dtype`` decides ``auto``); fp32."""
    spec = spec_of(spec)
    opts = _options(spec)
    K, V = (state.shape[-2], state.shape[-1]) if spec.state == "kv" else (state.shape[-1], state.shape[-2])
    BK, BV = _tiles(K, V, opts)
    state = state.contiguous()
    out = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    if state.numel():
        kernels.round_state_kernel[(triton.cdiv(V, BV), state.shape[0] * state.shape[1])](
            state, out, K=K, V=V, BK=BK, BV=BV,
            **DecodeParams.from_spec(spec, model_dtype).constants(*ROUND_STATE_CONSTEXPRS))
    return out


def _check(spec, q, v, cu_seqlens, prefill_lengths, valid_lengths, n):
    reason = unsupported_reason(spec, q.shape[-1], v.shape[-1])
    if reason is not None:
        raise ValueError(f"decode_fused cannot run {spec}: {reason}")
    if prefill_lengths.numel() != n or valid_lengths.numel() != n:
        raise ValueError(f"decode_fused: need {n} prefill/valid lengths, got {prefill_lengths.numel()}/"
                         f"{valid_lengths.numel()}")


def _decay_on_grid(g, step, cu_seqlens, pre, n: int, T: int):
    """g with the suffix tokens' log-decays rounded to the grid (fp32); g itself without a grid."""
    if step is None:
        return g
    W = g[0, 0].numel()
    out = torch.full(g.shape, float("nan"), dtype=torch.float32, device=g.device)
    if cu_seqlens is None:
        longest = T
    else:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if n else 0
    BW = triton.next_power_of_2(W)
    BT = max(1, min(16, 4096 // BW))
    kernels.decay_grid_kernel[(triton.cdiv(max(longest, 1), BT), n)](
        g, out, cu_seqlens if cu_seqlens is not None else pre, pre, float(step), T,
        W=W, BT=BT, BW=BW, IS_VARLEN=cu_seqlens is not None)
    return out


def _run_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths, *,
                 save_ckpt: bool, round_initial_state: bool = True):
    spec = spec_of(spec)
    require_lengths(spec, prefill_lengths, valid_lengths)
    opts = _options(spec)
    B, T, H, _ = q.shape
    HV = v.shape[2]
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _check(spec, q, v, cu_seqlens, prefill_lengths, valid_lengths, n)
    K, V, BK, BV, NV = _geometry(q, v, opts)
    dev = q.device
    pre = prefill_lengths.to(device=dev, dtype=torch.int32).contiguous()
    val = valid_lengths.to(device=dev, dtype=torch.int32).contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = torch.full((B, T, HV, V), float("nan"), dtype=q.dtype, device=dev)
    ht = torch.full((n, HV, K, V) if spec.state == "kv" else (n, HV, V, K), float("nan"), dtype=torch.float32,
                    device=dev)
    max_len = int(val.max().item()) if save_ckpt and n else 0
    nck = max(triton.cdiv(max_len, CHECKPOINT_EVERY), 1)
    ckpt = torch.empty(n * HV * NV * nck * BK * BV if save_ckpt else 1, dtype=torch.float32, device=dev)
    cu = cu_seqlens.to(torch.int32).contiguous() if cu_seqlens is not None else pre
    params = DecodeParams.from_spec(spec, v.dtype)
    g = _decay_on_grid(g, opts.decay_log_step, cu if cu_seqlens is not None else None, pre, n, T)
    kernels.decode_fwd_kernel[(NV, n * HV)](
        q, k, v, g, beta, h0 if h0 is not None else q, o, ht, ckpt, cu, pre, val,
        float(scale), opts.window, T, nck,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, SAVE_CKPT=save_ckpt, STORE_O=not save_ckpt,
        ROUND_H0=round_initial_state, **_flags(initial_state, cu_seqlens), **params.constants(),
        num_warps=_forward_warps(params, BK, BV),
    )
    return o, ht, (ckpt, nck, pre, val, cu, opts, (K, V, BK, BV, NV), n, g, params)


def decode_fused_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                         valid_lengths=None, round_initial_state=True):
    """``round_initial_state=False``: the initial state is a handoff state, not a cache (no rounding on load)."""
    o, ht, _ = _run_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths,
                            valid_lengths, save_ckpt=False, round_initial_state=round_initial_state)
    return o, ht


def decode_fused_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, *,
                          prefill_lengths=None, valid_lengths=None, round_initial_state=True):
    spec = spec_of(spec)
    _, _, (ckpt, nck, pre, val, cu, opts, (K, V, BK, BV, NV), n, g_used, params) = _run_forward(
        spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, prefill_lengths, valid_lengths, save_ckpt=True,
        round_initial_state=round_initial_state)
    B, T, H, _ = q.shape
    HV = v.shape[2]
    dev = q.device
    total = B * T
    nan = float("nan")  # every element is written by the kernel (padding tokens with zeros)
    dq = torch.full((NV, total, HV, K), nan, dtype=torch.float32, device=dev)
    dk = torch.full_like(dq, nan)
    dg = torch.full((NV, total, HV, K if spec.kind == "kda" else 1), nan, dtype=torch.float32, device=dev)
    dbeta = torch.full((NV, total, HV), nan, dtype=torch.float32, device=dev)
    dv = torch.full((B, T, HV, V), nan, dtype=torch.float32, device=dev)
    dh0 = torch.full_like(initial_state, float("nan"), dtype=torch.float32) if initial_state is not None else None
    scratch = torch.empty(n * HV * NV * CHECKPOINT_EVERY * BK * BV, dtype=torch.float32, device=dev)
    h0 = initial_state.contiguous() if initial_state is not None else None
    kernels.decode_bwd_kernel[(NV, n * HV)](
        q.contiguous(), k.contiguous(), v.contiguous(), g_used, beta.contiguous(),
        h0 if h0 is not None else q, ckpt, scratch, cu, pre, val, do.contiguous(), dht.contiguous(),
        dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else dq,
        float(scale), opts.window, T, nck, total,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, **_flags(initial_state, cu_seqlens),
        **params.constants(), num_warps=_num_warps(BK, BV),
    )
    group = HV // H
    dq = dq.sum(0).view(B, T, H, group, K).sum(3)
    dk = dk.sum(0).view(B, T, H, group, K).sum(3)
    dg = dg.sum(0).view(B, T, HV, -1)
    dg = dg if spec.kind == "kda" else dg[..., 0]
    dbeta = dbeta.sum(0).view(B, T, HV)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if dh0 is not None else None)


def source_modules(spec) -> dict[str, ModuleType]:
    DecodeParams.from_spec(spec)  # refuses a spec the kernels cannot run
    return {"forward and backward": kernels}


def constexprs(spec) -> dict[str, object]:
    """The ``tl.constexpr`` values the spec fixes (``DecodeParams.constants()``). A GDN serving profile with
    ``state_dtype: auto`` leaves CACHE out: the inputs' dtype fixes it at launch."""
    spec = spec_of(spec)
    opts = _options(spec)
    values = DecodeParams.from_spec(spec).constants()
    if opts.serving and spec.kind == "gdn" and opts.state_dtype == "auto":
        del values["CACHE"]
    return values


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    reason = decode_reason(spec, "triton")
    if reason is None and _options(spec).serving is not None:
        return ("a serving profile's prefix is the chunked prefill, not this kernel's token recurrence "
                "(decode_serving runs it, with these kernels for the suffix)")
    return reason or needs(triton_runs(ctx), not_float64(ctx)) or unsupported_reason(spec, ctx.head_k, ctx.head_v)


register_variant(
    "decode_fused",
    decode_fused_forward,
    decode_fused_backward,
    "fused Triton decode-phase training kernel (token / replay), fp32 state, fwd + bwd with state checkpoints",
    supports=supports,
    summary="fused Triton decode-phase kernel (token / replay), fwd + bwd",
    source_modules=source_modules,
    constexprs=constexprs,
)
