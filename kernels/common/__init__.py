"""What every kernel family shares: the QDQ device functions, the code cache and template rendering, input checks, autograd glue."""
