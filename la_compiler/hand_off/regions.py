"""Repeated layers compiled once, under the Inductor hand-off (docs/options.md, "Hand-off").

Inductor's compile of one graph grows with the graph: a 16-layer LM's training graph spends most of its first step
in AOTAutograd and Inductor (docs/model-bench.md, "Every compile and search of the first step"), compiling the same
layer sixteen times. Here a rewritten graph whose nodes fall in two or more runs of ``per_piece`` consecutive layers
of a module list (Dynamo's ``nn_module_stack``: ``model.layers.0``, ``layers[3]``; layers 0 to per_piece - 1 are a
run) is split at the runs' bounds (``torch.fx`` ``split_module``): one piece per run, one for each stretch of the
nodes before, between and after them. Each piece compiles through the same steps the whole graph would
(``compile_piece``); a piece equal to one compiled before (the same code node for node, the same metadata of its
inputs; ``piece_key``) runs that piece's compiled callable, forward and backward, instead of compiling again. A run
takes its layers' parameters as inputs, so identical runs share one compile. Each piece's call costs the step the
Python of one AOTAutograd graph, forward and backward: a piece per layer made the step measurably slower than one
graph, runs of several layers (la_compiler.options.LAYERS_PER_PIECE) did not (docs/model-bench.md, "Repeated layers
compile once").

What runs is what the whole graph's compile would run but for the bounds: the partitioner decides what each piece
keeps for its backward, and Inductor fuses within a piece, not across two.

The graph compiles whole (``unsplit_reason`` says why) with fewer than two runs, symbolic shapes, a higher-order op
(its body is a graph of its own), a node that changes global state (autocast, grad mode), or under Dynamo's
DDPOptimizer, which splits the graph itself, by gradient bucket.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from contextlib import nullcontext
from copy import copy
from typing import Any, Callable, Optional
from unittest import mock

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

# the path of a module list's item in Dynamo's nn_module_stack: ``<source>.<attribute>.<index>`` or ``...[<index>]``
LAYER_PATH = re.compile(r"^(?P<parent>.*\.[A-Za-z_]\w*)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")
GLOBAL_STATE_TARGETS = (torch.amp._enter_autocast, torch.amp._exit_autocast, torch._C._set_grad_enabled)

# compile_piece(piece, inputs, handed_back): a callable running ``piece`` (its outputs a tuple) on its inputs;
# ``handed_back`` the output positions that only the graph's own output reads
PieceCompiler = Callable[[torch.fx.GraphModule, list, frozenset], Callable]


@dataclasses.dataclass(frozen=True)
class Regions:
    """How a graph was split: its pieces, how many of them were layers (``per_piece`` layers each), and how many
    compiles they took."""
    pieces: int
    layers: int
    compiles: int
    per_piece: int = 1

    def describe(self) -> str:
        groups = f"{self.layers} layers" if self.per_piece == 1 else f"{self.layers} runs of {self.per_piece} layers"
        return f"{self.pieces} pieces ({groups}), {self.compiles} compiled"


def layer_of(node: torch.fx.Node) -> Optional[tuple[str, int]]:
    """(module list path, index) of the outermost module list item the node was traced in; None outside any."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = LAYER_PATH.match(str(path))
        if found:
            return found["parent"], int(found["dot"] or found["bracket"])
    return None


def layer_partitions(graph: torch.fx.GraphModule, per_piece: int = 1) -> tuple[dict[torch.fx.Node, int], int]:
    """Each computing node's piece, numbered in graph order: a new piece wherever the run of ``per_piece``
    consecutive layers (layers 0 to per_piece - 1 of a module list, then the next per_piece) changes, the nodes
    outside any layer included; -> (the pieces, how many of them are layer runs)."""
    partition: dict[torch.fx.Node, int] = {}
    current, count, layers = None, -1, 0
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_of(node)
        if layer is not None:
            layer = layer[0], layer[1] // per_piece
        if count < 0 or layer != current:
            count += 1
            layers += layer is not None
            current = layer
        partition[node] = count
    return partition, layers


def _has_symbols(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return False


def unsplit_reason(graph: torch.fx.GraphModule, inputs, layers: int, per_piece: int = 1) -> Optional[str]:
    """Why ``graph`` compiles whole; None where it splits (``layers``: its runs of ``per_piece`` layers)."""
    if layers < 2:
        return "fewer than two layers" if per_piece == 1 else f"fewer than two runs of {per_piece} layers"
    if any(_has_symbols(x) for x in inputs):
        return "symbolic shapes"
    context = torch._guards.TracingContext.try_get()
    if getattr(context, "ddp_optimizer_ctx", None) is not None:
        return "DDPOptimizer splits the graph by gradient bucket"
    for node in graph.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(graph, node.target, None), torch.fx.GraphModule):
            return "a higher-order op"
        if node.op == "call_function" and node.target in GLOBAL_STATE_TARGETS:
            return f"a node that changes global state ({node.target.__name__})"
    return None


def _target_name(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if callable(target):
        return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}#{id(target)}"
    return repr(target)


def _argument(value, names: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_argument(v, names) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _argument(v, names)) for k, v in value.items()))
    if isinstance(value, slice):
        return "slice", _argument(value.start, names), _argument(value.stop, names), _argument(value.step, names)
    return type(value).__name__, repr(value)


def _input(value, storages: dict) -> Any:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__, repr(value)
    storage = storages.setdefault(value.untyped_storage()._cdata, len(storages))  # which inputs share memory
    return (type(value).__name__, isinstance(value, torch.nn.Parameter), tuple(value.shape), value.stride(),
            value.storage_offset(), value.dtype, value.device, value.requires_grad, value.is_leaf, storage)


