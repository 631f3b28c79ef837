"""The "decode_fused" kernel variant: decode-phase training (token / replay) on Triton, forward and backward.

Each sequence's prefix runs on the chunk kernels, its decode suffix on the decode kernels (phased.py, suffix.py;
docs/decode_phase.md): the suffix token by token with the rounding of kernels/reference/decode.py (the numerics
contract), its checkpoints stored in the same pass, its backward one reverse walk of the state gradient and then
every block of tokens at once. A serving profile's spec (``x.serving``) runs on ``decode_serving`` (the same
kernels, in the server's order of operations).
"""
from __future__ import annotations

from types import ModuleType

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.decode_phase import decode_reason
from la_compiler.kernels.common.support import needs, not_float64, triton_runs
from la_compiler.kernels.decode import kernels, phased, suffix
from la_compiler.kernels.registry import SelectionContext, get_variant, register_variant, spec_of

decode_fused_forward = phased.phased_forward
decode_fused_backward = phased.phased_backward


def suffix_constexprs(spec) -> dict[str, object]:
    """The ``tl.constexpr`` values the spec fixes in the decode kernels (``DecodeParams.constants()``). A GDN
    serving profile with ``state_dtype: auto`` leaves CACHE out: the inputs' dtype fixes it at launch."""
    spec = spec_of(spec)
    opts = suffix.options_of(spec)
    values = suffix.DecodeParams.from_spec(spec).constants()
    if opts.serving and spec.kind == "gdn" and opts.state_dtype == "auto":
        del values["CACHE"]
    return values


def constexprs(spec) -> dict[str, object]:
    """The decode suffix's constexprs, then the chunked prefix's (named "prefix <NAME>")."""
    prefix = get_variant("chunk").constexprs(phased.prefill_spec(spec_of(spec)))
    return {**suffix_constexprs(spec), **{f"prefix {name}": value for name, value in prefix.items()}}


def source_modules(spec) -> dict[str, ModuleType]:
    spec = spec_of(spec)
    suffix.DecodeParams.from_spec(spec)  # refuses a spec the kernels cannot run
    prefix = {f"prefix (chunk) {role}": module
              for role, module in get_variant("chunk").source_modules(phased.prefill_spec(spec)).items()}
    return {"suffix (decode) forward and backward": kernels, **prefix}


def supports_phase(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    """What both decode variants need: a decode spec, Triton on the device, head dims, a chunked prefix."""
    return (decode_reason(spec) or needs(triton_runs(ctx), not_float64(ctx))
            or suffix.unsupported_reason(spec, ctx.head_k, ctx.head_v) or phased.prefill_reason(spec, ctx))


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    reason = decode_reason(spec)
    if reason is None and suffix.options_of(spec).serving is not None:
        return "a serving profile runs on decode_serving (the server's order of operations)"
    return reason or supports_phase(spec, ctx)


register_variant(
    "decode_fused",
    decode_fused_forward,
    decode_fused_backward,
    "decode-phase training (token / replay): the prefix on the chunk kernels, the suffix on the fused Triton "
    "decode kernels (checkpoints stored in the forward, block-parallel backward)",
    supports=supports,
    summary="chunked prefix + fused Triton decode suffix (token / replay), fwd + bwd",
    residual_size=phased.residual_numel,
    source_modules=source_modules,
    constexprs=constexprs,
)
