"""Launchers of the decode-suffix kernels (kernels.py): every sequence's suffix packed one after another.

    suffix_forward   the suffix token by token from the handoff states: o, the final states and (for a backward)
                     the checkpoints, the state entering every CHECKPOINT_EVERY-th token, in the same pass
    suffix_backward  the state gradient walked back once (it reads no forward state), then every block of
                     CHECKPOINT_EVERY tokens at once: its states recomputed from its checkpoint, its reverse
                     recurrence (docs/decode_phase.md derives it)

One program per (sequence, value head, value tile of BV columns) in the forward. BV is the codec's scale group
where it has one (``[K x BV]`` tiles; blocks of N values: BV = N), so every rounding group lies inside one program
(int8_h32: its tile, inside which its 32-value groups and replay's factor groups lie); without a codec, 32
columns. The state-gradient walk rounds nothing: its tile is free (DSTATE_BLOCK_V). Warps: FORWARD_WARPS and
BACKWARD_WARPS by the codec's scale groups. What the spec fixes of the kernels is
``DecodeParams.constants()``, passed by name at every launch (``laqat source SPEC`` shows the file and values).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from la_compiler.kernels.decode import kernels
from la_compiler.kernels.registry import spec_of
from la_compiler.options import DecodeOptions, decode_options, interpreter

CODEC_IDS = {None: 0, "fp8_e4m3": 1, "int8": 2, "int8_h32": 3}
FACTOR_IDS = {"none": 0, "fp8_e4m3": 1, "int8": 2}
CACHE_IDS = {"float32": 0, "bfloat16": 1, "float16": 2}
CHECKPOINT_EVERY = 32  # tokens per backward block (one checkpoint each, and CK states of scratch per program)
MAX_HEAD_DIM = 256
# Warps per program by the state codec's scale groups: "none" (no codec), "tile" (one scale per [K x BV] tile),
# "block" (one per key row and N values). Measured on the H200 (docs/decode_phase.md, "Launch settings").
FORWARD_WARPS = {"none": 4, "tile": 8, "block": 8}
BACKWARD_WARPS = {"none": 4, "tile": 4, "block": 8}
NUM_WARPS: int | None = None  # None: the tables above (benchmarks may override both kernels' warps)
PROGRAMS_PER_SM = 4  # the backward's persistent grid: at most this many programs per multiprocessor, and
SCRATCH_BYTES = 256 * 2**20  # at most this much scratch (CK states per program), but at least one per multiprocessor
DSTATE_BLOCK_V = 32  # value columns per program of the state-gradient walk (it rounds nothing, so its tile is
DSTATE_NUM_WARPS = 2  # free: the fastest measured, docs/decode_phase.md)
UNCODED_BLOCK_V = 32  # value columns per program without a state codec
# A serving profile's forward launches as vLLM 0.33 launches its decode kernels (value tiles of at most 32
# columns; fused_recurrent_gated_delta_rule_packed_decode: 1 warp, fused_recurrent_kda_packed_decode: 4), so
# that Triton lays the state tile out, and orders the sums over K, as it does for vLLM's kernels.
SERVING_NUM_WARPS = {"gdn": 1, "kda": 4}


@functools.lru_cache(maxsize=1024)  # parsed once per spec, not on every launch
def options_of(spec) -> DecodeOptions:
    return decode_options(spec)


def unsupported_reason(spec, head_k: int, head_v: int) -> str | None:
    if head_k > MAX_HEAD_DIM or head_v > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} exceed one register tile"
    opts = options_of(spec_of(spec))
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
    codec_block: int = 0  # 0: one codec scale per [K x BV] tile; N: one per key row and N values

    @classmethod
    def from_spec(cls, spec, model_dtype=None) -> "DecodeParams":
        """``model_dtype``: the dtype of v, which decides a serving profile's ``state_dtype: auto``."""
        spec = spec_of(spec)
        opts = options_of(spec)
        cache = opts.cache_dtype(spec.kind, model_dtype) if opts.serving else "float32"
        return cls(kind=spec.kind, state=spec.state, codec=opts.codec, readout=opts.readout, mode=opts.mode,
                   factor=opts.factor_format, vfirst=opts.vllm_order, cache=cache, codec_block=opts.codec_block)

    def constants(self, *names: str) -> dict[str, object]:
        """The ``tl.constexpr`` values of the kernels (kernels.py) that these params fix; only ``names`` if given
        (each kernel takes those it reads: ``KERNEL_CONSTEXPRS``)."""
        values = {"IS_KDA": self.kind == "kda", "STATE_VK": self.state == "vk", "CODEC": CODEC_IDS[self.codec],
                  "CODEC_BLOCK": self.codec_block, "READ_STORED": self.readout == "stored",
                  "REPLAY": self.mode == "replay", "FACTOR": FACTOR_IDS[self.factor], "VFIRST": self.vfirst,
                  "CACHE": CACHE_IDS[self.cache]}
        return {name: values[name] for name in names} if names else values


