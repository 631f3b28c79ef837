"""The fused recurrent family: token-by-token Triton kernels of GDN/KDA (exact numerics)."""
