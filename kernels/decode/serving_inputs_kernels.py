"""The server's pre-processing of a GDN layer's recurrence inputs, as vLLM 0.33.0's kernels compute it
(docs/serving.md, "The server's pre-processing"): one kernel per formula, each written as the server's kernel
writes it (its tile shapes, its order of operations, its warp count), so that the same sums and roundings happen.

    l2norm_prefill_kernel   the prefill's ``_fused_post_conv_kernel`` (fused_gdn_prefill_post_conv.py): tiles of
                            16 tokens x K, ``x * (1 / sqrt(sum(x * x) + eps))``, 4 warps
    l2norm_decode_kernel    the packed decode (fused_recurrent.py): one token and head, ``x / sqrt(sum(x * x) + 1e-6)``,
                            1 warp
    gdn_gate_kernel         ``-exp(A_log) * softplus(a + dt_bias)`` with the prefill's softplus
                            (``x + log(1 + exp(-x))`` for x > 0) on prefix tokens, the decode's (``log(1 + exp(x))``)
                            on the others, both ``x`` itself above 20
    sigmoid_kernel          beta = ``sigmoid(b)`` in fp32 (both phases)

Every kernel writes fp32; the prefill's rounding of q and k to the model's dtype is a torch cast after it
(serving_inputs.py), as the GPU's store rounds (nearest even; Triton's interpreter would truncate).
"""
import triton
import triton.language as tl


@triton.jit
def l2norm_prefill_kernel(x, out, n_tokens, H: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BK: tl.constexpr):
    """x [n_tokens, H, K] -> out fp32; one program per (16 tokens, head)."""
    i_tb, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)
    o_k = tl.arange(0, BK)
    mask = (o_t < n_tokens)[:, None] & (o_k < K)[None, :]
    offsets = o_t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_x = tl.load(x + offsets, mask=mask, other=0).to(tl.float32)
    b_inv = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)
    tl.store(out + offsets, b_x * b_inv[:, None], mask=mask)


@triton.jit
def l2norm_decode_kernel(x, out, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """x [n_tokens, H, K] -> out fp32; one program per (token, head)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    mask = o_k < K
    offsets = (i_t * H + i_h) * K + o_k
    b_x = tl.load(x + offsets, mask=mask, other=0).to(tl.float32)
    b_x = b_x / tl.sqrt(tl.sum(b_x * b_x) + 1e-6)
    tl.store(out + offsets, b_x, mask=mask)


@triton.jit
def gdn_gate_kernel(a, A_log, dt_bias, prefix, out, n, HV: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                    THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    """a [n / HV, HV], prefix [n / HV] (1: a prefix token) -> out fp32 [n / HV, HV]."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < n
    i_hv = o % HV
    b_x = tl.load(a + o, mask=mask, other=0).to(tl.float32)
    if HAS_DT_BIAS:
        b_x = b_x + tl.load(dt_bias + i_hv, mask=mask, other=0).to(tl.float32)
    b_prefix = tl.load(prefix + o // HV, mask=mask, other=0) != 0
    sp_prefill = tl.where(b_x > 0, b_x + tl.log(1.0 + tl.exp(-b_x)), tl.log(1.0 + tl.exp(b_x)))
    sp_prefill = tl.where(b_x <= THRESHOLD, sp_prefill, b_x)
    sp_decode = tl.where(b_x <= THRESHOLD, tl.log(1.0 + tl.exp(b_x)), b_x)
    b_A = tl.load(A_log + i_hv, mask=mask, other=0).to(tl.float32)
    tl.store(out + o, -tl.exp(b_A) * tl.where(b_prefix, sp_prefill, sp_decode), mask=mask)


@triton.jit
def sigmoid_kernel(b, out, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < n
    tl.store(out + o, tl.sigmoid(tl.load(b + o, mask=mask, other=0).to(tl.float32)), mask=mask)
