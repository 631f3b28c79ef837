"""laqat's decode-phase forward under a serving profile against vLLM 0.33.0's own kernels on the same tokens.

vLLM (tests/serving/vllm_serving.py) prefills each prefix with its chunk kernel, stores the state in its cache
dtype, and decodes the suffix one token per step with its recurrent kernel; laqat runs the policy's spec
(decode_serving) once over the whole batch. Both run in Triton's interpreter as the GPU computes
(``as_gpu``: bf16 casts round to nearest even, bf16 arithmetic is widened exactly). Inputs are the canonical
operands as vLLM's kernels take them: q, k l2-normalized and rounded to the model dtype, g and beta in fp32.

What is bit-identical, and why the rest is not:
- every decode step: the same fp32 operations in the same order (the state tile V-first, sums over K along
  the tile's contiguous axis) and the same round-to-nearest-even cache writes, so outputs and states of the
  suffix are bit-identical whenever the state handed off is;
- KDA's chunked prefill with bf16 inputs, outputs and states, and GDN's prefill states: laqat's chunk kernels
  keep FLA's bf16 intermediates at the same points and reduce in the same order as vLLM's copy of FLA (KDA: with
  G in log2 units and exp2 decays, as vLLM's Kimi-K3 kernels, ChunkParams.gate_exp2);
- GDN's prefill outputs differ where a chunk starts from a non-zero state (an initial state, or a chunk
  before it): laqat's output stage multiplies the state by ``Q ⊙ exp(G)`` rounded to bf16, vLLM's
  ``chunk_fwd_kernel_o`` multiplies it by Q and scales the fp32 product by ``exp(G)`` after, so each term of
  that sum carries one more bf16 rounding (2^-9 relative) in laqat. Measured: at most one unit in the last
  bf16 place of the token's largest output, relative L2 2.5e-3; asserted: PREFIX_ROW_ULPS units, PREFIX_REL;
- fp32 prefills (KDA only: vLLM's GDN chunk refuses fp32) differ in the last fp32 bits of the sums (rel 1e-7):
  the handed-off state then differs by at most one unit of the cache dtype where it straddles a rounding
  boundary (none on these inputs), and an fp32 cache carries the fp32 difference on (FP32_REL).
"""
import pytest
import torch
import torch.nn.functional as F

import la_compiler.kernels  # noqa: F401  (registers the variants)
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.registry import get_variant
from la_compiler.kernels.selection import select_kernel
from la_compiler.policy.file_format import with_precision_alias
from la_compiler.policy.resolution import Policy
from tests.helpers import rel_l2
from tests.serving.vllm_serving import serve

PREFIX_ROW_ULPS = 2  # GDN bf16 prefill outputs: |laqat - vLLM| <= 2 bf16 units of the token's largest |o|
PREFIX_REL = 5e-3
FP32_REL = 1e-6

BF16, FP32 = torch.bfloat16, torch.float32
CASES = {
    # id: (kind, input dtype, serving cfg, vLLM cache dtype, state layout, initial state, cu_seqlens | B, T,
    #      H, HV, K, V, prefill lengths, valid lengths)
    # packed: a prefix and a suffix / an empty prefix (all decode) / a one-token suffix; grouped value heads;
    # precision: vllm = serving {state_dtype: auto}, which is bf16 for a bf16 GDN model
    "gdn-bf16-auto-cache-packed-gqa": ("gdn", BF16, {"precision": "vllm"}, BF16, "vk", True, [0, 20, 28, 33], 33,
                                       1, 2, 16, 16, [12, 0, 4], [20, 8, 5]),
    "gdn-bf16-fp16-cache-batch": ("gdn", BF16, {"serving": {"state_dtype": "float16"}}, torch.float16, "kv", False,
                                  2, 14, 2, 2, 16, 16, [9, 13], [14, 14]),
    "gdn-bf16-fp32-cache": ("gdn", BF16, {"serving": {"state_dtype": "float32"}}, FP32, "vk", True, 1, 18, 1, 1,
                            16, 16, [11], [18]),
    # vLLM's GDN chunk kernel refuses fp32 inputs: decode only (empty prefixes), one sequence shorter
    "gdn-fp32-bf16-cache-decode": ("gdn", FP32, {"serving": {"state_dtype": "bfloat16"}}, BF16, "vk", True, 2, 7,
                                   1, 2, 16, 16, [0, 0], [7, 5]),
    "gdn-fp32-fp32-cache-decode": ("gdn", FP32, {"serving": {"state_dtype": "float32"}}, FP32, "kv", True, 1, 6, 1,
                                   1, 32, 32, [0], [6]),
    "kda-bf16-bf16-cache-packed": ("kda", BF16, {"serving": {"state_dtype": "bfloat16", "model": "kimi_k3"}}, BF16,
                                   "vk", True, [0, 20, 28, 33], 33, 2, 2, 16, 16, [12, 0, 4], [20, 8, 5]),
    # precision: vllm_kimi_k3 = serving {model: kimi_k3, state_dtype: auto}: float32 for KDA
    "kda-bf16-auto-cache": ("kda", BF16, {"precision": "vllm_kimi_k3"}, FP32, "kv", False, 1, 18, 1, 1, 16, 16,
                            [11], [18]),
    "kda-fp32-bf16-cache": ("kda", FP32, {"serving": {"state_dtype": "bfloat16"}}, BF16, "vk", True, 1, 18, 1, 1,
                            16, 16, [11], [18]),
}


