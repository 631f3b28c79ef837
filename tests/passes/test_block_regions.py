"""FLA's blocks traced once (passes/frontends/fla/block_regions.py) and inlined back (passes/inline_regions.py).

The oracle is the same model traced without regions (FLA's own block forward restored): the graph laqat's passes
see is the same op for op, every node under the same module path; training under ``torch.compile(model,
backend="laqat")`` gives the same loss and gradients, bit for bit; a per-layer policy gives each layer its own
spec. Dynamo really reuses the first block's trace (one region body for every block). Calls that are not plain
training calls, and calls traced for another backend, keep FLA's forward; a block that returns more than its hidden states is refused; the inliner leaves
other regions alone and refuses module paths it cannot place.
"""
import contextlib

import pytest
import torch

pytest.importorskip("fla")

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402,F401  (installs the FLA substitutions)
from la_compiler.backend_mark import mark_laqat_backend  # noqa: E402
from la_compiler.passes.frontends.fla import block_regions  # noqa: E402
from la_compiler.passes.frontends.fla.substitutions import UnsupportedArgumentError  # noqa: E402
from la_compiler.passes.inline_regions import (RegionInlineError, inline_block_regions,  # noqa: E402
                                               rebased_module_stack)

pytestmark = pytest.mark.skipif(not block_regions.dynamo_reuses_regions(),
                                reason="this torch's Dynamo does not reuse a region's trace: no block regions")

VOCAB = 64
FP8_STATE = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}


def _model(family: str, layers: int = 3, **overrides):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

    config_class, model_class = ((KDAConfig, KDAForCausalLM) if family == "kda"
                                 else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM))
    torch.manual_seed(0)
    return model_class(config_class(hidden_size=32, num_hidden_layers=layers, head_dim=8, num_heads=2, expand_v=1,
                                    vocab_size=VOCAB, intermediate_size=64, **overrides)).train()


def _tokens(B=2, T=12):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _without_regions():
    """FLA's own block forward (laqat's other substitutions stay)."""
    saved = {cls: cls.__dict__["forward"] for cls in block_regions.block_classes()}
    try:
        for cls, current in saved.items():
            cls.forward = current.__laqat_original__
        yield
    finally:
        for cls, current in saved.items():
            cls.forward = current


def _graph(model, tokens, laqats=True):
    """(the graph Dynamo hands the backend, the graph after ``inline_block_regions``), the backend marked as laqat's
    or not."""
    seen = {}

    def backend(gm, example_inputs):
        seen["traced"] = [n.target for n in gm.graph.nodes]
        inline_block_regions(gm)
        seen["inlined"] = gm
        return gm.forward

    if laqats:
        mark_laqat_backend(backend)
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=tokens, labels=tokens, use_cache=False)
    return seen["traced"], seen["inlined"]