KERNEL_CONSTEXPRS = {  # the spec's constexprs each kernel takes (decay_grid_kernel: none)
    "decode_fwd_kernel": ("IS_KDA", "STATE_VK", "CODEC", "CODEC_BLOCK", "READ_STORED", "REPLAY", "FACTOR", "VFIRST",
                          "CACHE"),
    "decode_dstate_kernel": ("IS_KDA", "STATE_VK", "REPLAY", "FACTOR", "VFIRST"),
    "decode_bwd_kernel": ("IS_KDA", "STATE_VK", "CODEC", "CODEC_BLOCK", "READ_STORED", "REPLAY", "FACTOR", "VFIRST",
                          "CACHE"),
    "round_state_kernel": ("STATE_VK", "CODEC", "CODEC_BLOCK", "VFIRST", "CACHE"),
}


def _constants(params: DecodeParams, kernel: str) -> dict:
    return params.constants(*KERNEL_CONSTEXPRS[kernel])


# ---- geometry ----------------------------------------------------------------------------------
def tiles(K: int, V: int, opts: DecodeOptions) -> tuple[int, int]:
    """(BK, BV): the state tile of one program; BV is the codec's tile (its scale group, or for int8_h32 the
    replay factors' group) where there is a codec."""
    BV = UNCODED_BLOCK_V if opts.codec is None else opts.block_v
    return triton.next_power_of_2(K), BV if V >= BV else triton.next_power_of_2(V)


def kernel_params(spec, model_dtype) -> tuple[DecodeParams, bool]:
    """The params the kernels run with, and whether the spec's states are transposed around them: a V-first register
    tile (a serving profile) takes its states V-first in memory too, K contiguous, whatever the spec's layout. Triton
    lays a tile out from its loads and stores; only a K-contiguous one gets the layout of vLLM's kernels, and with it
    their order of the sums over K (docs/serving.md)."""
    params = DecodeParams.from_spec(spec, model_dtype)
    if params.vfirst and params.state == "kv":
        return dataclasses.replace(params, state="vk"), True
    return params, False


def state_io_dtype(p: DecodeParams) -> torch.dtype:
    """The dtype the forward's state tiles enter and leave the kernel in (the handoff, the final state, the
    checkpoints): a serving profile's 16-bit cache dtype where no codec rounds first (every such state is already
    rounded to it), else fp32. The width of these loads and stores decides Triton's register layout of the tile,
    and so the order of its sums over K: the server's kernel loads and stores its 16-bit cache (docs/serving.md)."""
    if p.vfirst and p.codec is None and p.cache != "float32":
        return getattr(torch, p.cache)
    return torch.float32


def _codec_groups(p: DecodeParams) -> str:
    return "none" if p.codec is None else "block" if p.codec_block else "tile"


def _forward_warps(p: DecodeParams) -> int:
    if NUM_WARPS is not None:
        return NUM_WARPS
    return SERVING_NUM_WARPS[p.kind] if p.vfirst else FORWARD_WARPS[_codec_groups(p)]


def _backward_warps(p: DecodeParams) -> int:
    return NUM_WARPS if NUM_WARPS is not None else BACKWARD_WARPS[_codec_groups(p)]


