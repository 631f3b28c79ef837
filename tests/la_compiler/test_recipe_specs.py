"""Every shipped recipe resolves to the spec it always has (the policy fields of the spec string, per kind), and a
decode recipe's spec to the decode options and kernel constants it always has: the policy file format and the spec
encoding are what trained models and their recorded runs name."""
from __future__ import annotations

import pytest
import torch

from la_compiler.ir.spec import GEMM_SITES, RecurrenceSpec
from la_compiler.kernels.decode.suffix import DecodeParams
from la_compiler.options import decode_options
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import load_recipe
from la_compiler.recipes import recipe_names

MODULE = "model.layers.0.attn"


def _operands(fmt: str) -> str:
    """Every GEMM operand site and W in ``fmt`` (W stands for state_read's lhs)."""
    sites = sorted([f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if f"{s}.{side}" != "state_read.lhs"]
                   + ["w"])
    return "; ".join(f"q.{site}={fmt}" for site in sites)


# recipe -> the spec's phase and its fields after kernel=auto, for either kind
RECIPE_SPECS = {
    "decode_token_state_fp8": ("token", "q.state=fp8_e4m3/tile64; x.readout=working"),
    "exact": ("none", ""),
    "prefill_operands_fp8": ("none", _operands("fp8_e4m3/row")),
    "prefill_operands_nvfp4": ("none", _operands("nvfp4/block16")),
    "state_fp8": ("none", "q.state=fp8_e4m3/tile64"),
    "state_int8_block32": ("none", "q.state=int8/block32"),
    "state_int8_hadamard32": ("none", "q.state=int8_h32/tile64"),
    "vllm_gdn_state_bf16": ("token", "x.readout=working; x.serving=vllm-0.33; x.state_dtype=bfloat16"),
    "vllm_kda_state_bf16": ("token", "x.readout=working; x.serving=vllm-0.33; x.state_dtype=bfloat16"),
    "w_fp8": ("none", "q.w=fp8_e4m3/row"),
}
REFUSED = {("vllm_kda_state_bf16", "gdn"): "linear_attention[0].cfg.serving.model: 'kimi_k3' is vLLM's KDA profile"}

# decode recipe -> (decode options, the decode kernels' constants for bf16 inputs) per kind
DECODE = {
    "decode_token_state_fp8": (("token", "fp8_e4m3", 64, 0, "working", None, 1, "none", None, "float32"),
                               {"CACHE": 0, "CODEC": 1, "VFIRST": False}),
    "vllm_gdn_state_bf16": (("token", None, 64, 0, "working", None, 1, "none", "vllm-0.33", "bfloat16"),
                            {"CACHE": 1, "CODEC": 0, "VFIRST": True}),
    "vllm_kda_state_bf16": (("token", None, 64, 0, "working", None, 1, "none", "vllm-0.33", "bfloat16"),
                            {"CACHE": 1, "CODEC": 0, "VFIRST": True}),
}
SAME_FOR_EVERY_DECODE_RECIPE = {"CODEC_BLOCK": 0, "FACTOR": 0, "READ_STORED": False, "REPLAY": False,
                                "STATE_VK": False}


def _spec(name: str, kind: str) -> RecurrenceSpec:
    res = load_recipe(name).resolve(MODULE, kind)
    return RecurrenceSpec(kind).replace(quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                                        chunk=res.chunk, phase=res.phase, extra=res.extra, numerics=res.numerics)


def test_the_table_covers_the_shipped_recipes():
    assert sorted(RECIPE_SPECS) == sorted(recipe_names())


@pytest.mark.parametrize("name", sorted(RECIPE_SPECS))
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_recipe_resolves_to_its_spec(name, kind):
    if (name, kind) in REFUSED:
        with pytest.raises(PolicyError) as e:
            _spec(name, kind)
        assert str(e.value).startswith(REFUSED[name, kind])
        return
    phase, fields = RECIPE_SPECS[name]
    spec = _spec(name, kind)
    assert spec.to_string() == (f"{kind}[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase={phase}; "
                                f"kernel=auto{'; ' if fields else ''}{fields}]")
    assert RecurrenceSpec.parse(spec.to_string()) == spec


@pytest.mark.parametrize("name", sorted(DECODE))
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_decode_recipe_reads_back_to_its_options_and_kernel_constants(name, kind):
    if (name, kind) in REFUSED:
        return
    spec = _spec(name, kind)
    opts = decode_options(spec)
    fields, constants = DECODE[name]
    assert (opts.mode, opts.codec, opts.block_v, opts.codec_block, opts.readout, opts.decay_log_step, opts.window,
            opts.factor_format, opts.serving, opts.state_dtype) == fields
    assert DecodeParams.from_spec(spec, torch.bfloat16).constants() == {
        **SAME_FOR_EVERY_DECODE_RECIPE, **constants, "IS_KDA": kind == "kda"}
