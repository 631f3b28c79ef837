"""Tiny Megatron-Core (0.19.2) language models with GatedDeltaNet layers, built from Megatron's own modules.

``tiny_gpt(config)`` is Megatron's ``GPTModel`` over a ``TransformerBlock`` of ``TransformerLayer``s whose
``self_attention`` is Megatron's ``GatedDeltaNet`` (or the KDA test layer below), with Megatron's local
modules: ``ColumnParallelLinear`` / ``RowParallelLinear`` and torch norms (the layer spec Megatron builds
with Transformer Engine, ``get_gated_delta_net_module_spec``, with TE's modules swapped for the local
ones; TE is a CUDA library). Module names are Megatron's: ``decoder.layers.<i>.self_attention``.

Megatron-Core 0.19.2 has no KDA layer. ``KimiDeltaAttentionTestLayer`` is Megatron's ``GatedDeltaNet``
with KDA's gate: the ``alpha`` section of the input projection widens from one value per value head to
one per (value head, key channel), ``dt_bias`` with it, and the decay becomes
``g = -exp(A_log[h]) * softplus(alpha[h, c] + dt_bias[h, c])`` per key channel (FLA's KDA gate,
``fla.ops.kda.gate.naive_kda_gate``); the recurrence is FLA's ``chunk_kda`` or, with
``deterministic_mode=True``, FLA's torch reference ``naive_chunk_kda`` (in chunks of 16). Everything else (projections,
convolution, l2norm, grouped heads, the gated output norm, TP sharding, the sharded state dict) is
Megatron's GDN code, inherited.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

VOCAB = 64
NAIVE_KDA_CHUNK = 16  # the KDA test layer's deterministic mode: FLA's naive_chunk_kda in chunks of 16


def tiny_config(*, tp: int = 1, cp: int = 1, layers: int = 2, deterministic: bool = False, key_heads: int = 1,
                value_heads: int = 2, **overrides) -> TransformerConfig:
    """hidden 64, ``key_heads`` q/k heads and ``value_heads`` value heads (grouped: Megatron repeat-interleaves
    q and k), all of dim 16, SiLU (Megatron's GDN requires silu for its convolution and output gate), RMSNorm, no
    dropout, no biases, fp32, parameters initialized on the CPU."""
    config = dict(
        num_layers=layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1] * layers,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        normalization="RMSNorm", activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        deterministic_mode=deterministic, params_dtype=torch.float32,
    )
    config.update(overrides)
    return TransformerConfig(**config)


class KimiDeltaAttentionTestLayer(GatedDeltaNet):
    """Megatron's GatedDeltaNet with KDA's per-key-channel gate (see the module docstring)."""

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        K, tp, cp = self.key_head_dim, self.tp_size, self.cp_size
        self.in_proj_extra_dim = self.num_value_heads * (1 + K)  # beta per head, alpha per head and channel
        sections = list(self.in_proj_split_sections)
        sections[-1] = self.num_value_heads * K // tp
        self.in_proj_split_sections = tuple(sections)
        split = list(self.feat_dim_split)
        split[-1] = self.num_value_heads * K // tp // cp
        self.feat_dim_split = tuple(split)
        self.dt_bias_dim = self.num_v_heads_local_tp * K
        if self.config.deterministic_mode:
            from fla.ops.kda.naive import naive_chunk_kda

            # chunks of 16 (FLA's default is 64): Dynamo unrolls a 15-row triangular loop per chunk, not 63
            self.gated_delta_rule = _without_cu_seqlens(functools.partial(naive_chunk_kda, chunk_size=NAIVE_KDA_CHUNK))
        else:
            from fla.ops.kda import chunk_kda

            self.gated_delta_rule = chunk_kda

    def _compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
        B, T = alpha.shape[:2]
        alpha = alpha.float().reshape(B, T, -1, self.key_head_dim)
        dt_bias = dt_bias_local_cp.reshape(-1, self.key_head_dim)
        g = -A_log_local_cp.exp()[:, None] * F.softplus(alpha + dt_bias)  # fp32, [B, T, HV, K]
        return g, beta.sigmoid()


def _without_cu_seqlens(fn):
    """FLA's naive chunk KDA takes no ``cu_seqlens`` / ``use_qk_l2norm_in_kernel``; Megatron passes None / False."""
    def call(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             cu_seqlens=None):
        assert cu_seqlens is None and not use_qk_l2norm_in_kernel
        return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)

    return call


