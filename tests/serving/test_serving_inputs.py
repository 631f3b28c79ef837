"""The server's pre-processing (kernels/decode/serving_inputs.py, passes/serving_inputs.py) against vLLM 0.33.0's own
kernels in Triton's interpreter (as the GPU rounds): the prefill's ``fused_post_conv_prep`` bit for bit; and one
GDN layer of a tiny Qwen3.5 (transformers' own layer code, through FLA's chunk function and through its torch
fallback), compiled with the serving profile in
a decode phase, against vLLM's layer's kernel calls on the raw projections (``fused_post_conv_prep`` and
``chunk_gated_delta_rule`` over the prefix, the cache write, ``fused_recurrent_gated_delta_rule_packed_decode`` per
decode token): outputs equal bit for bit. Plus the ops' gradients, and the pass's refusals (the ops' contracts:
tests/la_compiler/test_op_contracts.py)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import la_compiler
from la_compiler.backend import last_record
from la_compiler.kernels.decode import serving_inputs  # noqa: F401  (registers the ops)
from la_compiler.passes.module_names import function_behind
from la_compiler.passes.serving_inputs import ServingInputsWarning

BF16 = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: vLLM's kernels compiled, as the server runs them


def _raw(T, H, HV, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixed = (torch.randn(T, 2 * H * K + HV * V, generator=g) * 2).to(BF16)
    a = (torch.randn(T, HV, generator=g) * 4).to(BF16)  # softplus on both sides of 0 and past its threshold
    a[0, 0] = 25.0
    b = (torch.randn(T, HV, generator=g) * 2).to(BF16)
    A_log = torch.rand(HV, generator=g).mul(3).log().float()
    dt_bias = torch.rand(HV, generator=g).float()
    return (x.to(DEVICE) for x in (mixed, a, b, A_log, dt_bias))


def test_prefill_preprocessing_is_vllms_bit_for_bit(vllm, as_gpu):
    T, H, HV, K, V = 37, 2, 4, 16, 16  # K = V: vLLM's prep kernel does not compile for K != V on a GPU
    mixed, a, b, A_log, dt_bias = _raw(T, H, HV, K, V)
    q, k, _, g, beta = vllm.gdn_post_conv.fused_post_conv_prep(mixed, a, b, A_log, dt_bias, H, K, V)
    prefix = torch.ones(1, T, dtype=torch.int8, device=DEVICE)
    q_raw = mixed[:, :H * K].reshape(1, T, H, K)
    k_raw = mixed[:, H * K:2 * H * K].reshape(1, T, H, K)
    assert torch.equal(torch.ops.laqat.serving_l2norm(q_raw, prefix)[0], q.float())
    assert torch.equal(torch.ops.laqat.serving_l2norm(k_raw, prefix)[0], k.float())
    assert torch.equal(torch.ops.laqat.serving_gdn_gate(a[None], A_log, dt_bias, prefix)[0], g)
    assert torch.equal(torch.ops.laqat.serving_sigmoid(b[None])[0], beta)
    # the decode formulas differ from the prefill's: fp32 q (not rounded), another softplus
    decode = torch.zeros_like(prefix)
    assert not torch.equal(torch.ops.laqat.serving_l2norm(q_raw, decode)[0], q.float())


def _layer_core(mixed_qkv, a, b, A_log, dt_bias, H, HV, K, V, chunk_function, final_state=False):
    """Qwen3.5's GatedDeltaNet forward from the convolution's output to the recurrence's output
    (transformers' modeling_qwen3_next / qwen3_5: split, beta, g, the chunk function with its in-kernel l2 norm);
    ``final_state``: (the output, the final state)."""
    B, T = mixed_qkv.shape[:2]
    query, key, value = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)
    query = query.reshape(B, T, -1, K)
    key = key.reshape(B, T, -1, K)
    value = value.reshape(B, T, -1, V)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if HV // H > 1:
        query = query.repeat_interleave(HV // H, dim=2)
        key = key.repeat_interleave(HV // H, dim=2)
    if final_state:
        return chunk_function(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                              output_final_state=True)
    out, _ = chunk_function(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return out


def _chunk_function(chunk="fla"):
    """The layer's chunk function: transformers' FLA kernel (``fla``, FLA's directly where transformers is not
    installed: a GPU host with FLA's wheels only) or transformers' torch fallback (``torch``)."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        if chunk == "torch":
            pytest.skip("transformers is not installed")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    return function_behind(m.torch_chunk_gated_delta_rule) if chunk == "torch" else m.torch_chunk_gated_delta_rule


def _vllm_layer(vllm, mixed, a, b, A_log, dt_bias, H, HV, K, V, prefill, cache_dtype=BF16, final_state=False):
    """What vLLM's GDN layer computes for one sequence: the prefix prefilled from its zeroed cache slot (the cache's
    dtype, as vLLM's layer reads it), its state cached in ``cache_dtype``, then one packed decode launch per later
    token; ``final_state``: (the outputs, the cached state [HV, V, K] after the last token)."""
    T = mixed.shape[0]
    scale = K ** -0.5
    q, k, v, g, beta = vllm.gdn_post_conv.fused_post_conv_prep(mixed[:prefill], a[:prefill], b[:prefill], A_log,
                                                                dt_bias, H, K, V)
    o_pre, ht = vllm.gdn_chunk.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=scale,
        initial_state=torch.zeros(1, HV, V, K, dtype=cache_dtype, device=DEVICE), output_final_state=True,
        cu_seqlens=torch.tensor([0, prefill], dtype=torch.int32, device=DEVICE))
    cache = torch.zeros(2, HV, V, K, dtype=cache_dtype, device=DEVICE)
    cache[1] = ht[0].to(cache_dtype)
    outs = [o_pre[0].to(mixed.dtype)]
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    for t in range(prefill, T):
        out = torch.empty(1, 1, HV, V, dtype=mixed.dtype, device=DEVICE)
        vllm.gdn_recurrent.fused_recurrent_gated_delta_rule_packed_decode(
            mixed[t:t + 1].contiguous(), a[t:t + 1].contiguous(), b[t:t + 1].contiguous(), A_log, dt_bias, scale,
            cache, out, slot, use_qk_l2norm_in_kernel=True)
        outs.append(out[0])
    return (torch.cat(outs), cache[1]) if final_state else torch.cat(outs)


@pytest.mark.parametrize("H,HV,chunk", [(2, 2, "fla"), (1, 2, "fla"), (1, 2, "torch")])
def test_a_qwen35_layer_compiled_with_the_profile_is_vllms_layer(vllm, as_gpu, H, HV, chunk):
    T, K, V, prefill = 80, 16, 16, 70  # two chunks of prefix, ten decode steps
    mixed, a, b, A_log, dt_bias = _raw(T, H, HV, K, V, seed=1)
    core = torch.compile(_layer_core, backend="laqat", fullgraph=True,
                         options={"policy": "vllm_gdn_state_bf16", "compiler": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServingInputsWarning)
        with la_compiler.phase(prefill_lengths=[prefill]):
            out = core(mixed[None], a[None], b[None], A_log, dt_bias, H, HV, K, V, _chunk_function(chunk))
    rules = [r for g in last_record().graphs for m in g.matches for r in m.policy_rules]
    assert any(r.startswith("serving pre-processing: ") and "q: vLLM's l2 norm" in r
               and "g: vLLM's softplus gate" in r and "beta: sigmoid(b) in fp32" in r for r in rules), rules
    if chunk == "torch":  # the fallback widens v to fp32; the server's kernels take the model's bf16
        assert any("v: in the model's torch.bfloat16" in r for r in rules), rules
    expected = _vllm_layer(vllm, mixed, a, b, A_log, dt_bias, H, HV, K, V, prefill)
    assert out.dtype == BF16
    assert torch.equal(out[0], expected), (out[0] - expected).abs().max()


def test_without_the_servers_formula_the_input_keeps_the_models_own_with_a_warning(vllm):
    chunk_function = _chunk_function()

    def core(q, k, v, g, beta):
        return chunk_function(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    T, H, D = 80, 2, 8
    q, k, v = (torch.randn(1, T, H, D, device=DEVICE).to(BF16) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, T, H, device=DEVICE))  # not the softplus gate
    beta = torch.rand(1, T, H, device=DEVICE)  # no sigmoid
    compiled = torch.compile(core, backend="laqat", options={"policy": "vllm_gdn_state_bf16", "compiler": "eager"})
    with pytest.warns(ServingInputsWarning, match=r"g \(not -exp\(A_log\).*beta \(not sigmoid\(b\)\)"):
        with la_compiler.phase(prefill_lengths=[70]):
            compiled(q, k, v, g, beta)


@pytest.fixture
def on_device():
    with torch.device(DEVICE):
        yield


def _gdn_gate_fp64(a, A_log, dt_bias):
    return -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())


def assert_l2norm_against_fp64(op):
    """``op(x, prefix)`` (a serving l2 norm, fp32 inputs: the prefill's rounding to x's dtype is none) and its gradient
    against ``x / sqrt(sum(x²) + 1e-6)`` in fp64, on prefix and decode tokens."""
    torch.manual_seed(3)
    x = torch.randn(2, 9, 3, 16, dtype=torch.float32, requires_grad=True)
    prefix = (torch.arange(9) < 4).to(torch.int8).expand(2, 9).contiguous()
    y = op(x, prefix)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-6)


