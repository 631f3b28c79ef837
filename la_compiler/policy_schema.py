"""The policy schema: typed, frozen, validated configs for the ``linear_attention`` section,
and the checks every policy key goes through.

Keys keep ModelOpt's names (``backend``, ``chunk_size``, ``state.block_v``, ``solve``,
``decode``, ``matmul``). Each config validates itself in ``__post_init__`` (torchao style)
and raises ``PolicyError`` naming the key (relative to its ``cfg``) and the allowed values;
the loader prefixes the position of the rule (``linear_attention[2].cfg.``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from la_compiler.kernels.selection import ORDER
from la_compiler.spec import GEMM_SITES


class PolicyError(ValueError):
    """A policy config that is not valid; the message names the key and the allowed values."""


# ---- small checks, each naming the key ----------------------------------------------------

def check_mapping(obj: Any, key: str, allowed: tuple[str, ...]) -> Mapping:
    if not isinstance(obj, Mapping):
        raise PolicyError(f"{key}: must be a mapping with keys from {list(allowed)}, got {type(obj).__name__} {obj!r}")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise PolicyError(f"{key}: unknown key(s) {unknown}; allowed: {list(allowed)}")
    return obj


def check_choice(value: Any, key: str, allowed: tuple) -> Any:
    if value not in allowed or (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)):
        raise PolicyError(f"{key}: must be one of {list(allowed)}, got {value!r}")
    return value


def check_int(value: Any, key: str, *, lo: int | None = None, hi: int | None = None, pow2: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{key}: must be an integer, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise PolicyError(f"{key}: must be {bound}, got {value}")
    if pow2 and (value <= 0 or value & (value - 1)):
        raise PolicyError(f"{key}: must be a positive power of two, got {value}")
    return value


def check_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{key}: must be true or false, got {type(value).__name__} {value!r}")
    return value


def check_str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyError(f"{key}: must be a non-empty string, got {type(value).__name__} {value!r}")
    return value


def prefixed(prefix: str, fn, *args, **kwargs):
    """Runs ``fn``; a PolicyError it raises gets ``prefix`` in front of its key."""
    try:
        return fn(*args, **kwargs)
    except PolicyError as e:
        raise PolicyError(f"{prefix}{e}") from None


# ---- the linear_attention cfg ---------------------------------------------------------------

BACKEND_ALIASES = ("auto", "matmul")  # "matmul" is ModelOpt's "apply the policy's numerics": laqat picks the kernel
IMPLEMENTATIONS = ("auto", "triton", "torch")  # constrains the kernel family; never the numerics
DECODE_MODES = ("none", "token", "replay")
READOUTS = ("working", "stored")  # decode readout from the unrounded working state or the stored (rounded) one
# The stored state's codec: the state quantizer's format as it is, or (INT8 only) ReplaySSM's Hadamard-32.
# It is the format of every state rounding (prefill chunks and decode writes alike): the spec's q.state.
STATE_CODECS = ("quantizer", "hadamard32")
STATE_BLOCK_V = (16, 32, 64, 128)
ACCUMULATOR_DTYPES = ("fp32", "fp16", "bf16")
REPLAY_WINDOW = (1, 64)


def kernel_backends() -> tuple[str, ...]:
    """The values ``backend`` accepts: the aliases and every variant of the kernel-selection table."""
    return BACKEND_ALIASES + ORDER


@dataclasses.dataclass(frozen=True)
class StateCfg:
    block_v: int = 64  # BV: one state scale per [K x BV] tile per (sequence, head)

    def __post_init__(self):
        check_int(self.block_v, "state.block_v")
        check_choice(self.block_v, "state.block_v", STATE_BLOCK_V)


@dataclasses.dataclass(frozen=True)
class SolveCfg:
    method: str = "exact"
    degree: int | None = None  # Neumann degree: required with method=neumann, forbidden with exact
    implementation: str = "auto"

    def __post_init__(self):
        check_choice(self.method, "solve.method", ("exact", "neumann"))
        check_choice(self.implementation, "solve.implementation", IMPLEMENTATIONS)
        if self.method == "exact" and self.degree is not None:
            raise PolicyError(f"solve.degree: an exact solve takes no degree (got degree={self.degree!r}); "
                              f"use solve.method='neumann' for a polynomial of that degree")
        if self.method == "neumann":
            if self.degree is None:
                raise PolicyError("solve.degree: required with solve.method='neumann' (no default degree)")
            check_int(self.degree, "solve.degree", lo=1)


@dataclasses.dataclass(frozen=True)
class ReplayCfg:
    window: int  # the anchor is refreshed every `window` tokens
    factor_qdq: bool = False

    def __post_init__(self):
        check_int(self.window, "decode.replay.window", lo=REPLAY_WINDOW[0], hi=REPLAY_WINDOW[1])
        check_bool(self.factor_qdq, "decode.replay.factor_qdq")


@dataclasses.dataclass(frozen=True)
class DecodeCfg:
    mode: str = "none"
    readout: str = "working"
    state_codec: str = "quantizer"
    decay_log_step: float | None = None  # round g to this grid in the decode phase
    replay: ReplayCfg | None = None
    implementation: str = "auto"

    def __post_init__(self):
        check_choice(self.mode, "decode.mode", DECODE_MODES)
        check_choice(self.readout, "decode.readout", READOUTS)
        check_choice(self.state_codec, "decode.state_codec", STATE_CODECS)
        check_choice(self.implementation, "decode.implementation", IMPLEMENTATIONS)
        if self.decay_log_step is not None:
            step = self.decay_log_step
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0:
                raise PolicyError(f"decode.decay_log_step: must be a positive finite number, got {step!r}")
        if self.replay is not None and not isinstance(self.replay, ReplayCfg):
            raise PolicyError(f"decode.replay: must be a ReplayCfg, got {self.replay!r}")
        if self.mode == "replay" and self.replay is None:
            raise PolicyError("decode.replay: required with decode.mode='replay' (give replay.window, 1..64)")
        if self.mode != "replay" and self.replay is not None:
            raise PolicyError(f"decode.replay: only with decode.mode='replay', got decode.mode={self.mode!r}")
        if self.mode == "none":  # the state codec is the stored state's format: it holds in every phase
            given = [f.name for f in dataclasses.fields(self)
                     if f.name not in ("mode", "state_codec") and getattr(self, f.name) != f.default]
            if given:
                raise PolicyError(f"decode.{given[0]}: only with decode.mode 'token' or 'replay', "
                                  f"got decode.mode='none'")


@dataclasses.dataclass(frozen=True)
class AccCfg:
    accumulator_dtype: str = "fp32"
    reduction_block: int | None = None  # fp16/bf16: products summed in fp32 within a block, rounded between

    def __post_init__(self):
        check_choice(self.accumulator_dtype, "accumulator_dtype", ACCUMULATOR_DTYPES)
        if self.accumulator_dtype == "fp32":
            if self.reduction_block is not None:
                raise PolicyError("reduction_block: only with accumulator_dtype 'fp16' or 'bf16' "
                                  "(an fp32 accumulator is not emulated)")
        elif self.reduction_block is None:
            raise PolicyError(f"reduction_block: required with accumulator_dtype={self.accumulator_dtype!r}")
        else:
            check_int(self.reduction_block, "reduction_block", pow2=True)

    def canonical(self) -> str | None:
        """The spec's ``acc.<site>`` value (``fp16:16``), None when nothing is emulated."""
        return None if self.accumulator_dtype == "fp32" else f"{self.accumulator_dtype}:{self.reduction_block}"


