"""Registers the built-in kernel variants (imported lazily by ``registry``)."""
import importlib.util

from la_compiler.kernels import fused_recurrent  # noqa: F401
from la_compiler.kernels import chunk_variant  # noqa: F401
from la_compiler.kernels import reference_variant  # noqa: F401
from la_compiler.kernels import decode_reference_variant  # noqa: F401
from la_compiler.kernels import decode_fused  # noqa: F401

if importlib.util.find_spec("fla") is not None:
    from la_compiler.kernels import fla_chunk_variant  # noqa: F401
