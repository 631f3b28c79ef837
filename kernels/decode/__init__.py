"""The decode family: fused Triton kernels of decode-phase training (token / replay state rounding)."""
