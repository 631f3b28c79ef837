"""Repeated layers compile once under the Inductor hand-off (la_compiler/hand_off/regions.py): the split graph's
loss and every gradient against the uncompiled model; pieces that differ (a constant, an input's strides) compile
apart; graphs that must compile whole do. Inductor's compile_fx is replaced by AOTAutograd with eager compilers
(``aot_eager``): the forward and backward graphs, the partitioner and the lazy backward compile are AOTAutograd's,
without a C++ build."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import la_compiler
import la_compiler.backend
from la_compiler.backend import BackendOptionsError
from la_compiler.hand_off import regions
from la_compiler.hand_off.regions import layer_of, piece_key
from la_compiler.options import LAYERS_PER_PIECE
from tests.helpers import assert_close_rel

TOL = 1e-4
_original_fake_run = regions._fake_run


@pytest.fixture
def compiles(monkeypatch):
    """The node count of every graph handed to Inductor's compile_fx, each compiled by aot_eager instead."""
    import torch._inductor.compile_fx as inductor
    from torch._dynamo.backends.debugging import aot_eager

    calls = []

    def recording(gm, inputs, *args, **kwargs):
        calls.append(len(gm.graph.nodes))
        return aot_eager(gm, inputs)
    monkeypatch.setattr(inductor, "compile_fx", recording)
    return calls


class Block(nn.Module):
    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.up, self.down, self.scale = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), scale

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * self.scale


class Stack(nn.Module):
    def __init__(self, scales, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width, s) for s in scales)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x).square().mean()


def _train_step(model, x, options=None):
    """(loss, gradients) of the compiled model against the uncompiled copy's; -> the graph's record."""
    reference = copy.deepcopy(model)
    start = len(la_compiler.backend.last_record().graphs)
    loss = torch.compile(model, backend="laqat", options={"compiler": "inductor", **(options or {})})(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    assert_close_rel(loss, expected, TOL, "loss")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, TOL, f"d{name}")
    (graph,) = la_compiler.backend.last_record().graphs[start:]
    return graph


def _no_fake_run(*args):
    raise AssertionError("a piece ran on fakes: Dynamo's example values should have been its outputs")


def test_identical_layers_compile_once(compiles, monkeypatch, caplog):
    monkeypatch.setattr(regions, "_fake_run", _no_fake_run)
    with caplog.at_level(logging.INFO, logger="la_compiler.hand_off.compiler_choice"):
        graph = _train_step(Stack([1.0] * 4), torch.randn(3, 5, 8), {"regional": 1})
    assert graph.regions == "6 pieces (4 layers), 3 compiled"
    assert len(compiles) == 3
    assert f"graph {graph.graph_id} under Inductor: 6 pieces (4 layers), 3 compiled" in caplog.text


def test_by_default_runs_of_four_layers_compile_once(compiles, monkeypatch):
    """``regional: True``: a piece per run of LAYERS_PER_PIECE (4) layers; ten layers make two runs of four and a
    run of two, so the head, one run of four, the run of two and the tail compile."""
    monkeypatch.setattr(regions, "_fake_run", _no_fake_run)
    assert LAYERS_PER_PIECE == 4
    graph = _train_step(Stack([1.0] * 10), torch.randn(3, 5, 8))
    assert graph.regions == "5 pieces (3 runs of 4 layers), 4 compiled"
    assert len(compiles) == 4


def test_a_number_of_layers_per_piece(compiles):
    graph = _train_step(Stack([1.0] * 6), torch.randn(3, 5, 8), {"regional": 2})
    assert graph.regions == "5 pieces (3 runs of 2 layers), 3 compiled"
    assert len(compiles) == 3


def test_four_layers_compile_whole_by_default(compiles):
    graph = _train_step(Stack([1.0] * 4), torch.randn(3, 5, 8))
    assert graph.regions == "whole: fewer than two runs of 4 layers"
    assert len(compiles) == 1


