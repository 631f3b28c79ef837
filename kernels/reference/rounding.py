"""Where the chunked (WY) reference rounds: one callable per quant site of a spec.

The chunk reference (``reference/chunk.py``) asks this object, at fixed points of the
algorithm, to round a tensor. Every callable takes and returns a tensor of the working
dtype and rounds groups along the LAST dimension:

    state(S)                    S [..., K, V]: one scale per [K x BV] tile (BV from the format)
    w(W)                        W [..., C, K]: one scale per token (row) over K
    operand(site, side, x)      x [..., M, R]: the GEMM operand with its reduction dim R last,
                                one FP8/INT8 scale per row, NVFP4 blocks of 16 along R; the
                                callable gets (x, tile_dims): the last tile_dims dims are one
                                operand tile (one (sequence, head, chunk)): 2, or 3 for the
                                pairwise KDA operands [..., C, C, K] (NVFP4's global amax)
    accumulate(site)            (accumulator dtype, reduction block) or None

``rounding_from_spec.rounding_from_spec`` builds them from the spec's canonical format strings through
``la_compiler.quant``. Tests may build a ``ChunkRounding`` directly with their own callables.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from la_compiler.ir.spec import GEMM_SITES, RecurrenceSpec

Rounder = Callable[[torch.Tensor], torch.Tensor]
OperandRounder = Callable[[torch.Tensor, int], torch.Tensor]  # (x, tile_dims) -> rounded x


@dataclasses.dataclass(frozen=True)
class ChunkRounding:
    state: Rounder | None = None
    w: Rounder | None = None
    operands: Mapping[tuple[str, str], OperandRounder] = dataclasses.field(default_factory=dict)
    accumulators: Mapping[str, tuple[torch.dtype, int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for site, side in self.operands:
            if site not in GEMM_SITES or side not in ("lhs", "rhs"):
                raise ValueError(f"unknown GEMM operand site {site}.{side}; sites: {GEMM_SITES}")
            if (site, side) == ("state_read", "lhs"):
                raise ValueError("state_read.lhs is the W quantizer: pass it as `w`")
        for site, (acc_dtype, block) in self.accumulators.items():
            if site not in GEMM_SITES:
                raise ValueError(f"unknown accumulator site {site!r}; sites: {GEMM_SITES}")
            if acc_dtype not in (torch.float16, torch.bfloat16, torch.float32) or block <= 0:
                raise ValueError(f"accumulator of {site}: dtype {acc_dtype} / block {block} not supported")

    @property
    def is_exact(self) -> bool:
        return self.state is None and self.w is None and not self.operands and not self.accumulators

    def operand(self, site: str, side: str, x: torch.Tensor, tile_dims: int = 2) -> torch.Tensor:
        if (site, side) == ("state_read", "lhs"):
            return x if self.w is None else self.w(x)
        fn = self.operands.get((site, side))
        return x if fn is None else fn(x, tile_dims)

    def accumulate(self, site: str) -> tuple[torch.dtype, int] | None:
        return self.accumulators.get(site)
