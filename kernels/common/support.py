"""Conditions that several kernel variants' ``supports`` share."""
from __future__ import annotations

import torch

from la_compiler.kernels.registry import SelectionContext
from la_compiler.options import interpreter


def needs(*checks: tuple[bool, str]) -> str | None:
    """None when every check holds, else every failed check's reason (explain shows them all)."""
    failed = [why for ok, why in checks if not ok]
    return "; ".join(failed) if failed else None


def triton_runs(ctx: SelectionContext) -> tuple[bool, str]:
    return (ctx.device == "cuda" or interpreter(),
            f"Triton kernels need CUDA or TRITON_INTERPRET=1 (device is {ctx.device})")


def not_float64(ctx: SelectionContext) -> tuple[bool, str]:
    return (ctx.dtype != torch.float64, "it computes in fp32: float64 inputs would come back at fp32 accuracy "
                                        "(the fp64 reference variant computes in float64)")
