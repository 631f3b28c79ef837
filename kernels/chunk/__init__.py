"""The chunk family: chunked (WY) Triton kernels of GDN/KDA, forward and backward, every quant site."""
