"""What every kernel family shares: the QDQ device functions, the kernel-parameter error, the on-disk cache's atomic writes, input checks, autograd glue."""
