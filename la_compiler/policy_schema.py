"""The policy schema: typed, frozen, validated configs for the ``linear_attention`` section,
and the checks every policy key goes through.

Keys keep ModelOpt's names (``backend``, ``chunk_size``, ``state.block_v``, ``solve``,
``decode``, ``matmul``); ``numerics`` is laqat's (``la_compiler.options.NumericsOptions``). Each config validates itself in ``__post_init__`` (torchao style)
and raises ``PolicyError`` naming the key (relative to its ``cfg``) and the allowed values;
the loader prefixes the position of the rule (``linear_attention[2].cfg.``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from la_compiler.kernels.selection import ORDER
from la_compiler.options import NumericsOptions, OptionsError
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
# Serving profiles (docs/serving.md): the engines and releases whose decode laqat reproduces, their state-cache
# dtypes (vLLM's --mamba-ssm-cache-dtype; KDA: MambaStateDtypeCalculator.kda_state_dtype's three), and
# ModelOpt's `precision` spellings.
SERVING_VERSIONS = {"vllm": ("0.33",)}
SERVING_STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KDA_SERVING_STATE_DTYPES = ("auto", "float32", "bfloat16")
SERVING_MODELS = (None, "kimi_k3")  # kimi_k3: vLLM's Kimi-K3 / Kimi-Linear KDA layers (KDA only)
PRECISIONS = ("vllm", "vllm_kimi_k3", "replayssm")
SERVING_KEYS = ("engine", "version", "state_dtype", "model")


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
class ServingCfg:
    """A serving engine whose decode the decode phase reproduces (kernels/decode/serving.py)."""

    engine: str = "vllm"
    version: str = "0.33"
    state_dtype: str = "auto"  # the state cache's dtype; auto: GDN the model's dtype, KDA float32 (vLLM's rule)
    model: str | None = None

    def __post_init__(self):
        check_choice(self.engine, "serving.engine", tuple(SERVING_VERSIONS))
        version = repr(self.version) if isinstance(self.version, float) else self.version  # YAML's 0.33
        if isinstance(version, str) and version.count(".") == 2 and version.endswith(".0"):
            version = version[:-2]  # vLLM spells its releases 0.33.0
        object.__setattr__(self, "version", version)
        check_choice(self.version, "serving.version", SERVING_VERSIONS[self.engine])
        check_choice(self.state_dtype, "serving.state_dtype", SERVING_STATE_DTYPES)
        check_choice(self.model, "serving.model", SERVING_MODELS)
        if self.model == "kimi_k3":
            check_choice(self.state_dtype, "serving.state_dtype", KDA_SERVING_STATE_DTYPES)

    @property
    def profile(self) -> str:
        """The spec's ``x.serving``."""
        return f"{self.engine}-{self.version}"

    def check_kind(self, kind: str) -> None:
        if self.model == "kimi_k3" and kind != "kda":
            raise PolicyError(f"serving.model: 'kimi_k3' is vLLM's KDA profile; this recurrence is {kind}")
        if kind == "kda" and self.state_dtype not in KDA_SERVING_STATE_DTYPES:
            raise PolicyError(f"serving.state_dtype: vLLM 0.33 keeps a KDA state in one of "
                              f"{list(KDA_SERVING_STATE_DTYPES)} (MambaStateDtypeCalculator.kda_state_dtype), "
                              f"got {self.state_dtype!r}")


def with_precision_alias(cfg: Mapping) -> dict:
    """A cfg with ModelOpt's ``precision`` spelt as laqat's keys: ``vllm`` = ``serving: {}``, ``vllm_kimi_k3`` =
    ``serving: {model: kimi_k3}``, ``replayssm`` (in no vLLM release) = ReplaySSM's emulation, ``decode:
    {mode: replay, state_codec: hadamard32, replay: {window: 1}}`` under the cfg's own decode keys."""
    out = {k: v for k, v in cfg.items() if k != "precision"}
    if "precision" not in cfg:
        return out
    precision = check_choice(cfg["precision"], "precision", PRECISIONS)
    if precision == "replayssm":
        decode = cfg.get("decode") or {}
        out["decode"] = {"mode": "replay", "state_codec": "hadamard32", "replay": {"window": 1},
                         **check_mapping(decode, "decode", tuple(decode) if isinstance(decode, Mapping) else ())}
    elif cfg.get("serving") is not None:
        raise PolicyError(f"precision: {precision!r} and serving both choose a serving profile; give one")
    else:
        out["serving"] = {} if precision == "vllm" else {"model": "kimi_k3"}
    return out


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
    numerics: NumericsOptions = NumericsOptions()  # the chunk kernels' precisions and key blocks (spec n.<name>)
    serving: ServingCfg | None = None  # a serving engine's decode, reproduced (docs/serving.md)

    def __post_init__(self):
        check_choice(check_str(self.backend, "backend"), "backend", kernel_backends())
        check_int(self.chunk_size, "chunk_size", lo=1, hi=1024, pow2=True)
        for name, kind in (("state", StateCfg), ("solve", SolveCfg), ("decode", DecodeCfg),
                           ("numerics", NumericsOptions)):
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
        if self.serving is not None:
            self._check_serving()

    def _check_serving(self):
        if not isinstance(self.serving, ServingCfg):
            raise PolicyError(f"serving: must be a ServingCfg, got {self.serving!r}")
        d, engine = self.decode, self.serving.engine
        if d.mode != "token":
            raise PolicyError(f"decode.mode: a serving profile decodes one token per step: needs 'token', "
                              f"got {d.mode!r}")
        if d.readout != "working":
            raise PolicyError(f"decode.readout: {engine} reads each decode output from the fp32 working state "
                              f"('working'), got {d.readout!r}")
        if d.decay_log_step is not None:
            raise PolicyError(f"decode.decay_log_step: {engine} does not round the log-decay; leave it out with "
                              f"serving")
        if d.state_codec != "quantizer":
            raise PolicyError(f"decode.state_codec: {d.state_codec!r} is ReplaySSM's codec, not {engine}'s; a serving "
                              f"profile takes the state quantizer's own format (or none)")

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
        cfg = with_precision_alias(check_mapping(cfg, "cfg", LINEAR_ATTENTION_KEYS))
        fields: dict[str, Any] = {k: cfg[k] for k in ("backend", "chunk_size") if k in cfg}
        if cfg.get("serving") is not None:
            fields["serving"] = ServingCfg(**check_mapping(cfg["serving"], "serving", SERVING_KEYS))
            decode = cfg.get("decode") or {}
            if isinstance(decode, Mapping) and "mode" not in decode:  # a serving profile decodes token by token
                cfg = {**cfg, "decode": {**decode, "mode": "token"}}
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
        if "numerics" in cfg:
            try:
                fields["numerics"] = NumericsOptions.from_dict(cfg["numerics"], key="numerics.")
            except OptionsError as e:
                raise PolicyError(str(e)) from None
        return LinearAttentionCfg(**fields)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul"] = {site: dataclasses.asdict(acc) for site, acc in self.matmul}
        return out


LINEAR_ATTENTION_KEYS = tuple(f.name for f in dataclasses.fields(LinearAttentionCfg)) + ("precision",)


def _replay_fields(replay: Any) -> dict:
    fields = dict(check_mapping(replay, "decode.replay", ("window", "factor_qdq")))
    if "window" not in fields:
        raise PolicyError("decode.replay.window: required (1..64)")
    return fields
