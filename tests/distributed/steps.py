"""One training step of a tiny model, in a rank of a data-parallel group or in one process, and what it produced.

A step compiles the model (wrapped as its test asks) with the laqat backend, runs it on this rank's slice of a
global batch, backpropagates, and returns a ``StepResult``: the loss averaged over the ranks (the global batch's
loss), every parameter's gradient by the model's own parameter names (full tensors, after the gradient
all-reduce or reduce-scatter), what laqat rewrote, how many graphs the backend compiled and Dynamo's graph
breaks. ``single_process`` runs the same step on the whole batch in one process: what every data-parallel run
must equal.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from tests.distributed import models

RANK_BATCH, SEQ_LEN = 1, 6  # sequences per rank, tokens per sequence
# what runs the rewritten graphs: eager by default (Inductor compiles each of DDPOptimizer's pieces, forward and
# backward: minutes on a CPU with a cold cache); LAQAT_DISTRIBUTED_HAND_OFF=inductor runs every case through it
HAND_OFF = os.environ.get("LAQAT_DISTRIBUTED_HAND_OFF", "eager")
# state FP8 for the module the user calls layers.1, by its exact name (no glob): DDP's module.* would miss it
LAYER1_STATE_FP8 = {"name": "layer1_state_fp8", "quant_cfg": [
    {"quantizer_name": "*", "enable": False},
    {"quantizer_name": "layers.1.gdn_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}},
]}
POLICIES = {"exact": None, "state_fp8": "state_fp8", "layer1_state_fp8": LAYER1_STATE_FP8}


def laqat_options(policy: str) -> dict:
    return {"policy": POLICIES[policy], "compiler": HAND_OFF}


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    matches: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)  # module, frontend, kind, spec
    graphs: int = 0  # graphs the backend compiled (DDPOptimizer's pieces each count)
    breaks: dict[str, int] = dataclasses.field(default_factory=dict)  # Dynamo's graph-break reasons -> count
    break_lines: list[str] = dataclasses.field(default_factory=list)  # laqat's record: why and where each broke
    error: tuple[str, str, tuple[str, ...]] | None = None  # (class, message, classes of its MRO) if it raised
    node_input_types: set[str] = dataclasses.field(default_factory=set)  # tensor types the laqat nodes read
    notes: list[str] = dataclasses.field(default_factory=list)  # the record's notes of every graph


def new_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(models, name)()


def global_batch(model: torch.nn.Module, world_size: int):
    return models.make_batch(RANK_BATCH * world_size, SEQ_LEN, model)


def rank_slice(batch, rank: int):
    x, states = batch
    rows = slice(rank * RANK_BATCH, (rank + 1) * RANK_BATCH)
    return x[rows], tuple(s[rows] for s in states)


def _break_counts() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["graph_break"])


class LaqatBackend:
    """The laqat backend with ``options`` (what ``backend="laqat", options=options`` calls), noting the tensor
    types that the laqat nodes of the graphs it rewrites read (plain tensors, or DTensors)."""

    def __init__(self, options: dict):
        self.options, self.node_input_types = options, set()

    def __call__(self, gm, example_inputs):
        from la_compiler.backend import laqat_backend
        from la_compiler.ir.delta_rule import is_delta_rule

        compiled = laqat_backend(gm, example_inputs, options=self.options)
        for node in gm.graph.nodes:
            if is_delta_rule(node):
                for arg in node.all_input_nodes:
                    value = arg.meta.get("example_value", arg.meta.get("val"))
                    if isinstance(value, torch.Tensor):
                        self.node_input_types.add(type(value).__name__)
        return compiled


def step(model: torch.nn.Module, wrapped: torch.nn.Module, batch, *, backend, full_grad=lambda g: g,
         world_size: int = 1, compile_model: bool = True, options: dict | None = None) -> StepResult:
    """Compiles ``wrapped`` (``model`` or its data-parallel wrapper) with ``backend`` (and ``options``: the user's
    ``torch.compile(..., backend="laqat", options=options)``) unless ``compile_model`` is False (the test compiled
    parts of it), runs one forward and backward on ``batch``."""
    import la_compiler.backend
    from la_compiler.record import CompileRecord

    result = StepResult()
    record = CompileRecord()
    la_compiler.backend._ACTIVE_RECORD.append(record)
    breaks_before = _break_counts()
    try:
        run = torch.compile(wrapped, backend=backend, options=options) if compile_model else wrapped
        loss = run(*batch)
        loss.backward()
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        result.error = (type(e).__name__, str(e), tuple(c.__name__ for c in type(e).__mro__))
        return result
    finally:
        la_compiler.backend._ACTIVE_RECORD.pop()
        after = _break_counts()
        result.breaks = {k: n - breaks_before.get(k, 0) for k, n in after.items() if n != breaks_before.get(k, 0)}
    loss = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(loss)
        loss /= world_size
    result.loss = loss
    result.grads = {name: full_grad(p.grad).detach().clone() for name, p in model.named_parameters()}
    result.matches = [(m.module, m.frontend, m.kind, m.spec) for g in record.graphs for m in g.matches]
    result.graphs = len(record.graphs)
    result.break_lines = [g.graph_break for g in record.graphs if g.graph_break and "DDPOptimizer" not in g.graph_break]
    result.node_input_types = set(getattr(backend, "node_input_types", ()))
    result.notes = [note for g in record.graphs for note in g.notes]
    return result


def single_process(model_name: str, policy: str, world_size: int = 2) -> StepResult:
    """The step on the whole global batch in this process, compiled with laqat as the data-parallel runs are."""
    torch._dynamo.reset()
    model = new_model(model_name)
    return step(model, model, global_batch(model, world_size), backend=LaqatBackend(laqat_options(policy)))


def eager(model_name: str, world_size: int = 2) -> StepResult:
    """The uncompiled model on the whole batch (FLA's kernels swapped for FLA's torch references)."""
    model = new_model(model_name)
    oracle = contextlib.nullcontext()
    if model_name.startswith("Fla"):
        from tests.passes.fla_oracle import naive_fla

        oracle = naive_fla()
    with oracle:
        loss = model(*global_batch(model, world_size))
    loss.backward()
    return StepResult(loss=loss.detach(), grads={n: p.grad.detach().clone() for n, p in model.named_parameters()})
