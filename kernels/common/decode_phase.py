"""What the decode-phase variants (``decode_fused``, ``decode_serving``, ``decode_reference``) share: whether a
spec is theirs, and the phase lengths they run with."""
from __future__ import annotations

from la_compiler.error_base import LaqatError
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.options import DecodeOptionsError, decode_options


class PhaseLengthsMissing(LaqatError, RuntimeError):
    """A decode variant was called without phase lengths (through the plain delta_rule op)."""


def decode_reason(spec: RecurrenceSpec) -> str | None:
    """None, or why a decode-phase variant does not run ``spec`` (not a decode phase, or decode options it refuses)."""
    if spec.phase == "none":
        return "a decode-phase kernel: the spec has phase=none"
    try:
        decode_options(spec)
    except DecodeOptionsError as e:
        return str(e)
    return None


def require_lengths(spec, prefill_lengths, valid_lengths):
    if prefill_lengths is None or valid_lengths is None:
        raise PhaseLengthsMissing(
            f"spec {spec} has phase={spec.phase}: it runs through laqat::delta_rule_phased (the laqat backend's "
            f"phase pass rewrites such nodes), not through laqat::delta_rule, which carries no phase lengths")
