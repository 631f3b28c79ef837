"""A Triton kernel importable by name, for tests/kernels/test_compile_workers.py (a worker process imports it).
A ``JITFunction`` made directly, not by ``triton.jit``: under the tests' ``TRITON_INTERPRET=1`` the decorator
would give the interpreter's stand-in, which compiles nothing."""
import triton.language as tl
from triton.runtime.jit import JITFunction


def scaled_exp_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(y_ptr + offsets, tl.exp(x * scale) * x, mask=offsets < n)


scaled_exp_kernel = JITFunction(scaled_exp_kernel)
