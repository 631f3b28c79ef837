"""laqat's settings: the chunk kernels' numerics, the tuning of their launches, the decode phase's numerics, and
the environment it reads.

* ``NumericsOptions`` change result bits: a policy sets them (``linear_attention`` rules, ``cfg.numerics``), so
  they travel with the model; the annotate pass writes a non-default value into the spec as ``n.<name>=<value>``
  and the chunk kernels take them through ``ChunkParams``, hence constexprs of the launched kernels.
* ``TuningOptions`` never change result bits: ``torch.compile(..., options={"tuning": {...}})`` sets them for
  the whole compile, written into the spec as ``t.<name>=<value>`` (the kernels read them from there, so a
  forward and its backward always agree). Unset, a field takes the launch table's choice
  (``kernels/chunk/launch.py``).
* ``DecodeOptions`` are the numerics of a decode phase (``phase=token|replay``): the policy builds them from a
  rule's ``decode`` and ``serving`` keys and the state quantizer and writes them into the spec (``phase``,
  ``q.state``, ``x.<key>=<value>``); the decode kernels and the fp64 reference read them with ``decode_options``.
* ``HAND_OFFS``: the values of ``options={"compiler": ...}`` (what runs a rewritten graph) and the default's choice
  by device (``la_compiler.hand_off.compiler_choice``).
* ``ENVIRONMENT`` lists every ``LAQAT_*`` variable; the only one laqat itself reads is ``LAQAT_CACHE_DIR``, here.

The option classes are frozen dataclasses validated in ``__post_init__``; a bad value is an ``OptionsError``
naming the key. docs/options.md is generated from the fields below (``la_compiler.options_doc``).
This module imports nothing of the project but ``la_compiler.suggest`` and the quantizer formats
(``la_compiler.quant.config``), so the spec types and the kernels can both depend on it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from la_compiler.error_base import LaqatError
from la_compiler.quant.config import QuantConfig, QuantConfigError
from la_compiler.suggest import did_you_mean

if TYPE_CHECKING:
    from la_compiler.ir.spec import RecurrenceSpec


class OptionsError(LaqatError, ValueError):
    """A numerics or tuning option, or its spec field, with a key or value laqat does not accept."""


def option(default, choices: tuple, doc: str):
    """A field of an options class: its default, every value it accepts, what it does (docs/options.md)."""
    return dataclasses.field(default=default, metadata={"choices": choices, "doc": doc})


def spelling(value) -> str:
    """A value as a spec field writes it: ``true`` / ``false`` for booleans, else ``str(value)``."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _same(a, b) -> bool:
    """Equal and of the same type (True is no 1, 16.0 no 16)."""
    return type(a) is type(b) and a == b


