"""The "chunk" kernel variant: chunked (WY) Triton kernels of GDN/KDA, forward and backward.

Forward: ``chunk/fwd.py`` (intra, h, o); backward: ``chunk/bwd.py`` (forward recomputed, then
dh, intra). Exact numerics, the Neumann solve, state / W quantization, the FP8/INT8 (row) and NVFP4
GEMM operand sites and accumulator emulation, and every numerics option (``n.<name>``, through ChunkParams); the
tuning options (``t.<name>``) reach the launchers. What else a spec asks for is refused by
``chunk.params.unsupported`` (the selection table then moves on). The kernels of each stage and the constexprs
a spec fixes in them: ``chunk/stages.py``.
"""
from __future__ import annotations

import dataclasses
import functools

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk import stages
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.compile_ahead import compile_training_step
from la_compiler.kernels.chunk.forms import max_head_k
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams, unsupported
from la_compiler.kernels.chunk.precision import describe
from la_compiler.kernels.chunk.residual import residual_size
from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.registry import SelectionContext, register_variant, spec_of
from la_compiler.options import NumericsOptions, TuningOptions


@functools.lru_cache(maxsize=256)
def _params(spec) -> ChunkParams:
    """ChunkParams of a spec, once per spec (host time: docs/kernels-chunk-measurements.md, "Host time")."""
    return ChunkParams.from_spec(spec)


@functools.lru_cache(maxsize=256)
def _tuning(spec) -> TuningOptions:
    return spec.tuning_options


def chunk_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, save_to=None, gate_exp2=False,
                  raw_gate=None):
    """``gate_exp2``: KDA's decays in log2 units, as vLLM's Kimi-K3 prefill computes them (ChunkParams.gate_exp2; a
    serving profile's prefix forward, kernels/decode/phased.py); ``raw_gate`` = (A_log, dt_bias or None): g is KDA's
    raw gate, whose vLLM gate the cumsum stage computes (chunk_fwd)."""
    spec = spec_of(spec)
    p = _params(spec)
    if gate_exp2:
        p = dataclasses.replace(p, gate_exp2=True)
    if save_to is not None:
        compile_training_step(p, _tuning(spec), q, k, v, g, beta, scale, initial_state, cu_seqlens, raw_gate)
    return chunk_fwd(p, q, k, v, g, beta, scale, initial_state, cu_seqlens, save_to=save_to, tuning=_tuning(spec),
                     raw_gate=raw_gate)


def chunk_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht, saved=None):
    spec = spec_of(spec)
    return chunk_bwd(_params(spec), q, k, v, g, beta, scale, do, dht, initial_state, cu_seqlens, saved=saved,
                     tuning=_tuning(spec))


def chunk_residual_size(spec, q, v, cu_seqlens) -> int:
    spec = spec_of(spec)
    return residual_size(_params(spec), q, v, cu_seqlens, _tuning(spec).keep_residual)


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    reason = unsupported(spec)
    if reason:
        return reason
    max_k, why = max_head_k(ChunkParams.from_spec(spec))
    return needs(
        (ctx.head_k <= max_k, why),
        (ctx.head_v <= 256, "head_v above 256"),
        triton_runs(ctx),
        not_float64(ctx),
    )


def detail(spec: RecurrenceSpec, ctx: SelectionContext) -> str:
    """The chosen kernels' numerics at the input dtype (GEMM precision, intermediates)."""
    return describe(ChunkParams.from_spec(spec), ctx.dtype)


def source_modules(spec: RecurrenceSpec) -> dict:
    """The stage modules a training step of ``spec`` launches, by role ("forward intra_gdn", "forward wu",
    "backward dh", ...)."""
    return stages.modules_of(ChunkParams.from_spec(spec))


def constexprs(spec: RecurrenceSpec) -> dict:
    """The spec-derived constexprs of those stages (``chunk/flags.py``)."""
    return stages.constexprs_of(ChunkParams.from_spec(spec))


register_variant(
    "chunk",
    chunk_forward,
    chunk_backward,
    "chunked (WY) Triton kernels, forward and backward (exact, Neumann solve, state and W QDQ, "
    "FP8/INT8 row and NVFP4 GEMM operand sites, fp16/bf16 accumulator emulation)",
    supports=supports,
    summary="chunked (WY) Triton kernels: state/W/operand QDQ, accumulators, fwd + bwd",
    residual_size=chunk_residual_size,
    detail=detail,
    source_modules=source_modules,
    constexprs=constexprs,
    numerics=NumericsOptions.keys(),
)