def _inputs(kind, dtype, B, T, H, HV, K, V, n, layout, with_h0):
    q = F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V).to(dtype)
    g = F.logsigmoid(torch.randn((B, T, HV) if kind == "gdn" else (B, T, HV, K))) * 0.5
    beta = torch.rand(B, T, HV).sigmoid()
    h0 = torch.randn(n, HV, K, V) if with_h0 else None
    if h0 is not None and layout == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    return q, k, v, g, beta, h0


def _laqat(cfg, kind, layout, q, k, v, g, beta, h0, cu, prefill, valid):
    """The spec the policy resolves for a module, on the variant the selection table picks for it."""
    cfg = with_precision_alias(cfg)  # laqat's own forward (serving.forward auto would run vLLM's kernels here)
    cfg["serving"] = {**cfg["serving"], "forward": "laqat"}
    res = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": cfg}]}).resolve("model.layers.0.attn",
                                                                                            kind)
    spec = RecurrenceSpec(kind, state=layout, phase=res.phase, quant=res.quant, extra=res.extra)
    choice = select_kernel(spec, device="cpu", dtype=q.dtype, head_k=q.shape[-1], head_v=v.shape[-1])
    assert choice.variant == "decode_serving", choice.explain()
    return get_variant(choice.variant).forward(
        spec.replace(kernel=choice.variant), q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5,
        prefill_lengths=torch.tensor(prefill), valid_lengths=torch.tensor(valid))


def _bf16_row_ulps(a, b):
    """|a - b| in units of the last bf16 place of each token's largest |b| (per token and value head)."""
    a, b = a.float(), b.float()
    scale = b.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return ((a - b).abs() / torch.exp2(torch.floor(torch.log2(scale)) - 7)).max().item()


def _cache_ulps(a, b, dtype):
    """Elementwise |a - b| in units of the last place of ``dtype`` at |b|."""
    mant = {BF16: 7, torch.float16: 10, FP32: 23}[dtype]
    scale = b.abs().clamp_min(torch.finfo(dtype).tiny)
    return ((a - b).abs() / torch.exp2(torch.floor(torch.log2(scale)) - mant)).max().item()


def _mismatch(a, b):
    diff = a.float() != b.float()
    return f"{int(diff.sum())} of {diff.numel()} differ, max |diff| {(a.float() - b.float()).abs().max().item():.3e}"


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_phase_forward_equals_vllm(case, vllm, as_gpu):
    kind, dtype, cfg, cache, layout, with_h0, batch, T, H, HV, K, V, prefill, valid = CASES[case]
    cu = torch.tensor(batch, dtype=torch.long) if isinstance(batch, list) else None
    B, n = (1, len(batch) - 1) if cu is not None else (batch, batch)
    q, k, v, g, beta, h0 = _inputs(kind, dtype, B, T, H, HV, K, V, n, layout, with_h0)
    h0_kv = h0.transpose(-1, -2) if h0 is not None and layout == "vk" else h0
    o_ref, h_ref = serve(vllm, kind, q, k, v, g, beta, prefill_lengths=prefill, valid_lengths=valid,
                         cache_dtype=cache, initial_state=h0_kv, cu_seqlens=cu)
    o, ht = _laqat(cfg, kind, layout, q, k, v, g, beta, h0, cu, prefill, valid)
    ht = ht.transpose(-1, -2) if layout == "vk" else ht
    assert o.dtype == o_ref.dtype and torch.isfinite(o.float()).all()

    suffix = torch.zeros(B * T, dtype=torch.bool)
    starts = cu[:-1].tolist() if cu is not None else [b * T for b in range(B)]
    for s, p, L in zip(starts, prefill, valid):
        suffix[s + p:s + L] = True
    o, o_ref = o.reshape(B * T, HV, V), o_ref.reshape(B * T, HV, V)
    fp32_prefill = dtype == FP32 and any(prefill)
    if not fp32_prefill:  # the handed-off states are equal bit for bit: so is every decode step
        assert torch.equal(o[suffix], o_ref[suffix]), f"suffix outputs: {_mismatch(o[suffix], o_ref[suffix])}"
    if kind == "gdn" or dtype == FP32:  # (no fp32 GDN prefill: vLLM refuses it)
        assert torch.equal(ht, h_ref), f"final states: {_mismatch(ht, h_ref)}"
    elif cache == FP32:  # KDA bf16 prefill, kept in fp32: the chunk state's fp32 sums differ in the last bits
        assert rel_l2(ht, h_ref) <= FP32_REL, rel_l2(ht, h_ref)
        assert _bf16_row_ulps(o[suffix], o_ref[suffix]) <= 1
    else:
        assert torch.equal(ht, h_ref), f"final states: {_mismatch(ht, h_ref)}"
    prefix = ~suffix
    if kind == "kda" and dtype == BF16:
        assert torch.equal(o[prefix], o_ref[prefix]), f"prefix outputs: {_mismatch(o[prefix], o_ref[prefix])}"
    elif fp32_prefill:
        assert rel_l2(o, o_ref) <= FP32_REL and _cache_ulps(ht, h_ref, cache) <= 1
    elif any(prefill):  # GDN's bf16 output stage, another order of the same products
        assert _bf16_row_ulps(o[prefix], o_ref[prefix]) <= PREFIX_ROW_ULPS
        assert rel_l2(o[prefix], o_ref[prefix]) <= PREFIX_REL