class _Options:
    """Validation, the spec encoding and the dict form that both option classes share."""

    SPEC_PREFIX = ""  # "n." / "t.": the spec fields' prefix

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if not any(_same(value, c) for c in choices):
                raise OptionsError(f"{f.name}: must be one of {list(choices)}, got {value!r}"
                                   f"{did_you_mean(value, choices)}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None, *, key: str = ""):
        """From a user's mapping (Python values); ``key`` prefixes the error message (``options['tuning'].``)."""
        if values is None:
            return cls()
        if isinstance(values, cls):
            return values
        if not isinstance(values, Mapping):
            raise OptionsError(f"{key.rstrip('.') or cls.__name__}: must be a mapping with keys from "
                               f"{list(cls.keys())}, got {type(values).__name__} {values!r}")
        unknown = sorted(str(k) for k in values if k not in cls.keys())
        if unknown:
            raise OptionsError(f"{key}{unknown[0]}: unknown key; allowed: {list(cls.keys())}"
                               f"{did_you_mean(unknown[0], cls.keys())}")
        try:
            return cls(**values)
        except OptionsError as e:
            raise OptionsError(f"{key}{e}") from None

    def to_dict(self) -> dict:
        """Every field (``from_dict`` reads it back equal)."""
        return dataclasses.asdict(self)

    def spec_items(self) -> tuple[tuple[str, str], ...]:
        """The fields that differ from their defaults, as the spec writes them: sorted (name, spelling) pairs."""
        return tuple(sorted((f.name, spelling(getattr(self, f.name))) for f in dataclasses.fields(self)
                            if not _same(getattr(self, f.name), f.default)))

    @classmethod
    def from_spec_items(cls, items) -> "_Options":
        """From a spec's (name, text) pairs; an unknown name or a text no value spells is an error naming it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for name, text in items:
            if name not in fields:
                raise OptionsError(f"{cls.SPEC_PREFIX}{name}: unknown {cls.__name__} field; known: {list(fields)}")
            spelled = {spelling(c): c for c in fields[name].metadata["choices"] if c is not None}
            if text not in spelled:
                raise OptionsError(f"{cls.SPEC_PREFIX}{name}: must be one of {list(spelled)}, got {text!r}")
            values[name] = spelled[text]
        return cls(**values)


KEY_BLOCKS = (None, 16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class NumericsOptions(_Options):
    """How the chunk kernels multiply, where that changes result bits. The defaults are laqat's numerics as
    measured (docs/kernels-chunk-measurements.md); every other value is a documented alternative of the same contract."""

    SPEC_PREFIX = "n."

    gemm: str = option("input", ("input", "tf32"), (
        "GEMMs over values and states (W and U from T, W h, K^T V_new, Q h, A_qk V_new and their gradients) for "
        "bf16 / fp16 inputs: `input` multiplies operands in the input dtype with fp32 accumulation and keeps W, U, h, "
        "V_new, dh, dV_new in it (FLA's numerics), except where the spec rounds a GEMM operand or emulates an "
        "accumulator (those keep fp32 operands); `tf32`: fp32 operands and intermediates, TF32 dots. No effect on "
        "fp32 inputs"))
    fp32_dot: str = option("ieee", ("ieee", "tf32x3"), (
        "dot precision of the chunk kernels for fp32 inputs: `ieee` (the exact-numerics contract, <= 1e-5 against "
        "fp64) or `tf32x3` (three TF32 passes on tensor cores; on the H200 within 4.9e-7 at K = 64, refused for "
        "shared memory at K = 128). No effect on 16-bit inputs (TF32)"))
    key_block: int | None = option(None, KEY_BLOCKS, (
        "key columns per step of the forward intra stage; unset: whole rows up to 64 columns, blocks of 32 above. "
        "The pair products are summed over the blocks, so the block decides the order of those fp32 sums. Whole "
        "rows regardless where GDN's rounded pair product or an NVFP4 wy_key.rhs needs them"))
    bwd_key_block: int | None = option(None, KEY_BLOCKS, (
        "key columns per step of the key-blocked backward (KDA's intra and pairs stages, GDN's intra stage); unset: "
        "whole rows up to 64 columns, above that 64 (KDA) or 128 (GDN) with 16-bit GEMMs and 32 with fp32 ones"))


KEEP_RESIDUAL = ("intra", "all", "none")


@dataclasses.dataclass(frozen=True)
class TuningOptions(_Options):
    """How the chunk kernels are launched and what they keep between forward and backward. Pipelining reorders
    no arithmetic, and the three residual modes compute the same bits (tests/kernels/test_chunk_residual.py);
    ``autotune`` says where a tuned warp count can differ."""

    SPEC_PREFIX = "t."

    keep_residual: str = option("intra", KEEP_RESIDUAL, (
        "what a training forward keeps for its backward: `intra` T, A_qk and G (GDN) or P (KDA), so the backward "
        "recomputes only W, U and h; `all` also W, U, h, V_new (KDA: G, kd), so it runs no forward kernel (more "
        "memory); `none` nothing, so it recomputes the whole forward but its output stage"))
    serial_stages: int | None = option(None, (None, 1, 2, 3, 4), (
        "pipeline depth of the serial h / dh loops; unset: the launch table's (1 at K >= 128, else 3). A launch "
        "that Triton refuses for shared memory is retried with fewer stages"))
    autotune: bool = option(False, (False, True), (
        "on CUDA, the first launch of each chunk kernel (per module, constants, grid, GPU, Triton) times up to six "
        "warps / stages configurations around the launch table's and keeps the fastest, cached in "
        "`<cache dir>/autotune/chunk.json`. Warps decide how Triton splits a reduction (tl.sum) over threads: a "
        "tuned launch can differ from the table's in the last bits of such sums, so bit-reproducible runs leave it "
        "off"))
    compile_ahead: bool = option(True, (True, False), (
        "on CUDA, the first training forward of each kind (spec, dtype, head shapes) compiles every Triton kernel of "
        "its forward at once, in parallel threads, before it launches any, and its backward's in a background "
        "thread while the step goes on (kernels/chunk/compile_ahead.py); `false`: each kernel compiles at its first "
        "launch, one after another. Compiles only: what runs is the same"))
    nan_fill: bool | None = option(None, (None, True, False), (
        "whether the kernels' scratch and output buffers are NaN-filled before the kernels write them (an element "
        "no kernel writes then shows up); unset: under Triton's interpreter only (a fill costs a full write)"))


DEFAULT_NUMERICS = NumericsOptions()
DEFAULT_TUNING = TuningOptions()


# ---- the hand-off: what runs a rewritten graph (``options={"compiler": ...}``; la_compiler/hand_off/compiler_choice.py) ----------

LINEAR_OUTPUT_MIN_RATIO = 4  # Inductor hand-off: a linear graph output this many times its input leaves on its own

HAND_OFFS = {
    "inductor": "Inductor compiles the graph around laqat's ops: AOTAutograd traces the forward and the backward, "
                "its partitioner decides what the backward keeps; Triton kernels on a GPU, C++ on the CPU. A graph "
                f"output that a linear layer computes from a graph input weight and that is at least "
                f"{LINEAR_OUTPUT_MIN_RATIO}x its input "
                "(a model's logits) leaves the compiled graph through its own autograd node, so that autograd "
                "allocates no zero gradient of its size where the loss does not use it "
                "(la_compiler/hand_off/linear_outputs.py, docs/memory.md)",
    "eager": "the rewritten graph runs op by op under autograd, laqat's ops included: each op saves what its "
             "autograd saves; nothing is compiled beyond Dynamo's capture and laqat's passes",
}
LOSS_TAIL = ("Under both, FLA's fused cross-entropy with `inplace_backward=True` (its causal LMs' loss) on logits "
             f"that a linear layer computes from a graph input weight, at least {LINEAR_OUTPUT_MIN_RATIO}x its "
             "input, that nothing else in the graph reads, runs after the graph, outside it: its backward writes "
             "the logits' gradient into the logits, as FLA's does, where a compiled graph would allocate another "
             "tensor of their size (la_compiler/hand_off/loss_tails.py, docs/memory.md)")
LAYERS_PER_PIECE = 4  # options["regional"] True: the layers of one piece
REGIONAL = ("Under Inductor, `options={\"regional\": True}` (the default) splits a graph whose nodes fall in two or "
            f"more runs of `LAYERS_PER_PIECE` ({LAYERS_PER_PIECE}) consecutive layers of a module list (Dynamo's "
            "module paths `model.layers.0`, `layers[3]`; layers 0-3 are a run, 4-7 the next) at the runs' bounds "
            "and compiles each distinct piece once: runs with the same code and the same input shapes, strides and "
            "dtypes run one compiled forward and backward, each with its own parameters (la_compiler/hand_off/"
            "regions.py). An int "
            "`n` makes runs of `n` layers (`1`: a piece per layer). Each piece's call costs the step the Python of an "
            "AOTAutograd graph, forward and backward: a piece per layer made the step measurably slower than one "
            "graph, runs of four did not, at less than half its graph compile time (measured: docs/model-bench.md, "
            "\"Repeated layers compile once\"). The partitioner then decides what each "
            "piece keeps for its backward, and Inductor fuses within a piece, not across two. A graph with fewer than "
            "two runs (a 4-layer LM, by default), symbolic shapes, a higher-order op (activation checkpointing's, "
            "say) or a node that changes autocast or grad mode compiles whole, as it does under Dynamo's "
            "DDPOptimizer (which splits by gradient bucket) and with `False`. The graph's record "
            "(`la_compiler.backend.last_record().graphs[i].regions`) says how it was split (`6 pieces (4 runs of 4 "
            "layers), 3 compiled`) or why it compiled whole")
DEVICE_HAND_OFF = "inductor"  # unset, where a tensor of the graph is on an accelerator (CUDA, XPU, ...)
CPU_HAND_OFF = "eager"  # unset, where every tensor of the graph is on the CPU


# ---- the decode phase ------------------------------------------------------------------------

DECODE_MODES = ("token", "replay")
READOUTS = ("working", "stored")
REPLAY_WINDOW = (1, 64)  # tokens between replay's anchor refreshes: the fewest and the most
TILE_CODECS = ("fp8_e4m3", "int8", "int8_h32")  # decode state codecs with one scale per [K x BV] tile
BLOCK_CODECS = ("fp8_e4m3", "int8")  # decode state codecs with one scale per key row and N values (block<N>)
SERVING_PROFILES = ("vllm-0.33",)  # <engine>-<release>: the servers whose decode laqat reproduces
SERVING_STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # vLLM's --mamba-ssm-cache-dtype
SERVING_RELEASES = {"vllm-0.33": "0.33.0"}  # the release each profile reproduces (the parity tests' wheel)
# The prefill kernels a server can run: laqat reproduces the first (vLLM's Triton copy of FLA); the others are
# compiled CUDA kernels, refused by the policy (docs/serving.md).
SERVING_PREFILL_BACKENDS = ("triton", "flashinfer", "flashkda")
# Which kernels compute a serving profile's forward: the server's own (its package importable), laqat's
# reproduction, or auto (the server's where they are importable at the profile's release, else laqat's).
SERVING_FORWARDS = ("auto", "server", "laqat")
# The server's settings whose numerics each profile reproduces, per recurrence kind (besides the cache dtype,
# --mamba-ssm-cache-dtype, which the profile's state_dtype names).
SERVING_PINS = {
    ("vllm-0.33", "gdn"): (
        "--gdn-prefill-backend triton (vLLM's default on Hopper is flashinfer)",
        "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=1 (the default: the packed Triton decode)",
        "VLLM_TRITON_FORCE_FIRST_CONFIG=1 (autotuned kernels run their first config)",
        "no speculative decoding"),
    ("vllm-0.33", "kda"): (
        "--kda-prefill-backend triton (Kimi-K3's default on NVIDIA is flashkda)",
        "--kda-decode-backend triton",
        "no gate_lower_bound",
        "VLLM_TRITON_FORCE_FIRST_CONFIG=1 (autotuned kernels run their first config)",
        "no speculative decoding"),
}


def serving_summary(profile: str, kind: str, state_dtype: str, forward: str) -> str:
    """What a serving profile reproduces, in words (``la_compiler.explain``'s policy lines): the server's release,
    its kernels, the settings that change its numerics, and which kernels run the forward."""
    engine = profile.partition("-")[0]
    release = SERVING_RELEASES[profile]
    cache = {"auto": "auto (GDN: the model's dtype; KDA: float32)"}.get(state_dtype, state_dtype)
    kernels = ("prefill: Triton chunk_gated_delta_rule, decode: Triton fused_recurrent packed decode" if kind == "gdn"
               else "prefill: Triton chunk_kda_with_fused_gate, decode: Triton fused_recurrent_kda packed decode")
    return (f"{engine} {release} {kind.upper()} ({kernels}); --mamba-ssm-cache-dtype {cache}; "
            f"{'; '.join(SERVING_PINS[profile, kind])}; forward: {forward}")


class DecodeOptionsError(OptionsError):
    """A decode option laqat does not accept. ``field`` is the ``DecodeOptions`` field (None: the spec as a whole)
    and ``reason`` the message without its key, so that a policy can name its own key instead of the spec's."""

    def __init__(self, reason: str, field: str | None = None, *, where: str = ""):
        self.reason, self.field = reason, field
        text = f"{DecodeOptions.spec_key(field)}: {reason}" if field else reason
        super().__init__(f"{where}: {text}" if where else text)


def decode_option(default, *, spec: str, policy: str, doc: str, choices: tuple | None = None, values: str = ""):
    """A field of ``DecodeOptions``: its default, the spec key and the policy key that carry it, what it accepts
    (``choices``, else ``values`` in words, checked in ``__post_init__``) and what it does (docs/options.md)."""
    return dataclasses.field(default=default, metadata={"spec": spec, "policy": policy, "choices": choices,
                                                        "values": values, "doc": doc})


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How a spec with ``phase=token|replay`` rounds its decode suffix (docs/decode_phase.md). ``Policy.resolve``
    builds them from a ``linear_attention`` rule's ``decode`` and ``serving`` keys and the state quantizer, and
    writes them into the spec (``phase``, ``q.state``, ``spec_extra()``); the decode kernels and the fp64 reference
    read them back with ``decode_options(spec)``. Every value and combination is checked here (the policy file's
    checks read their values from the constants above); a bad one is a ``DecodeOptionsError`` naming the spec key."""

    mode: str = decode_option("token", spec="phase", policy="decode.mode", choices=DECODE_MODES, doc=(
        "`token`: the state rounded at every decode write; `replay`: rounded at every `window`-th write (the "
        "anchor), the writes between it kept unrounded (but for `factor_qdq`)"))
    state_codec: QuantConfig | None = decode_option(None, spec="q.state", policy="quant_cfg", values=(
        "unset, `fp8_e4m3` / `int8` / `int8_h32` with `tile<BV>`, `fp8_e4m3` / `int8` with `block<N>`"), doc=(
        "the stored state's format: the state quantizer's (the rule for `*_state_quantizer`; INT8 as ReplaySSM's "
        "Hadamard-32 with `decode.state_codec: hadamard32`), identity gradient; unset: the decode state is not "
        "rounded"))
    readout: str = decode_option("working", spec="x.readout", policy="decode.readout", choices=READOUTS, doc=(
        "each decode output read from the state before the write's rounding (`working`) or after it (`stored`)"))
    decay_log_step: float | None = decode_option(None, spec="x.decay_log_step", policy="decode.decay_log_step",
                                                 values="unset, a positive finite number", doc=(
        "the suffix's log-decays rounded to `round(g/d)*d` (identity gradient)"))
    window: int = decode_option(1, spec="x.replay_window", policy="decode.replay.window",
                                values=f"`{REPLAY_WINDOW[0]}`..`{REPLAY_WINDOW[1]}`", doc=(
        "replay: the anchor is refreshed every `window` suffix tokens (token mode: 1)"))
    factor_qdq: bool = decode_option(False, spec="x.replay_factor_qdq", policy="decode.replay.factor_qdq",
                                     choices=(False, True), doc=(
        "replay: the rank-one factors k_t, u_t rounded once, when written, in the state codec's scalar format "
        "(`fp8_e4m3`, or `int8` for `int8` / `int8_h32`); the spec spells it `0` / `1`"))
    serving: str | None = decode_option(None, spec="x.serving", policy="serving", choices=(None,) + SERVING_PROFILES,
                                        doc=(
        "`<engine>-<release>` of the policy's `serving.engine` and `serving.version` (or `precision: vllm`): the "
        "decode steps in that server's order of operations (its sums over K), token mode, working readout "
        "(docs/serving.md)"))
    state_dtype: str = decode_option("float32", spec="x.state_dtype", policy="serving.state_dtype",
                                     choices=SERVING_STATE_DTYPES, doc=(
        "with `serving` only (the policy's default there: `auto`): the server's state-cache dtype, the state "
        "rounded to it (nearest even) on load, at the handoff and at every decode write, after the codec; `auto` is "
        "vLLM's rule (GDN: the dtype of v; KDA: float32); `float32` rounds nothing"))
    forward: str = decode_option("laqat", spec="x.forward", policy="serving.forward", choices=("laqat", "server"),
                                 doc=(
        "with `serving` only: which kernels compute the forward, `laqat`'s reproduction or the `server`'s own "
        "(vLLM's Triton kernels, imported from its package; no state codec); the backward is laqat's either way. "
        "The policy's `auto` (its default) resolves to one of them; the spec writes `x.forward` only for `server`"))

    def __post_init__(self):
        if isinstance(self.state_codec, str):
            try:
                object.__setattr__(self, "state_codec", QuantConfig.parse(self.state_codec))
            except QuantConfigError as e:
                raise DecodeOptionsError(str(e), "state_codec") from None
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices is not None and not any(_same(value, c) for c in choices):
                raise DecodeOptionsError(f"must be one of {list(choices)}, got {value!r}"
                                         f"{did_you_mean(value, choices)}", f.name)
        self._check_codec()
        step = self.decay_log_step
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not (math.isfinite(step) and step > 0):
                raise DecodeOptionsError(f"must be a positive finite number, got {step!r}", "decay_log_step")
            object.__setattr__(self, "decay_log_step", float(step))
        lo, hi = REPLAY_WINDOW
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not lo <= self.window <= hi:
            raise DecodeOptionsError(f"must be in {lo}..{hi}, got {self.window!r}", "window")
        if self.mode == "token" and (self.window != 1 or self.factor_qdq):
            raise DecodeOptionsError("only for phase=replay", "window" if self.window != 1 else "factor_qdq")
        if self.factor_qdq and self.state_codec is None:
            raise DecodeOptionsError("rounds the replay factors in the state codec's format, but there is no "
                                     "state codec", "factor_qdq")
        if self.serving is None and self.state_dtype != "float32":
            raise DecodeOptionsError("the serving cache's dtype, only with x.serving", "state_dtype")
        if self.forward == "server" and self.serving is None:
            raise DecodeOptionsError("the server's own forward kernels, only with x.serving", "forward")
        if self.forward == "server" and self.state_codec is not None:
            raise DecodeOptionsError(f"the server's kernels round the state to its cache dtype only; a state codec "
                                     f"({self.state_codec.to_string()}) needs laqat's forward", "forward")
        unserved = unserved_decode(self.mode, self.readout, self.decay_log_step, self.codec)
        if self.serving is not None and unserved:
            raise DecodeOptionsError(f"{self.serving} decodes as that server does: it needs "
                                     f"{', '.join(UNSERVED[u] for u in unserved)}", unserved[0])

    def _check_codec(self):
        cfg = self.state_codec
        if cfg is None:
            return
        if not isinstance(cfg, QuantConfig):
            raise DecodeOptionsError(f"must be a QuantConfig, its string or None, got {cfg!r}", "state_codec")
        tile = cfg.format in TILE_CODECS and cfg.group == "tile"
        block = cfg.format in BLOCK_CODECS and cfg.group == "block"
        if not (tile or block) or cfg.ste != "identity":
            raise DecodeOptionsError(f"the decode state codec must be one of {[f + '/tile<BV>' for f in TILE_CODECS]}"
                                     f" or {[f + '/block<N>' for f in BLOCK_CODECS]}, got {cfg.to_string()!r}",
                                     "state_codec")

    @classmethod
    def spec_key(cls, field: str) -> str:
        return cls.__dataclass_fields__[field].metadata["spec"]

    @classmethod
    def policy_key(cls, field: str) -> str:
        return cls.__dataclass_fields__[field].metadata["policy"]

    # ---- what the decode kernels read ---------------------------------------------------------
    @property
    def codec(self) -> str | None:
        """The state codec's format (``fp8_e4m3``, ``int8``, ``int8_h32``), None where the state is not rounded."""
        return None if self.state_codec is None else self.state_codec.format

    @property
    def block_v(self) -> int:
        """Value columns per codec scale group: the tile's BV, or a block's N."""
        cfg = self.state_codec
        return 64 if cfg is None else cfg.block_v if cfg.group == "tile" else cfg.block_size

    @property
    def codec_block(self) -> int:
        """0: one codec scale per [K x BV] tile; N: one per key row and N values along V (BV = N)."""
        cfg = self.state_codec
        return cfg.block_size if cfg is not None and cfg.group == "block" else 0

    @property
    def factor_format(self) -> str:
        """The replay factors' format: ``none``, or the codec's scalar format."""
        if not self.factor_qdq:
            return "none"
        return "fp8_e4m3" if self.codec == "fp8_e4m3" else "int8"

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

    # ---- the spec encoding --------------------------------------------------------------------
    def spec_extra(self) -> tuple[tuple[str, str], ...]:
        """The spec's ``x.<key>`` items: the readout always, the serving profile's two, the decay step if set, and
        replay's two in replay mode (``phase`` and ``q.state`` carry ``mode`` and ``state_codec``)."""
        extra = {"readout": self.readout}
        if self.serving is not None:
            extra.update(serving=self.serving, state_dtype=self.state_dtype)
        if self.forward == "server":
            extra["forward"] = "server"
        if self.decay_log_step is not None:
            extra["decay_log_step"] = repr(self.decay_log_step)
        if self.mode == "replay":
            extra.update(replay_window=str(self.window), replay_factor_qdq="1" if self.factor_qdq else "0")
        return tuple(sorted(extra.items()))


UNSERVED = {"mode": "phase=token", "readout": "x.readout=working", "decay_log_step": "no x.decay_log_step",
            "state_codec": "a state codec other than int8_h32 (Hadamard-32 is ReplaySSM's codec)"}


def unserved_decode(mode: str, readout: str, decay_log_step: float | None, codec: str | None) -> tuple[str, ...]:
    """The fields (in ``UNSERVED``'s order) whose values a serving profile does not decode: a server decodes one
    token per step from its fp32 working state, rounds no log-decay, and stores the state in the state
    quantizer's own format."""
    served = {"mode": mode == "token", "readout": readout == "working", "decay_log_step": decay_log_step is None,
              "state_codec": codec != "int8_h32"}
    return tuple(field for field, ok in served.items() if not ok)


@functools.lru_cache(maxsize=1024)  # read once per spec, not at every launch
def decode_options(spec: RecurrenceSpec) -> DecodeOptions:
    """The decode options a spec carries (``phase``, ``q.state``, ``x.<key>``); a spec of another phase, an ``x.``
    key that is no decode option, or a numerics field the decode phase does not round is a ``DecodeOptionsError``."""
    if spec.phase not in DECODE_MODES:
        raise DecodeOptionsError(f"spec {spec} has phase={spec.phase}; decode kernels need phase=token or replay")
    keys = {f.metadata["spec"][2:]: f.name for f in dataclasses.fields(DecodeOptions)
            if f.metadata["spec"].startswith("x.")}
    extra = dict(spec.extra)
    unknown = sorted(set(extra) - set(keys))
    if unknown:
        raise DecodeOptionsError(f"spec {spec}: unknown decode option(s) {['x.' + k for k in unknown]}; "
                                 f"known: {['x.' + k for k in keys]}")
    others = [f"q.{s}" for s, _ in spec.quant if s != "state"] + [f"acc.{s}" for s, _ in spec.acc] + (
        [f"solve={spec.solve}"] if spec.solve != "exact" else [])
    if others:
        raise DecodeOptionsError(f"spec {spec}: decode-phase kernels round the state only; the prefix runs the "
                                 f"exact recurrence, so {others} cannot be applied (not implemented)")
    values = {keys[k]: text for k, text in extra.items()}
    try:
        if "decay_log_step" in values:
            values["decay_log_step"] = float(values["decay_log_step"])
        if "window" in values:
            values["window"] = int(values["window"])
    except ValueError as e:
        raise DecodeOptionsError(f"spec {spec}: x.decay_log_step / x.replay_window not a number: {e}") from None
    if "factor_qdq" in values:
        spelled = {"0": False, "1": True}
        if values["factor_qdq"] not in spelled:
            raise DecodeOptionsError(f"must be 0 or 1, got {values['factor_qdq']!r}", "factor_qdq",
                                     where=f"spec {spec}")
        values["factor_qdq"] = spelled[values["factor_qdq"]]
    try:
        return DecodeOptions(mode=spec.phase, state_codec=spec.quant_map.get("state"), **values)
    except DecodeOptionsError as e:
        raise DecodeOptionsError(e.reason, e.field, where=f"spec {spec}") from None


# ---- the environment -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EnvironmentVariable:
    name: str
    read_by: str  # who reads it
    doc: str


CACHE_DIR_ENV = "LAQAT_CACHE_DIR"
FLA_SEARCHES_ENV = "LAQAT_FLA_SEARCHES"
FLA_SEARCHES = ("narrowed", "full")
FLA_COMPILE_AHEAD_ENV = "LAQAT_FLA_COMPILE_AHEAD"
FLA_COMPILE_AHEAD = ("on", "off")
FLA_BLOCK_REGIONS_ENV = "LAQAT_FLA_BLOCK_REGIONS"
FLA_BLOCK_REGIONS = ("on", "off")
PROCESS_KEYS_AHEAD_ENV = "LAQAT_PROCESS_KEYS_AHEAD"
PROCESS_KEYS_AHEAD = ("on", "off")
ENVIRONMENT = (
    EnvironmentVariable(CACHE_DIR_ENV, "la_compiler.options.cache_dir", (
        "where the autotuner's choices (`autotune/chunk.json`, with `t.autotune=true`) are kept; compiled kernels "
        "stay in Triton's own cache; default `$XDG_CACHE_HOME/laqat`, else `~/.cache/laqat`")),
    EnvironmentVariable(FLA_SEARCHES_ENV, "la_compiler.options.fla_searches", (
        "the autotuning searches of FLA's kernels that laqat's ops launch (SwiGLU, short convolution, l2, gated "
        "and plain norms; kernels/fla/autotune_searches.py): `narrowed` (default) times the few candidates that "
        "win on the H200, `full` every candidate FLA lists; either way the candidates compile in parallel threads "
        "first")),
    EnvironmentVariable(FLA_COMPILE_AHEAD_ENV, "la_compiler.options.fla_compile_ahead", (
        "`on` (default): at the first CUDA forward of each kind, laqat's FLA ops compile the kernels their "
        "backward will launch, every candidate its searches will time, in a background thread "
        "(kernels/fla/backward_ahead.py); `off`: each compiles at its first launch in the backward")),
    EnvironmentVariable(FLA_BLOCK_REGIONS_ENV, "la_compiler.options.fla_block_regions", (
        "`on` (default): where Dynamo reuses a nested compile region's trace (torch 2.13), it traces one FLA block "
        "(GDN, KDA) of a training call and stamps it out for the others, which laqat inlines back "
        "(passes/frontends/fla/block_regions.py); `off`: Dynamo traces every block; read when Dynamo traces a "
        "block")),
    EnvironmentVariable(PROCESS_KEYS_AHEAD_ENV, "la_compiler.options.process_keys_ahead", (
        "`on` (default): from the import of laqat's backend, a daemon thread computes the hashes of torch's and "
        "Triton's sources and binary that Inductor's and Triton's caches compute once per process "
        "(la_compiler/hand_off/process_keys_ahead.py); `off`: the first compile computes them; read at that "
        "import")),
    EnvironmentVariable("TRITON_INTERPRET", "Triton; la_compiler.options.interpreter", (
        "`1`: Triton kernels run in its CPU interpreter (set by `make demo`, `make test` and the tests' conftest); "
        "laqat then takes the interpreter's stand-ins (16-bit GEMM operands rounded and multiplied in fp32, "
        "arithmetic E4M3 rounding) and NaN-fills buffers")),
    EnvironmentVariable("LAQAT_DISTRIBUTED_HAND_OFF", "tests/distributed", (
        "tests only: `eager` (default) or `inductor`, what runs the rewritten graphs of the DDP and FSDP2 tests "
        "(docs/distributed.md)")),
    EnvironmentVariable("LAQAT_MODELS_RESULTS", "tests/models", (
        "tests only: a directory where the model conformance tests write each model's JSON line with its CPU and "
        "wall seconds (docs/models.md)")),
    EnvironmentVariable("LAQAT_TEST_CACHE", "tests/serving", (
        "tests only: where the serving tests keep the vLLM wheel they fetch and the kernel files taken from it; "
        "default `~/.cache/laqat-test`")),
    EnvironmentVariable("LAQAT_COMMIT", "examples/benchmarks/gpu_chores.sh, examples/qat/study.py", (
        "benchmark scripts: the commit a results record names, where the tree is no git checkout")),
    EnvironmentVariable("LAQAT_GPU_CACHE", "examples/benchmarks/gpu_chores.sh", (
        "benchmark scripts: where the GPU machine's compile caches live (Triton's, laqat's, Inductor's; packed and "
        "restored at that path)")),
    EnvironmentVariable("LAQAT_GPU_SCRATCH", "examples/benchmarks/gpu_chores.sh", (
        "benchmark scripts: the GPU machine's scratch directory")),
)


def cache_dir() -> Path:
    """The root of laqat's on-disk caches: ``LAQAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/laqat`` or ``~/.cache/laqat``.
    Read at each call (a launcher may set it after laqat is imported)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "laqat"


def _choice(env: str, choices: tuple[str, ...]) -> str:
    """The value of the environment variable ``env``, one of ``choices`` (the first when unset or empty)."""
    value = os.environ.get(env) or choices[0]
    if value not in choices:
        raise OptionsError(f"{env}: must be one of {list(choices)}, got {value!r}")
    return value


def fla_searches() -> str:
    """``LAQAT_FLA_SEARCHES``: `narrowed` (default) or `full`; read at each call."""
    return _choice(FLA_SEARCHES_ENV, FLA_SEARCHES)


def fla_compile_ahead() -> bool:
    """``LAQAT_FLA_COMPILE_AHEAD``: `on` (default) or `off`; read at each call."""
    return _choice(FLA_COMPILE_AHEAD_ENV, FLA_COMPILE_AHEAD) == "on"


def fla_block_regions() -> bool:
    """``LAQAT_FLA_BLOCK_REGIONS``: `on` (default) or `off`; read at each call."""
    return _choice(FLA_BLOCK_REGIONS_ENV, FLA_BLOCK_REGIONS) == "on"


def process_keys_ahead() -> bool:
    """``LAQAT_PROCESS_KEYS_AHEAD``: `on` (default) or `off`; read at the import of laqat's backend."""
    return _choice(PROCESS_KEYS_AHEAD_ENV, PROCESS_KEYS_AHEAD) == "on"


def interpreter() -> bool:
    """Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