def test_the_ops_gradients_against_fp64(on_device):
    assert_l2norm_against_fp64(torch.ops.laqat.serving_l2norm)

    prefix = (torch.arange(9) < 4).to(torch.int8).expand(2, 9).contiguous()
    a = (torch.randn(2, 9, 3) * 8).requires_grad_()
    A_log = torch.randn(3).requires_grad_()
    dt_bias = torch.randn(3).requires_grad_()
    out = torch.ops.laqat.serving_gdn_gate(a, A_log, dt_bias, prefix)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, A_log, dt_bias), dout)
    leaves = [t.detach().double().requires_grad_() for t in (a, A_log, dt_bias)]
    out64 = _gdn_gate_fp64(*leaves)
    grads64 = torch.autograd.grad(out64, leaves, dout.double())
    torch.testing.assert_close(out.double(), out64, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, grads64):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)

    b = (torch.randn(2, 9, 3) * 3).requires_grad_()
    beta = torch.ops.laqat.serving_sigmoid(b)
    (db,) = torch.autograd.grad(beta, b, dout)
    b64 = b.detach().double().requires_grad_()
    (db64,) = torch.autograd.grad(torch.sigmoid(b64), b64, dout.double())
    torch.testing.assert_close(db.double(), db64, rtol=1e-5, atol=1e-6)
