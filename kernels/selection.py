"""The kernel-selection table: annotated spec + device + dtype + head dims -> kernel variant.

The table is data: one row a line, tried top to bottom; the first row whose condition
holds wins. Every rejected row is kept with its reason so that ``explain`` can say why a
candidate was not chosen. A spec that no row accepts is an error, never a silent fallback
to other numerics. Rows name only variants that compute the spec's numerics exactly as
NUMERICS.md defines them; they differ in speed, not in what they round.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import Callable

import torch

from la_compiler.spec import RecurrenceSpec


class KernelSelectionError(RuntimeError):
    """No kernel variant implements this spec on this device."""


@dataclasses.dataclass(frozen=True)
class SelectionContext:
    device: str
    dtype: torch.dtype
    head_k: int
    head_v: int
    requested: str | None = None  # a policy's explicit `backend:` choice
    family: str | None = None  # a policy's `implementation:` ("triton" | "torch")
    seq_len: int | None = None  # tokens per sequence (q.shape[1]); None where unknown (symbolic): long


@dataclasses.dataclass(frozen=True)
class Row:
    variant: str
    condition: Callable[[RecurrenceSpec, SelectionContext], str | None]  # None = accepted, else why not
    summary: str
    family: str = "triton"  # what a policy's `implementation:` key selects: "triton" or "torch"


@dataclasses.dataclass(frozen=True)
class Selection:
    variant: str
    reason: str
    rejected: tuple[tuple[str, str], ...]

    def explain(self) -> str:
        lines = [f"{self.variant}: {self.reason}"]
        lines += [f"  not {name}: {why}" for name, why in self.rejected]
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _needs(*checks: tuple[bool, str]) -> str | None:
    """None when every check holds, else every failed check's reason (explain shows them all)."""
    failed = [why for ok, why in checks if not ok]
    return "; ".join(failed) if failed else None


def _fla_chunk(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return _needs(
        (ctx.device == "cuda", f"FLA's chunk kernels need CUDA (device is {ctx.device})"),
        (spec.is_exact, "FLA's kernels apply no quantization (spec has quant sites, a non-exact solve or a phase)"),
        (_fla_available(), "flash-linear-attention is not installed"),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "FLA supports head dims up to 256"),
        _not_float64(ctx),
    ) or _fla_gdn_backward_blocked(spec) or _laqat_kda_chunk_is_faster(spec, ctx)


