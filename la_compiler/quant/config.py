"""QuantConfig: the parsed form of one quantizer's config, and its canonical string.

Canonical strings (used as values of ``q.<site>=`` in laqat spec strings; characters are
limited to ``[\\w./:,+-]``)::

    fp8_e4m3/tile64      one scale per [K x 64] state tile per (sequence, head)
    fp8_e4m3/row         one scale per row of the reduction (last axis)
    fp8_e4m3/tensor      one scale for the whole tensor
    fp8_e4m3/axis:0,1,2  one scale per index of the kept axes (ModelOpt ``axis``)
    int8/block32         one scale per 32 consecutive values of the last axis
    nvfp4/block16        NVFP4: per-16-block E4M3 scales under a per-tensor global scale
    int8_h32/tile64      INT8 Hadamard-32 (ReplaySSM codec) inside [K x 64] state tiles
    log_grid:0.03125     log-decay grid round(g/d)*d
    .../clip             suffix: clipped straight-through gradient instead of identity

This module imports nothing but ``la_compiler.suggest`` (not even torch), so every layer of the project may use
it. ``MODELOPT_KEYS``, ``MODELOPT_VALUES`` and ``NUM_BITS`` are what a ModelOpt cfg may say; the checks below and
the policy file's JSON Schema (``la_compiler.policy.json_schema``) both read them.
The numerics behind each form are in docs/numerics.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping

from la_compiler.error_base import LaqatError
from la_compiler.suggest import did_you_mean

FORMATS = ("fp8_e4m3", "int8", "nvfp4", "int8_h32", "log_grid")
GROUPS = ("tensor", "axis", "tile", "row", "block")
STES = ("identity", "clipped")
TILE_BLOCK_V = (16, 32, 64, 128)
BLOCK_SIZES = (16, 32)

# Which groups each format accepts (log_grid is elementwise: no group).
_FORMAT_GROUPS = {
    "fp8_e4m3": ("tensor", "axis", "tile", "row", "block"),
    "int8": ("tensor", "axis", "tile", "row", "block"),
    "nvfp4": ("block",),
    "int8_h32": ("tile",),
    "log_grid": (),
}
_CLIPPABLE = ("fp8_e4m3", "int8", "nvfp4")


class QuantConfigError(LaqatError, ValueError):
    """A quantizer config or format string that is not valid; the message names the key."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """One quantizer: format, scale group, and straight-through-estimator flavour.

    Scales are always dynamic (amax of the group at the moment of rounding).
    """

    format: str
    group: str | None = None  # None only for log_grid
    axis: tuple[int, ...] | None = None  # group="axis": kept axes, ModelOpt's meaning
    block_v: int | None = None  # group="tile": value columns per [K x BV] state tile
    block_size: int | None = None  # group="block": values per block along the last axis
    step: float | None = None  # format="log_grid": the grid step d
    ste: str = "identity"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise QuantConfigError(f"quant format must be one of {FORMATS}, got {self.format!r}")
        allowed = _FORMAT_GROUPS[self.format]
        if self.format == "log_grid":
            if self.group is not None:
                raise QuantConfigError(f"quant group must be None for format 'log_grid', got {self.group!r}")
            if not isinstance(self.step, (int, float)) or isinstance(self.step, bool) or not (
                math.isfinite(self.step) and self.step > 0
            ):
                raise QuantConfigError(f"quant step of 'log_grid' must be a finite float > 0, got {self.step!r}")
            object.__setattr__(self, "step", float(self.step))
        else:
            if self.group not in allowed:
                raise QuantConfigError(
                    f"quant group for format {self.format!r} must be one of {allowed}, got {self.group!r}"
                )
            if self.step is not None:
                raise QuantConfigError(f"quant step is only for format 'log_grid', got step={self.step!r}")
        if self.group == "axis":
            if (
                not isinstance(self.axis, tuple)
                or not self.axis
                or not all(isinstance(a, int) and not isinstance(a, bool) for a in self.axis)
                or len(set(self.axis)) != len(self.axis)
            ):
                raise QuantConfigError(f"quant axis must be a non-empty tuple of distinct ints, got {self.axis!r}")
        elif self.axis is not None:
            raise QuantConfigError(f"quant axis is only for group 'axis', got axis={self.axis!r}")
        if self.group == "tile":
            if self.block_v not in TILE_BLOCK_V:
                raise QuantConfigError(f"quant block_v (tile width) must be one of {TILE_BLOCK_V}, got {self.block_v!r}")
            if self.format == "int8_h32" and self.block_v % 32:
                raise QuantConfigError(
                    f"quant block_v for format 'int8_h32' must be a multiple of 32 (Hadamard-32 groups), "
                    f"got {self.block_v!r}"
                )
        elif self.block_v is not None:
            raise QuantConfigError(f"quant block_v is only for group 'tile', got block_v={self.block_v!r}")
        if self.group == "block":
            sizes = (16,) if self.format == "nvfp4" else BLOCK_SIZES
            if self.block_size not in sizes:
                raise QuantConfigError(
                    f"quant block_size for format {self.format!r} must be one of {sizes}, got {self.block_size!r}"
                )
        elif self.block_size is not None:
            raise QuantConfigError(f"quant block_size is only for group 'block', got block_size={self.block_size!r}")
        if self.ste not in STES:
            raise QuantConfigError(f"quant ste must be one of {STES}, got {self.ste!r}")
        if self.ste == "clipped" and self.format not in _CLIPPABLE:
            raise QuantConfigError(
                f"quant ste 'clipped' is only for formats {_CLIPPABLE} (it would never clip for "
                f"{self.format!r}), got format {self.format!r}"
            )

    @property
    def qmax(self) -> float | None:
        """Largest quantized magnitude in scaled units (None for log_grid)."""
        return {"fp8_e4m3": 448.0, "int8": 127.0, "nvfp4": 6.0, "int8_h32": 127.0}.get(self.format)

    # ---- the canonical string ----------------------------------------------------------
    def to_string(self) -> str:
        if self.format == "log_grid":
            text = f"log_grid:{self.step!r}"
        elif self.group == "axis":
            text = f"{self.format}/axis:{','.join(str(a) for a in self.axis)}"
        elif self.group == "tile":
            text = f"{self.format}/tile{self.block_v}"
        elif self.group == "block":
            text = f"{self.format}/block{self.block_size}"
        else:
            text = f"{self.format}/{self.group}"
        return text + ("/clip" if self.ste == "clipped" else "")

    __str__ = to_string

    @staticmethod
    def parse(text: str) -> "QuantConfig":
        if not isinstance(text, str):
            raise QuantConfigError(f"quant format string must be a str, got {type(text).__name__}")
        return _parse_cached(text)

    @staticmethod
    def coerce(cfg: "QuantConfig | str | Mapping[str, Any]", site: str | None = None) -> "QuantConfig":
        """A QuantConfig from a QuantConfig, a canonical string, or a ModelOpt cfg dict."""
        if isinstance(cfg, QuantConfig):
            return cfg
        if isinstance(cfg, str):
            return QuantConfig.parse(cfg)
        if isinstance(cfg, Mapping):
            out = QuantConfig.from_modelopt(cfg, site)
            if out is None:
                raise QuantConfigError("quant cfg has enable=False: there is nothing to apply")
            return out
        raise QuantConfigError(f"quant config must be a QuantConfig, str or dict, got {type(cfg).__name__}")

    # ---- ModelOpt's quant_cfg vocabulary -----------------------------------------------
    @staticmethod
    def from_modelopt(cfg: Mapping[str, Any], site: str | None = None, *, state_block_v: int = 64) -> "QuantConfig | None":
        """Parse one ModelOpt ``quant_cfg`` entry's ``cfg`` dict; None when it sets enable=False.

        ``site`` is a laqat quant site ("state", "w", "<gemm_site>.lhs|rhs") or None. It only
        decides the grouping the seeds give to ModelOpt's ``axis`` at linear-attention sites:
        state + axis (0, 1) -> ``tile<state_block_v>``; w / GEMM sites + axis (0, 1, 2) -> ``row``.
        """
        return _from_modelopt(cfg, site, state_block_v)


_GROUP_RE = re.compile(r"(?:(?P<simple>tensor|row)|axis:(?P<axis>-?\d+(?:,-?\d+)*)|tile(?P<tile>\d+)|block(?P<block>\d+))")
_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str) -> QuantConfig:
    parts = text.strip().split("/")
    ste = "identity"
    if len(parts) > 1 and parts[-1] == "clip":
        ste = "clipped"
        parts = parts[:-1]
    head = parts[0]
    if head.startswith("log_grid"):
        fmt, sep, step = head.partition(":")
        if fmt != "log_grid" or not sep or not _FLOAT_RE.fullmatch(step) or len(parts) != 1:
            raise QuantConfigError(f"quant format string {text!r}: log grid must read 'log_grid:<step>', e.g. 'log_grid:0.03125'")
        return QuantConfig("log_grid", step=float(step), ste=ste)
    if head not in FORMATS:
        raise QuantConfigError(f"quant format string {text!r}: format must be one of {FORMATS}, got {head!r}")
    if len(parts) != 2:
        raise QuantConfigError(
            f"quant format string {text!r} must read '<format>/<group>[/clip]' with group one of "
            f"tensor, row, axis:<i,j,..>, tile<BV>, block<N>"
        )
    m = _GROUP_RE.fullmatch(parts[1])
    if not m:
        raise QuantConfigError(
            f"quant format string {text!r}: group must be one of tensor, row, axis:<i,j,..>, tile<BV>, "
            f"block<N>, got {parts[1]!r}"
        )
    if m.group("simple"):
        return QuantConfig(head, m.group("simple"), ste=ste)
    if m.group("axis"):
        return QuantConfig(head, "axis", axis=tuple(int(a) for a in m.group("axis").split(",")), ste=ste)
    if m.group("tile"):
        return QuantConfig(head, "tile", block_v=int(m.group("tile")), ste=ste)
    return QuantConfig(head, "block", block_size=int(m.group("block")), ste=ste)


# ---- ModelOpt parsing ------------------------------------------------------------------
MODELOPT_KEYS = (
    "enable", "num_bits", "axis", "type", "block_sizes", "fake_quant", "unsigned", "narrow_range",
    "learn_amax", "bias", "rotate", "pass_through_bwd", "calibrator", "trt_high_precision_dtype",
)
# The keys of ModelOpt's vocabulary that laqat accepts only at some values: key -> (allowed values, default).
MODELOPT_VALUES = {
    "type": (("static", "dynamic"), "static"),  # static needs block_sizes' type dynamic (no calibrated amax)
    "fake_quant": ((True,), True),
    "unsigned": ((False,), False),
    "learn_amax": ((False,), False),
    "narrow_range": ((True, False), False),  # dynamic amax/127 scales never reach -128
    "bias": ((None,), None),
    "calibrator": (("max",), "max"),  # calibration does not apply to dynamic scales
    "trt_high_precision_dtype": (("Float", "Half", "BFloat16"), "Float"),  # ONNX export only
    "pass_through_bwd": ((True, False, None), None),  # False: the clipped straight-through gradient
}
BLOCK_SPECIAL_KEYS = ("type", "scale_bits", "scale_block_sizes")
_FP8_BITS = ((4, 3), "e4m3", "fp8", "fp8_e4m3")
_INT8_BITS = (8, "int8")
_FP4_BITS = ((2, 1), "e2m1", "fp4", "nvfp4")
NUM_BITS = {"fp8_e4m3": _FP8_BITS, "int8": _INT8_BITS, "nvfp4": _FP4_BITS}  # format -> num_bits spellings


def _bits(value):
    """Normalise ModelOpt's num_bits (int, (E, M) tuple or list, or a name) for comparison."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, str):
        value = value.lower()
    return value


