"""The decode-phase options of a spec (``phase=token|replay`` plus its ``x.<key>`` extras).

Spec encoding (the keys la_compiler/policy.py writes from a policy's ``decode:`` section;
docs/decode_phase.md):

    phase=token | replay            the suffix of every sequence runs as decode
    q.state=<format>                the state codec: fp8_e4m3/tile<BV>, int8/tile<BV> (one scale per [K x BV]
                                    tile), fp8_e4m3/block<N>, int8/block<N> (one scale per key row and N values
                                    along V), int8_h32/tile<BV> (absent: the decode state is not rounded)
    x.readout=working | stored      token output read from the unrounded or the rounded state
    x.decay_log_step=<float>        suffix log-decays rounded to round(g/d)*d (identity gradient)
    x.replay_window=<1..64>         replay: anchor refreshed every `window` suffix tokens
    x.replay_factor_qdq=0 | 1       replay: the stored rank-one factors k_t, u_t rounded in the
                                    state codec's scalar format (fp8_e4m3, or int8 for int8/int8_h32)
    x.decode_impl=auto | triton | torch   constrains the kernel family (selection table), never numerics
    x.serving=vllm-0.33             the decode steps reproduce that server's recurrent kernel: its order of
                                    operations (the state tile V-first in registers, so its sums over K are
                                    the server's), token mode, output read from the working state
    x.state_dtype=auto | float32 | bfloat16 | float16
                                    (with x.serving) the server's state cache dtype (mamba_ssm_cache_dtype):
                                    the state is rounded to it (nearest even) on load, at the handoff and at
                                    every decode write, after the state codec if any; auto is vLLM's rule
                                    (GDN: the model's dtype, that of v; KDA: float32)

Unknown ``x.`` keys of a phased spec are an error, never ignored.
"""
from __future__ import annotations

import dataclasses
import math

from la_compiler.error_base import LaqatError
from la_compiler.quant.config import QuantConfig
from la_compiler.spec import RecurrenceSpec

READOUTS = ("working", "stored")
STATE_CODEC_FORMATS = ("fp8_e4m3", "int8", "int8_h32")
BLOCK_CODEC_FORMATS = ("fp8_e4m3", "int8")  # with group block<N>: one scale per key row and N values
FACTOR_FORMATS = ("none", "fp8_e4m3", "int8")
KNOWN_EXTRAS = ("readout", "decay_log_step", "replay_window", "replay_factor_qdq", "decode_impl", "solve_impl",
                "serving", "state_dtype")
DEFAULT_BLOCK_V = 64
SERVING_PROFILES = ("vllm-0.33",)
STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")


