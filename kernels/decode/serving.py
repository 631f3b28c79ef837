"""The "decode_serving" kernel variant: decode-phase training as a serving profile (``x.serving``) computes it.

What a server computes for each sequence n (docs/serving.md) is what ``decode_fused`` runs (phased.py): the
initial state a cache rounded on load, the prefix the chunked prefill (the chunk kernels with FLA's 16-bit
intermediates for 16-bit inputs, as vLLM's Triton prefill, a copy of FLA's chunk kernels, keeps them), the
handoff, then one decode step per token; here every decode step is in the server's order of operations (the
state tile V-first in registers, so that the sums over K are the server's) and the state is rounded to the
server's cache dtype at every write, after the codec.

Backward: the decode kernels' backward over the suffixes gives the gradient of each handoff state, which is the
chunk kernels' final-state gradient over the prefixes (identity through every rounding). The suffix gradients are
exact in fp32 for the emulated forward; the prefix gradients are the chunk kernels'.

A KDA node may take its gate raw (``A_log``, ``dt_bias``: ir/delta_rule_phased.py, as the serving pass hands it): its
log-decay is then laqat::serving_kda_gate's, and the server's prefill sums the raw gate itself.

With ``x.forward=server`` (the policy's ``serving.forward``) the forward's outputs are the server's own kernels'
(kernels/decode/server_forward.py); the backward stays the one above, at the same inputs.
"""
from __future__ import annotations

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.decode_phase import decode_reason
from la_compiler.kernels.decode import fused, phased, server_forward, suffix
from la_compiler.kernels.registry import SelectionContext, register_variant

decode_serving_forward = server_forward.forward_with(phased.phased_forward)
decode_serving_backward = phased.phased_backward


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    reason = decode_reason(spec)
    if reason is None and suffix.options_of(spec).serving is None:
        return "a serving profile's kernel: the spec has no x.serving"
    return reason or fused.supports_phase(spec, ctx)


register_variant(
    "decode_serving",
    decode_serving_forward,
    decode_serving_backward,
    "decode-phase training under a serving profile: the prefix through the chunk kernels (the chunked prefill), "
    "the suffix through the decode kernels in the server's order of operations, the cache dtype at every write",
    supports=supports,
    summary="serving profile: chunked prefix + decode steps as the server computes them, fwd + bwd",
    residual_size=phased.residual_numel,
    source_modules=fused.source_modules,
    constexprs=fused.constexprs,
    raw_gate=True,
)
