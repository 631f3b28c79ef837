"""What the chunk kernels are specialized on (``ChunkParams``), and which specs they implement.

A spec's numerics reach the chunk family only through these parameters: the kind, the state layout,
the chunk size, the solve, the canonical format strings of the state, W and GEMM-operand
quantizers and the accumulator emulation (parsed once, into ``ChunkParams.formats``: chunk/formats.py), and the
numerics options (``n.<name>``: GEMM and dot precision, key blocks). ``unsupported(spec)`` says why a spec is not
one of them.
"""
from __future__ import annotations

import dataclasses

from la_compiler.ir.spec import GEMM_SITES, KINDS, STATE_LAYOUTS, RecurrenceSpec
from la_compiler.kernels.chunk.formats import Accumulator, ChunkFormats
from la_compiler.kernels.common.errors import KernelParamsError
from la_compiler.options import NumericsOptions
from la_compiler.quant.config import QuantConfig

STATE_FORMATS = ("fp8_e4m3", "int8", "int8_h32")  # with group tile<BV>
STATE_BLOCK_FORMATS = ("fp8_e4m3", "int8")  # with group block<N>: one scale per key row x N values along V
W_FORMATS = ("fp8_e4m3", "int8", "nvfp4")  # fp8/int8 with group row or block<N>; nvfp4/block16