def layer_spec(kda: bool = False) -> ModuleSpec:
    attention = ModuleSpec(
        module=KimiDeltaAttentionTestLayer if kda else GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                           out_proj=RowParallelLinear),
    )
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                          linear_fc2=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def tiny_gpt(config: TransformerConfig, *, kda: bool = False, seed: int = 0) -> GPTModel:
    """Megatron's GPTModel (no position embedding: the GDN layers carry position) over GDN layers."""
    torch.manual_seed(seed)
    block = TransformerBlockSubmodules(layer_specs=[layer_spec(kda)] * config.num_layers, layer_norm=WrappedTorchNorm)
    model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=1024, position_embedding_type="none")
    _spread_decays(model)
    return model


def _spread_decays(model) -> None:
    """Megatron initializes dt_bias = 1 and A in U(1, 16): every head's state decays by e^-1.3 or faster per
    token, so nothing carried across a chunk boundary (nor its rounding) reaches the loss. dt_bias is redrawn
    as softplus^-1 of a dt log-uniform in [1e-3, 1e-1] (Mamba's init, as tests/models does): long-lived states."""
    generator = torch.Generator().manual_seed(1)
    for module in gdn_layers(model):
        with torch.no_grad():
            dt = torch.exp(torch.empty(module.dt_bias.shape).uniform_(-6.9, -2.3, generator=generator))
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def batch(B: int = 1, T: int = 72, seed: int = 0):
    """(input_ids, position_ids, labels) of B sequences of T random tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=generator)
    labels = torch.randint(0, VOCAB, (B, T), generator=generator)
    return ids, torch.arange(T).expand(B, T), labels


def packed(cu_seqlens: list[int]) -> PackedSeqParams:
    """Megatron's packed-sequence (THD) parameters for one packed row with these boundaries."""
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=int(max(torch.diff(cu))), max_seqlen_kv=int(max(torch.diff(cu))))


def gdn_layers(model) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


# ---- tensor-parallel shards of a TP=1 model's tensors (the test's own reading of Megatron's layout) ----------
def _sections(model, name: str, tp: int):
    """The global section sizes of a fused GDN tensor along dim 0, or None for an ordinary tensor."""
    module_name, _, leaf = name.rpartition(".")
    owner_name, _, child = module_name.rpartition(".")
    if child not in ("in_proj", "conv1d") or not isinstance(model.get_submodule(owner_name), GatedDeltaNet):
        return None
    gdn = model.get_submodule(owner_name)
    if child == "in_proj":
        return [s * tp for s in gdn.in_proj_split_sections]
    return [gdn.qk_dim_local_tp * tp, gdn.qk_dim_local_tp * tp, gdn.v_dim_local_tp * tp]


def tp_shard(full: dict[str, torch.Tensor], model_tp, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of every tensor of a TP=1 model (parameters or gradients, by name), in the layout
    of the TP=``tp`` model ``model_tp``: a tensor-parallel parameter is cut along its ``partition_dim``,
    a fused GDN tensor (in_proj's q|k|v|z|beta|alpha rows, conv1d's q|k|v channels) section by section,
    anything else is replicated."""
    out = {}
    for name, param in model_tp.named_parameters():
        tensor = full[name]
        if not getattr(param, "tensor_model_parallel", False):
            out[name] = tensor
            continue
        dim = param.partition_dim
        sections = _sections(model_tp, name, tp)
        parts = torch.split(tensor, sections, dim=dim) if sections else (tensor,)
        out[name] = torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim)
        assert out[name].shape == param.shape, (name, out[name].shape, param.shape)
    return out
