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


@dataclasses.dataclass(frozen=True)
class Row:
    variant: str
    condition: Callable[[RecurrenceSpec, SelectionContext], str | None]  # None = accepted, else why not
    summary: str


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
    for ok, why in checks:
        if not ok:
            return why
    return None


def _fla_chunk(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return _needs(
        (ctx.device == "cuda", f"FLA's chunk kernels need CUDA (device is {ctx.device})"),
        (spec.is_exact, "FLA's kernels apply no quantization (spec has quant sites, a non-exact solve or a phase)"),
        (_fla_available(), "flash-linear-attention is not installed"),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "FLA supports head dims up to 256"),
    )


def _fused_recurrent(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return _needs(
        (spec.is_exact, "the generated recurrent kernel has no quant sites, solve or phase support yet"),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "head dims above 256 exceed one register tile"),
    )


def _reference(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return None


# Tried top to bottom; `requested` (a policy's backend) skips to that variant's row.
TABLE: tuple[Row, ...] = (
    Row("fla_chunk", _fla_chunk, "FLA's own chunk kernel: exact numerics on CUDA"),
    Row("fused_recurrent", _fused_recurrent, "generated token-by-token Triton kernel, fp32 state"),
    Row("reference", _reference, "fp64 torch reference: any spec, any device, slow"),
)


def select_kernel(spec: RecurrenceSpec, *, device: str, dtype: torch.dtype, head_k: int, head_v: int,
                  requested: str | None = None) -> Selection:
    from la_compiler.kernels.registry import variant_names

    ctx = SelectionContext(device, dtype, head_k, head_v, requested)
    known = set(variant_names())
    rejected = []
    for row in TABLE:
        if requested is not None and row.variant != requested:
            continue
        why_not = "not registered in this build" if row.variant not in known else row.condition(spec, ctx)
        if why_not is None:
            reason = row.summary + (" (requested by the policy)" if requested else "")
            return Selection(row.variant, reason, tuple(rejected))
        rejected.append((row.variant, why_not))
    if requested is not None and not any(r.variant == requested for r in TABLE):
        raise KernelSelectionError(f"policy backend {requested!r} is not a kernel variant; known: "
                                   f"{[r.variant for r in TABLE]}")
    details = "; ".join(f"{name}: {why}" for name, why in rejected)
    raise KernelSelectionError(f"no kernel variant implements {spec} on {device}: {details}")
