"""A model traced by Dynamo compiles once: later training steps of the same shapes run the first compile. FLA's KDA
layers call einops, whose lazily registered torch backend used to break a guard at the second call
(la_compiler/backend.py, ``_register_einops_torch_backend``)."""
import pytest
import torch

pytest.importorskip("fla")


@pytest.mark.parametrize("layers", [("kda",), ("gdn",)])
def test_later_steps_reuse_the_first_compile(layers):
    from torch._dynamo.utils import counters

    from la_compiler.tiny_models import TinyConfig, TinyHybridLM

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.compile(TinyHybridLM(TinyConfig(layers=layers)), backend="laqat")
    tokens = torch.randint(0, 64, (2, 20))
    for _ in range(3):
        model(tokens).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
