"""Triton's interpreter made to compute what the GPU computes, where vLLM's kernels need it.

Triton 3.9's interpreter stores bf16 values as their uint16 bit patterns, and several of its operations
work on those bits as if they were numbers:

- ``x.to(tl.bfloat16)`` from fp32 truncates (``InterpreterBuilder.cast_impl`` drops the low mantissa
  bits); compiled, the cast rounds to nearest even (``cvt.rn.bf16.f32``). vLLM's kernels store their bf16
  state cache and bf16 outputs with that cast;
- ``tl.dot`` of bf16 operands multiplies the bit patterns (``create_dot`` hands them to ``np.matmul``);
- arithmetic, comparisons, math functions, fma and reductions on bf16 values (``binary_op``,
  ``unary_op``, ``create_fma``, ``tl.sum``), and casts from bf16 to anything but fp32, do the same.

vLLM's chunk kernels compute on bf16 values in all these ways, so interpreted unchanged they return
garbage (or a truncating server that does not exist). ``interpreter_as_gpu()`` fixes them while it is
active: bf16 values are widened to fp32 exactly, the operation runs in fp32 (a dot accumulates in its
accumulator dtype, fp32, as tensor cores multiply bf16 exactly and accumulate in fp32), and a bf16 result
is rounded to nearest even, as the GPU rounds each bf16 operation; NaN stays NaN. The order in which a
GPU accumulates a dot or a reduction is its own and is not reproduced. Every fp32 / fp16 operation is
Triton's. laqat's decode kernels compute in fp32 and round on the bits (kernels/decode/device.py), so only
their bf16 output store goes through the patched cast.
"""
from __future__ import annotations

import contextlib

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    x = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((bits >> 16) | 0x40).astype(np.uint16)  # NaN: sign and payload's top bits kept, quieted
    return np.where(np.isnan(x), quiet, rounded).reshape(x.shape)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


_ARITHMETIC = (np.add, np.subtract, np.multiply, np.divide, np.fmod, np.minimum, np.maximum, np.fmin, np.fmax)
_COMPARISONS = (np.less, np.greater, np.less_equal, np.greater_equal, np.equal, np.not_equal)


@contextlib.contextmanager
def interpreter_as_gpu():
    import triton.language as tl
    from triton.runtime import interpreter

    handle, builder, reduce_ops = interpreter.TensorHandle, interpreter.InterpreterBuilder, interpreter.ReduceOps
    originals = {name: getattr(builder, name) for name in ("cast_impl", "create_dot", "binary_op", "unary_op",
                                                             "create_fma")}
    original_sum = reduce_ops.sum

    def is_bf16(x):
        return x.dtype.scalar == tl.bfloat16

    def wide(x):
        return bf16_values(x.data) if is_bf16(x) else x.data

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(bf16_bits(src.data), dst_type.scalar)
        if is_bf16(src) and dst_type.scalar not in (tl.float32, tl.bfloat16):
            src = handle(bf16_values(src.data), tl.float32)
        return originals["cast_impl"](self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a) or is_bf16(b):
            out = np.matmul(wide(a).astype(np.float32), wide(b).astype(np.float32), dtype=d.data.dtype) + d.data
            return handle(out, d.dtype.scalar)
        return originals["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) and is_bf16(rhs) and op in _ARITHMETIC:
            return handle(bf16_bits(op(wide(lhs), wide(rhs))), tl.bfloat16)
        if is_bf16(lhs) and is_bf16(rhs) and op in _COMPARISONS:
            return handle(op(wide(lhs), wide(rhs)).astype(np.uint16), tl.bfloat16)  # as Triton widens a bool
        return originals["binary_op"](self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return handle(bf16_bits(op(wide(arg)).astype(np.float32)), tl.bfloat16)
        return originals["unary_op"](self, arg, op)

    def create_fma(self, x, y, z):
        if is_bf16(z):
            product = np.multiply(wide(x), wide(y), dtype=np.float64)
            return handle(bf16_bits(np.add(product, wide(z), dtype=np.float64).astype(np.float32)), tl.bfloat16)
        return originals["create_fma"](self, x, y, z)

    def reduce_sum(self, input):
        if is_bf16(input.handle):
            total = np.sum(bf16_values(input.handle.data), axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(bf16_bits(total), input.dtype)
        return original_sum(self, input)

    patched = {"cast_impl": cast_impl, "create_dot": create_dot, "binary_op": binary_op, "unary_op": unary_op,
               "create_fma": create_fma}
    for name, fn in patched.items():
        setattr(builder, name, fn)
    reduce_ops.sum = reduce_sum
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(builder, name, fn)
        reduce_ops.sum = original_sum
