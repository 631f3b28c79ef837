"""The transformers architectures with a GDN/KDA torch fallback, as tiny random models.

One row per architecture: the config and model classes (names in ``transformers``), the config
overrides and the fully qualified names of the linear-attention modules laqat must rewrite.
Overrides shrink sizes only (hidden 32, 8-dim heads, one linear-attention layer where the config
allows it, two in Qwen3.5 and Bailing-hybrid, whose second layer takes the first one's algebra check, 4 experts, a
vocabulary of 64); everything about the linear attention itself (gates,
``allow_neg_eigval``, lower bounds, safe gate, norms, the short convolution) keeps the config's
default. Every fallback here is chunked with C = 64, and laqat rewrites a chunk loop of at
least two chunks, so the runner uses T = 72 (two chunks, the second padded): the path a
training step takes (T > 1, no cache).
"""
from __future__ import annotations

import dataclasses
from typing import Any

SEQ_LEN = 72
BATCH = 2
VOCAB = 64

# sizes shared by the GDN models (Qwen3-Next family): 1 key head, 2 value heads (grouped), 8-dim heads
_GDN_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, layer_types=["linear_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
)
_MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
_NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str  # the architecture, as the docs name it
    config_class: str  # transformers class names
    model_class: str
    kind: str  # "gdn" | "kda"
    linear_attention: tuple[str, ...]  # fully qualified names of the linear-attention modules
    overrides: dict[str, Any]  # config keyword arguments (a sub-config as a dict)
    # where the architecture's linear attention departs from Qwen3-Next's / Kimi-Linear's (for the docs)
    note: str = ""
    # Qwen3-Next's init (dt_bias = 1, A in U(0.01, 16)) decays the state by exp(-1.31 A) per token: e^-3
    # or faster for every head these tiny models draw, so nothing crosses a chunk boundary and neither
    # the carried state nor its rounding reaches the loss (state_fp8 moved the logits by 7e-8). The
    # runner redraws dt_bias as OLMo-hybrid and Kimi-Linear initialize it: softplus^-1 of dt,
    # log-uniform in [1e-3, 1e-1].
    redraw_dt_bias: bool = False
    # also compiled under the Inductor hand-off (the GPU's default; the CPU's is eager): one model per kind of
    # linear-attention code (all nine call one chunked fallback per kind: Qwen3-Next for GDN, Kimi-Linear for
    # KDA), as Inductor's cold C++ build is most of a model's test time on the CPU
    inductor: bool = False


MODELS: tuple[ModelCase, ...] = (
    ModelCase(
        "qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "gdn", ("model.layers.0.linear_attn",),
        dict(_GDN_SIZES, **_MOE_SIZES), redraw_dt_bias=True,
        note="fused qkvz / ba projections, gated RMSNorm (silu), MoE", inductor=True),
    ModelCase(
        "qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "gdn",
        ("model.layers.0.linear_attn", "model.layers.1.linear_attn"),
        dict(_GDN_SIZES, num_hidden_layers=2, layer_types=["linear_attention"] * 2), redraw_dt_bias=True,
        note="separate qkv / z / b / a projections, dense MLP"),
    ModelCase(
        "qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "gdn", ("model.layers.0.linear_attn",),
        dict(_GDN_SIZES, **_MOE_SIZES), redraw_dt_bias=True),
    ModelCase(
        "qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", "gdn", ("model.layers.0.linear_attn",),
        dict(_GDN_SIZES, **_MOE_SIZES, hc_lowrank=8), redraw_dt_bias=True,
        note="hyper-connections (4 residual streams), MoE"),
    ModelCase(
        "lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", "gdn", ("model.layers.0.linear_attn",),
        dict(_GDN_SIZES, **_MOE_SIZES, eos_token_id=None), redraw_dt_bias=True,
        note="Qwen3.5's gated delta net, MoE, tied embeddings"),
    ModelCase(
        "olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", "gdn", ("model.layers.0.linear_attn",),
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
             max_position_embeddings=256, **_NO_SPECIAL_TOKENS),
        note="allow_neg_eigval (beta = 2 sigmoid), value heads twice the key dim; needs one full-attention layer"),
    ModelCase(
        "kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", "kda", ("model.layers.0.self_attn",),
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
             layer_types=["linear_attention"], mlp_layer_types=["sparse"], num_attention_heads=4,
             num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8,
             linear_num_heads=2, max_position_embeddings=256, **_NO_SPECIAL_TOKENS),
        note="softplus forget gate per key channel, MoE", inductor=True),
    ModelCase(
        "glm5_next", "Glm5NextConfig", "Glm5NextForConditionalGeneration", "kda",
        ("model.language_model.layers.0.self_attn",),
        dict(text_config=dict(
                 vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4,
                 num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, linear_head_dim=8,
                 linear_num_heads=2, max_position_embeddings=256, q_lora_rank=16, kv_lora_rank=16,
                 qk_nope_head_dim=8, v_head_dim=8, index_head_dim=8, index_n_heads=2, pad_token_id=None,
                 hc_sinkhorn_iters=2),
             vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                                projection_intermediate_size=16)),
        note="lower-bound forget gate (-5 sigmoid), hyper-connections; the text model inside the VLM class"),
    ModelCase(
        "bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", "kda",
        ("model.layers.0.self_attn", "model.layers.1.self_attn"),
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             layer_types=["linear_attention"] * 2, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
             num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=256,
             **_NO_SPECIAL_TOKENS),
        note="kda_safe_gate: lower-bound forget gate (-5 sigmoid), dense first layer"),
)

BY_NAME = {case.name: case for case in MODELS}

# config keys that choose what the linear attention computes (not its sizes): no row overrides them,
# the runner reports their values
LINEAR_ATTENTION_KEYS = (
    "hidden_act", "rms_norm_eps", "linear_conv_kernel_dim", "short_conv_kernel_size", "linear_allow_neg_eigval",
    "linear_lower_bound", "kda_safe_gate", "kda_lower_bound", "output_gate_type", "linear_a_log_min",
    "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor",
)