def test_pieces_without_traced_values_run_on_fakes(compiles, monkeypatch):
    """Where a piece's output has no Dynamo example value, the piece runs on fake tensors for the next one's inputs."""
    fake_runs = []
    monkeypatch.setattr(regions, "_traced_outputs", lambda piece, inputs: None)
    monkeypatch.setattr(regions, "_fake_run", lambda *a: fake_runs.append(1) or _original_fake_run(*a))
    graph = _train_step(Stack([1.0] * 3), torch.randn(3, 5, 8), {"regional": 1})
    assert graph.regions == "5 pieces (3 layers), 3 compiled"
    assert len(fake_runs) == 5


def test_layers_differing_in_a_constant_compile_apart(compiles):
    """Blocks that differ only in a Python constant: Dynamo bakes it into each layer's nodes, so their pieces
    differ and share no compile (one shared compile would scale every layer alike: the loss and the gradients
    above would be off)."""
    graph = _train_step(Stack([1.0, 3.0, 1.0, 3.0]), torch.randn(3, 5, 8), {"regional": 1})
    assert graph.regions == "6 pieces (4 layers), 4 compiled"


def test_regional_false_compiles_the_graph_whole(compiles):
    graph = _train_step(Stack([1.0] * 8), torch.randn(2, 4, 8), {"regional": False})
    assert graph.regions == "whole: options['regional'] is False"
    assert len(compiles) == 1


def test_one_layer_compiles_whole(compiles):
    graph = _train_step(Stack([1.0]), torch.randn(2, 4, 8), {"regional": 1})
    assert graph.regions == "whole: fewer than two layers"


def test_symbolic_shapes_compile_whole(compiles):
    model, x = Stack([1.0] * 8), torch.randn(2, 4, 8)
    torch._dynamo.mark_dynamic(x, 1)
    graph = _train_step(model, x)
    assert graph.regions == "whole: symbolic shapes"


def test_eager_hand_off_does_not_split(compiles):
    graph = _train_step(Stack([1.0] * 2), torch.randn(2, 4, 8), {"compiler": "eager"})
    assert graph.regions == "" and compiles == []


@pytest.mark.parametrize("value", ["yes", 0, -2, 1.5])
def test_regional_option_is_a_bool_or_a_number_of_layers(value):
    with pytest.raises(BackendOptionsError, match=r"options\['regional'\] must be a bool or a number of layers"):
        torch.compile(Stack([1.0]), backend="laqat", options={"regional": value})(torch.randn(1, 2, 8))


def _node(*paths):
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {f"k{i}": (p, nn.Module) for i, p in enumerate(paths)}
    return node


def test_layer_of_reads_the_outermost_module_list_item():
    assert layer_of(_node("L['args'][0]", "L['args'][0].model", "L['args'][0].model.layers.2",
                          "L['args'][0].model.layers.2.mlp.experts.5")) == ("L['args'][0].model.layers", 2)
    assert layer_of(_node("L['self']", "L['self'].layers[11]")) == ("L['self'].layers", 11)
    # a source's own index is no layer: the root module passed as the first argument
    assert layer_of(_node("L['args'][0]", "L['args'][0].norm")) is None
    assert layer_of(_node()) is None


def test_piece_key_tells_strides_dtypes_and_sharing_apart():
    piece = torch.fx.symbolic_trace(lambda a, b: a * 2 + b)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    key = piece_key(piece, [x, y], frozenset())
    assert piece_key(piece, [x.clone(), y.clone()], frozenset()) == key
    assert piece_key(piece, [x.t().contiguous().t(), y], frozenset()) != key  # strides
    assert piece_key(piece, [x.double(), y], frozenset()) != key
    assert piece_key(piece, [x, x], frozenset()) != key  # the two inputs share memory
    assert piece_key(piece, [x, y.requires_grad_()], frozenset()) != key
    assert piece_key(piece, [x, y], frozenset({0})) != key
    other = torch.fx.symbolic_trace(lambda a, b: a * 3 + b)
    assert piece_key(other, [x, y], frozenset()) != key


