"""Source of the fused recurrent kernels, specialized per spec (templates in ``recurrent/templates/``).

What the spec fixes (the decay form of the kind, the memory layout of the state) is decided here, at
generation time; what the inputs decide at run time (initial state present, varlen) stays a
``tl.constexpr`` flag of the kernels. The hooks ``ON_STATE_LOAD`` / ``ON_STATE_WRITE`` are where a
rounding of the state would go (empty: the family computes exact numerics).
"""
from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

from la_compiler.kernels.common import cache
from la_compiler.kernels.common.codegen import CodegenError, module_source, render
from la_compiler.kernels.common.codegen import template as _template
from la_compiler.spec import KINDS, STATE_LAYOUTS, RecurrenceSpec

TEMPLATES = "la_compiler.kernels.recurrent.templates"


def template(name: str) -> str:
    return _template(TEMPLATES, name)


@dataclasses.dataclass(frozen=True)
class FusedRecurrentParams:
    """What the fused recurrent kernels are specialized on."""

    kind: str  # "gdn": scalar decay per value head; "kda": per key channel
    state: str  # memory layout of h0 / ht / dht / dh0: "kv" = [K, V], "vk" = [V, K]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise CodegenError(f"fused_recurrent: kind must be one of {KINDS}, got {self.kind!r}")
        if self.state not in STATE_LAYOUTS:
            raise CodegenError(f"fused_recurrent: state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")

    @classmethod
    def from_spec(cls, spec: RecurrenceSpec | str) -> "FusedRecurrentParams":
        spec = spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
        if not spec.is_exact:
            raise CodegenError(
                f"fused_recurrent implements exact numerics only; {spec} has quant sites, "
                "accumulator emulation, a non-exact solve or a phase")
        return cls(kind=spec.kind, state=spec.state)


def _fused_recurrent_values(p: FusedRecurrentParams) -> dict[str, str]:
    per_channel = p.kind == "kda"
    if per_channel:
        load_decay = "b_g = tl.load(p_g + i_t * (HV * K), mask=m_k, other=0).to(tl.float32)"
        decay_state = "b_h *= tl.exp(b_g)[:, None]"
        decay_pointer = "g + (bos * HV + i_hv) * K + o_k"
        decay_gradient_pointer = "dg + (i_v * total_tokens * HV + bos * HV + i_hv) * K + o_k"
        decay_gradient = ("b_dg = tl.sum(b_dh * b_hd, 1)\n"
                          "tl.store(p_dg + i_t * (HV * K), b_dg, mask=m_k)\n"
                          "b_dh *= tl.exp(b_g)[:, None]")
    else:
        load_decay = "b_g = tl.load(p_g + i_t * HV).to(tl.float32)"
        decay_state = "b_h *= tl.exp(b_g)"
        decay_pointer = "g + bos * HV + i_hv"
        decay_gradient_pointer = "dg + i_v * total_tokens * HV + bos * HV + i_hv"
        decay_gradient = ("b_dg = tl.sum(tl.sum(b_dh * b_hd, 1), 0)\n"
                          "tl.store(p_dg + i_t * HV, b_dg)\n"
                          "b_dh *= tl.exp(b_g)")
    state_offsets = "o_k[:, None] * V + o_v[None, :]" if p.state == "kv" else "o_k[:, None] + o_v[None, :] * K"
    hooks = {"ON_STATE_LOAD": "", "ON_STATE_WRITE": ""}

    def step(after_decay: str) -> str:
        return render(template("fused_recurrent_step"),
                      {"DECAY_STATE": decay_state, "AFTER_DECAY": after_decay,
                       "ON_STATE_WRITE": hooks["ON_STATE_WRITE"]}, where="fused_recurrent_step")

    return {
        "PROGRAM_SETUP": render(template("fused_recurrent_program_setup"),
                                {"STATE_OFFSETS": state_offsets, "DECAY_POINTER": decay_pointer},
                                where="fused_recurrent_program_setup"),
        "LOAD_TOKEN": render(template("fused_recurrent_load_token"), {"LOAD_DECAY": load_decay},
                             where="fused_recurrent_load_token"),
        "STEP": step(""),
        "STEP_RECORDING_DECAYED_STATE": step("tl.store(p_s + (i_t - i_c * C) * (BK * BV), b_h)"),
        "DECAY_STATE": decay_state,
        "DECAY_GRADIENT_POINTER": decay_gradient_pointer,
        "DECAY_GRADIENT": decay_gradient,
        "ON_STATE_LOAD": hooks["ON_STATE_LOAD"],
    }


def fused_recurrent_source(p: FusedRecurrentParams) -> str:
    values = _fused_recurrent_values(p)
    fwd_keys = ("PROGRAM_SETUP", "LOAD_TOKEN", "STEP", "ON_STATE_LOAD")
    bwd_keys = ("PROGRAM_SETUP", "LOAD_TOKEN", "STEP", "STEP_RECORDING_DECAYED_STATE",
                "DECAY_GRADIENT_POINTER", "DECAY_GRADIENT", "ON_STATE_LOAD")
    fwd = render(template("fused_recurrent_fwd"), {k: values[k] for k in fwd_keys}, where="fused_recurrent_fwd")
    bwd = render(template("fused_recurrent_bwd"), {k: values[k] for k in bwd_keys}, where="fused_recurrent_bwd")
    params = dataclasses.asdict(p)
    return module_source(f"Fused recurrent {p.kind.upper()} kernels, state layout {p.state}, fp32 state.",
                         params, [fwd, bwd])


@functools.lru_cache(maxsize=None)  # generating and hashing the source: ~1 ms of host time per call
def fused_recurrent_module(p: FusedRecurrentParams) -> ModuleType:
    """The loaded module with ``fused_recurrent_fwd_kernel`` and ``fused_recurrent_bwd_kernel``."""
    return cache.load_source(f"fused_recurrent_{p.kind}_{p.state}", fused_recurrent_source(p),
                             {"family": "fused_recurrent", **dataclasses.asdict(p)})