@dataclasses.dataclass(frozen=True)
class ChunkParams:
    """What the chunk forward kernels are specialized on."""

    kind: str
    state: str  # layout of h0 / ht: "kv" or "vk"
    chunk: int
    solve: str = "exact"
    degree: int | None = None
    state_quant: str | None = None  # canonical QuantConfig string of q.state
    w_quant: str | None = None  # canonical QuantConfig string of q.w (= q.state_read.lhs)
    operands: tuple[tuple[str, str], ...] = ()  # ("<gemm site>.lhs|rhs", format), sorted
    acc: tuple[tuple[str, str], ...] = ()  # ("<gemm site>", "fp16:16"), sorted: accumulator emulation
    numerics: NumericsOptions = NumericsOptions()  # the spec's n.<name> fields
    # KDA's gate in log2 units (a serving profile's prefix, forward only): G = cumsum(g) / ln 2 and every decay
    # exp2 of it, vLLM's order of operations (chunk/device.py, gate_exp); no spec field, set by decode_serving
    gate_exp2: bool = False
    formats: ChunkFormats = dataclasses.field(init=False, repr=False, compare=False)  # the strings above, parsed

    def __post_init__(self):
        if self.kind not in KINDS:
            raise KernelParamsError(f"chunk: kind must be one of {KINDS}, got {self.kind!r}")
        if self.state not in STATE_LAYOUTS:
            raise KernelParamsError(f"chunk: state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")
        if not isinstance(self.numerics, NumericsOptions):
            raise KernelParamsError(f"chunk: numerics must be a NumericsOptions, got {self.numerics!r}")
        if self.chunk < 1 or self.chunk & (self.chunk - 1):
            raise KernelParamsError(f"chunk: chunk size must be a power of two, got {self.chunk}")
        if (self.solve == "neumann") != (self.degree is not None) or self.solve not in ("exact", "neumann"):
            raise KernelParamsError(f"chunk: solve must be exact or neumann with a degree, got {self.solve}/{self.degree}")
        state = None
        if self.state_quant is not None:
            state = QuantConfig.parse(self.state_quant)
            tile = state.group == "tile" and state.format in STATE_FORMATS
            block = state.group == "block" and state.format in STATE_BLOCK_FORMATS
            if not (tile or block) or state.ste != "identity":
                raise KernelParamsError(f"chunk: q.state={self.state_quant} is not implemented by the chunk kernels "
                                   f"(they take {STATE_FORMATS} with tile<BV> groups, {STATE_BLOCK_FORMATS} with "
                                   "block<N> groups, and the identity STE)")
        operands = {}
        for site, fmt in self.operands:
            cfg = QuantConfig.parse(fmt)
            if site not in OPERAND_SITES:
                raise KernelParamsError(f"chunk: q.{site} is not a GEMM operand site of the chunk kernels")
            row = cfg.format in ("fp8_e4m3", "int8") and cfg.group == "row"
            if not (row or cfg.format == "nvfp4") or cfg.ste != "identity":
                raise KernelParamsError(f"chunk: q.{site}={fmt} is not implemented by the chunk kernels "
                                   "(GEMM operands take fp8_e4m3/row, int8/row or nvfp4/block16, identity STE)")
            if cfg.format == "nvfp4" and self.chunk % 16:
                raise KernelParamsError(f"chunk: q.{site}={fmt}: NVFP4 blocks of 16 along a chunk need chunk % 16 == 0, "
                                   f"got chunk={self.chunk}")
            operands[site] = cfg
        accumulators = {}
        for site, text in self.acc:
            if site not in GEMM_SITES:
                raise KernelParamsError(f"chunk: acc.{site}: not a GEMM site")
            try:
                accumulators[site] = Accumulator.parse(text)
            except ValueError as e:
                raise KernelParamsError(f"chunk: acc.{site}={text}: {e}") from None
        w = None
        if self.w_quant is not None:
            w = QuantConfig.parse(self.w_quant)
            ok = w.format in W_FORMATS and w.group in ("row", "block") and w.ste == "identity"
            if not ok:
                raise KernelParamsError(f"chunk: q.w={self.w_quant} is not implemented by the chunk kernels "
                                   f"(they take {W_FORMATS} with row or block<N> groups and the identity STE)")
        object.__setattr__(self, "formats", ChunkFormats(state, w, operands, accumulators))

    @property
    def h_full_v(self) -> bool:
        """The h stage holds all value columns in one tile: NVFP4 operands of state_read / state_update
        take a global amax over all of V."""
        return any(self.formats.operand_format(site) == "nvfp4" for site in ("state_read.rhs", "state_update.rhs"))

    @property
    def sub_chunk(self) -> int:
        """KDA's sub-chunk rows (>= 2 blocks per chunk, so both block kinds always run)."""
        return max(1, min(16, self.chunk // 2))

    @property
    def state_block_v(self) -> int | None:
        """The state tile's width BV (group tile<BV>: the h stage's value tile is that tile), else None."""
        return None if self.formats.state is None else self.formats.state.block_v

    @property
    def state_block(self) -> int:
        """N of a block<N> state quantizer (one scale per key row x N consecutive values along V), else 0. Any h-stage
        value tile that is a multiple of N, or that holds all of V, holds whole blocks."""
        state = self.formats.state
        return state.block_size if state is not None and state.group == "block" else 0

    @classmethod
    def from_spec(cls, spec: RecurrenceSpec | str) -> "ChunkParams":
        spec = spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
        why = unsupported(spec)
        if why:
            raise KernelParamsError(f"chunk kernels cannot run {spec}: {why}")
        quant = spec.quant_map
        w = quant.get("w") or quant.get("state_read.lhs")
        return cls(kind=spec.kind, state=spec.state, chunk=spec.chunk, solve=spec.solve, degree=spec.degree,
                   state_quant=quant.get("state"), w_quant=w, operands=_operand_sites(quant), acc=spec.acc,
                   numerics=spec.numerics_options)


def unsupported(spec: RecurrenceSpec) -> str | None:
    """None when the chunk kernels implement ``spec``'s numerics, else why not (for the selection table)."""
    if spec.phase != "none":
        return f"phase={spec.phase} (decode-phase training) is not a chunk-kernel feature"
    if spec.extra:
        return f"it applies no spec options {['x.' + k for k, _ in spec.extra]}"
    quant = spec.quant_map
    if "w" in quant and "state_read.lhs" in quant and quant["w"] != quant["state_read.lhs"]:
        return "q.w and q.state_read.lhs (the same quantizer) disagree"
    try:
        cls_args = dict(state_quant=quant.get("state"), w_quant=quant.get("w") or quant.get("state_read.lhs"),
                        operands=_operand_sites(quant), acc=spec.acc)
        ChunkParams(kind=spec.kind, state=spec.state, chunk=spec.chunk, solve=spec.solve, degree=spec.degree,
                    **cls_args)
    except (KernelParamsError, ValueError) as e:
        return str(e)
    return None


OPERAND_SITES = tuple(f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if f"{s}.{side}" != "state_read.lhs")


def _operand_sites(quant: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((site, fmt) for site, fmt in quant.items() if site not in ("state", "w", "state_read.lhs")))
