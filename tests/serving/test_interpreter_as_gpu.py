"""The oracle's interpreter patches compute what the GPU computes: fp32 -> bf16 rounds to nearest even (torch's
cast is the reference: ties, binade edges, subnormals, overflow, NaN), and bf16 arithmetic, comparisons, dots and sums
are those of the exact values, rounded once (torch's bf16 ops on the CPU round each result to nearest even)."""
import os

import pytest
import torch
import triton
import triton.language as tl

from tests.serving.interpreter_as_gpu import interpreter_as_gpu

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="patches Triton's interpreter")


@triton.jit
def _cast_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o).to(tl.bfloat16))


@triton.jit
def _bf16_ops_kernel(a, b, out_mul, out_add, out_max, out_dot, out_sum, N: tl.constexpr):
    o = tl.arange(0, N)
    b_a = tl.load(a + o[:, None] * N + o[None, :])  # bf16 [N, N]
    b_b = tl.load(b + o[:, None] * N + o[None, :])
    tl.store(out_mul + o[:, None] * N + o[None, :], b_a * b_b)
    tl.store(out_add + o[:, None] * N + o[None, :], b_a + b_b)
    tl.store(out_max + o[:, None] * N + o[None, :], tl.where(b_a < b_b, b_b, b_a))
    tl.store(out_dot + o[:, None] * N + o[None, :], tl.dot(b_a, b_b))
    tl.store(out_sum + o, tl.sum(b_a, 1))


def test_fp32_to_bf16_rounds_to_nearest_even():
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x00008000, 0x00018000,
                         0x80018000, 0x7FC00001, 0xFF800000, 0x3F800001, 0x4B7FFFFF, 0x00000001, 0x80000000],
                        dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(57) * 1e3, torch.randn(57) * 1e-39])  # 128 values
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    with interpreter_as_gpu():
        _cast_kernel[(1,)](x, y, N=x.numel())
    want = x.to(torch.bfloat16)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))
    unpatched = torch.empty_like(y)
    _cast_kernel[(1,)](x, unpatched, N=x.numel())
    assert not torch.equal(unpatched.view(torch.int16), want.view(torch.int16))  # Triton's own cast truncates


def test_bf16_arithmetic_dot_and_sum_are_those_of_the_values():
    N = 16
    a, b = torch.randn(N, N).bfloat16(), torch.randn(N, N).bfloat16()
    outs = [torch.empty(N, N, dtype=torch.bfloat16) for _ in range(3)]
    dot = torch.empty(N, N, dtype=torch.float32)
    total = torch.empty(N, dtype=torch.bfloat16)
    with interpreter_as_gpu():
        _bf16_ops_kernel[(1,)](a, b, *outs, dot, total, N=N)
    assert torch.equal(outs[0], a * b) and torch.equal(outs[1], a + b)
    assert torch.equal(outs[2], torch.maximum(a, b))  # comparisons of the values, not of their bit patterns
    assert (dot - a.float() @ b.float()).abs().max() <= 1e-5 * (a.float().abs() @ b.float().abs()).max()
    assert (total.float() - a.float().sum(1)).abs().max() <= 2 ** -7 * a.float().abs().sum(1).max()
