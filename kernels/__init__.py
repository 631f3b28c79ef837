"""Kernels: generated Triton source, the code cache, launchers, autograd glue, fp64 references."""
