"""What runs a rewritten graph (la_compiler/hand_off/compiler_choice.py, docs/options.md "Hand-off"): unset, eager
for a CPU-only graph and Inductor for a graph with tensors on a GPU; ``options["compiler"]`` as given, on any device; the
record, ``explain`` and the log say which ran and why."""
import pytest
import torch
from torch._subclasses import FakeTensorMode

import la_compiler
import la_compiler.backend
from la_compiler.hand_off.compiler_choice import choose_hand_off
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.options import CPU_HAND_OFF, DEVICE_HAND_OFF
from tests.ir_inputs import random_inputs

CPU_DEFAULT = "default: every tensor of the graph is on the CPU"
OPTION = "options['compiler']"


def _delta_rule(q, k, v, g, beta):
    return torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 0.5, str(RecurrenceSpec(kind="gdn")))[0]


@pytest.fixture
def inductor_calls(monkeypatch):
    """Every graph handed to Inductor's compile_fx; each runs as traced instead (no C++ build in the tests)."""
    import torch._inductor.compile_fx as inductor

    calls = []

    def recording(gm, inputs, *args, **kwargs):
        calls.append(gm)
        return gm.forward
    monkeypatch.setattr(inductor, "compile_fx", recording)
    return calls


def _compiled_step(options):
    xs, _ = random_inputs("gdn", T=5, H=1, K=8, V=8)
    start = len(la_compiler.backend.last_record().graphs)
    torch.compile(_delta_rule, backend="laqat", fullgraph=True, options=options)(*xs[:5]).sum().backward()
    (graph,) = la_compiler.backend.last_record().graphs[start:]
    assert [m.kind for m in graph.matches] == ["gdn"]
    return graph


@pytest.mark.parametrize("options", [None, {}, {"compiler": None}])
def test_a_cpu_graph_runs_eager_by_default(inductor_calls, options):
    graph = _compiled_step(options)
    assert CPU_HAND_OFF == "eager"
    assert (graph.hand_off, graph.hand_off_reason) == ("eager", CPU_DEFAULT)
    assert inductor_calls == []


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_an_explicit_compiler_is_kept_on_the_cpu(inductor_calls, compiler):
    graph = _compiled_step({"compiler": compiler})
    assert (graph.hand_off, graph.hand_off_reason) == (compiler, OPTION)
    assert len(inductor_calls) == (compiler == "inductor")


def _traced():
    return torch.fx.symbolic_trace(lambda x: x * 2)


def test_a_graph_with_tensors_on_a_gpu_goes_to_inductor_unless_told_otherwise():
    """Decided from the example inputs and from the values the graph computes (Dynamo's ``example_value``): a
    graph that makes its tensors on a GPU from CPU inputs counts as a GPU graph. Fake tensors stand for CUDA ones."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.empty(2, device="cuda")
    assert DEVICE_HAND_OFF == "inductor"
    gpu_input = choose_hand_off(None, _traced(), [on_gpu])
    assert (gpu_input.compiler, gpu_input.reason) == ("inductor", "default: the graph's tensors are on cuda")
    made_on_gpu = _traced()
    for node in made_on_gpu.graph.nodes:
        node.meta["example_value"] = on_gpu
    assert choose_hand_off(None, made_on_gpu, [torch.ones(2)]).compiler == "inductor"
    assert choose_hand_off(None, _traced(), [torch.ones(2), 3]) == choose_hand_off(None, _traced(), [])
    assert choose_hand_off(None, _traced(), [torch.ones(2)]).reason == CPU_DEFAULT
    kept = choose_hand_off("eager", _traced(), [on_gpu])
    assert (kept.compiler, kept.reason) == ("eager", OPTION)


def test_explain_names_the_hand_off_and_why():
    xs, _ = random_inputs("gdn", T=5, H=1, K=8, V=8, requires_grad=False)
    by_default = la_compiler.explain(_delta_rule, *xs[:5], compiler=None)
    assert by_default.hand_off == f"eager ({CPU_DEFAULT})"
    assert f"\nhand-off: eager ({CPU_DEFAULT})\n" in str(by_default)
    assert la_compiler.explain(_delta_rule, *xs[:5]).hand_off == f"eager ({OPTION})"  # explain's own default