@dataclasses.dataclass(frozen=True)
class LinearAttentionCfg:
    backend: str = "auto"
    chunk_size: int = 64
    state: StateCfg = StateCfg()
    solve: SolveCfg = SolveCfg()
    decode: DecodeCfg = DecodeCfg()
    matmul: tuple[tuple[str, AccCfg], ...] = ()  # (gemm site, accumulator), sorted by site

    def __post_init__(self):
        check_choice(check_str(self.backend, "backend"), "backend", kernel_backends())
        check_int(self.chunk_size, "chunk_size", lo=1, hi=1024, pow2=True)
        for name, kind in (("state", StateCfg), ("solve", SolveCfg), ("decode", DecodeCfg)):
            if not isinstance(getattr(self, name), kind):
                raise PolicyError(f"{name}: must be a {kind.__name__}, got {getattr(self, name)!r}")
        sites = [s for s, _ in self.matmul]
        for site in sites:
            check_choice(site, "matmul", GEMM_SITES)
        if sites != sorted(set(sites)):
            raise PolicyError(f"matmul: sites must be sorted and unique, got {sites}")
        if self.solve.method == "neumann" and self.solve.degree >= self.chunk_size:
            raise PolicyError(f"solve.degree: must be below chunk_size={self.chunk_size} (the strictly lower "
                              f"triangular chunk matrix is nilpotent: degree {self.chunk_size - 1} is already exact), "
                              f"got {self.solve.degree}")
        impls = {k: v for k, v in (("solve", self.solve.implementation), ("decode", self.decode.implementation))
                 if v != "auto"}
        if len(set(impls.values())) > 1:
            raise PolicyError(f"decode.implementation: one kernel runs both the solve and the decode phase; "
                              f"solve.implementation={impls['solve']!r} and decode.implementation={impls['decode']!r} "
                              f"cannot both hold")
        if self.decode.state_codec == "hadamard32" and self.state.block_v < 32:
            raise PolicyError(f"decode.state_codec: 'hadamard32' needs state.block_v >= 32 (one 32-point Hadamard "
                              f"per block), got state.block_v={self.state.block_v}")

    @property
    def requested_backend(self) -> str | None:
        return None if self.backend in BACKEND_ALIASES else self.backend

    @property
    def implementation(self) -> tuple[str, str] | None:
        """(key, "triton" | "torch") when the cfg constrains the kernel family."""
        for key, value in (("solve.implementation", self.solve.implementation),
                           ("decode.implementation", self.decode.implementation)):
            if value != "auto":
                return key, value
        return None

    # ---- dict form ---------------------------------------------------------------------
    @staticmethod
    def from_dict(cfg: Mapping) -> "LinearAttentionCfg":
        check_mapping(cfg, "cfg", LINEAR_ATTENTION_KEYS)
        fields: dict[str, Any] = {k: cfg[k] for k in ("backend", "chunk_size") if k in cfg}
        if "state" in cfg:
            fields["state"] = StateCfg(**check_mapping(cfg["state"], "state", ("block_v",)))
        if "solve" in cfg:
            fields["solve"] = SolveCfg(**check_mapping(cfg["solve"], "solve", ("method", "degree", "implementation")))
        if "decode" in cfg:
            decode = dict(check_mapping(cfg["decode"], "decode", tuple(f.name for f in dataclasses.fields(DecodeCfg))))
            if decode.get("replay") is not None:
                decode["replay"] = ReplayCfg(**_replay_fields(decode["replay"]))
            fields["decode"] = DecodeCfg(**decode)
        if "matmul" in cfg:
            matmul = check_mapping(cfg["matmul"], "matmul", GEMM_SITES)
            fields["matmul"] = tuple(sorted(
                (site, prefixed(f"matmul.{site}.", AccCfg, **check_mapping(
                    acc, f"matmul.{site}", ("accumulator_dtype", "reduction_block"))))
                for site, acc in matmul.items()))
        return LinearAttentionCfg(**fields)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul"] = {site: dataclasses.asdict(acc) for site, acc in self.matmul}
        return out


LINEAR_ATTENTION_KEYS = tuple(f.name for f in dataclasses.fields(LinearAttentionCfg))


def _replay_fields(replay: Any) -> dict:
    fields = dict(check_mapping(replay, "decode.replay", ("window", "factor_qdq")))
    if "window" not in fields:
        raise PolicyError("decode.replay.window: required (1..64)")
    return fields
