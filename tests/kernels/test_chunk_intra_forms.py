"""One kernel per form of the chunk intra stages: the form a spec fixes (chunk/forms.py) picks the stage's kernel in
the launch plan and in ``laqat source``, and each kernel takes the spec constexprs its own signature names."""
import inspect

import pytest
import torch
import triton.language as tl

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels import sources
from la_compiler.kernels.chunk import forms, stages
from la_compiler.kernels.chunk.flags import spec_constexprs
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.plan import ChunkShape, chunk_plan
from la_compiler.options import TuningOptions

PAIR_FP8 = {"key_interaction.lhs": "fp8_e4m3/row", "key_interaction.rhs": "fp8_e4m3/row"}

# (kind, spec fields, the forward intra form, the backward intra form)
FORMS = [
    ("gdn", {}, "gdn", "key_blocks"),
    ("gdn", {"solve": "neumann", "degree": 2}, "gdn", "rows"),
    ("gdn", {"quant": PAIR_FP8}, "gdn", "rows"),
    ("gdn", {"quant": {"state_read.rhs": "fp8_e4m3/row"}}, "gdn", "rows"),
    ("kda", {}, "kda", "split_pairs"),
    ("kda", {"quant": PAIR_FP8}, "kda", "split_pairs"),
    ("kda", {"solve": "neumann", "degree": 2}, "kda", "rows"),
]


def _spec(kind, fields):
    return RecurrenceSpec(kind=kind, chunk=16, kernel="chunk").replace(**fields)


def _signature_constexprs(kernel) -> set[str]:
    return {a.name for a in inspect.signature(kernel.fn).parameters.values() if a.annotation is tl.constexpr}


@pytest.mark.parametrize("kind, fields, fwd_form, bwd_form", FORMS)
def test_the_form_picks_the_intra_kernels(kind, fields, fwd_form, bwd_form):
    spec = _spec(kind, fields)
    p = ChunkParams.from_spec(spec)
    assert (forms.fwd_intra_form(p), forms.bwd_intra_form(p)) == (fwd_form, bwd_form)
    plan = chunk_plan(p, ChunkShape(B=1, T=20, H=1, HV=1, K=16, V=16, N=1, NT=2, varlen=False), torch.float32,
                      TuningOptions())
    assert (plan.forward_intra_form, plan.backward_intra_form) == (fwd_form, bwd_form)
    for launch, direction, form in ((plan.fwd_intra, "fwd", fwd_form), (plan.bwd_intra, "bwd", bwd_form)):
        kernel = stages.kernel(direction, f"intra_{form}")
        assert launch.kernel is kernel and kernel.fn.__name__ == f"chunk_{direction}_kernel_intra_{form}"
        # every spec constexpr the kernel names, with the spec's value, and no other
        values = spec_constexprs(p)
        named = _signature_constexprs(kernel) & values.keys()
        assert {n: launch.constexprs[n] for n in named} == {n: values[n] for n in named}
        assert not (set(launch.constexprs) - _signature_constexprs(kernel))
    roles = sources.paths_of_spec(spec)
    assert roles[f"forward intra_{fwd_form}"].name == f"fwd_intra_{fwd_form}.py"
    assert roles[f"backward intra_{bwd_form}"].name == f"bwd_intra_{bwd_form}.py"
    assert sum(role.startswith(("forward intra", "backward intra")) for role in roles) == 2


def test_each_form_names_only_what_varies_in_it():
    """The form fixes the kind and the solve's family where it can: those constexprs are gone from its kernel."""
    split, key_blocks, rows = (stages.kernel("bwd", f"intra_{f}") for f in ("split_pairs", "key_blocks", "rows"))
    assert not {"KDA", "SOLVE", "DEGREE", "PAIRS_ROUNDED", "SUB_CHUNK"} & _signature_constexprs(split)
    assert not {"KDA", "SOLVE", "Q_KEY_INTERACTION_LHS", "Q_STATE_READ_RHS"} & _signature_constexprs(key_blocks)
    assert {"KDA", "SOLVE", "DEGREE", "PAIRS_ROUNDED", "Q_KEY_INTERACTION_LHS"} <= _signature_constexprs(rows)
    gdn, kda = (stages.kernel("fwd", f"intra_{f}") for f in ("gdn", "kda"))
    assert "KDA" not in _signature_constexprs(gdn) | _signature_constexprs(kda)
    assert "FACTORED_PAIRS" in _signature_constexprs(gdn) and "FACTORED_PAIRS" not in _signature_constexprs(kda)
