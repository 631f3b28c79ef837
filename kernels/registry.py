"""Kernel variants: named implementations of one laqat recurrence node, each with what it supports.

A variant is what the lower pass writes into a spec's ``kernel=`` field. It carries its entry points, the
condition under which it computes a spec exactly as docs/numerics.md defines it, and (for the Triton families) the
modules its kernels live in. The kernel families register their variants from
``kernels/__init__.py``; the selection table (``kernels/selection.py``) orders the registered variants and
imports no family.

    forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale) -> (o, final_state)
    backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht)
        -> (dq, dk, dv, dg, dbeta, dh0 or None)
    supports(spec, ctx: SelectionContext) -> None (it computes the spec on ctx) | why not
    detail(spec, ctx) -> str               what a chosen variant adds to its selection reason (optional)
    source_modules(spec) -> {role: module} the modules a spec runs (optional; kernels/sources.py)
    constexprs(spec) -> {name: value}      the ``tl.constexpr`` values a spec fixes in those modules' kernels
                                           (optional)

A variant lists the numerics options it applies (``numerics``: ``la_compiler.options.NumericsOptions`` field
names); a spec that sets another (``n.<name>``) is refused for it before its ``supports`` is asked
(``unapplied_numerics``), by the selection table and where a spec names the variant itself.

A variant that keeps work for its backward also gives ``residual_size(spec, q, v, cu_seqlens) -> int`` (elements
of an fp32 buffer; 0 where a spec keeps nothing); its forward then takes ``save_to=`` (the buffer to
fill) and its backward ``saved=`` (the filled buffer). Training graphs call it through
``laqat::delta_rule_train`` (``la_compiler/ir/delta_rule.py``).
"""
from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from la_compiler.ir.spec import RecurrenceSpec

IMPLEMENTATIONS = ("triton", "torch")  # what a policy's `implementation:` key selects


@dataclasses.dataclass(frozen=True)
class SelectionContext:
    device: str
    dtype: torch.dtype
    head_k: int
    head_v: int
    requested: str | None = None  # a policy's explicit `backend:` choice
    family: str | None = None  # a policy's `implementation:` ("triton" | "torch")
    seq_len: int | None = None  # tokens per sequence (q.shape[1]); None where unknown (symbolic): long


Supports = Callable[[RecurrenceSpec, SelectionContext], "str | None"]


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    name: str
    forward: Callable
    backward: Callable
    description: str  # what `laqat kernels` lists
    supports: Supports
    summary: str  # its line in the selection table (explain)
    implementation: str = "triton"
    residual_size: Callable | None = None
    detail: Callable[[RecurrenceSpec, SelectionContext], str] | None = None
    source_modules: Callable[[RecurrenceSpec], dict[str, ModuleType]] | None = None
    constexprs: Callable[[RecurrenceSpec], dict[str, object]] | None = None
    numerics: tuple[str, ...] = ()  # the NumericsOptions fields it applies
    raw_gate: bool = False  # takes KDA's gate raw (the phased node's A_log, dt_bias; ir/delta_rule_phased.py)

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"kernel variant {self.name!r}: implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")

    def unapplied_numerics(self, spec: RecurrenceSpec) -> str | None:
        """Why it cannot run ``spec``'s numerics options (n.<name> fields it does not apply), else None."""
        unapplied = [f"n.{key}={value}" for key, value in spec.numerics if key not in self.numerics]
        if not unapplied:
            return None
        applies = f"it applies only {['n.' + key for key in self.numerics]}" if self.numerics else "it applies none"
        return f"the numerics options {unapplied} are not {self.name}'s ({applies})"

    def residual_numel(self, spec, q, v, cu_seqlens) -> int:
        """Elements of the fp32 residual its forward keeps for its backward (0: none)."""
        return 0 if self.residual_size is None else self.residual_size(spec, q, v, cu_seqlens)


_VARIANTS: dict[str, KernelVariant] = {}


def register_variant(name: str, forward: Callable, backward: Callable, description: str, *, supports: Supports,
                     summary: str, implementation: str = "triton", residual_size: Callable | None = None,
                     detail: Callable | None = None, source_modules: Callable | None = None,
                     constexprs: Callable | None = None, numerics: tuple[str, ...] = (),
                     raw_gate: bool = False) -> KernelVariant:
    if name in _VARIANTS:
        raise ValueError(f"kernel variant {name!r} is registered twice")
    variant = KernelVariant(name, forward, backward, description, supports, summary, implementation,
                            residual_size, detail, source_modules, constexprs, tuple(numerics), raw_gate)
    _VARIANTS[name] = variant
    return variant


def get_variant(name: str) -> KernelVariant:
    try:
        return _VARIANTS[name]
    except KeyError:
        raise KeyError(f"no kernel variant named {name!r}; known: {sorted(_VARIANTS)}") from None


def registered(name: str) -> bool:
    return name in _VARIANTS


def variant_names() -> list[str]:
    return sorted(_VARIANTS)


def spec_of(spec: str | RecurrenceSpec) -> RecurrenceSpec:
    return spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
