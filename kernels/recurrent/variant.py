"""The "fused_recurrent" kernel variant: the token-by-token kernels of ``fused_recurrent.py``, exact numerics."""
from __future__ import annotations

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.recurrent import fused_recurrent
from la_compiler.kernels.recurrent.fused_recurrent import fused_recurrent_bwd, fused_recurrent_fwd
from la_compiler.kernels.recurrent.params import FusedRecurrentParams
from la_compiler.kernels.registry import SelectionContext, register_variant, spec_of


def fused_recurrent_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    params = FusedRecurrentParams.from_spec(spec_of(spec))
    return fused_recurrent_fwd(params, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def fused_recurrent_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    params = FusedRecurrentParams.from_spec(spec_of(spec))
    return fused_recurrent_bwd(params, q, k, v, g, beta, scale, do, dht, initial_state, cu_seqlens)


# On CUDA the token-by-token kernel is faster than the chunked ones only for short sequences: it runs T
# dependent steps where the chunk kernels run T / 64 (FLA's layers switch to fused_recurrent at 64 tokens).
FUSED_RECURRENT_MAX_TOKENS_ON_CUDA = 64


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    short = ctx.device != "cuda" or (ctx.seq_len is not None and ctx.seq_len <= FUSED_RECURRENT_MAX_TOKENS_ON_CUDA)
    return needs(
        (spec.is_exact, "the fused recurrent kernel has no quant sites, accumulator emulation, Neumann solve or "
                        "decode phase: it computes the exact recurrence"),
        triton_runs(ctx),
        not_float64(ctx),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "head dims above 256 exceed one register tile"),
        (short, f"on CUDA the chunk kernels are faster beyond {FUSED_RECURRENT_MAX_TOKENS_ON_CUDA} tokens per "
                f"sequence (T is {'symbolic' if ctx.seq_len is None else ctx.seq_len})"),
    )


def source_modules(spec: RecurrenceSpec) -> dict:
    FusedRecurrentParams.from_spec(spec)  # refuses a spec the kernels cannot run
    return {"forward and backward": fused_recurrent}


def constexprs(spec: RecurrenceSpec) -> dict:
    return FusedRecurrentParams.from_spec(spec).constexprs()


register_variant(
    "fused_recurrent",
    fused_recurrent_forward,
    fused_recurrent_backward,
    "token-by-token Triton kernel specialized by constexpr flags, fp32 state (forward and backward; exact "
    "numerics)",
    supports=supports,
    summary="token-by-token Triton kernel, fp32 state",
    source_modules=source_modules,
    constexprs=constexprs,
)
