"""The recurrence spec: what one laqat IR node computes, as data and as a canonical string.

This module is the floor of the import graph: it imports only ``la_compiler.options`` (which imports
nothing of the project), so the kernels, the passes and the door can all depend on it.

The canonical string is what ``gm.print_readable()`` shows as the last argument of every
``laqat.delta_rule`` call, e.g.::

    gdn[src=fla; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=fused_recurrent;
        q.state=fp8_e4m3/tile64]

Keys are emitted in a fixed order; quant sites (``q.<site>``), per-site accumulator
emulation (``acc.<site>``), decode options (``x.<name>``), numerics options (``n.<name>``,
``la_compiler.options.NumericsOptions``) and tuning options (``t.<name>``, ``TuningOptions``) are sorted
by name and emitted only when enabled or not at their defaults, so two specs are equal exactly when their
strings are equal.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Mapping

from la_compiler.error_base import LaqatError
from la_compiler.options import DECODE_MODES, NumericsOptions, OptionsError, TuningOptions

KINDS = ("gdn", "kda")
STATE_LAYOUTS = ("kv", "vk")  # "vk" = FLA's state_v_first / vLLM's V-first GDN cache
SOLVE_METHODS = ("exact", "neumann")
PHASE_MODES = ("none",) + DECODE_MODES

# Quantization sites of one recurrence. "state" and "w" are the recurrent-state and WY-key
# quantizers; the rest are the eight prefill GEMM operand sites, each with lhs/rhs.
GEMM_SITES = (
    "key_interaction",
    "wy_value",
    "wy_key",
    "state_read",
    "state_update",
    "output_state",
    "output_score",
    "output_value",
)
QUANT_SITES = ("state", "w") + tuple(f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs"))


class SpecError(LaqatError, ValueError):
    """A spec string or field that is not a valid laqat recurrence spec."""


@dataclasses.dataclass(frozen=True)
class RecurrenceSpec:
    """Everything that decides the numerics and the kernel of one recurrence call.

    Quant formats are kept as their canonical strings (``la_compiler.quant`` parses them),
    so this module stays free of project imports.
    """

    kind: str
    src: str = "user"  # the frontend that produced the node: "fla", "torch", "user"
    layout: str = "bthd"  # the IR's inputs are always [B, T, H, D]; frontends transpose
    state: str = "kv"
    chunk: int = 64
    # the program passed ``chunk`` (an FLA call's chunk_size=): the annotate pass keeps it against a policy's chunk
    # size or refuses the pair, and writes the annotated spec without this mark
    chunk_passed: bool = False
    solve: str = "exact"
    degree: int | None = None  # Neumann degree; only with solve="neumann"
    phase: str = "none"  # decode-phase mode (token / replay) when a phase context is active
    kernel: str = "auto"  # the variant chosen by the lower pass; "auto" = choose at run time
    quant: tuple[tuple[str, str], ...] = ()  # (site, format string), sorted, enabled only
    acc: tuple[tuple[str, str], ...] = ()  # (gemm site, accumulator emulation), sorted
    extra: tuple[tuple[str, str], ...] = ()  # policy options of later stages (decode, replay)
    numerics: tuple[tuple[str, str], ...] = ()  # NumericsOptions fields off their defaults, as spelt in the spec
    tuning: tuple[tuple[str, str], ...] = ()  # TuningOptions fields off their defaults

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecError(f"spec kind must be one of {KINDS}, got {self.kind!r}")
        if self.layout != "bthd":
            raise SpecError(f"spec layout must be 'bthd' (frontends transpose), got {self.layout!r}")
        if self.state not in STATE_LAYOUTS:
            raise SpecError(f"spec state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")
        if self.solve not in SOLVE_METHODS:
            raise SpecError(f"spec solve must be one of {SOLVE_METHODS}, got {self.solve!r}")
        if (self.solve == "neumann") != (self.degree is not None):
            raise SpecError("spec degree is required with solve=neumann and forbidden otherwise")
        if self.phase not in PHASE_MODES:
            raise SpecError(f"spec phase must be one of {PHASE_MODES}, got {self.phase!r}")
        if not isinstance(self.chunk, int) or self.chunk <= 0 or self.chunk & (self.chunk - 1):
            raise SpecError(f"spec chunk must be a positive power of two, got {self.chunk!r}")
        for site, _ in self.quant:
            if site not in QUANT_SITES:
                raise SpecError(f"unknown quant site {site!r}; known: {QUANT_SITES}")
        for site, _ in self.acc:
            if site not in GEMM_SITES:
                raise SpecError(f"unknown accumulator site {site!r}; known: {GEMM_SITES}")
        for name in _ITEM_FIELDS:
            items = getattr(self, name)
            if list(items) != sorted(items) or len({k for k, _ in items}) != len(items):
                raise SpecError(f"spec {name} entries must be sorted and unique, got {items!r}")
            for k, v in items:
                if not _TOKEN.fullmatch(k) or not _TOKEN.fullmatch(v):
                    raise SpecError(f"spec {name} entry {k!r}={v!r} has characters outside [\\w./:,+-]")
        for name, options in (("numerics", NumericsOptions), ("tuning", TuningOptions)):
            if not getattr(self, name):
                continue
            try:
                parsed = options.from_spec_items(getattr(self, name))
            except OptionsError as e:
                raise SpecError(f"spec {e}") from None
            defaults = sorted(set(getattr(self, name)) - set(parsed.spec_items()))
            if defaults:
                key, value = defaults[0]
                raise SpecError(f"spec {options.SPEC_PREFIX}{key}={value} is the default: leave it out "
                                f"(a spec writes only the {name} options it changes)")

    # ---- convenience -------------------------------------------------------------------
    @property
    def quant_map(self) -> dict[str, str]:
        return dict(self.quant)

    @property
    def numerics_options(self) -> NumericsOptions:
        return NumericsOptions.from_spec_items(self.numerics)

    @property
    def tuning_options(self) -> TuningOptions:
        return TuningOptions.from_spec_items(self.tuning)

    @property
    def is_exact(self) -> bool:
        """No rounding anywhere: the original numerics."""
        return not self.quant and not self.acc and self.solve == "exact" and self.phase == "none"

    def replace(self, **changes) -> "RecurrenceSpec":
        """``dataclasses.replace``; quant / acc / extra may be given as mappings, numerics / tuning as their
        options objects or as mappings of Python values (``{"key_block": 16}``)."""
        for name in ("quant", "acc", "extra"):
            if name in changes and isinstance(changes[name], Mapping):
                changes[name] = tuple(sorted(changes[name].items()))
        for name, options in (("numerics", NumericsOptions), ("tuning", TuningOptions)):
            if name in changes and isinstance(changes[name], (Mapping, options)):
                try:
                    changes[name] = options.from_dict(changes[name], key=options.SPEC_PREFIX).spec_items()
                except OptionsError as e:
                    raise SpecError(f"spec {e}") from None
        return dataclasses.replace(self, **changes)

    # ---- the canonical string ----------------------------------------------------------
    def to_string(self) -> str:
        parts = [
            f"src={self.src}",
            f"layout={self.layout}",
            f"state={self.state}",
            f"chunk={self.chunk}" + (":passed" if self.chunk_passed else ""),
            f"solve={self.solve}" + (f":{self.degree}" if self.degree is not None else ""),
            f"phase={self.phase}",
            f"kernel={self.kernel}",
        ]
        parts += [f"q.{k}={v}" for k, v in self.quant]
        parts += [f"acc.{k}={v}" for k, v in self.acc]
        parts += [f"x.{k}={v}" for k, v in self.extra]
        parts += [f"n.{k}={v}" for k, v in self.numerics]
        parts += [f"t.{k}={v}" for k, v in self.tuning]
        return f"{self.kind}[{'; '.join(parts)}]"

    __str__ = to_string

    @staticmethod
    def parse(text: str) -> "RecurrenceSpec":
        return _parse_cached(text)


_ITEM_FIELDS = ("quant", "acc", "extra", "numerics", "tuning")
_PREFIXES = {"q.": "quant", "acc.": "acc", "x.": "extra", "n.": "numerics", "t.": "tuning"}
_TOKEN = re.compile(r"[\w./:,+\-]+")
_SPEC = re.compile(r"(?P<kind>\w+)\[(?P<body>.*)\]")


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> RecurrenceSpec:
    m = _SPEC.fullmatch(text.strip())
    if not m:
        raise SpecError(f"not a laqat spec string: {text!r}")
    fields: dict = {"kind": m.group("kind")}
    items: dict[str, list] = {name: [] for name in _ITEM_FIELDS}
    body = m.group("body").strip()
    for item in filter(None, (p.strip() for p in body.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"spec item {item!r} in {text!r} is not key=value")
        key, value = key.strip(), value.strip()
        prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            items[_PREFIXES[prefix]].append((key[len(prefix):], value))
        elif key == "chunk":
            size, _, mark = value.partition(":")
            if mark not in ("", "passed"):
                raise SpecError(f"spec chunk {value!r} in {text!r}: the only mark after the size is ':passed'")
            fields["chunk"] = int(size)
            fields["chunk_passed"] = mark == "passed"
        elif key == "solve":
            method, _, degree = value.partition(":")
            fields["solve"] = method
            fields["degree"] = int(degree) if degree else None
        elif key in ("src", "layout", "state", "phase", "kernel"):
            fields[key] = value
        else:
            raise SpecError(f"unknown spec key {key!r} in {text!r}")
    return RecurrenceSpec(**fields, **{name: tuple(sorted(found)) for name, found in items.items()})
