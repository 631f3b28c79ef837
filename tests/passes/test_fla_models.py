"""FLA's own causal LMs train under ``torch.compile(model, backend="laqat", fullgraph=True)``.

``KDAForCausalLM`` and ``GatedDeltaNetForCausalLM``, tiny (hidden 32, 2 layers of 2 heads of 8, vocab 128),
with FLA's default config (fuse_norm, fuse_swiglu, fuse_cross_entropy on, use_l2warp off: KDA trains with
``FusedLinearCrossEntropyLoss``, GDN with ``FusedCrossEntropyLoss``) and with every fusion off (torch
norms, FLA's ``swiglu``, ``nn.CrossEntropyLoss``), in train mode with labels (one of them ignored): the
loss and every parameter gradient against the uncompiled model under ``naive_fla()`` (fp32, relative
L2 <= 1e-5), one laqat node per layer named ``model.layers.<i>.attn``, no graph break.

The Inductor compiles (one per configuration, forward and backward) dominate the run time; the
configurations share most kernels, so each compile after the first reuses the ones compiled before.
"""
import functools

import pytest
import torch

pytest.importorskip("fla")

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402,F401  (installs the FLA substitutions)
from tests.helpers import assert_close_rel, rel_l2  # noqa: E402
from tests.passes.fla_oracle import naive_fla  # noqa: E402

TOL = 1e-5
CONFIGS = ("kda-fused", "kda-unfused", "gdn-fused", "gdn-unfused")
FUSIONS_OFF = dict(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False)
# the loss op each configuration trains with (KDA's forward fuses the LM head into the loss in training)
LOSS_OP = {"kda-fused": "fused_linear_cross_entropy", "gdn-fused": "cross_entropy"}
VOCAB = 128  # 4x hidden: the logits leave Inductor's graph through their own node (hand_off/linear_outputs.py)


def _classes(family):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

    return (KDAConfig, KDAForCausalLM) if family == "kda" else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM)


def _model(config: str, **overrides):
    family, fusions = config.split("-")
    config_class, model_class = _classes(family)
    options = dict(hidden_size=32, num_hidden_layers=2, head_dim=8, num_heads=2, expand_v=1, vocab_size=VOCAB,
                   intermediate_size=64)
    if fusions == "unfused":
        options.update(FUSIONS_OFF)
    torch.manual_seed(0)
    return model_class(config_class(**options, **overrides)).train()


def _batch(B=2, T=12):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, T), generator=generator)
    labels = tokens.clone()
    labels[0, 3] = -100  # FLA's (and torch's) ignore_index
    return tokens, labels


@functools.cache
def _oracle(config: str):
    """(loss, every parameter's gradient) of the uncompiled model with FLA's torch references."""
    model = _model(config)
    tokens, labels = _batch()
    with naive_fla():
        loss = model(tokens, labels=labels, use_cache=False).loss
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _check_loss_and_grads(config, model, loss, grads=True):
    loss_ref, grads_ref = _oracle(config)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close_rel(loss, loss_ref, TOL, "loss")
    if not grads:
        return
    names = [name for name, _ in model.named_parameters()]
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert len(got) == len(grads_ref) == len(names)
    for name, grad, grad_ref in zip(names, got, grads_ref):
        assert_close_rel(grad, grad_ref, TOL, f"d{name}")


def _check_matches(config, matches):
    family = config.split("-")[0]
    assert [(m.kind, m.frontend, m.module) for m in matches] == [
        (family, "fla", f"model.layers.{i}.attn") for i in range(2)]


def _laqat_calls(readable: str) -> list[str]:
    """The laqat ops a rewritten graph calls, in order (source comments skipped)."""
    return [line.split("torch.ops.laqat.", 1)[1].split("(")[0].split(".")[0] for line in readable.splitlines()
            if "torch.ops.laqat." in line and not line.lstrip().startswith("#")]


def test_fla_default_config_is_what_the_fused_configurations_use():
    """The fused configurations are FLA 0.6's defaults; FLA applies no L2Warp by default."""
    for family in ("kda", "gdn"):
        config = _classes(family)[0]()
        assert config.fuse_norm and config.fuse_swiglu and config.fuse_cross_entropy and not config.use_l2warp
        assert not getattr(config, "fuse_linear_cross_entropy", False)