def _fla_lm_trains_as_on_torch_references(model, options):
    """One training step of FLA's causal LM ``model`` compiled with ``options`` against a copy run with FLA's layers on
    their torch references: the loss and every gradient; -> the compiled graph's record."""
    from tests.passes.fla_oracle import naive_fla

    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (1, 6))
    start = len(la_compiler.backend.last_record().graphs)
    loss = torch.compile(model, backend="laqat", options=options)(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    with naive_fla():
        expected = reference(tokens, labels=tokens, use_cache=False).loss
    expected.backward()
    assert_close_rel(loss, expected, TOL, "loss")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, TOL, f"d{name}")
    (graph,) = la_compiler.backend.last_record().graphs[start:]
    return graph


def test_fla_causal_lm_layers_compile_once(compiles, monkeypatch):
    """FLA's GDN causal LM in training, its recurrences rewritten: three pieces compile for two layers, and the loss
    and every gradient match FLA's layers run on their torch references."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    monkeypatch.setattr(regions, "_fake_run", _no_fake_run)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, head_dim=8, num_heads=2,
                                                         expand_v=1, vocab_size=64, intermediate_size=64))
    graph = _fla_lm_trains_as_on_torch_references(model, {"compiler": "inductor", "regional": 1})
    assert [m.module for m in graph.matches] == ["model.layers.0.attn", "model.layers.1.attn"]
    assert graph.regions == "4 pieces (2 layers), 3 compiled"
    assert len(compiles) == 3


def test_fla_causal_lm_in_runs_of_four_layers_by_default(compiles):
    """FLA's KDA causal LM, eight layers, the default options in training: two runs of four layers share one compile
    (the head, one run, the tail), and the loss and every gradient match FLA's layers run on their torch
    references."""
    from fla.models import KDAConfig, KDAForCausalLM

    model = KDAForCausalLM(KDAConfig(hidden_size=32, num_hidden_layers=8, head_dim=8, num_heads=2, expand_v=1,
                                     vocab_size=64, intermediate_size=64))
    graph = _fla_lm_trains_as_on_torch_references(model, {"compiler": "inductor"})
    assert graph.regions == "4 pieces (2 runs of 4 layers), 3 compiled"
    assert len(compiles) == 3


def test_the_split_graph_keeps_what_the_whole_graph_keeps(monkeypatch):
    """What the backward keeps is the same tensors, split or whole: FLA's KDA causal LM, bf16, three layers, under
    Inductor's partitioner (examples/benchmarks/memory_account.py walks the saved tensors; the parameters, which
    count no bytes, are left out: a piece may keep a view of one where the whole graph keeps another)."""
    import torch._inductor.compile_fx as inductor
    from fla.models import KDAConfig, KDAForCausalLM

    from tests.la_compiler.test_saved_tensors import _partition_only, memory_account

    monkeypatch.setattr(inductor, "compile_fx", _partition_only)
    base = KDAForCausalLM(KDAConfig(hidden_size=32, num_hidden_layers=3, head_dim=8, num_heads=2, expand_v=1,
                                    vocab_size=64, intermediate_size=64)).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 70))
    kept = {}
    for regional in (1, False):
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="laqat", options={"compiler": "inductor", "regional": regional})
        acc = memory_account.account(lambda: compiled(tokens, labels=tokens, use_cache=False).loss, model)
        kept[regional] = sorted((tuple(s.shape), s.dtype, s.bytes) for s in acc.saved if not s.parameter)
        assert acc.saved and acc.packed_bytes == acc.total_bytes
    assert la_compiler.backend.last_record().graphs[-2].regions == "5 pieces (3 layers), 3 compiled"
    assert kept[1] == kept[False]
