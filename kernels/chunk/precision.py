"""What the chunk kernels multiply in, and what they keep their intermediates in.

Two precisions per launch:

* ``DOT_PRECISION``, of the pair products, the solve and their gradients (fp32 operands): IEEE for fp32
  inputs (the exact-numerics contract), TF32 for 16-bit inputs. GDN's pair products take ``GEMM_PRECISION``
  (their operands are raw inputs, 16-bit numbers that TF32 holds exactly, so bf16 operands form the same
  products), and so do the four products of its key-blocked backward's pair gradients with K and Q (as FLA's
  backward does);
* ``GEMM_PRECISION``, of the GEMMs over values and states (W and U from T, W h, K^T V_new, Q h, A_qk V_new,
  the state gradient's and the input gradients' products with h, dh, V_new, dO): for 16-bit inputs and
  specs that round no GEMM operand, operands in the input dtype with fp32 accumulation, FLA's own
  numerics (its kernels keep w, u, h, v_new, dh in the input dtype and multiply them in it), and the
  intermediates W, U, h, V_new, dh, dV_new stored in the input dtype (half the memory traffic of the
  serial h / dh stages). Otherwise the same as ``DOT_PRECISION`` with fp32 intermediates.

Specs with GEMM operand QDQ, accumulator emulation or the W quantizer keep fp32 operands: a rounded
operand (FP8 value times an fp32 scale) is not a bf16 number, and casting it would round it again. The
state quantizer does not block the 16-bit GEMMs: the state carried from chunk to chunk stays fp32 and is
rounded by its quantizer; the GEMMs read it in the input dtype, as FLA's kernels (and a serving engine
running them on a dequantized FP8 state) do. The numerics option ``n.gemm=tf32`` keeps fp32 operands (TF32)
and fp32 intermediates for 16-bit inputs; ``n.fp32_dot=tf32x3`` takes Triton's three-pass TF32 split for fp32
inputs (``la_compiler.options.NumericsOptions``).
"""
from __future__ import annotations

import torch

from la_compiler.options import interpreter

_SIXTEEN_BIT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def dot_precision(p, dtype: torch.dtype) -> str:
    """tf32 for 16-bit inputs; for fp32 inputs IEEE (the exact-numerics contract), or with n.fp32_dot=tf32x3
    Triton's three-pass TF32 split (tensor cores, close to fp32)."""
    if dtype not in (torch.float32, torch.float64):
        return "tf32"
    return p.numerics.fp32_dot


def rounds_gemm_operands(p) -> bool:
    """The spec rounds a GEMM operand (a site, the W quantizer) or emulates an accumulator."""
    return bool(p.operands or p.acc or p.w_quant)


def gemm_precision(p, dtype: torch.dtype) -> str:
    """``GEMM_PRECISION`` of ``p``'s kernels for inputs of ``dtype``: "bf16" / "fp16" (operands cast to
    the input dtype), else ``dot_precision(dtype)``. Under Triton's interpreter "bf16_rounded" /
    "fp16_rounded": its tl.dot of bf16 operands returns garbage (Triton 3.9), so the operands are rounded
    to the 16-bit format (to nearest even) and multiplied in fp32, which gives the same products (a
    product of two 16-bit numbers is exact in fp32); only the order of the fp32 sums may differ."""
    if dtype in _SIXTEEN_BIT and p.numerics.gemm == "input" and not rounds_gemm_operands(p):
        return _SIXTEEN_BIT[dtype] + ("_rounded" if interpreter() else "")
    return dot_precision(p, dtype)


def _sixteen_bit(precision: str) -> str | None:
    """"bf16" / "fp16" for a 16-bit ``GEMM_PRECISION`` (the interpreter's "_rounded" stand-ins too), else None."""
    name = precision.split("_")[0]
    return name if name in _SIXTEEN_BIT.values() else None


def intermediate_dtype(precision: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of W, U, h, V_new, dh, dV_new for a ``GEMM_PRECISION``: the input dtype for 16-bit GEMMs."""
    return dtype if _sixteen_bit(precision) else torch.float32


def describe(p, dtype: torch.dtype) -> str:
    """What the chunk kernels multiply in for ``p`` and inputs of ``dtype`` (the selection's explanation)."""
    gemm = gemm_precision(p, dtype)
    name = _sixteen_bit(gemm)
    if name:
        return (f"GEMMs over values and states in {name} with fp32 accumulation, W/U/h/V_new kept in {name} "
                f"(FLA's numerics); pair products and solve in {dot_precision(p, dtype)}")
    if dtype not in _SIXTEEN_BIT:
        return f"every dot in fp32 ({gemm})"
    why = "the spec rounds GEMM operands" if rounds_gemm_operands(p) else "n.gemm=tf32"
    return f"fp32 GEMM operands and intermediates, dots in {gemm} ({why})"

