"""KDA's gate as vLLM 0.33.0's Kimi-K3 kernels compute it, for every kernel that computes it from the raw gate.

``-exp(A_log) * softplus(s)`` with ``s = g + dt_bias`` in fp32 and softplus ``log(1 + exp(s))``, ``s`` itself above
the threshold (20): ``kda_gate_chunk_cumsum_vector_kernel`` before its cumsum (its softplus beta 1: ``s * 1.0`` and
``(1.0 / 1.0) * y`` are exact) and ``fused_recurrent_kda_packed_decode_kernel`` compute the same operations. A kernel
that sums the gate (a chunk cumsum) leaves the product to the compiler, which on a GPU contracts it into the sum's
FMA, as it does in vLLM's (docs/serving.md, "The server's pre-processing").
"""
import triton
import triton.language as tl

SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def kda_server_gate(b_s, b_a, THRESHOLD: tl.constexpr):
    """The gate of the fp32 pre-activation ``b_s`` (the raw gate plus dt_bias) and ``b_a`` = exp(A_log)."""
    b_softplus = tl.where(b_s > THRESHOLD, b_s, tl.log(1.0 + tl.exp(b_s)))
    return -b_a * b_softplus
