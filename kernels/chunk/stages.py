"""The kernel of every chunk stage, and the constexprs a spec fixes in it: what the launch plan (chunk/plan.py)
runs for ``ChunkParams``, and what ``laqat source SPEC`` shows.

A stage module holds the ``@triton.jit`` kernel of each of its stages (``KERNELS``: stage -> kernel) and, at its
end, the launchers that take the plan and the tensors. The spec-derived constexprs of a kernel are those of its
``tl.constexpr`` arguments that ``chunk/flags.py`` gives values (``flags.spec_constexpr_names``).
"""
from __future__ import annotations

from types import ModuleType

from la_compiler.kernels.chunk import (bwd_dg, bwd_dh, bwd_intra_key_blocks, bwd_intra_rows, bwd_intra_split_pairs,
                                       bwd_pairs, forms, fwd_h, fwd_intra, fwd_intra_gdn, fwd_intra_kda, fwd_o,
                                       fwd_pairs)
from la_compiler.kernels.chunk.flags import kernel_spec_constexprs
from la_compiler.kernels.chunk.params import ChunkParams

# pairs_rounded: KDA's pair products (or their gradients) with rounding, column by column (forms.kda_rounds_pairs);
# intra_<form>: the intra stage's kernel of each form (forms.fwd_intra_form, forms.bwd_intra_form)
STAGES: dict[tuple[str, str], ModuleType] = {
    ("fwd", "cumsum"): fwd_pairs,
    ("fwd", "pair_amax"): fwd_pairs,
    ("fwd", "pairs"): fwd_pairs,
    ("fwd", "pairs_rounded"): fwd_pairs,
    ("fwd", "intra_gdn"): fwd_intra_gdn,
    ("fwd", "intra_kda"): fwd_intra_kda,
    ("fwd", "wu"): fwd_intra,
    ("fwd", "h"): fwd_h,
    ("fwd", "o"): fwd_o,
    ("bwd", "dh"): bwd_dh,
    ("bwd", "intra_split_pairs"): bwd_intra_split_pairs,
    ("bwd", "intra_key_blocks"): bwd_intra_key_blocks,
    ("bwd", "intra_rows"): bwd_intra_rows,
    ("bwd", "pairs"): bwd_pairs,
    ("bwd", "pairs_rounded"): bwd_pairs,
    ("bwd", "dg"): bwd_dg,
}


def kernel(direction: str, stage: str):
    """The ``@triton.jit`` kernel of one stage ("fwd" / "bwd", a name of ``STAGES``)."""
    return STAGES[(direction, stage)].KERNELS[stage]


def stages_of(p: ChunkParams) -> list[tuple[str, str]]:
    """The (direction, stage) pairs a training step of ``p`` can launch (the backward's recompute of W and U from
    a kept residual included)."""
    pairs = "pairs_rounded" if forms.kda_rounds_pairs(p) else "pairs"
    forward = []
    if forms.kda_pairs_kernel(p):
        forward += ["cumsum"] + (["pair_amax"] if forms.kda_pairs_nvfp4(p) else []) + [pairs]
    forward += [f"intra_{forms.fwd_intra_form(p)}", "wu", "h", "o"]
    backward = ["dh", f"intra_{forms.bwd_intra_form(p)}"] + ([pairs, "dg"] if forms.kda_splits_pair_grads(p) else [])
    return [("fwd", s) for s in forward] + [("bwd", s) for s in backward]


def modules_of(p: ChunkParams) -> dict[str, ModuleType]:
    """The stage modules ``p`` runs, by role ("forward intra_gdn", "forward wu", ...), in launch order."""
    roles: dict[ModuleType, list[str]] = {}
    for direction, stage in stages_of(p):
        roles.setdefault(STAGES[(direction, stage)], []).append(stage)
    return {f"{'backward' if module.__name__.split('.')[-1].startswith('bwd') else 'forward'} {', '.join(names)}":
            module for module, names in roles.items()}


def constexprs_of(p: ChunkParams) -> dict[str, object]:
    """Every spec-derived constexpr of the stages ``p`` runs, with its value."""
    values: dict[str, object] = {}
    for direction, stage in stages_of(p):
        values.update(kernel_spec_constexprs(p, kernel(direction, stage)))
    return values
