"""Kernels: one sub-package per family, the registry and the selection table at the bottom.

    common/      what every family shares: QDQ device functions, the kernel-parameter error, the on-disk
                 cache's atomic writes, input checks, autograd glue, shared selection conditions
    chunk/       chunked (WY) Triton kernels, forward and backward, every quant site
    recurrent/   token-by-token Triton kernels (exact numerics)
    decode/      fused Triton kernels of decode-phase training
    reference/   the fp64 torch references and the variants built on them
    fla/         FLA's own kernels as a variant
    registry.py  kernel variants: entry points, what each supports, the modules it runs
    selection.py the order in which the registered variants are tried
    sources.py   what a spec runs, for people reading it

The families register their variants here: these imports are the only ones from this package up to
the families (docs/architecture.md, "Layers").
"""
if __name__ == "kernels":  # the repository root on sys.path: the installed "kernels" keeps its name
    import os as _os

    from la_compiler.shadowed_name import hand_over

    hand_over(__name__, _os.path.dirname(__file__))
    del _os, hand_over
    # this module's namespace is no longer the one importers get; what follows registers under la_compiler.kernels

from la_compiler.kernels.chunk import variant as _chunk  # noqa: F401
from la_compiler.kernels.decode import fused as _decode_fused  # noqa: F401
from la_compiler.kernels.decode import serving as _decode_serving  # noqa: F401
from la_compiler.kernels.fla import chunk_variant as _fla_chunk  # noqa: F401
from la_compiler.kernels.recurrent import variant as _fused_recurrent  # noqa: F401
from la_compiler.kernels.reference import decode_variant as _decode_reference  # noqa: F401
from la_compiler.kernels.reference import variant as _reference  # noqa: F401
