"""The server's pre-processing of a KDA layer's recurrence inputs, as vLLM 0.33.0's Kimi-K3 / Kimi-Linear kernels
compute it (docs/serving.md, "The server's pre-processing"): each written as the server's kernel writes it (its tile
shapes, its order of operations, its warp count), so that the same sums and roundings happen.

    l2norm_prefill_kernel   the prefill's ``l2norm_fwd`` (third_party/flash_linear_attention/ops/l2norm.py,
                            ``l2norm_fwd_kernel2``, the default without ``USE_DEFAULT_FLA_NORM``): tiles of 32 rows
                            x D, ``x * rsqrt(sum(x * x) + eps)``, 4 warps (Triton's default)
    kda_gate_kernel         ``-exp(A_log) * softplus(g + dt_bias)`` per key channel (kernels/common/server_gate.py):
                            the values the packed decode's ``fused_recurrent_kda_packed_decode_kernel`` computes

The decode's l2 norm is GDN's (serving_inputs_kernels.l2norm_decode_kernel, ``x / sqrt(sum(x * x) + 1e-6)``), launched
with the KDA decode's 4 warps; beta is ``serving_sigmoid`` (``sigmoid(b)`` in fp32, both phases).
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.server_gate import kda_server_gate


@triton.jit
def l2norm_prefill_kernel(x, out, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, MBLOCK: tl.constexpr):
    """x [n_rows, D] -> out fp32; one program per 32 rows (a row: one token's head)."""
    row_idx = tl.program_id(0) * MBLOCK + tl.arange(0, MBLOCK)[:, None]
    xmask = row_idx < n_rows
    rindex = tl.arange(0, BD)[None, :]
    mask = xmask & (rindex < D)
    xs = tl.load(x + (rindex + D * row_idx), mask, other=0.0).to(tl.float32)
    square = tl.broadcast_to(xs * xs, [MBLOCK, BD])
    square_sum = tl.sum(tl.where(xmask, square, 0), 1)[:, None]
    rsqrt = tl.rsqrt(square_sum + eps)
    tl.store(out + (rindex + D * row_idx), xs * rsqrt, mask)


@triton.jit
def kda_gate_kernel(g, A_log, dt_bias, out, n, HV: tl.constexpr, K: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                    THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    """g [n / (HV K), HV, K] -> out fp32, the same shape; A_log [HV], dt_bias [HV K]."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < n
    i_hk = o % (HV * K)
    b_g = tl.load(g + o, mask=mask, other=0).to(tl.float32)
    if HAS_DT_BIAS:
        b_g += tl.load(dt_bias + i_hk, mask=mask, other=0).to(tl.float32)
    b_a = tl.exp(tl.load(A_log + i_hk // K, mask=mask, other=0).to(tl.float32))
    tl.store(out + o, kda_server_gate(b_g, b_a, THRESHOLD), mask=mask)