def checkpoint_numel(spec, q, v, cu_seqlens) -> int:
    """Elements of the fp32 checkpoint buffer of any phase of these inputs (an upper bound from the shapes, so
    that a fake implementation knows it): every sequence's suffix has at most cdiv(length, CK) blocks, and
    Σ cdiv(s_n, CK) <= cdiv(B T, CK) + N."""
    spec = spec_of(spec)
    BK, BV = tiles(q.shape[-1], v.shape[-1], options_of(spec))
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    blocks = (q.shape[0] * q.shape[1] + CHECKPOINT_EVERY - 1) // CHECKPOINT_EVERY + n
    return blocks * v.shape[2] * triton.cdiv(v.shape[-1], BV) * BK * BV


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The CK-token blocks of packed suffixes: each sequence's first block and each block's sequence."""

    offsets: torch.Tensor  # [N + 1] int32
    sequence: torch.Tensor  # [blocks] int32
    count: int


def blocks_of(lengths: list[int], device) -> Blocks:
    counts = [triton.cdiv(n, CHECKPOINT_EVERY) for n in lengths]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    sequence = [i for i, c in enumerate(counts) for _ in range(c)]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    return Blocks(as_tensor(offsets), as_tensor(sequence or [0]), offsets[-1])


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    bounds = cu_seqlens.tolist()
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# ---- launchers ---------------------------------------------------------------------------------
def round_state(spec, state: torch.Tensor, model_dtype) -> torch.Tensor:
    """``state`` [N, HV, K, V] (or V-first, the spec's layout) as the decode kernels round a cache on load:
    the spec's state codec, then a serving profile's cache dtype (``model_dtype`` decides ``auto``); fp32."""
    spec = spec_of(spec)
    opts = options_of(spec)
    K, V = (state.shape[-2], state.shape[-1]) if spec.state == "kv" else (state.shape[-1], state.shape[-2])
    BK, BV = tiles(K, V, opts)
    state = state.contiguous()
    out = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    if state.numel():
        kernels.round_state_kernel[(triton.cdiv(V, BV), state.shape[0] * state.shape[1])](
            state, out, K=K, V=V, BK=BK, BV=BV,
            **_constants(DecodeParams.from_spec(spec, model_dtype), "round_state_kernel"))
    return out


def decay_on_grid(g: torch.Tensor, step: float | None) -> torch.Tensor:
    """The suffix log-decays rounded to the grid (fp32), or g itself without a grid."""
    if step is None:
        return g
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        BLOCK = 1024
        kernels.decay_grid_kernel[(triton.cdiv(n, BLOCK),)](g.contiguous(), out, float(step), n, BLOCK=BLOCK)
    return out


def _check(spec, q, v):
    reason = unsupported_reason(spec, q.shape[-1], v.shape[-1])
    if reason is not None:
        raise ValueError(f"the decode kernels cannot run {spec}: {reason}")


def suffix_forward(spec, q, k, v, g, beta, handoff, cu_seqlens, scale, *, checkpoints: torch.Tensor | None = None):
    """The packed suffixes [1, total, ...] from their handoff states [N, HV, K, V] (or V-first; rounded here by
    the handoff): (o [1, total, HV, V] in q's dtype, the final states fp32). ``checkpoints``: a buffer of at least
    ``checkpoint_numel`` elements that receives the state entering every CK-th token (for suffix_backward)."""
    spec = spec_of(spec)
    _check(spec, q, v)
    opts = options_of(spec)
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    n = cu_seqlens.numel() - 1
    BK, BV = tiles(K, V, opts)
    dev = q.device
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = decay_on_grid(g.contiguous(), opts.decay_log_step)
    cu = cu_seqlens.to(torch.int32).contiguous()
    params, transposed = kernel_params(spec, v.dtype)
    io = state_io_dtype(params)
    handoff = handoff.transpose(-1, -2) if transposed else handoff
    handoff = handoff.to(io).contiguous()  # 16-bit io: the handoff's rounding to the cache (nearest even), done here
    o = torch.empty(v.shape, dtype=q.dtype, device=dev)
    ht = torch.empty(handoff.shape, dtype=io, device=dev)
    blocks = blocks_of(_lengths(cu), dev) if checkpoints is not None else None
    if blocks is not None:  # the op returns the buffer: no element of it left unwritten
        written = blocks.count * HV * triton.cdiv(V, BV) * BK * BV * io.itemsize  # bytes, in the io dtype
        checkpoints[triton.cdiv(written, checkpoints.element_size()):].zero_()
        checkpoints = checkpoints.view(io)
    if n:
        kernels.decode_fwd_kernel[(triton.cdiv(V, BV), n * HV)](
            q, k, v, g, beta, handoff, o, ht, checkpoints if checkpoints is not None else o,
            cu, blocks.offsets if blocks is not None else cu, float(scale), opts.window,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, SAVE_CKPT=checkpoints is not None,
            **_constants(params, "decode_fwd_kernel"), num_warps=_forward_warps(params))
    ht = ht.float()
    return o, ht.transpose(-1, -2).contiguous() if transposed else ht


def _backward_programs(work: int, state_bytes: int, device) -> int:
    """Programs of the backward's persistent grid (``state_bytes``: one program's scratch)."""
    if device.type != "cuda" or interpreter():
        return max(1, min(work, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work, PROGRAMS_PER_SM * sms, max(sms, SCRATCH_BYTES // state_bytes)))


def suffix_backward(spec, q, k, v, g, beta, cu_seqlens, scale, do, dht, checkpoints: torch.Tensor):
    """Gradients of the packed suffixes (checkpoints: what suffix_forward stored for the same inputs):
    (dq, dk, dv, dg, dbeta) [1, total, ...] in fp32 and the gradient of the handoff states (fp32, their layout)."""
    spec = spec_of(spec)
    _check(spec, q, v)
    opts = options_of(spec)
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    total = q.shape[1]
    n = cu_seqlens.numel() - 1
    BK, BV = tiles(K, V, opts)
    NV = triton.cdiv(V, BV)
    dev = q.device
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    g = decay_on_grid(g.contiguous(), opts.decay_log_step)
    cu = cu_seqlens.to(torch.int32).contiguous()
    blocks = blocks_of(_lengths(cu), dev)
    params, transposed = kernel_params(spec, v.dtype)
    dht = dht.transpose(-1, -2) if transposed else dht
    f32 = torch.float32
    dh_end = torch.empty(max(blocks.count, 1) * HV * K * V, dtype=f32, device=dev)
    d_handoff = torch.empty(dht.shape, dtype=f32, device=dev)
    # every element below is written by the kernels (each token of each suffix)
    dq = torch.empty((NV, total, HV, K), dtype=f32, device=dev)
    dk = torch.empty_like(dq)
    dg = torch.empty((NV, total, HV, K if spec.kind == "kda" else 1), dtype=f32, device=dev)
    dbeta = torch.empty((NV, total, HV), dtype=f32, device=dev)
    dv = torch.empty((1, total, HV, V), dtype=f32, device=dev)
    if n:
        BV_d = min(DSTATE_BLOCK_V, triton.next_power_of_2(V))
        kernels.decode_dstate_kernel[(triton.cdiv(V, BV_d), n * HV)](
            q, k, v, g, beta, do, dht.contiguous(), dh_end, d_handoff, cu, blocks.offsets, float(scale),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV_d, CK=CHECKPOINT_EVERY, **_constants(params, "decode_dstate_kernel"),
            num_warps=NUM_WARPS or DSTATE_NUM_WARPS)
        work = blocks.count * HV * NV
        programs = _backward_programs(work, CHECKPOINT_EVERY * BK * BV * 4, dev)
        scratch = torch.empty(programs * CHECKPOINT_EVERY * BK * BV, dtype=f32, device=dev)
        kernels.decode_bwd_kernel[(programs,)](
            q, k, v, g, beta, checkpoints.view(state_io_dtype(params)), dh_end, scratch, cu, blocks.offsets,
            blocks.sequence, do,
            dq, dk, dv, dg, dbeta, float(scale), opts.window, total, blocks.count,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=CHECKPOINT_EVERY, **_constants(params, "decode_bwd_kernel"),
            num_warps=_backward_warps(params))
    group = HV // H
    dq = dq.sum(0).view(1, total, H, group, K).sum(3)
    dk = dk.sum(0).view(1, total, H, group, K).sum(3)
    dg = dg.sum(0).view(1, total, HV, -1)
    dg = dg if spec.kind == "kda" else dg[..., 0]
    dbeta = dbeta.sum(0).view(1, total, HV)
    return dq, dk, dv, dg, dbeta, d_handoff.transpose(-1, -2).contiguous() if transposed else d_handoff
