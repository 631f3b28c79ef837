"""Quantize-dequantize (QDQ) references: the torch side of NUMERICS.md."""