def _ops(gm):
    """Each call's target and module path, in order."""
    def path(node):
        stack = node.meta.get("nn_module_stack") or {}
        return [p for p, _ in stack.values()][-1] if stack else ""
    return [(str(n.target), path(n)) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_a_model_traced_with_block_regions_inlines_to_the_graph_traced_without(family):
    tokens = _tokens()
    traced, inlined = _graph(_model(family), tokens)
    calls = [t for t in traced if t is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 3  # every block in a region, one body for all
    assert sum(1 for t in traced if isinstance(t, str) and t.startswith("subgraph")) == 3
    with _without_regions():
        plain_traced, plain = _graph(_model(family), tokens)
    assert torch.ops.higher_order.invoke_subgraph not in plain_traced
    ops, plain_ops = _ops(inlined), _ops(plain)
    assert [t for t, _ in ops if t != "<built-in function getitem>"] == \
        [t for t, _ in plain_ops if t != "<built-in function getitem>"]
    layer_paths = {p for _, p in ops if ".layers." in p}
    assert layer_paths == {p for _, p in plain_ops if ".layers." in p}
    assert {p.split(".layers.")[1].split(".")[0] for p in layer_paths} == {"0", "1", "2"}
    recurrences = [p for t, p in ops if "delta_rule" in t]
    assert [p.split("model.")[-1] for p in recurrences] == [f"layers.{i}.attn" for i in range(3)]


UNFUSED = dict(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False)


@pytest.mark.parametrize("family, fusions", [("kda", {}), ("gdn", {}), ("kda", UNFUSED)])
def test_training_with_block_regions_is_bitwise_the_training_without(family, fusions):
    """FLA's default fusions, and none (FLA's SwiGLU ``autograd.Function`` in the region's body)."""
    tokens = _tokens()

    def step():
        torch._dynamo.reset()
        model = _model(family, **fusions)
        loss = torch.compile(model, backend="laqat")(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step()
    with _without_regions():
        plain_loss, plain_grads = step()
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_a_per_layer_policy_gives_each_inlined_layer_its_own_spec_and_explain_notes_the_regions():
    policy = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*layers.1.attn.*state_quantizer", "cfg": FP8_STATE}]}
    tokens = _tokens()

    seen_notes = []

    def specs():
        torch._dynamo.reset()
        report = la_compiler.explain(_model("kda"), input_ids=tokens, labels=tokens, use_cache=False, policy=policy)
        seen_notes[:] = report.notes
        return {m.module: m.spec for m in report.matches}

    with_regions = specs()
    assert any(n.startswith("3 FLA block calls traced as one region each") for n in seen_notes)
    with _without_regions():
        assert specs() == with_regions
        assert not any("FLA block calls" in n for n in seen_notes)
    assert sorted(with_regions) == [f"model.layers.{i}.attn" for i in range(3)]
    assert "q.state=fp8" in with_regions["model.layers.1.attn"]
    assert "q.state" not in with_regions["model.layers.0.attn"] + with_regions["model.layers.2.attn"]


def test_another_backend_keeps_flas_forward():
    traced, _ = _graph(_model("kda", layers=2), _tokens(), laqats=False)
    assert torch.ops.higher_order.invoke_subgraph not in traced and traced


class _Blocks(torch.nn.Module):
    def __init__(self, blocks, **call):
        super().__init__()
        self.blocks, self.call = blocks, call

    def forward(self, hidden_states):
        for block in self.blocks:
            hidden_states = block(hidden_states, **self.call)[0]
        return hidden_states


def _regions_in_two_blocks(blocks, **call) -> int:
    """How many region calls Dynamo writes for two blocks called one after the other (Dynamo inlines a region
    whose trace no other call reuses; the input requires grad, as the second block's does, so that it reuses)."""
    seen = {}

    @mark_laqat_backend
    def backend(gm, example_inputs):
        seen["targets"] = [n.target for n in gm.graph.nodes]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Blocks(blocks, **call), backend=backend)(torch.randn(1, 8, 32, requires_grad=True))
    assert seen["targets"]
    return seen["targets"].count(torch.ops.higher_order.invoke_subgraph)


def test_calls_that_are_not_plain_training_calls_keep_flas_forward():
    model = _model("kda", layers=2)
    model.gradient_checkpointing_enable()
    traced, _ = _graph(model, _tokens())
    assert torch.ops.higher_order.invoke_subgraph not in traced
    blocks = _model("kda", layers=2).model.layers
    assert _regions_in_two_blocks(blocks) == 2
    assert _regions_in_two_blocks(blocks, output_attentions=True) == 0
    assert _regions_in_two_blocks(blocks, attention_mask=torch.ones(1, 8, dtype=torch.long)) == 0


def test_blocks_sharded_by_fsdp2_keep_flas_forward():
    """``fully_shard`` makes each block an instance of a subclass of FSDP2's ``FSDPModule`` (here without a process
    group: the class alone)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = _model("kda", layers=2).model.layers
    assert _regions_in_two_blocks(blocks) == 2
    for block in blocks:
        block.__class__ = type(f"FSDP{type(block).__name__}", (FSDPModule, type(block)), {})
    assert _regions_in_two_blocks(blocks) == 0


def test_a_block_with_another_attention_layer_keeps_flas_forward():
    """A hybrid model's softmax-attention block (FLA's ``Attention`` needs flash-attn: a stand-in layer here)."""
    class OtherAttention(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states * 2, None, None

    blocks = _model("gdn", layers=2).model.layers
    assert _regions_in_two_blocks(blocks) == 2
    for block in blocks:
        block.attn = OtherAttention()
    assert _regions_in_two_blocks(blocks) == 0


def test_a_block_that_returns_more_than_its_hidden_states_is_refused():
    block = _model("gdn", layers=1).model.layers[0]

    def returns_attentions(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                           output_attentions=False, attnres_states=None, **kwargs):
        return hidden_states * 2, hidden_states, None, None

    forward = block_regions.region_forward(returns_attentions)
    torch._dynamo.reset()
    with pytest.raises(UnsupportedArgumentError, match="more than its hidden states"):
        torch.compile(lambda h: forward(block, h)[0], backend="laqat", fullgraph=True)(torch.randn(1, 8, 32))
    assert block_regions.region_forward(lambda self, hidden_states: hidden_states) is None  # another signature


def test_the_inliner_leaves_other_regions_alone():
    @torch.compiler.nested_compile_region
    def double(x):
        return x * 2

    seen = {}

    def backend(gm, example_inputs):
        seen["count"] = inline_block_regions(gm)
        seen["left"] = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(3)
    out = torch.compile(lambda t: double(double(t)), backend=backend, fullgraph=True)(x)
    assert seen["count"] == 0 and len(seen["left"]) == 2 and torch.equal(out, x * 4)


def test_module_paths_move_under_the_calling_block():
    class Block:
        pass

    class Attention:
        pass

    call = {"m": ("L['self'].model", object), "b3": ("L['self'].model.layers.3", Block)}
    body = {"m": ("L['self'].model", object), "b0": ("L['self'].model.layers.0", Block),
            "a0": ("L['self'].model.layers.0.attn", Attention)}
    moved = rebased_module_stack(body, call)
    assert list(moved.values()) == [("L['self'].model", object), ("L['self'].model.layers.3", Block),
                                    ("L['self'].model.layers.3.attn", Attention)]
    assert rebased_module_stack(dict(list(body.items())[:2]), call) == call
    with pytest.raises(RegionInlineError, match="called from"):
        rebased_module_stack(body, {**call, "b3": ("L['self'].model.layers.3", Attention)})
    with pytest.raises(RegionInlineError, match="is not inside"):
        rebased_module_stack({**body, "a0": ("L['self'].model.layers.10.attn", Attention)}, call)


def test_the_environment_turns_block_regions_off_and_a_bad_value_is_refused(monkeypatch):
    from la_compiler.options import OptionsError

    monkeypatch.setenv("LAQAT_FLA_BLOCK_REGIONS", "off")
    traced, _ = _graph(_model("gdn", layers=2), _tokens())
    assert torch.ops.higher_order.invoke_subgraph not in traced and traced
    monkeypatch.setenv("LAQAT_FLA_BLOCK_REGIONS", "sometimes")
    with pytest.raises(OptionsError, match="LAQAT_FLA_BLOCK_REGIONS"):
        _graph(_model("gdn", layers=2), _tokens())


def test_symbolic_sizes_keep_flas_forward():
    """Dynamo's reuse of a region's trace fails on symbolic sizes (torch 2.13): ``dynamic=True`` and a recompile
    with automatic dynamic shapes trace every block, and train as without regions."""
    traced = []

    @mark_laqat_backend
    def backend(gm, example_inputs):
        traced.append([n.target for n in gm.graph.nodes])
        return la_compiler.backend.laqat_backend(gm, example_inputs)

    def losses(dynamic):
        torch._dynamo.reset()
        compiled = torch.compile(_model("kda"), backend=backend, dynamic=dynamic)
        return [compiled(input_ids=t, labels=t, use_cache=False).loss for t in (_tokens(T=12), _tokens(T=20))]

    for dynamic, regions in ((True, [0]), (None, [3, 0])):  # True: one graph; None: static, then a dynamic recompile
        traced.clear()
        with_regions = losses(dynamic)
        assert [t.count(torch.ops.higher_order.invoke_subgraph) for t in traced] == regions
        with _without_regions():
            assert [torch.equal(a, b) for a, b in zip(with_regions, losses(dynamic))] == [True, True]