def piece_key(piece: torch.fx.GraphModule, inputs: list, handed_back: frozenset) -> tuple:
    """What decides a piece's compile: its code with its nodes named by position, the metadata of its inputs
    (which of them share memory included) and the outputs handed back; two pieces with one key compile alike."""
    names, code = {}, []
    for i, node in enumerate(piece.graph.nodes):
        names[node] = f"%{i}"
        if node.op in ("get_attr", "call_module"):
            target = f"{node.op}#{id(getattr(piece, node.target))}"  # equal only where the same object
        elif node.op == "placeholder":
            target = ""
        else:
            target = _target_name(node.target)
        code.append((node.op, target, _argument(node.args, names), _argument(node.kwargs, names),
                     repr(node.meta.get("recompute"))))
    storages: dict = {}
    return tuple(code), tuple(_input(x, storages) for x in inputs), tuple(sorted(handed_back))


def _tuple_outputs(piece: torch.fx.GraphModule) -> bool:
    """Makes the piece return a tuple (AOTAutograd's compilers expect one); -> whether it returned one value."""
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    single = not isinstance(output.args[0], (tuple, list))
    if single:
        output.args = ((output.args[0],),)
    elif isinstance(output.args[0], list):
        output.args = (tuple(output.args[0]),)
    piece.recompile()
    return single


def _graph_output_only(split: torch.fx.GraphModule, node: torch.fx.Node, single: bool) -> frozenset:
    """The positions of ``node``'s outputs (a piece's call in ``split``) that only the graph's output reads."""
    def only_output(value: torch.fx.Node) -> bool:
        return bool(value.users) and all(user.op == "output" for user in value.users)

    if single:
        return frozenset({0}) if only_output(node) else frozenset()
    return frozenset(user.args[1] for user in node.users
                     if user.op == "call_function" and user.target is operator.getitem and only_output(user))


def _traced_outputs(piece: torch.fx.GraphModule, inputs: list) -> Optional[tuple]:
    """The piece's outputs as Dynamo's fake values (``example_value``, which ``split_module`` copies with each node);
    None where one has none."""
    given = dict(zip(piece.graph.find_nodes(op="placeholder"), inputs))
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    values = []
    for node in output.args[0]:
        value = given[node] if node in given else node.meta.get("example_value")
        if value is None:
            return None
        values.append(value)
    return tuple(values)


def _fake_run(piece: torch.fx.GraphModule, inputs: list, fake_mode) -> tuple:
    """The piece run on fake tensors, outside any saved-tensor hooks of the caller (they would see fakes)."""
    no_hooks = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", nullcontext)
    with (no_hooks(), fake_mode,
          mock.patch.object(fake_mode, "allow_non_fake_inputs", True)):
        return tuple(piece(*inputs))


class CompiledPiece(torch.nn.Module):
    """A piece's compiled callable in the split graph, returning one value where the piece did."""

    def __init__(self, compiled: Callable, single: bool):
        super().__init__()
        self.compiled = compiled
        self.single = single

    def forward(self, *args):
        outputs = self.compiled(*args)
        return outputs[0] if self.single else outputs


def _piece_context(outer):
    """A tracing context of the piece's own, so that AOTAutograd keeps each piece's forward metadata for its lazy
    backward compile (one context holds one graph's); the rest (the fake mode, the guards) is the graph's."""
    if outer is None:
        return nullcontext()
    context = copy(outer)
    context.fw_metadata = None
    context.aot_graph_name = None
    context.params_flat = context.params_flat_unwrap_subclasses = context.params_unwrapped_to_flat_index = None
    context.output_strides = None
    context.fakify_first_call = False
    return torch._guards.tracing(context)


def compile_regions(graph: torch.fx.GraphModule, inputs: list, partition: dict, layers: int,
                    compile_piece: PieceCompiler, per_piece: int = 1) -> tuple[torch.fx.GraphModule, Regions]:
    """``graph`` split by ``partition`` (``layer_partitions``), each distinct piece compiled once by
    ``compile_piece``; -> the split graph (called with the graph's inputs) and what was done."""
    split = split_module(graph, None, lambda node: partition[node], keep_original_order=True)
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    sources = {n.name: getattr(n, "_dynamo_source", None) for n in graph.graph.find_nodes(op="placeholder")}
    fake_mode = torch._guards.detect_fake_mode(inputs) or torch._subclasses.FakeTensorMode()
    outer = torch._guards.TracingContext.try_get()
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, inputs))
    compiled: dict[tuple, Callable] = {}
    pieces = 0
    for node in list(split.graph.nodes):
        if node.op == "placeholder":
            continue
        if node.op == "output":
            break
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        if node.op == "call_function":  # a getitem of a piece's outputs
            env[node] = node.target(*args)
            continue
        pieces += 1
        piece = getattr(split, node.target)
        piece.meta = dict(graph.meta)
        for p in piece.graph.find_nodes(op="placeholder"):
            p._dynamo_source = sources.get(p.name)
        single = _tuple_outputs(piece)
        handed_back = _graph_output_only(split, node, single)
        key = piece_key(piece, list(args), handed_back)
        # the next pieces' inputs; taken before the compile, whose passes may change ``piece``
        outputs = _traced_outputs(piece, list(args))
        if outputs is None:
            outputs = _fake_run(piece, list(args), fake_mode)
        if key not in compiled:
            with _piece_context(outer):
                compiled[key] = compile_piece(piece, list(args), handed_back)
        setattr(split, node.target, CompiledPiece(compiled[key], single))
        env[node] = outputs[0] if single else outputs
    split.recompile()
    return split, Regions(pieces=pieces, layers=layers, compiles=len(compiled), per_piece=per_piece)
