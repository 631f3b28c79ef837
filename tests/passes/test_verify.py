import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.passes.verify import IRVerificationError
from tests.ir_inputs import random_inputs


def _compile(fn, *args):
    return torch.compile(fn, backend="laqat", options={"compiler": "eager"})(*args)


def test_verifier_rejects_a_gdn_node_with_a_kda_gate():
    (q, k, v, g, beta, _), _ = random_inputs("kda", T=3, requires_grad=False)
    spec = RecurrenceSpec(kind="gdn").to_string()
    with pytest.raises(Exception, match=r"g has shape \(1, 3, 2, 4\), the IR needs \(1, 3, 2\)"):
        _compile(lambda *a: torch.ops.laqat.delta_rule(*a, None, None, 0.5, spec)[0], q, k, v, g, beta)


def test_verifier_rejects_bad_initial_state_layout():
    (q, k, v, g, beta, h0), _ = random_inputs("gdn", T=3, K=4, V=3, initial_state=True, requires_grad=False)
    spec = RecurrenceSpec(kind="gdn", state="vk").to_string()
    with pytest.raises(Exception, match=r"initial_state has shape \(1, 2, 4, 3\), the IR needs \(1, 2, 3, 4\)"):
        _compile(lambda *a: torch.ops.laqat.delta_rule(*a, None, 0.5, spec)[0], q, k, v, g, beta, h0)


def test_verifier_rejects_non_positive_scale():
    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=3, requires_grad=False)
    spec = RecurrenceSpec(kind="gdn").to_string()
    with pytest.raises(Exception, match="scale must be a positive float"):
        _compile(lambda *a: torch.ops.laqat.delta_rule(*a, None, None, -1.0, spec)[0], q, k, v, g, beta)


def test_verifier_error_type_is_exposed():
    assert issubclass(IRVerificationError, RuntimeError)
