"""The kernel of every chunk stage, and the constexprs a spec fixes in it: what the launchers (fwd.py, bwd.py)
run for ``ChunkParams``.

A stage module holds the ``@triton.jit`` kernel of each of its stages (``KERNELS``: stage -> kernel) and the
names of the spec-derived constexprs each takes (``SPEC_CONSTEXPRS``: stage -> names, values from
``chunk/flags.py``); its launch arguments are the launcher's. A stage not listed here still comes from the
generated module of ``chunk/codegen.py``.
"""
from __future__ import annotations

from la_compiler.kernels.chunk.codegen import chunk_bwd_module, chunk_fwd_module
from la_compiler.kernels.chunk.flags import pick
from la_compiler.kernels.chunk.params import ChunkParams

# (direction, stage) -> stage module
STAGES: dict[tuple[str, str], object] = {}

# pairs_rounded: KDA's pair products (or their gradients) with rounding, column by column (forms.kda_rounds_pairs)
FORWARD_STAGES = ("cumsum", "pair_amax", "pairs", "pairs_rounded", "intra", "wu", "h", "o")
BACKWARD_STAGES = ("dh", "intra", "pairs", "pairs_rounded", "dg")
_GENERATED_NAME = {"pairs_rounded": "pairs"}  # the templates' kernel of the stage


def stage_kernel(p: ChunkParams, direction: str, stage: str):
    """(kernel, spec constexprs) of one stage for ``p``: ``kernel[grid](*args, **constexprs, **launch's)``."""
    module = STAGES.get((direction, stage))
    if module is not None:
        return module.KERNELS[stage], pick(p, module.SPEC_CONSTEXPRS[stage])
    generated = chunk_fwd_module(p) if direction == "fwd" else chunk_bwd_module(p)
    return getattr(generated, f"chunk_{p.kind}_{direction}_kernel_{_GENERATED_NAME.get(stage, stage)}"), {}
