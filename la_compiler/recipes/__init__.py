"""Shipped policy recipes (``<name>.yaml`` beside this file), loadable by name:

    torch.compile(model, backend="laqat", options={"policy": "state_fp8"})
    la_compiler.policy.resolution.load_recipe("state_fp8")  # -> Policy

Each recipe's rules name both kinds at once (``*_state_quantizer`` matches ``gdn_state_quantizer`` and
``kda_state_quantizer``), so a model with only GDN or only KDA layers meets every rule: no recipe warns of an
unmatched rule on a GDN-only, KDA-only or hybrid model. ``SERVES`` says which serving setting each recipe
trains for (``laqat recipes`` prints it).
"""
from __future__ import annotations

from pathlib import Path

from la_compiler.policy.file_format import PolicyError
from la_compiler.suggest import did_you_mean

_DIR = Path(__file__).parent

# recipe -> the serving setting it trains for (docs/policy.md, "Recipes"; docs/serving.md)
SERVES = {
    "exact": "a server in full precision: nothing rounded",
    "state_fp8": "an FP8 E4M3 recurrent-state cache, one dynamic scale per [K x 64] state tile",
    "state_int8_block32": "an INT8 recurrent-state cache, one dynamic scale per 32 values of a key row",
    "state_int8_hadamard32": "ReplaySSM's INT8 Hadamard-32 state cache",
    "w_fp8": "a prefill kernel that keeps the WY keys W in FP8 E4M3",
    "prefill_operands_fp8": "FP8 E4M3 prefill GEMMs (per-row scales)",
    "prefill_operands_nvfp4": "NVFP4 prefill GEMMs (blocks of 16)",
    "decode_token_state_fp8": "decode from an FP8 state cache, one token at a time (train under la_compiler.phase)",
    "vllm_gdn_state_bf16": "vLLM 0.33 GDN (Qwen3-Next / Qwen3.5), --mamba-ssm-cache-dtype bfloat16, Triton kernels",
    "vllm_kda_state_bf16": "vLLM 0.33 Kimi-K3 KDA, --mamba-ssm-cache-dtype bfloat16, Triton kernels (KDA only)",
}


def recipe_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    path = _DIR / f"{name}.yaml"
    if name not in recipe_names():
        raise PolicyError(f"recipe {name!r} does not exist; recipes: {recipe_names()}"
                          f"{did_you_mean(name, recipe_names())}")
    return path
