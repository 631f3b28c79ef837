"""Quantize-dequantize (QDQ): format configs and torch references (the torch side of docs/numerics.md)."""
from la_compiler.quant.config import QuantConfig, QuantConfigError
from la_compiler.quant.reference import fake_quant, group_amax, quant_scale

__all__ = ["QuantConfig", "QuantConfigError", "fake_quant", "group_amax", "quant_scale"]
