"""The rounding a chunk spec asks for, parsed once: the quantizer of every site and the emulated accumulators.

``ChunkParams`` keeps the spec's canonical strings (its identity); its ``formats`` are these typed values, built
when the params are, so that no launch parses a format string again.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from la_compiler.quant.config import QuantConfig

ACC_DTYPES = ("fp16", "bf16")  # accumulator emulation: the running sum rounded to this dtype


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """An emulated accumulator (the spec's ``acc.<site>=<dtype>:<block>``): the running sum rounded to ``dtype``
    after every ``block`` terms of the reduction."""

    dtype: str
    block: int

    @classmethod
    def parse(cls, text: str) -> "Accumulator":
        """``fp16:16`` -> Accumulator("fp16", 16); ValueError otherwise."""
        name, sep, block = text.partition(":")
        if name not in ACC_DTYPES or not sep or not block.isdigit() or int(block) <= 0:
            raise ValueError(f"accumulator {text!r} must read '<fp16|bf16>:<reduction block>'")
        return cls(name, int(block))


@dataclasses.dataclass(frozen=True)
class ChunkFormats:
    state: QuantConfig | None  # q.state
    w: QuantConfig | None  # q.w (= q.state_read.lhs)
    operands: Mapping[str, QuantConfig]  # GEMM operand site ("wy_key.rhs", ...) -> its quantizer
    accumulators: Mapping[str, Accumulator]  # GEMM site ("state_update", ...) -> its emulated accumulator

    def __post_init__(self):
        object.__setattr__(self, "operands", MappingProxyType(dict(self.operands)))
        object.__setattr__(self, "accumulators", MappingProxyType(dict(self.accumulators)))

    def operand_format(self, site: str) -> str | None:
        """The format name of a GEMM operand site ("fp8_e4m3", "int8", "nvfp4"), None when it is off."""
        cfg = self.operands.get(site)
        return None if cfg is None else cfg.format

    def has_nvfp4_operands(self) -> bool:
        return any(cfg.format == "nvfp4" for cfg in self.operands.values())
