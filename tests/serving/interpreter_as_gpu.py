"""Triton's interpreter rounds fp32 -> bf16 as the GPU does, for the parity tests.

``x.to(tl.bfloat16)`` truncates in Triton's interpreter (``InterpreterBuilder.cast_impl`` drops the low
mantissa bits); compiled for a GPU the same cast rounds to nearest even (``cvt.rn.bf16.f32``). vLLM's
kernels store their bf16 state cache and bf16 outputs with that cast, so the oracle run in the interpreter
would compute a truncating server that does not exist. ``gpu_bf16_rounding()`` makes the interpreter's
fp32 -> bf16 cast round to nearest even (NaN stays NaN) for as long as it is active; every other cast is
Triton's own. laqat's state codecs do not use the cast (kernels/decode/device.py rounds on the bits).
"""
from __future__ import annotations

import contextlib

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((bits >> 16) | 0x40).astype(np.uint16)  # NaN: keep the sign and the payload's top, quieted
    return np.where(np.isnan(x), quiet, rounded).reshape(np.shape(x))


@contextlib.contextmanager
def gpu_bf16_rounding():
    from triton.runtime import interpreter
    import triton.language as tl

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.cast_impl = original
