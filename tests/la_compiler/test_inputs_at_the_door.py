"""Bad inputs of a laqat node are errors naming the argument, before any kernel runs; float64 is computed in
float64 (the fp64 reference variant), never at fp32 accuracy behind a float64 dtype."""
import pytest
import torch

import la_compiler.backend  # noqa: F401  (registers the ops and the FLA frontend)
from la_compiler.ir.checks import IRInputError
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs

SPEC = "gdn[src=user; kernel=auto]"


def _op(q, k, v, g, beta, h0=None, cu=None):
    return torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, cu, 0.5, SPEC)


def _inputs(T=8, dtype=torch.float32):
    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=T, H=1, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("offsets, message", [
    ([0, 3, 12], r"end at T=8; got \[0, 3, 12\]"),  # past T: read out of bounds before this check
    ([1, 8], r"start at 0"),
    ([0, 5, 3, 8], r"never decrease"),
])
@pytest.mark.parametrize("compiled", [False, True])
def test_cu_seqlens_values_are_checked_before_a_kernel_runs(offsets, message, compiled):
    q, k, v, g, beta = _inputs()
    cu = torch.tensor(offsets, dtype=torch.int32)
    fn = torch.compile(_op, backend="laqat", fullgraph=True, options={"compiler": "eager"}) if compiled else _op
    with pytest.raises(IRInputError, match=r"cu_seqlens must start at 0, never decrease and end at T=8.*" if
                       "T=8" not in message else message):
        fn(q, k, v, g, beta, None, cu)


@pytest.mark.parametrize("bad, message", [
    ("float_offsets", r"cu_seqlens must be int32 or int64 offsets, got torch.float32"),
    ("k_float64", r"q and k must have one dtype, got q torch.float32 and k torch.float64"),
    ("rank3_q", r"q must have 4 dims .*got shape \(1, 8, 4\)"),
])
def test_bad_tensors_are_compile_time_errors_naming_the_argument(bad, message):
    q, k, v, g, beta = _inputs()
    cu = None
    if bad == "float_offsets":
        cu = torch.tensor([0.0, 8.0])
    elif bad == "k_float64":
        k = k.double()
    elif bad == "rank3_q":
        q = q[:, :, 0]
    fn = torch.compile(_op, backend="laqat", fullgraph=True, options={"compiler": "inductor"})
    with pytest.raises(IRInputError, match=message):  # as itself, not wrapped in Dynamo's TorchRuntimeError
        fn(q, k, v, g, beta, None, cu)


def test_float64_is_computed_in_float64():
    q, k, v, g, beta = (x.requires_grad_() for x in _inputs(T=5, dtype=torch.float64))
    fn = torch.compile(_op, backend="laqat", fullgraph=True, options={"compiler": "inductor"})
    o, ht = fn(q, k, v, g, beta)
    (match,) = la_compiler.backend.last_record().graphs[-1].matches
    assert match.kernel == "reference", match.kernel_reason
    ro, rht = delta_rule_reference(q, k, v, g, beta, kind="gdn", scale=0.5)
    assert o.dtype == torch.float64 and rel_l2(o, ro) < 1e-13 and rel_l2(ht, rht) < 1e-13
    assert torch.autograd.gradcheck(lambda *xs: fn(*xs)[0], (q, k, v, g, beta))


def test_fla_call_with_offsets_past_t_is_refused_before_a_kernel_runs():
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta = _inputs()

    def fn(q, k, v, g, beta, cu):
        return fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)[0]
    compiled = torch.compile(fn, backend="laqat", fullgraph=True, options={"compiler": "inductor"})
    with pytest.raises(IRInputError, match=r"cu_seqlens must start at 0, never decrease and end at T=8; got "
                                           r"\[0, 3, 12\]"):
        compiled(q, k, v, g, beta, torch.tensor([0, 3, 12], dtype=torch.int32))
