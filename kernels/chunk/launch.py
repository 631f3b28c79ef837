"""Launch configurations of the chunk kernels, and a launch that survives a shared-memory refusal.

The configurations come from compiling every stage for sm_90 (Triton's ptxas, on a CPU machine:
``cuobjdump -res-usage`` of the cubins) at K = 64 and 128, bf16 and fp32, warps 4/8, stages 1-3, and from timings
on the H200 (docs/kernels-chunk.md, "Launch configurations"; the figures: docs/kernels-chunk-measurements.md,
"Launch configurations"): eight warps spill less than four; pipelining (stages > 1) adds shared memory and brings
spills back; fp32 inputs at BK = 64 ask for more shared memory than sm_90 has at three stages.

The tuning option ``t.autotune=true`` replaces the table's choice by the fastest of a few around it
(chunk/autotune.py); ``t.serial_stages`` sets the depth of the serial h / dh loops.
Pipelining depth never changes what is computed, so a launch that Triton refuses for shared memory
is retried with fewer stages (and the working depth remembered per kernel and constants); any other
error propagates.

A ``StageLaunch`` is one kernel launch as the launch plan (chunk/plan.py) fixes it; the stage launchers at the end
of each stage module pass it to ``launch`` with the tensors. Inside chunk/compile_ahead.py's ``compiling_only``,
``launch`` requests the launch's compile instead of launching.
"""
from __future__ import annotations

import contextvars
import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping

from triton.runtime.errors import OutOfResources

from la_compiler.kernels.chunk import autotune as chunk_autotune


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    num_warps: int
    num_stages: int
    keep_warps: bool = False  # the autotuner varies the stages only (chunk_autotune.candidates)


def launch_config(stage: str, BK: int, C: int, rounds_operands: bool = False, nvfp4_operands: bool = False,
                  serial_stages: int | None = None) -> LaunchConfig:
    """stage: one of fwd_cumsum, fwd_pair_amax, fwd_pairs, fwd_intra, fwd_h, fwd_o, bwd_dh, bwd_intra, bwd_pairs, bwd_dg;
    ``rounds_operands`` (the pair stages): the pair products are rounded (chunk.forms.kda_rounds_pairs);
    ``nvfp4_operands`` (the h, o and dh stages): a GEMM operand site rounds to NVFP4 (its blocks of 16 add live
    tiles; the h stage holds all of V); ``serial_stages`` (the tuning option t.serial_stages): the pipeline depth
    of the h and dh stages instead of the table's (at K = 128 two stages prefetch the next chunk's W, U, K; sm_90
    builds: docs/kernels-chunk-measurements.md, "Launch configurations")."""
    if stage not in ("fwd_cumsum", "fwd_pair_amax", "fwd_pairs", "fwd_intra", "fwd_h", "fwd_o", "bwd_dh", "bwd_intra",
                     "bwd_pairs", "bwd_dg"):
        raise ValueError(f"launch_config: unknown stage {stage!r}")
    if stage in ("fwd_pairs", "bwd_pairs") and BK >= 128:
        # rounded pair products hold whole key rows: on sm_90 at K = 128 four warps spill (backward), eight do not
        # (docs/kernels-chunk-measurements.md, "Rounded pair products")
        return LaunchConfig(8, 1)
    if stage == "fwd_pairs" and BK >= 64 and not rounds_operands:
        # the exact forward's row-block products ([C x BK] tiles): the autotuner's choice on the H200, no spills
        # on sm_90 at one stage (measured: docs/kernels-chunk-measurements.md, "KDA pair products")
        return LaunchConfig(4, 1)
    if stage in ("fwd_cumsum", "fwd_pairs", "bwd_pairs", "bwd_dg"):  # [BC x BK] / [C x BK] tiles: small programs
        return LaunchConfig(4, 3)
    warps = 8 if BK >= 64 or C * BK >= 4096 else 4  # [C, BK] / [BK, BV] fp32 tiles: spread over 8 warps
    stages = 1 if BK >= 128 else 3  # 3: Triton's default
    if BK == 128 and stage in ("fwd_h", "fwd_o", "bwd_dh") and not nvfp4_operands:
        # four warps beat eight in the h, o and dh stages on the H200, with rounded operands too although four
        # warps spill there: two programs per SM hide the serial loops' latency better than eight warps avoid
        # spills. Not at K = 256 (four warps spill more there; no timing), nor with NVFP4 operands (eight are
        # faster; their h stage holds all of V). Measured: docs/kernels-chunk-measurements.md, "Warps on the H200"
        warps, stages = 4, 2 if stage == "fwd_o" else 1
    if stage == "bwd_intra" and C * BK >= 2048:
        warps = 8  # faster than four (docs/kernels-chunk-measurements.md, "Warps on the H200")
    if stage in ("fwd_h", "bwd_dh") and serial_stages is not None:
        stages = serial_stages
    return LaunchConfig(warps, stages)


