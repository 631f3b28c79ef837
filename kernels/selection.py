"""The kernel-selection table: annotated spec + device + dtype + head dims -> kernel variant.

The table is data: the order in which the registered variants are tried, one a line; the first
whose ``supports`` accepts the spec wins. Every rejected variant is kept with its reason so that
``explain`` can say why a candidate was not chosen. A spec that no variant accepts is an error, never
a silent fallback to other numerics. Every variant computes the spec's numerics exactly as docs/numerics.md
defines them where it accepts it; they differ in speed, not in what they round. The conditions live with
the variants (``kernels/<family>/``), registered from ``kernels/__init__.py``.
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.error_base import LaqatError
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.registry import SelectionContext, get_variant, registered


class KernelSelectionError(LaqatError, RuntimeError):
    """No kernel variant implements this spec on this device."""


class NoFastKernelError(KernelSelectionError):
    """On CUDA only the fp64 torch reference implements a spec on inputs the Triton kernels take (not float64, head
    dims they hold): the lower pass refuses where the policy did not pin that reference (docs/policy.md, "Kernel
    selection"); the message names the layer, the spec field that keeps the Triton kernels off, and what to do."""


@dataclasses.dataclass(frozen=True)
class Selection:
    variant: str
    reason: str
    rejected: tuple[tuple[str, str], ...]

    def explain(self) -> str:
        lines = [f"{self.variant}: {self.reason}"]
        lines += [f"  not {name}: {why}" for name, why in self.rejected]
        return "\n".join(lines)


# Tried top to bottom; `requested` (a policy's backend) skips to that variant.
ORDER: tuple[str, ...] = (
    "fla_chunk",
    "fused_recurrent",
    "chunk",
    "decode_serving",
    "decode_fused",
    "decode_reference",
    "reference",
)

# The Triton variants that walk each sequence token by token: T dependent steps where the chunk kernels run T / chunk.
# On CUDA the lower pass warns where one runs a long sequence that the policy did not pin (docs/policy.md). (The
# decode-phase variants are not here: they chunk the prefix; the decode suffix is token by token by definition.)
TOKEN_BY_TOKEN: tuple[str, ...] = (
    "fused_recurrent",
)


def select_kernel(spec: RecurrenceSpec, *, device: str, dtype: torch.dtype, head_k: int, head_v: int,
                  requested: str | None = None, family: str | None = None, seq_len: int | None = None) -> Selection:
    if spec.phase == "none" and spec.extra:  # no prefill variant reads them: never ignore them silently
        raise KernelSelectionError(f"spec {spec}: options {['x.' + k for k, _ in spec.extra]} belong to a decode "
                                   f"phase (phase=token|replay); a prefill spec (phase=none) takes none")
    if requested is not None and requested not in ORDER:
        raise KernelSelectionError(f"policy backend {requested!r} is not a kernel variant; known: {list(ORDER)}")
    ctx = SelectionContext(device, dtype, head_k, head_v, requested, family, seq_len)
    rejected = []
    for name in ORDER:
        if requested is not None and name != requested:
            continue
        variant = get_variant(name) if registered(name) else None
        if variant is None:
            why_not = "not registered in this build"
        elif family is not None and variant.implementation != family:
            why_not = f"a {variant.implementation} kernel; the policy asks for implementation={family!r}"
        else:
            why_not = variant.unapplied_numerics(spec) or variant.supports(spec, ctx)
        if why_not is None:
            reason = variant.summary + (" (requested by the policy)" if requested or family else "")
            if variant.detail is not None:
                reason += "; " + variant.detail(spec, ctx)
            return Selection(name, reason, tuple(rejected))
        rejected.append((name, why_not))
    details = "; ".join(f"{name}: {why}" for name, why in rejected)
    raise KernelSelectionError(f"no kernel variant implements {spec} on {device}: {details}")
