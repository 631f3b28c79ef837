"""The policy file's format: its keys and values, parsed and checked; reading and writing the file.

    version: laqat.policy/1
    quant_cfg:                     # ordered; for each quantizer, later entries win
      - {quantizer_name: "*", enable: false}
      - {quantizer_name: "*gdn_state_quantizer", cfg: {num_bits: [4, 3], type: dynamic, axis: [0, 1]}}
    linear_attention:              # ordered; for each module, the last matching rule wins (whole cfg)
      - {module_name: "*layers.3.*", cfg: {chunk_size: 64, state: {block_v: 32}}}

``parse_policy`` checks the top-level keys and each rule; ``QuantRule`` keeps a ``quant_cfg`` entry's ModelOpt cfg
as written (what it means at a quant site is the resolution's: ``la_compiler.policy.resolution``). The
``linear_attention`` section is typed: frozen configs whose keys keep ModelOpt's names (``backend``, ``chunk_size``,
``state.block_v``, ``solve``, ``decode``, ``matmul``); ``numerics`` is laqat's
(``la_compiler.options.NumericsOptions``). The values the ``decode`` and ``serving`` keys accept are the decode options' (``la_compiler.options``:
``DecodeOptions``, which the resolution builds from them). Each config validates itself in ``__post_init__``
(torchao style) and raises ``PolicyError`` naming the key (relative to its ``cfg``) and the allowed values; the
parser prefixes the position of the rule (``linear_attention[2].cfg.``).

Each field says what it accepts in its metadata (``setting(...)``: choices, an integer range, a boolean, a positive
number, a nested config); ``check_fields`` runs those checks, and ``la_compiler.policy.json_schema`` writes the
policy file's JSON Schema from the same metadata, so the schema and the checks cannot disagree. The checks that
relate two fields stay in ``__post_init__``. A misspelt key or value is answered with the closest allowed
spellings ("did you mean ...?", ``la_compiler.suggest``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from la_compiler.error_base import LaqatError
from la_compiler.ir.spec import GEMM_SITES
from la_compiler.kernels.selection import ORDER
from la_compiler.options import (DECODE_MODES, READOUTS, REPLAY_WINDOW, SERVING_FORWARDS, SERVING_PREFILL_BACKENDS,
                                  SERVING_PROFILES, SERVING_STATE_DTYPES, NumericsOptions, OptionsError,
                                  unserved_decode)
from la_compiler.suggest import did_you_mean


class PolicyError(LaqatError, ValueError):
    """A policy config that is not valid; the message names the key and the allowed values."""


class PolicyWarning(UserWarning):
    """A policy that is valid but (partly) applies nowhere. ``warnings.simplefilter("error",
    la_compiler.PolicyWarning)`` makes every laqat policy warning an error (docs/policy.md, "Warnings")."""


class UnmatchedPolicyRuleWarning(PolicyWarning):
    """A policy rule matched no recurrence of a compiled graph, or (at load time) a ``quantizer_name`` glob matches
    no laqat quantizer of any model."""


class NothingQuantizedWarning(PolicyWarning):
    """A policy that changes numerics met a graph with candidate recurrences and rewrote none of them."""


# ---- small checks, each naming the key ----------------------------------------------------

def check_mapping(obj: Any, key: str, allowed: tuple[str, ...]) -> Mapping:
    if not isinstance(obj, Mapping):
        raise PolicyError(f"{key}: must be a mapping with keys from {list(allowed)}, got {type(obj).__name__} {obj!r}")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise PolicyError(f"{key}: unknown key(s) {unknown}; allowed: {list(allowed)}"
                          f"{did_you_mean(unknown[0], allowed)}")
    return obj


def check_choice(value: Any, key: str, allowed: tuple) -> Any:
    if value not in allowed or (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)):
        raise PolicyError(f"{key}: must be one of {list(allowed)}, got {value!r}{did_you_mean(value, allowed)}")
    return value


def check_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PolicyError(f"{key}: must be a positive finite number, got {value!r}")
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


# ---- what each field accepts: the checks and the JSON Schema both read it --------------------

def setting(default=dataclasses.MISSING, *, kind: str, doc: str, choices: tuple | None = None, lo: int | None = None,
        hi: int | None = None, pow2: bool = False, optional: bool = False, cls: type | None = None):
    """A field of a policy config. ``kind``: "choice" (one of ``choices``), "int" (``lo``..``hi``, ``pow2``, and
    one of ``choices`` if given), "bool", "number" (positive, finite), "str", "config" (a nested config of class
    ``cls``), or "custom" (checked in ``__post_init__`` only; ``choices`` then only documents it). ``optional``:
    None is allowed too. ``doc``: what it does (the schema's description)."""
    metadata = {"kind": kind, "doc": doc, "choices": choices, "lo": lo, "hi": hi, "pow2": pow2,
                "optional": optional, "cls": cls}
    return dataclasses.field(default=default, metadata=metadata)


def check_field(meta: Mapping, value: Any, name: str) -> None:
    """``value`` against one field's metadata; ``name`` is its key in messages."""
    if value is None and meta["optional"]:
        return
    kind = meta["kind"]
    if kind == "int":
        check_int(value, name, lo=meta["lo"], hi=meta["hi"], pow2=meta["pow2"])
        if meta["choices"] is not None:
            check_choice(value, name, meta["choices"])
    elif kind == "choice":
        check_choice(value, name, meta["choices"])
    elif kind == "bool":
        check_bool(value, name)
    elif kind == "number":
        check_number(value, name)
    elif kind == "str":
        check_str(value, name)
    elif kind == "config" and not isinstance(value, meta["cls"]):
        raise PolicyError(f"{name}: must be a {meta['cls'].__name__}, got {value!r}")


def check_fields(config) -> None:
    """Every field of a config dataclass against its metadata, in field order; keys read ``<KEY>.<field>``."""
    prefix = f"{config.KEY}." if config.KEY else ""
    for f in dataclasses.fields(config):
        if "kind" in f.metadata:
            check_field(f.metadata, getattr(config, f.name), prefix + f.name)


def prefixed(prefix: str, fn, *args, **kwargs):
    """Runs ``fn``; a PolicyError it raises gets ``prefix`` in front of its key."""
    try:
        return fn(*args, **kwargs)
    except PolicyError as e:
        raise PolicyError(f"{prefix}{e}") from None


# ---- the linear_attention cfg ---------------------------------------------------------------

BACKEND_ALIASES = ("auto", "matmul")  # "matmul" is ModelOpt's "apply the policy's numerics": laqat picks the kernel
IMPLEMENTATIONS = ("auto", "triton", "torch")  # constrains the kernel family; never the numerics
# The stored state's codec: the state quantizer's format as it is, or (INT8 only) ReplaySSM's Hadamard-32.
# It is the format of every state rounding (prefill chunks and decode writes alike): the spec's q.state.
STATE_CODECS = ("quantizer", "hadamard32")
STATE_BLOCK_V = (16, 32, 64, 128)
ACCUMULATOR_DTYPES = ("fp32", "fp16", "bf16")
# Serving profiles (docs/serving.md): the engines and releases of the profiles (la_compiler.options spells them
# <engine>-<release>), the KDA state-cache dtypes (MambaStateDtypeCalculator.kda_state_dtype's three), and
# ModelOpt's `precision` spellings.
SERVING_VERSIONS = {engine: tuple(p.partition("-")[2] for p in SERVING_PROFILES if p.partition("-")[0] == engine)
                    for engine in dict.fromkeys(p.partition("-")[0] for p in SERVING_PROFILES)}
KDA_SERVING_STATE_DTYPES = ("auto", "float32", "bfloat16")
SERVING_MODELS = (None, "kimi_k3")  # kimi_k3: vLLM's Kimi-K3 / Kimi-Linear KDA layers (KDA only)
PRECISIONS = ("vllm", "vllm_kimi_k3", "replayssm")


def config_keys(cls) -> tuple[str, ...]:
    """The keys a config dataclass reads from a policy file: its fields."""
    return tuple(f.name for f in dataclasses.fields(cls))


def kernel_backends() -> tuple[str, ...]:
    """The values ``backend`` accepts: the aliases and every variant of the kernel-selection table."""
    return BACKEND_ALIASES + ORDER


@dataclasses.dataclass(frozen=True)
class StateCfg:
    KEY = "state"
    block_v: int = setting(64, kind="int", choices=STATE_BLOCK_V,
                       doc="BV: one state scale per [K x BV] tile per (sequence, head)")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class SolveCfg:
    KEY = "solve"
    method: str = setting("exact", kind="choice", choices=("exact", "neumann"),
                      doc="the WY triangular solve: exact, or a Neumann polynomial of `degree`")
    degree: int | None = setting(None, kind="int", lo=1, optional=True,
                             doc="Neumann degree: required with method neumann (below chunk_size), forbidden with "
                                 "exact")
    implementation: str = setting("auto", kind="choice", choices=IMPLEMENTATIONS,
                              doc="the kernel family that runs the solve (never the numerics)")

    def __post_init__(self):
        check_fields(self)
        if self.method == "exact" and self.degree is not None:
            raise PolicyError(f"solve.degree: an exact solve takes no degree (got degree={self.degree!r}); "
                              f"use solve.method='neumann' for a polynomial of that degree")
        if self.method == "neumann" and self.degree is None:
            raise PolicyError("solve.degree: required with solve.method='neumann' (no default degree)")


@dataclasses.dataclass(frozen=True)
class ReplayCfg:
    KEY = "decode.replay"
    window: int = setting(kind="int", lo=REPLAY_WINDOW[0], hi=REPLAY_WINDOW[1],
                      doc="the anchor is refreshed every `window` tokens (required)")
    factor_qdq: bool = setting(False, kind="bool", doc="round the replay factors in the state codec's scalar format")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class DecodeCfg:
    KEY = "decode"
    mode: str = setting("none", kind="choice", choices=("none",) + DECODE_MODES,
                    doc="decode-phase training: none, token (the state rounded at every token write) or replay")
    readout: str = setting("working", kind="choice", choices=READOUTS,
                       doc="decode outputs read the unrounded working state or the stored (rounded) one")
    state_codec: str = setting("quantizer", kind="choice", choices=STATE_CODECS,
                           doc="the stored state's codec: the state quantizer's format, or (INT8 only) ReplaySSM's "
                               "Hadamard-32")
    decay_log_step: float | None = setting(None, kind="number", optional=True,
                                       doc="round the log-decay g to this grid in the decode phase")
    replay: ReplayCfg | None = setting(None, kind="config", cls=ReplayCfg, optional=True,
                                   doc="replay mode's options (only with mode replay)")
    implementation: str = setting("auto", kind="choice", choices=IMPLEMENTATIONS,
                              doc="the kernel family that runs the decode phase (never the numerics)")

    def __post_init__(self):
        check_fields(self)
        if self.mode == "replay" and self.replay is None:
            raise PolicyError(f"decode.replay: required with decode.mode='replay' (give replay.window, "
                              f"{REPLAY_WINDOW[0]}..{REPLAY_WINDOW[1]})")
        if self.mode != "replay" and self.replay is not None:
            raise PolicyError(f"decode.replay: only with decode.mode='replay', got decode.mode={self.mode!r}")
        if self.mode == "none":  # the state codec is the stored state's format: it holds in every phase
            given = [f.name for f in dataclasses.fields(self)
                     if f.name not in ("mode", "state_codec") and getattr(self, f.name) != f.default]
            if given:
                raise PolicyError(f"decode.{given[0]}: only with decode.mode 'token' or 'replay', "
                                  f"got decode.mode='none'")


# The prefill kernels vLLM runs that laqat does not reproduce (docs/serving.md): why, and the server's flag that
# makes it run the Triton kernels laqat does reproduce.
PREFILL_BACKEND_REFUSALS = {
    "flashinfer": "serving.prefill_backend: 'flashinfer' is FlashInfer's GDN prefill (compiled CUDA), vLLM 0.33.0's "
                  "default for GDN on Hopper (SM90) and on Blackwell with head_k_dim 128; laqat does not reproduce "
                  "FlashInfer's GDN prefill: serve with vLLM's `--gdn-prefill-backend triton` (additional_config "
                  "gdn_prefill_backend: triton) and set serving.prefill_backend: triton (the default)",
    "flashkda": "serving.prefill_backend: 'flashkda' is FlashKDA (compiled CUDA, vllm._flashkda_C), Kimi-K3's KDA "
                "prefill on NVIDIA SM90 / SM10x / SM12x with bf16 inputs, head dim 128 and a bounded gate; laqat does "
                "not reproduce FlashKDA: serve with vLLM's `--kda-prefill-backend triton` (and "
                "`--kda-decode-backend triton`) and set serving.prefill_backend: triton (the default)",
}


@dataclasses.dataclass(frozen=True)
class ServingCfg:
    """A serving engine whose decode the decode phase reproduces (kernels/decode/serving.py)."""

    KEY = "serving"
    engine: str = setting("vllm", kind="choice", choices=tuple(SERVING_VERSIONS), doc="the serving engine")
    version: str = setting("0.33", kind="custom", choices=tuple(v for vs in SERVING_VERSIONS.values() for v in vs),
                       doc="the engine's release (a string; YAML's 0.33 and vLLM's 0.33.0 are read as '0.33')")
    state_dtype: str = setting("auto", kind="choice", choices=SERVING_STATE_DTYPES,
                           doc="the state cache's dtype; auto: GDN the model's dtype, KDA float32 (vLLM's rule)")
    model: str | None = setting(None, kind="choice", choices=SERVING_MODELS,
                            doc="kimi_k3: vLLM's Kimi-K3 / Kimi-Linear KDA layers (KDA only)")
    prefill_backend: str = setting("triton", kind="choice", choices=SERVING_PREFILL_BACKENDS,
                               doc="the server's prefill kernel: triton (vLLM's Triton copy of FLA: "
                                   "--gdn-prefill-backend triton / --kda-prefill-backend triton), the one laqat "
                                   "reproduces; flashinfer (vLLM's GDN default on Hopper) and flashkda (Kimi-K3's "
                                   "KDA default on NVIDIA) are refused")
    forward: str = setting("auto", kind="choice", choices=SERVING_FORWARDS,
                       doc="which kernels compute the forward: server (the engine's own, its package importable "
                           "at the profile's release), laqat (the reproduction), auto (server where importable, "
                           "else laqat); the backward is laqat's")

    def __post_init__(self):
        check_field(dataclasses.fields(self)[0].metadata, self.engine, "serving.engine")
        version = repr(self.version) if isinstance(self.version, float) else self.version  # YAML's 0.33
        if isinstance(version, str) and version.count(".") == 2 and version.endswith(".0"):
            version = version[:-2]  # vLLM spells its releases 0.33.0
        object.__setattr__(self, "version", version)
        check_choice(self.version, "serving.version", SERVING_VERSIONS[self.engine])
        check_fields(self)
        if self.model == "kimi_k3":
            check_choice(self.state_dtype, "serving.state_dtype", KDA_SERVING_STATE_DTYPES)
        if self.prefill_backend != "triton":
            raise PolicyError(PREFILL_BACKEND_REFUSALS[self.prefill_backend])

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
    KEY = ""
    accumulator_dtype: str = setting("fp32", kind="choice", choices=ACCUMULATOR_DTYPES,
                                 doc="the GEMM's accumulator: fp32 (not emulated), or fp16 / bf16 rounded after "
                                     "each reduction block")
    reduction_block: int | None = setting(None, kind="int", pow2=True, optional=True,
                                      doc="fp16/bf16: products summed in fp32 within a block of this many, rounded "
                                          "between blocks (required with fp16/bf16)")

    def __post_init__(self):
        check_fields(self)
        if self.accumulator_dtype == "fp32":
            if self.reduction_block is not None:
                raise PolicyError("reduction_block: only with accumulator_dtype 'fp16' or 'bf16' "
                                  "(an fp32 accumulator is not emulated)")
        elif self.reduction_block is None:
            raise PolicyError(f"reduction_block: required with accumulator_dtype={self.accumulator_dtype!r}")

    def canonical(self) -> str | None:
        """The spec's ``acc.<site>`` value (``fp16:16``), None when nothing is emulated."""
        return None if self.accumulator_dtype == "fp32" else f"{self.accumulator_dtype}:{self.reduction_block}"


@dataclasses.dataclass(frozen=True)
class LinearAttentionCfg:
    KEY = ""
    backend: str = setting("auto", kind="custom", choices=kernel_backends(),
                       doc="auto, matmul (ModelOpt's 'apply the policy's numerics': same as auto) or a kernel variant "
                           "of the selection table, pinned")
    chunk_size: int = setting(64, kind="int", lo=1, hi=1024, pow2=True, doc="the chunk length, a power of two")
    state: StateCfg = setting(StateCfg(), kind="config", cls=StateCfg, doc="the state's scale tiles")
    solve: SolveCfg = setting(SolveCfg(), kind="config", cls=SolveCfg, doc="the WY triangular solve")
    decode: DecodeCfg = setting(DecodeCfg(), kind="config", cls=DecodeCfg,
                            doc="decode-phase training (docs/decode_phase.md)")
    # (gemm site, accumulator), sorted by site; in a policy file a mapping site -> accumulator
    matmul: tuple[tuple[str, AccCfg], ...] = setting((), kind="custom", choices=GEMM_SITES,
                                                 doc="per prefill GEMM site, an emulated fp16/bf16 accumulator")
    numerics: NumericsOptions = setting(NumericsOptions(), kind="config", cls=NumericsOptions,
                                    doc="the chunk kernels' precisions and key blocks (docs/options.md)")
    serving: ServingCfg | None = setting(None, kind="config", cls=ServingCfg, optional=True,
                                     doc="a serving engine's decode, reproduced (docs/serving.md)")

    def __post_init__(self):
        check_choice(check_str(self.backend, "backend"), "backend", kernel_backends())
        check_fields(self)
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
        """What a serving profile decodes (``la_compiler.options.unserved_decode``), in this file's keys; the state
        quantizer's own rotation is known at resolution (``DecodeOptions`` refuses it there)."""
        d, engine = self.decode, self.serving.engine
        refusals = {
            "mode": f"decode.mode: a serving profile decodes one token per step: needs 'token', got {d.mode!r}",
            "readout": f"decode.readout: {engine} reads each decode output from the fp32 working state "
                       f"('working'), got {d.readout!r}",
            "decay_log_step": f"decode.decay_log_step: {engine} does not round the log-decay; leave it out with "
                              f"serving",
            "state_codec": f"decode.state_codec: {d.state_codec!r} is ReplaySSM's codec, not {engine}'s; a serving "
                           f"profile takes the state quantizer's own format (or none)",
        }
        codec = "int8_h32" if d.state_codec == "hadamard32" else None
        unserved = unserved_decode(d.mode, d.readout, d.decay_log_step, codec)
        if unserved:
            raise PolicyError(refusals[unserved[0]])

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
            fields["serving"] = ServingCfg(**check_mapping(cfg["serving"], "serving", config_keys(ServingCfg)))
            decode = cfg.get("decode") or {}
            if isinstance(decode, Mapping) and "mode" not in decode:  # a serving profile decodes token by token
                cfg = {**cfg, "decode": {**decode, "mode": "token"}}
        if "state" in cfg:
            fields["state"] = StateCfg(**check_mapping(cfg["state"], "state", config_keys(StateCfg)))
        if "solve" in cfg:
            fields["solve"] = SolveCfg(**check_mapping(cfg["solve"], "solve", config_keys(SolveCfg)))
        if "decode" in cfg:
            decode = dict(check_mapping(cfg["decode"], "decode", config_keys(DecodeCfg)))
            if decode.get("replay") is not None:
                decode["replay"] = ReplayCfg(**_replay_fields(decode["replay"]))
            fields["decode"] = DecodeCfg(**decode)
        if "matmul" in cfg:
            matmul = check_mapping(cfg["matmul"], "matmul", GEMM_SITES)
            fields["matmul"] = tuple(sorted(
                (site, prefixed(f"matmul.{site}.", AccCfg, **check_mapping(acc, f"matmul.{site}", config_keys(AccCfg))))
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
    fields = dict(check_mapping(replay, "decode.replay", config_keys(ReplayCfg)))
    if "window" not in fields:
        raise PolicyError(f"decode.replay.window: required ({REPLAY_WINDOW[0]}..{REPLAY_WINDOW[1]})")
    return fields


# ---- the file: top-level keys, rules, reading and writing ---------------------------------------

POLICY_VERSION = "laqat.policy/1"
TOP_KEYS = ("version", "name", "description", "quant_cfg", "linear_attention", "algorithm")
QUANT_RULE_KEYS = ("quantizer_name", "cfg", "enable")
MODULE_RULE_KEYS = ("module_name", "cfg")


class _FrozenCfg(tuple):
    """A ModelOpt quantizer cfg, normalised (lists -> tuples, block_sizes keys -> ints) and
    immutable; ``dict(...)`` gives it back."""

    @staticmethod
    def of(cfg: Mapping) -> "_FrozenCfg":
        return _FrozenCfg(sorted((k, _freeze(k, v)) for k, v in cfg.items()))


def _freeze(key: str, value):
    if key == "block_sizes" and isinstance(value, Mapping):
        items = (((int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k), _freeze("", v))
                 for k, v in value.items())  # JSON spells the axis keys as strings
        return _FrozenCfg(sorted(items, key=str))
    if isinstance(value, Mapping):
        return _FrozenCfg(sorted((k, _freeze(k, v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze("", v) for v in value)
    return value


def _thaw(value, *, for_json: bool):
    if isinstance(value, _FrozenCfg):
        return {k: _thaw(v, for_json=for_json) for k, v in value}
    if isinstance(value, tuple):
        items = [_thaw(v, for_json=for_json) for v in value]
        return items if for_json else tuple(items)
    return value


@dataclasses.dataclass(frozen=True)
class QuantRule:
    """One ``quant_cfg`` entry: ``cfg`` replaces a matching quantizer's cfg (and enables it
    unless ``enable`` says otherwise); ``enable`` alone switches it on or off."""

    quantizer_name: str
    cfg: _FrozenCfg | None = None
    enable: bool | None = None

    def __post_init__(self):
        check_str(self.quantizer_name, "quantizer_name")
        if self.cfg is None and self.enable is None:
            raise PolicyError("cfg: an entry needs 'cfg' or 'enable' (or both)")
        if self.enable is not None:
            check_bool(self.enable, "enable")
        if self.cfg is not None:
            if not isinstance(self.cfg, _FrozenCfg):
                if not isinstance(self.cfg, Mapping):
                    raise PolicyError(f"cfg: must be a mapping of ModelOpt quantizer attributes, got {self.cfg!r}")
                object.__setattr__(self, "cfg", _FrozenCfg.of(self.cfg))
            inner = dict(self.cfg).get("enable")
            if inner is not None and self.enable is not None and inner != self.enable:
                raise PolicyError(f"enable: {self.enable!r} contradicts cfg.enable={inner!r}")

    @property
    def enables(self) -> bool:
        """What this entry does to a matching quantizer's on/off switch."""
        if self.enable is not None:
            return self.enable
        return dict(self.cfg).get("enable", True)

    def quant_cfg(self) -> dict:
        """The cfg as ``QuantConfig.from_modelopt`` takes it (tuples, int block keys), without ``enable``."""
        return {k: v for k, v in _thaw(self.cfg, for_json=False).items() if k != "enable"}

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"quantizer_name": self.quantizer_name}
        if self.cfg is not None:
            out["cfg"] = _thaw(self.cfg, for_json=True)
        if self.enable is not None:
            out["enable"] = self.enable
        return out


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """One ``linear_attention`` policy: modules matching ``module_name`` get ``cfg``."""

    module_name: str
    cfg: LinearAttentionCfg = LinearAttentionCfg()

    def __post_init__(self):
        check_str(self.module_name, "module_name")
        if not isinstance(self.cfg, LinearAttentionCfg):
            raise PolicyError(f"cfg: must be a LinearAttentionCfg, got {self.cfg!r}")

    def to_dict(self) -> dict:
        return {"module_name": self.module_name, "cfg": self.cfg.to_dict()}


def parse_policy(config: Mapping, *, name: str | None = None) -> dict:
    """A policy file's content (a mapping) -> the fields of a ``Policy``: its rules, name and description, each key
    and value checked."""
    check_mapping(config, "policy", TOP_KEYS)
    version = config.get("version", POLICY_VERSION)
    if version != POLICY_VERSION:
        if _schema_number(version) > _schema_number(POLICY_VERSION):
            raise PolicyError(f"version: {version!r} was written by a newer laqat; this laqat reads policies of "
                              f"version {POLICY_VERSION!r} (upgrade laqat to read it)")
        raise PolicyError(f"version: this laqat reads policies of version {POLICY_VERSION!r}, got {version!r}")
    if config.get("algorithm") is not None:
        raise PolicyError(f"algorithm: laqat scales are dynamic (no calibration): must be null/None, "
                          f"got {config['algorithm']!r}")
    quant = _list(config.get("quant_cfg", []), "quant_cfg")
    modules = _list(config.get("linear_attention", []), "linear_attention")
    return dict(
        quant_cfg=tuple(_quant_rule(f"quant_cfg[{i}]", e) for i, e in enumerate(quant)),
        linear_attention=tuple(_module_rule(f"linear_attention[{i}]", e) for i, e in enumerate(modules)),
        name=check_str(name or config.get("name", "custom"), "name"),
        description=_description(config.get("description", "")),
    )


def read_policy_file(path: Path) -> Mapping:
    """The content of a .yaml/.yml/.json policy file, not yet checked."""
    try:
        text = path.read_text()
    except OSError as e:
        raise PolicyError(f"policy file {str(path)!r}: cannot read it ({e.strerror})") from None
    if path.suffix == ".json":
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(f"policy file {str(path)!r}: not valid JSON ({e})") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PolicyError(f"policy file {str(path)!r}: not valid YAML ({e})") from None
    else:
        raise PolicyError(f"policy file {str(path)!r}: the suffix must be .yaml, .yml or .json")
    if config is None:  # an empty file: a policy must say what it wants, even exact numerics
        raise PolicyError(f"policy file {str(path)!r}: the file is empty; write at least "
                          f"`version: {POLICY_VERSION}` (an empty quant_cfg means exact numerics)")
    return config


def policy_yaml(config: dict) -> str:
    """A policy's ``to_dict()`` as a YAML file, the ``linear_attention`` keys at their defaults left out."""
    import yaml

    default = LinearAttentionCfg().to_dict()
    out = dict(config, linear_attention=[dict(rule, cfg=_without_defaults(rule["cfg"], default))
                                         for rule in config["linear_attention"]])
    return yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=120)


def _without_defaults(cfg: dict, default: dict) -> dict:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            value = _without_defaults(value, default[key])
            if value:
                out[key] = value
        elif value != default.get(key, object()):
            out[key] = value
    return out


def _schema_number(version) -> int:
    """N of "laqat.policy/N"; -1 for anything else."""
    prefix = POLICY_VERSION.rsplit("/", 1)[0] + "/"
    if isinstance(version, str) and version.startswith(prefix) and version[len(prefix):].isdigit():
        return int(version[len(prefix):])
    return -1


def _list(value, key: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise PolicyError(f"{key}: must be a list of entries, got {type(value).__name__} {value!r}")
    return list(value)


def _description(value) -> str:
    if not isinstance(value, str):
        raise PolicyError(f"description: must be a string, got {type(value).__name__}")
    return value


def _quant_rule(key: str, entry) -> QuantRule:
    check_mapping(entry, key, QUANT_RULE_KEYS)
    if "quantizer_name" not in entry:
        raise PolicyError(f"{key}.quantizer_name: required (a glob over quantizer names, e.g. '*gdn_state_quantizer')")
    cfg = entry.get("cfg")
    if cfg is not None and not isinstance(cfg, Mapping):
        raise PolicyError(f"{key}.cfg: must be a mapping of ModelOpt quantizer attributes, "
                          f"got {type(cfg).__name__} {cfg!r}")
    return prefixed(f"{key}.", QuantRule, entry["quantizer_name"], None if cfg is None else _FrozenCfg.of(cfg),
                    entry.get("enable"))


def _module_rule(key: str, entry) -> ModuleRule:
    check_mapping(entry, key, MODULE_RULE_KEYS)
    if "module_name" not in entry:
        raise PolicyError(f"{key}.module_name: required (a glob over module names, e.g. 'model.layers.*.attn')")
    cfg = check_mapping(entry.get("cfg") or {}, f"{key}.cfg", LINEAR_ATTENTION_KEYS)
    return prefixed(f"{key}.", ModuleRule, entry["module_name"],
                    prefixed(f"{key}.cfg.", LinearAttentionCfg.from_dict, cfg))