@pytest.mark.parametrize("config", ["kda-fused", "gdn-fused"])
def test_causal_lm_trains_under_inductor(config):
    """The user's call with the GPU's default hand-off named (on the CPU the default is eager): FLA's default
    (fused) configurations, exact policy, Inductor, fullgraph, training with labels. The unfused ones train under
    the eager hand-off below (Inductor's C++ build is most of a case's time on the CPU)."""
    model = _model(config)
    tokens, labels = _batch()
    compiled = torch.compile(model, backend="laqat", fullgraph=True, options={"compiler": "inductor"})
    out = compiled(tokens, labels=labels, use_cache=False)
    record = la_compiler.backend.last_record().graphs[-1]
    _check_matches(config, record.matches)
    if LOSS_OP.get(config) != "fused_linear_cross_entropy":  # that loss forms no logits
        assert type(out.logits.grad_fn).__name__ == "LinearOutputFunctionBackward"
    else:
        assert out.logits is None
    calls = _laqat_calls(record.readable)
    assert calls.count("delta_rule") == 2
    for op in ("cross_entropy", "fused_linear_cross_entropy"):
        assert calls.count(op) == (1 if LOSS_OP.get(config) == op else 0), (op, calls)
    _check_loss_and_grads(config, model, out.loss)


@pytest.mark.parametrize("config", CONFIGS)
def test_explain_reports_no_graph_break(config):
    model = _model(config)
    tokens, labels = _batch()
    report = la_compiler.explain(model, tokens, labels=labels, use_cache=False)
    assert report.graph_breaks == 0 and len(report.graphs) == 1
    _check_matches(config, report.matches)
    _check_loss_and_grads(config, model, report.output.loss, grads=False)


@pytest.mark.parametrize("config", ["gdn-fused", "kda-unfused", "gdn-unfused"])
def test_eager_hand_off_trains(config):
    model = _model(config)
    tokens, labels = _batch()
    compiled = torch.compile(model, backend="laqat", fullgraph=True, options={"compiler": "eager"})
    out = compiled(tokens, labels=labels, use_cache=False)
    _check_matches(config, la_compiler.backend.last_record().graphs[-1].matches)
    _check_loss_and_grads(config, model, out.loss)


@pytest.mark.filterwarnings("ignore:policy 'state_fp8'.*matched no quantizer")  # its KDA rule, in a GDN model
def test_state_fp8_moves_the_loss_and_adamw_lowers_it():
    """The state FP8 policy changes the loss (two chunks of 64: the second reads a rounded state; weights
    initialised at 0.2 so that the recurrence weighs in the loss), and an AdamW step through the compiled
    model lowers it (the loss of the same batch, compiled forward again: no recompile)."""
    model = _model("gdn-fused", initializer_range=0.2)
    tokens, labels = _batch(B=1, T=72)
    with naive_fla():
        exact = model(tokens, labels=labels, use_cache=False).loss.item()
    compiled = torch.compile(model, backend="laqat", fullgraph=True,
                             options={"policy": "state_fp8", "compiler": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graphs_before = len(la_compiler.backend.last_record().graphs)
    loss = compiled(tokens, labels=labels, use_cache=False).loss
    loss.backward()
    optimizer.step()
    after = compiled(tokens, labels=labels, use_cache=False).loss.item()
    graphs = la_compiler.backend.last_record().graphs[graphs_before:]
    assert len(graphs) == 1, "one compile for both steps"
    assert [m.spec.split("q.state=")[-1].rstrip("]") for m in graphs[0].matches] == ["fp8_e4m3/tile64"] * 2
    moved = rel_l2(loss.detach(), torch.tensor(exact))
    assert 10 * TOL < moved < 1e-2, (loss.item(), exact)
    assert after < loss.item(), (after, loss.item())


AUTOCAST_LOSS_TOL, AUTOCAST_GRAD_TOL = 1e-3, 0.1


@pytest.mark.parametrize("config,hand_off", [("kda-fused", None), ("gdn-fused", None), ("gdn-fused", "inductor")])
def test_causal_lm_trains_under_autocast(config, hand_off):
    """fp32 weights under ``torch.autocast`` to bf16, FLA's defaults (the fused MLP's down projection in the autocast
    dtype: kernels/fla/glu_linear_op.py), the backward outside autocast as torch advises; the default options, and
    GDN's logits under the Inductor hand-off (handed back through hand_off/linear_outputs.py): the loss and every
    gradient against the uncompiled model under ``naive_fla()`` in the same autocast. Bounds at bf16's rounding:
    the torch references round their matmuls to bf16 where laqat's recurrence kernels accumulate in fp32 (worst
    gradient about 4% apart, the gates')."""
    tokens, labels = _batch()
    model, reference = _model(config), _model(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        options = {"compiler": hand_off} if hand_off else None
        loss = torch.compile(model, backend="laqat", options=options)(tokens, labels=labels, use_cache=False).loss
        with naive_fla():
            loss_ref = reference(tokens, labels=labels, use_cache=False).loss
    assert_close_rel(loss, loss_ref, AUTOCAST_LOSS_TOL, "loss")
    loss.backward()
    loss_ref.backward()
    for (name, param), param_ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad.dtype == torch.float32, name
        assert_close_rel(param.grad, param_ref.grad, AUTOCAST_GRAD_TOL, f"d{name}")