def _laqat_kda_chunk_is_faster(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    """KDA's exact training step runs faster on laqat's chunk kernels than on FLA's (H200, bf16,
    [8,4096,16,128]: fwd+bwd 7.45 ms against FLA's 10.3, docs/performance.md), at the same accuracy; FLA's
    kernel stays the choice where the chunk kernels cannot run the spec."""
    if spec.kind != "kda" or _chunk(spec, ctx) is not None:
        return None
    return "laqat's chunk kernels run KDA's exact fwd+bwd faster on CUDA (0.72x FLA's, docs/performance.md)"


def _fla_gdn_backward_blocked(spec: RecurrenceSpec) -> str | None:
    """FLA refuses its GDN chunk backward on some Triton/GPU pairs (Hopper, Triton < 3.7.1); a
    variant is chosen for forward and backward together, so GDN then goes to another row."""
    if spec.kind != "gdn":
        return None
    from la_compiler.kernels.fla_chunk_variant import gdn_backward_blocker

    return gdn_backward_blocker()


def _triton_runs(ctx: SelectionContext) -> tuple[bool, str]:
    return (ctx.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
            f"Triton kernels need CUDA or TRITON_INTERPRET=1 (device is {ctx.device})")


def _not_float64(ctx: SelectionContext) -> tuple[bool, str]:
    return (ctx.dtype != torch.float64, "it computes in fp32: float64 inputs would come back at fp32 accuracy "
                                        "(the fp64 reference variant computes in float64)")


# On CUDA the token-by-token kernel is faster than the chunked ones only for short sequences: it runs T
# dependent steps where the chunk kernels run T / 64 (FLA's layers switch to fused_recurrent at 64 tokens).
FUSED_RECURRENT_MAX_TOKENS_ON_CUDA = 64


def _fused_recurrent(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    short = ctx.device != "cuda" or (ctx.seq_len is not None and ctx.seq_len <= FUSED_RECURRENT_MAX_TOKENS_ON_CUDA)
    return _needs(
        (spec.is_exact, "the generated recurrent kernel has no quant sites, solve or phase support yet"),
        _triton_runs(ctx),
        _not_float64(ctx),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "head dims above 256 exceed one register tile"),
        (short, f"on CUDA the chunk kernels are faster beyond {FUSED_RECURRENT_MAX_TOKENS_ON_CUDA} tokens per "
                f"sequence (T is {'symbolic' if ctx.seq_len is None else ctx.seq_len})"),
    )


def _chunk(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    from la_compiler.kernels.chunk_codegen import ChunkParams, max_head_k, unsupported

    reason = unsupported(spec)
    if reason:
        return reason
    max_k, why = max_head_k(ChunkParams.from_spec(spec))
    return _needs(
        (ctx.head_k <= max_k, why),
        (ctx.head_v <= 256, "head_v above 256"),
        _triton_runs(ctx),
        _not_float64(ctx),
    )


def _chunk_detail(spec: RecurrenceSpec, ctx: SelectionContext) -> str:
    from la_compiler.kernels.chunk_codegen import ChunkParams
    from la_compiler.kernels.chunk_precision import describe

    return describe(ChunkParams.from_spec(spec), ctx.dtype)


def _reference(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    from la_compiler.kernels.reference_variant import unsupported_reason

    return unsupported_reason(spec, ctx.head_v)


def _decode_reason(spec: RecurrenceSpec, family: str) -> str | None:
    """Shared checks of the decode-phase rows (kernels/decode_options.py parses the options)."""
    if spec.phase == "none":
        return "a decode-phase kernel: the spec has phase=none"
    from la_compiler.kernels.decode_options import DecodeOptionsError, decode_options

    try:
        decode_options(spec)
    except DecodeOptionsError as e:
        return str(e)
    impl = dict(spec.extra).get("decode_impl", "auto")
    if impl not in ("auto", family):
        return f"a {family} kernel; the policy asks for decode.implementation={impl!r}"
    return None


def _decode_fused(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    from la_compiler.kernels.decode_fused import unsupported_reason

    return (_decode_reason(spec, "triton") or _needs(_triton_runs(ctx), _not_float64(ctx))
            or unsupported_reason(spec, ctx.head_k, ctx.head_v))


def _decode_reference(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return _decode_reason(spec, "torch")


# Tried top to bottom; `requested` (a policy's backend) skips to that variant's row.
TABLE: tuple[Row, ...] = (
    Row("fla_chunk", _fla_chunk, "FLA's own chunk kernel: exact numerics on CUDA"),
    Row("fused_recurrent", _fused_recurrent, "generated token-by-token Triton kernel, fp32 state"),
    Row("chunk", _chunk, "generated chunked (WY) Triton kernels: state/W/operand QDQ, accumulators, fwd + bwd"),
    Row("decode_fused", _decode_fused, "fused Triton decode-phase kernel (token / replay), fwd + bwd"),
    Row("decode_reference", _decode_reference, "fp64 torch reference of decode-phase training (slow)", "torch"),
    Row("reference", _reference, "fp64 torch reference: any prefill spec, any device, slow", "torch"),
)

# What a chosen variant adds to its reason, given the spec and the context (its numerics at this dtype).
DETAILS: dict[str, Callable[[RecurrenceSpec, SelectionContext], str]] = {"chunk": _chunk_detail}


def select_kernel(spec: RecurrenceSpec, *, device: str, dtype: torch.dtype, head_k: int, head_v: int,
                  requested: str | None = None, family: str | None = None, seq_len: int | None = None) -> Selection:
    from la_compiler.kernels.registry import variant_names

    if spec.phase == "none" and spec.extra:  # no prefill variant reads them: never ignore them silently
        raise KernelSelectionError(f"spec {spec}: options {['x.' + k for k, _ in spec.extra]} belong to a decode "
                                   f"phase (phase=token|replay); a prefill spec (phase=none) takes none")
    ctx = SelectionContext(device, dtype, head_k, head_v, requested, family, seq_len)
    known = set(variant_names())
    rejected = []
    for row in TABLE:
        if requested is not None and row.variant != requested:
            continue
        if family is not None and row.family != family:
            why_not = f"a {row.family} kernel; the policy asks for implementation={family!r}"
        elif row.variant not in known:
            why_not = "not registered in this build"
        else:
            why_not = row.condition(spec, ctx)
        if why_not is None:
            reason = row.summary + (" (requested by the policy)" if requested or family else "")
            if row.variant in DETAILS:
                reason += "; " + DETAILS[row.variant](spec, ctx)
            return Selection(row.variant, reason, tuple(rejected))
        rejected.append((row.variant, why_not))
    if requested is not None and not any(r.variant == requested for r in TABLE):
        raise KernelSelectionError(f"policy backend {requested!r} is not a kernel variant; known: "
                                   f"{[r.variant for r in TABLE]}")
    details = "; ".join(f"{name}: {why}" for name, why in rejected)
    raise KernelSelectionError(f"no kernel variant implements {spec} on {device}: {details}")
