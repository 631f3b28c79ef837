"""FLA's own kernels as a variant (exact numerics, CUDA)."""
