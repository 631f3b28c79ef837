"""The Inductor hand-off rebuilds outputs that alias intermediates with as_strided, not by replaying their
recorded views: on torch 2.11 + CUDA the replay read garbage sizes for FLA's GDN LM logits at T=4096
(docs/architecture.md, "The hand-off")."""
import pytest
import torch

import la_compiler.backend


def test_the_hand_off_compiles_without_view_replay(monkeypatch):
    import torch._inductor.compile_fx as inductor

    seen = []
    original = inductor.compile_fx

    def recording(gm, inputs, *args, **kwargs):
        seen.append(torch._functorch.config.view_replay_for_aliased_outputs)
        return original(gm, inputs, *args, **kwargs)
    monkeypatch.setattr(inductor, "compile_fx", recording)

    def fn(x):
        y = (x * 2).view(2, 3, 4)  # an output that aliases an intermediate
        return y, y.transpose(1, 2)
    x = torch.randn(24, requires_grad=True)
    y, yt = torch.compile(fn, backend="laqat", options={"compiler": "inductor"})(x)
    assert seen and not any(seen)  # compile_fx calls itself once more to apply laqat's config patches
    assert torch.equal(y, (x * 2).view(2, 3, 4)) and torch.equal(yt, y.transpose(1, 2))
    assert yt._base is not None or yt.data_ptr() == y.data_ptr()  # still views of one buffer
    (y.sum() + yt.square().sum()).backward()
    assert torch.allclose(x.grad, 2 + 8 * x.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the crash needs CUDA (torch 2.11, H200)")
def test_gdn_lm_at_the_shape_that_crashed_trains_under_inductor():
    """The smallest shape it reproduced at: 4 layers, T=4096 (2 layers at T=4096, 4 at T=2048 ran)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=1024, num_hidden_layers=4, num_heads=8, head_dim=128, expand_v=1,
                                 vocab_size=32000)
    model = GatedDeltaNetForCausalLM(config).cuda().bfloat16()
    ids = torch.randint(0, 32000, (2, 4096), device="cuda")
    compiled = torch.compile(model, backend="laqat", options={"policy": "state_fp8", "compiler": "inductor"})
    for _ in range(2):
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert torch.isfinite(loss)
    assert la_compiler.backend.last_record().graphs[-1].matches
