"""Quantize-dequantize (QDQ): format configs and torch references (the torch side of NUMERICS.md)."""
from la_compiler.quant.config import QuantConfig, QuantConfigError

__all__ = ["QuantConfig", "QuantConfigError"]
