"""What a spec fixes of the fused recurrent kernels: the kind and the state layout, as ``tl.constexpr`` values."""
from __future__ import annotations

import dataclasses

from la_compiler.ir.spec import KINDS, STATE_LAYOUTS, RecurrenceSpec
from la_compiler.kernels.common.errors import KernelParamsError


@dataclasses.dataclass(frozen=True)
class FusedRecurrentParams:
    """What the fused recurrent kernels are specialized on."""

    kind: str  # "gdn": scalar decay per value head; "kda": per key channel
    state: str  # memory layout of h0 / ht / dht / dh0: "kv" = [K, V], "vk" = [V, K]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise KernelParamsError(f"fused_recurrent: kind must be one of {KINDS}, got {self.kind!r}")
        if self.state not in STATE_LAYOUTS:
            raise KernelParamsError(f"fused_recurrent: state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")

    @classmethod
    def from_spec(cls, spec: RecurrenceSpec | str) -> "FusedRecurrentParams":
        spec = spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
        if not spec.is_exact:
            raise KernelParamsError(
                f"fused_recurrent implements exact numerics only; {spec} has quant sites, "
                "accumulator emulation, a non-exact solve or a phase")
        return cls(kind=spec.kind, state=spec.state)

    def constexprs(self) -> dict[str, bool]:
        """The ``tl.constexpr`` arguments of both kernels that the spec fixes (the inputs fix the others)."""
        return {"IS_KDA": self.kind == "kda", "STATE_V_FIRST": self.state == "vk"}
