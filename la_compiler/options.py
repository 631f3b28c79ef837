"""laqat's settings: the chunk kernels' numerics, the tuning of their launches, and the environment it reads.

* ``NumericsOptions`` change result bits: a policy sets them (``linear_attention`` rules, ``cfg.numerics``), so
  they travel with the model; the annotate pass writes a non-default value into the spec as ``n.<name>=<value>``
  and the chunk kernels take them through ``ChunkParams``, hence constexprs of the launched kernels.
* ``TuningOptions`` never change result bits: ``torch.compile(..., options={"tuning": {...}})`` sets them for
  the whole compile, written into the spec as ``t.<name>=<value>`` (the kernels read them from there, so a
  forward and its backward always agree). Unset, a field takes the launch table's choice
  (``kernels/chunk/launch.py``).
* ``ENVIRONMENT`` lists every ``LAQAT_*`` variable; the only one laqat itself reads is ``LAQAT_CACHE_DIR``, here.

Both option classes are frozen dataclasses validated in ``__post_init__``; a bad value is an ``OptionsError``
naming the key. docs/options.md is generated from the fields below (``la_compiler.options_doc``).
This module imports nothing of the project but ``la_compiler.suggest``, so the spec types and the kernels can
both depend on it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

from la_compiler.error_base import LaqatError
from la_compiler.suggest import did_you_mean


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
    measured (docs/kernels-chunk.md); every other value is a documented alternative of the same contract."""

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
    nan_fill: bool | None = option(None, (None, True, False), (
        "whether the kernels' scratch and output buffers are NaN-filled before the kernels write them (an element "
        "no kernel writes then shows up); unset: under Triton's interpreter only (a fill costs a full write)"))


DEFAULT_NUMERICS = NumericsOptions()
DEFAULT_TUNING = TuningOptions()


# ---- the environment -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EnvironmentVariable:
    name: str
    read_by: str  # who reads it
    doc: str


CACHE_DIR_ENV = "LAQAT_CACHE_DIR"
ENVIRONMENT = (
    EnvironmentVariable(CACHE_DIR_ENV, "la_compiler.options.cache_dir", (
        "where the autotuner's choices (`autotune/chunk.json`, with `t.autotune=true`) are kept; compiled kernels "
        "stay in Triton's own cache; default `$XDG_CACHE_HOME/laqat`, else `~/.cache/laqat`")),
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


def interpreter() -> bool:
    """Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
