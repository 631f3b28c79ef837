"""Kernel variants: named (forward, backward) implementations of one laqat recurrence node.

A variant is what the lower pass writes into a spec's ``kernel=`` field. Each takes the
IR's canonical inputs and the parsed spec; the kernel-selection table
(``kernels/selection.py``) decides which variant a spec gets on a device.

    forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale) -> (o, final_state)
    backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht)
        -> (dq, dk, dv, dg, dbeta, dh0 or None)

A variant that keeps work for its backward also gives ``residual_size(spec, q, v, cu_seqlens) -> int`` (elements
of an fp32 buffer; 0 where a spec keeps nothing); its forward then takes ``save_to=`` (the buffer to
fill) and its backward ``saved=`` (the filled buffer). Training graphs call it through
``laqat::delta_rule_train`` (``ir.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from la_compiler.spec import RecurrenceSpec


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    name: str
    forward: Callable
    backward: Callable
    description: str
    residual_size: Callable | None = None

    def residual_numel(self, spec, q, v, cu_seqlens) -> int:
        """Elements of the fp32 residual its forward keeps for its backward (0: none)."""
        return 0 if self.residual_size is None else self.residual_size(spec, q, v, cu_seqlens)


_VARIANTS: dict[str, KernelVariant] = {}


def register_variant(name: str, forward: Callable, backward: Callable, description: str,
                     residual_size: Callable | None = None) -> KernelVariant:
    if name in _VARIANTS:
        raise ValueError(f"kernel variant {name!r} is registered twice")
    variant = KernelVariant(name, forward, backward, description, residual_size)
    _VARIANTS[name] = variant
    return variant


def get_variant(name: str) -> KernelVariant:
    _load_builtin_variants()
    try:
        return _VARIANTS[name]
    except KeyError:
        raise KeyError(f"no kernel variant named {name!r}; known: {sorted(_VARIANTS)}") from None


def variant_names() -> list[str]:
    _load_builtin_variants()
    return sorted(_VARIANTS)


_LOADED = False


def _load_builtin_variants() -> None:
    """Import the modules that register the built-in variants (lazily: they import triton)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from la_compiler.kernels import variants  # noqa: F401  (registers on import)


def spec_of(spec: str | RecurrenceSpec) -> RecurrenceSpec:
    return spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