# vLLM 0.33.0's kda_gate_chunk_cumsum_vector_kernel at its first autotune config (the serving profiles pin
# VLLM_TRITON_FORCE_FIRST_CONFIG=1): BS 32 key channels, 2 warps, Triton's default stages. Its tile and warps set the
# order of the scan's additions; a serving profile's KDA prefix launches laqat's cumsum with them (docs/serving.md).
SERVER_CUMSUM_BLOCK = 32
SERVER_CUMSUM_CONFIG = LaunchConfig(2, 3)

# Key columns per step of the key-blocked stages (forward intra; KDA's split backward intra and pairs):
# whole rows up to 64 columns, blocks of 32 above: the fastest with fp32 GEMM operands (measured:
# docs/kernels-chunk-measurements.md, "Key blocks").
WHOLE_ROWS_UP_TO = 64
KEY_BLOCK = 32
PAIRS_KEY_BLOCK = 64  # key columns per step of KDA's forward pairs kernel and its cumsum ([BC x 64] tiles)


# KDA's split backward (intra and pairs stages) with 16-bit GEMMs: blocks of 64, faster than 32 (measured:
# docs/kernels-chunk-measurements.md, "Key blocks"). With fp32 GEMM operands 32 stays.
BWD_KEY_BLOCK_16BIT = 64
# GDN's backward intra stage with 16-bit GEMMs (dT, hence dA, complete before its key loop): whole rows of 128,
# faster than blocks of 64 and 32 (measured: docs/kernels-chunk-measurements.md, "Key blocks").
GDN_BWD_KEY_BLOCK_16BIT = 128
# GDN's backward intra stage over whole key rows (a rounded pair product or key-side operand: one key block)
# steps through V in blocks of 32; the key-blocked form and KDA's keep 64: the faster in each case (measured:
# docs/kernels-chunk-measurements.md, "GDN's backward intra value block").
GDN_WHOLE_ROW_BWD_VALUE_BLOCK = 32


def key_block(BK: int, chosen: int | None, block: int = KEY_BLOCK) -> int:
    """Key columns per step for key rows padded to BK: whole rows up to 64 columns, else ``block``; or
    ``chosen`` (the numerics options n.key_block / n.bwd_key_block), at most BK."""
    if chosen is None:
        return BK if BK <= WHOLE_ROWS_UP_TO else block
    return min(BK, chosen)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host arithmetic: triton.cdiv and triton.next_power_of_2 are
    ConstexprFunctions in Triton 3.9, slow to call from the host (docs/kernels-chunk-measurements.md, "Host
    time")."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_working_stages: dict[tuple, int] = {}

# set while chunk/compile_ahead.py runs a recipe for its compiles: receives (kernel, the launch's keyword arguments)
# instead of a launch
compile_request: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("compile_request", default=None)


def _stages_key(kernel, config: LaunchConfig, constexprs: dict) -> tuple:
    """What a working pipeline depth is remembered by: the kernel, its warps and constants."""
    return id(kernel), config.num_warps, tuple(sorted(constexprs.items()))


@dataclasses.dataclass(frozen=True)
class StageLaunch:
    """One kernel launch of a chunk step, all but its tensors and what they say (an initial state or not, ...)."""

    kernel: object  # a @triton.jit kernel
    grid: tuple[int, ...]
    config: LaunchConfig
    constexprs: Mapping[str, object]  # the spec's (chunk/flags.py) and the plan's (shapes, blocks, precisions)
    autotune: bool = False  # t.autotune

    def __post_init__(self):
        object.__setattr__(self, "constexprs", MappingProxyType(dict(self.constexprs)))


def launch(stage: StageLaunch, arguments: Mapping[str, object], **constexprs):
    """stage.kernel[stage.grid](**arguments, **stage.constexprs, **constexprs) with the stage's config (or, with
    ``autotune`` (t.autotune) on CUDA, the fastest of a few around it: kernels/chunk/autotune.py); fewer pipeline
    stages on OutOfResources. ``constexprs``: those the launcher reads off the tensors."""
    kernel, grid, config = stage.kernel, stage.grid, stage.config
    constexprs = {**stage.constexprs, **constexprs}
    request = compile_request.get()
    if request is not None:  # chunk/compile_ahead.py: the compile this launch needs, no launch
        stages = _working_stages.get(_stages_key(kernel, config, constexprs), config.num_stages)
        return request(kernel, {**arguments, **constexprs, "num_warps": config.num_warps, "num_stages": stages})
    if chunk_autotune.active(stage.autotune):
        config = chunk_autotune.tuner().best(
            chunk_autotune.key_of(kernel, grid, constexprs), chunk_autotune.candidates(config),
            lambda c: kernel[grid](**arguments, num_warps=c.num_warps, num_stages=c.num_stages, **constexprs))
    key = _stages_key(kernel, config, constexprs)
    stages = _working_stages.get(key, config.num_stages)
    while True:
        try:
            result = kernel[grid](**arguments, num_warps=config.num_warps, num_stages=stages, **constexprs)
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _working_stages[key] = stages
        return result
