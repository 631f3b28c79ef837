"""The fla_chunk variant (CUDA only): registration and its refusals; its numerics run in the GPU benchmark."""
import pytest
import torch

pytest.importorskip("fla")

from la_compiler.kernels.fla import chunk_variant as fla_chunk_variant  # noqa: E402
from la_compiler.kernels.registry import get_variant  # noqa: E402

SPEC = "kda[src=fla; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=fla_chunk]"


def _inputs():
    q = k = torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 4, 1, 8)
    return q, k, v, -torch.rand(1, 4, 1, 8), torch.rand(1, 4, 1)


def test_registered_when_fla_is_installed():
    variant = get_variant("fla_chunk")
    assert variant.forward is fla_chunk_variant.fla_chunk_forward
    assert variant.backward is fla_chunk_variant.fla_chunk_backward


def test_refuses_cpu_tensors_naming_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        fla_chunk_variant.fla_chunk_forward(SPEC, *_inputs(), None, None, 0.5)


def test_refuses_rounding_specs():
    with pytest.raises(RuntimeError, match="exact numerics only"):
        fla_chunk_variant.fla_chunk_forward(SPEC.replace("kernel=fla_chunk", "kernel=fla_chunk; q.state=fp8_e4m3/tile64"),
                                            *_inputs(), None, None, 0.5)


def test_gdn_backward_blocker_follows_flas_guard(monkeypatch):
    import fla.utils

    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", False)
    assert "3.7.1" in fla_chunk_variant.gdn_backward_blocker()
    gdn = SPEC.replace("kda[", "gdn[")
    q, k, v, _, beta = _inputs()
    with pytest.raises(RuntimeError, match="cannot differentiate.*3.7.1.*kernel=fused_recurrent"):
        fla_chunk_variant.fla_chunk_backward(gdn, q, k, v, -torch.rand(1, 4, 1), beta, None, None, 0.5,
                                             torch.randn(1, 4, 1, 8), None)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", True)
    assert fla_chunk_variant.gdn_backward_blocker() is None
