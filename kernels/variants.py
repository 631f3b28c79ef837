"""Registers the built-in kernel variants (imported lazily by ``registry``)."""
from la_compiler.kernels import reference_variant  # noqa: F401
