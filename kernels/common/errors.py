"""The error of a kernel family's parameters: a spec the family cannot specialize its kernels for."""
from __future__ import annotations

from la_compiler.error_base import LaqatError


class KernelParamsError(LaqatError, ValueError):
    """A spec a kernel family cannot run (``ChunkParams``, ``FusedRecurrentParams``: the reason names the spec field),
    or a spec that names no Triton kernel family (``kernels/sources.py``)."""