def _from_modelopt(cfg: Mapping[str, Any], site: str | None, state_block_v: int) -> QuantConfig | None:
    if not isinstance(cfg, Mapping):
        raise QuantConfigError(f"quant cfg must be a dict, got {type(cfg).__name__}")
    for key in cfg:
        if key not in MODELOPT_KEYS:
            raise QuantConfigError(f"quant cfg key {key!r} is not known; known keys: {MODELOPT_KEYS}"
                                   f"{did_you_mean(key, MODELOPT_KEYS)}")
    enable = cfg.get("enable", True)
    if not isinstance(enable, bool):
        raise QuantConfigError(f"quant cfg key 'enable' must be True or False, got {enable!r}")
    if not enable:
        return None
    if "num_bits" not in cfg:
        raise QuantConfigError("quant cfg key 'num_bits' is required when the quantizer is enabled")

    def require(key):
        allowed, default = MODELOPT_VALUES[key]
        value = cfg.get(key, default)
        if not any(type(value) is type(a) and value == a for a in allowed):  # 1 is not True
            raise QuantConfigError(f"quant cfg key {key!r} must be one of {allowed}, got {value!r}"
                                   f"{did_you_mean(value, allowed)}")
        return value

    for key in MODELOPT_VALUES:
        require(key)
    pass_through = cfg.get("pass_through_bwd")
    ste = "clipped" if pass_through is False else "identity"
    rotate = cfg.get("rotate", False)
    if isinstance(rotate, Mapping):
        unknown = [k for k in rotate if k != "enable"]
        if unknown:
            raise QuantConfigError(f"quant cfg key 'rotate' only accepts 'enable' here, got keys {unknown}")
        rotate = rotate.get("enable", False)
    if rotate not in (True, False):
        raise QuantConfigError(f"quant cfg key 'rotate' must be True or False, got {rotate!r}")

    bits = _bits(cfg["num_bits"])
    if bits in _FP8_BITS:
        fmt = "fp8_e4m3"
    elif bits in _INT8_BITS:
        fmt = "int8_h32" if rotate else "int8"
    elif bits in _FP4_BITS:
        fmt = "nvfp4"
    else:
        spellings = [b for bits in NUM_BITS.values() for b in bits if isinstance(b, str)]
        raise QuantConfigError(
            f"quant cfg key 'num_bits' must be (4, 3) / 'e4m3' (FP8 E4M3), 8 / 'int8' (INT8) or "
            f"(2, 1) / 'e2m1' (NVFP4), got {cfg['num_bits']!r}{did_you_mean(cfg['num_bits'], spellings)}"
        )
    if rotate and fmt != "int8_h32":
        raise QuantConfigError(f"quant cfg key 'rotate' is only supported with num_bits=8 (INT8 Hadamard-32), got num_bits={cfg['num_bits']!r}")

    block_sizes = cfg.get("block_sizes")
    block_type = None
    block_size = None
    scale_bits = None
    if block_sizes is not None:
        if not isinstance(block_sizes, Mapping):
            raise QuantConfigError(f"quant cfg key 'block_sizes' must be a dict, got {block_sizes!r}")
        if cfg.get("axis") is not None:
            raise QuantConfigError("quant cfg keys 'axis' and 'block_sizes' cannot both be set (ModelOpt's rule)")
        axes = {k: v for k, v in block_sizes.items() if k not in BLOCK_SPECIAL_KEYS}
        for k in block_sizes:
            if isinstance(k, str) and k not in BLOCK_SPECIAL_KEYS:
                raise QuantConfigError(f"quant cfg key 'block_sizes.{k}' is not known; known: {BLOCK_SPECIAL_KEYS} and "
                                       f"axis ints{did_you_mean(k, BLOCK_SPECIAL_KEYS)}")
        if list(axes) != [-1]:
            raise QuantConfigError(f"quant cfg key 'block_sizes' must block the last axis only (key -1), got axes {list(axes)}")
        block_size = axes[-1]
        block_type = block_sizes.get("type", "static")
        if block_type not in ("static", "dynamic"):
            raise QuantConfigError(f"quant cfg key 'block_sizes.type' must be 'static' or 'dynamic', got {block_type!r}")
        scale_bits = _bits(block_sizes.get("scale_bits"))
        if block_sizes.get("scale_block_sizes") is not None:
            raise QuantConfigError("quant cfg key 'block_sizes.scale_block_sizes' is not supported (per-block scales are not re-blocked)")

    qtype = cfg.get("type", "static")
    if qtype != "dynamic" and block_type != "dynamic":
        raise QuantConfigError(
            "quant cfg key 'type' must be 'dynamic' (or block_sizes['type'] 'dynamic'): laqat computes "
            "scales at every rounding and has no calibrated static amax"
        )

    if fmt == "nvfp4":
        if block_size != 16 or scale_bits != (4, 3):
            raise QuantConfigError(
                "quant cfg for num_bits=(2, 1) must set block_sizes={-1: 16, 'type': 'dynamic', "
                "'scale_bits': (4, 3)} (NVFP4); " + f"got block_sizes={block_sizes!r}"
            )
        return QuantConfig("nvfp4", "block", block_size=16, ste=ste)
    if scale_bits is not None:
        raise QuantConfigError(
            f"quant cfg key 'block_sizes.scale_bits' is only supported as (4, 3) with num_bits=(2, 1) (NVFP4); "
            f"got {block_sizes.get('scale_bits')!r} with num_bits={cfg['num_bits']!r}"
        )

    if fmt == "int8_h32":
        if site not in (None, "state"):
            raise QuantConfigError(f"quant cfg key 'rotate' (INT8 Hadamard-32) is a state codec; site {site!r} is not 'state'")
        if block_sizes is not None and block_size != 32:
            raise QuantConfigError(f"quant cfg key 'block_sizes' with rotate=True must be {{-1: 32}} (Hadamard-32), got {block_sizes!r}")
        return QuantConfig("int8_h32", "tile", block_v=state_block_v, ste=ste)

    if block_sizes is not None:
        if block_size is None:
            return QuantConfig(fmt, "row", ste=ste)  # ModelOpt's per-token form {-1: None}
        if block_size not in BLOCK_SIZES:
            raise QuantConfigError(f"quant cfg key 'block_sizes' -1 must be one of {BLOCK_SIZES} or None, got {block_size!r}")
        return QuantConfig(fmt, "block", block_size=block_size, ste=ste)

    axis = cfg.get("axis")
    if axis is None:
        return QuantConfig(fmt, "tensor", ste=ste)
    if isinstance(axis, int) and not isinstance(axis, bool):
        axis = (axis,)
    if isinstance(axis, list):
        axis = tuple(axis)
    if not isinstance(axis, tuple) or not all(isinstance(a, int) and not isinstance(a, bool) for a in axis):
        raise QuantConfigError(f"quant cfg key 'axis' must be None, an int or a tuple of ints, got {cfg.get('axis')!r}")
    if site == "state" and axis == (0, 1):
        return QuantConfig(fmt, "tile", block_v=state_block_v, ste=ste)
    if site is not None and site != "state" and axis == (0, 1, 2):
        return QuantConfig(fmt, "row", ste=ste)
    return QuantConfig(fmt, "axis", axis=axis, ste=ste)