class DecodeOptionsError(LaqatError, ValueError):
    """A decode-phase spec option that is not valid; the message names the key."""


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    mode: str  # "token" | "replay"
    codec: str | None = None  # state codec format ("fp8_e4m3", "int8", "int8_h32") or None = no rounding
    block_v: int = DEFAULT_BLOCK_V  # value columns per state tile (one scale per [K x block_v] tile)
    codec_block: int = 0  # 0: one scale per [K x block_v] tile; N: one per key row and N values (block_v = N)
    readout: str = "working"
    decay_log_step: float | None = None
    window: int = 1
    factor_format: str = "none"
    serving: str | None = None  # a serving profile of SERVING_PROFILES: the decode steps follow that server
    state_dtype: str = "float32"  # the serving cache's dtype (STATE_DTYPES); float32 rounds nothing

    def __post_init__(self):
        if self.mode not in ("token", "replay"):
            raise DecodeOptionsError(f"spec phase must be 'token' or 'replay' for decode options, got {self.mode!r}")
        if self.codec is not None and self.codec not in STATE_CODEC_FORMATS:
            raise DecodeOptionsError(f"decode state codec must be one of {STATE_CODEC_FORMATS}, got {self.codec!r}")
        if self.codec_block and (self.codec not in BLOCK_CODEC_FORMATS or self.block_v != self.codec_block):
            raise DecodeOptionsError(f"a decode state codec with blocks of {self.codec_block} values takes "
                                     f"{BLOCK_CODEC_FORMATS} and a value tile of the block, got {self.codec!r}, "
                                     f"block_v {self.block_v}")
        if self.readout not in READOUTS:
            raise DecodeOptionsError(f"spec x.readout must be one of {READOUTS}, got {self.readout!r}")
        if self.decay_log_step is not None and not (math.isfinite(self.decay_log_step) and self.decay_log_step > 0):
            raise DecodeOptionsError(f"spec x.decay_log_step must be a finite float > 0, got {self.decay_log_step!r}")
        if not (1 <= self.window <= 64):
            raise DecodeOptionsError(f"spec x.replay_window must be in 1..64, got {self.window!r}")
        if self.factor_format not in FACTOR_FORMATS:
            raise DecodeOptionsError(f"decode factor format must be one of {FACTOR_FORMATS}, "
                                     f"got {self.factor_format!r}")
        if self.mode == "token" and (self.window != 1 or self.factor_format != "none"):
            raise DecodeOptionsError("spec x.replay_window / x.replay_factor_qdq are only for phase=replay")
        if self.state_dtype not in STATE_DTYPES:
            raise DecodeOptionsError(f"spec x.state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.serving is None:
            if self.state_dtype != "float32":
                raise DecodeOptionsError("spec x.state_dtype is the serving cache's dtype: it needs x.serving")
            return
        if self.serving not in SERVING_PROFILES:
            raise DecodeOptionsError(f"spec x.serving must be one of {SERVING_PROFILES}, got {self.serving!r}")
        served = {"phase=token": self.mode == "token", "x.readout=working": self.readout == "working",
                  "no x.decay_log_step": self.decay_log_step is None,
                  "a state codec other than int8_h32": self.codec != "int8_h32"}
        wrong = [what for what, ok in served.items() if not ok]
        if wrong:
            raise DecodeOptionsError(f"spec x.serving={self.serving} decodes as that server does: it needs "
                                     f"{', '.join(wrong)}")

    @property
    def vllm_order(self) -> bool:
        """The decode steps in vLLM's order of operations (the state tile V-first in registers)."""
        return self.serving is not None

    def cache_dtype(self, kind: str, model_dtype) -> str:
        """The state cache's dtype for inputs of ``model_dtype`` (a torch dtype): float32, bfloat16 or float16.
        ``auto`` is vLLM 0.33's MambaStateDtypeCalculator: GDN the model's dtype, KDA float32."""
        if self.state_dtype != "auto":
            return self.state_dtype
        if kind == "kda":
            return "float32"
        name = str(model_dtype).removeprefix("torch.")
        return name if name in ("bfloat16", "float16") else "float32"

    @staticmethod
    def from_spec(spec: RecurrenceSpec) -> "DecodeOptions":
        extra = dict(spec.extra)
        unknown = sorted(set(extra) - set(KNOWN_EXTRAS))
        if unknown:
            raise DecodeOptionsError(f"spec {spec}: unknown decode option(s) {['x.' + k for k in unknown]}; "
                                     f"known: {['x.' + k for k in KNOWN_EXTRAS]}")
        others = [site for site, _ in spec.quant if site != "state"]
        if others or spec.acc or spec.solve != "exact":
            what = [f"q.{s}" for s in others] + [f"acc.{s}" for s, _ in spec.acc] + (
                [f"solve={spec.solve}"] if spec.solve != "exact" else [])
            raise DecodeOptionsError(f"spec {spec}: decode-phase kernels round the state only; the prefix runs the "
                                     f"exact recurrence, so {what} cannot be applied (not implemented)")
        codec_text = spec.quant_map.get("state")
        codec, block_v, codec_block = None, DEFAULT_BLOCK_V, 0
        if codec_text is not None:
            cfg = QuantConfig.parse(codec_text)
            tile = cfg.format in STATE_CODEC_FORMATS and cfg.group == "tile"
            block = cfg.format in BLOCK_CODEC_FORMATS and cfg.group == "block"
            if not (tile or block) or cfg.ste != "identity":
                raise DecodeOptionsError(f"spec {spec}: the decode state codec must be one of "
                                         f"{[f + '/tile<BV>' for f in STATE_CODEC_FORMATS]} or "
                                         f"{[f + '/block<N>' for f in BLOCK_CODEC_FORMATS]}, got {codec_text!r}")
            codec = cfg.format
            block_v, codec_block = (cfg.block_v, 0) if tile else (cfg.block_size, cfg.block_size)
        factor = extra.get("replay_factor_qdq", "0")
        if factor not in ("0", "1"):
            raise DecodeOptionsError(f"spec {spec}: x.replay_factor_qdq must be 0 or 1, got {factor!r}")
        if factor == "1" and codec is None:
            raise DecodeOptionsError(f"spec {spec}: x.replay_factor_qdq=1 rounds factors in the state codec's format, "
                                     f"but the spec has no q.state")
        if extra.get("decode_impl", "auto") not in ("auto", "triton", "torch"):
            raise DecodeOptionsError(f"spec {spec}: x.decode_impl must be auto, triton or torch")
        try:
            step = extra.get("decay_log_step")
            window = extra.get("replay_window")
            return DecodeOptions(
                mode=spec.phase, codec=codec, block_v=block_v, codec_block=codec_block,
                readout=extra.get("readout", "working"),
                decay_log_step=None if step is None else float(step),
                window=1 if window is None else int(window),
                factor_format="none" if factor == "0" else ("fp8_e4m3" if codec == "fp8_e4m3" else "int8"),
                serving=extra.get("serving"), state_dtype=extra.get("state_dtype", "float32"),
            )
        except ValueError as e:
            if isinstance(e, DecodeOptionsError):
                raise DecodeOptionsError(f"spec {spec}: {e}") from None
            raise DecodeOptionsError(f"spec {spec}: x.decay_log_step / x.replay_window not a number: {e}") from None


def decode_options(spec: RecurrenceSpec) -> DecodeOptions:
    if spec.phase not in ("token", "replay"):
        raise DecodeOptionsError(f"spec {spec} has phase={spec.phase}; decode kernels need phase=token or replay")
    return DecodeOptions.from_spec(spec)


class PhaseLengthsMissing(LaqatError, RuntimeError):
    """A decode variant was called without phase lengths (through the plain delta_rule op)."""


def require_lengths(spec, prefill_lengths, valid_lengths):
    if prefill_lengths is None or valid_lengths is None:
        raise PhaseLengthsMissing(
            f"spec {spec} has phase={spec.phase}: it runs through laqat::delta_rule_phased (the laqat backend's "
            f"phase pass rewrites such nodes), not through laqat::delta_rule, which carries no phase lengths")


def decode_reason(spec: RecurrenceSpec, implementation: str) -> str | None:
    """What the decode-phase variants' ``supports`` share: None, or why a decode variant of this
    implementation ("triton" | "torch") does not run ``spec``."""
    if spec.phase == "none":
        return "a decode-phase kernel: the spec has phase=none"
    try:
        decode_options(spec)
    except DecodeOptionsError as e:
        return str(e)
    impl = dict(spec.extra).get("decode_impl", "auto")
    if impl not in ("auto", implementation):
        return f"a {implementation} kernel; the policy asks for decode.implementation={impl!r}"
    return None
