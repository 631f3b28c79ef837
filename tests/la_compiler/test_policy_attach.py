"""A policy attached to the model (la_compiler/policy/attach.py): it round-trips through ``state_dict`` and
``torch.save`` / ``torch.load(weights_only=True)``, ``torch.compile`` without a policy option uses it (module,
bound method, ``Module.compile``, after a graph break), an explicit option wins, ``explain`` names the source;
a checkpoint without a policy loads with exact numerics; a newer schema version and bad values are refused.

Numerics are checked against the fp64 token-by-token oracle of tests/passes/test_annotate_policy.py, forward
and every gradient, with the modules lowered to the reference variant (the kernels have their own tests), and
the eager hand-off (where the policy comes from does not depend on what runs the rest of the graph)."""
import json

import pytest
import torch
from torch import nn

import la_compiler
from la_compiler.backend import last_record
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.policy.attach import POLICY_KEY
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import load_policy
from la_compiler.recipes import recipe_names
from tests.passes.test_annotate_policy import (FP8_STATE, K, Attention, TwoLayers, _grads, assert_matches_oracle,
                                               make_inputs, on_reference, oracle)

FP8_CHUNK4 = on_reference({
    "name": "fp8_chunk4",
    "quant_cfg": [{"quantizer_name": "*", "enable": False},
                  {"quantizer_name": "*_state_quantizer", "cfg": FP8_STATE}],
    "linear_attention": [{"module_name": "*", "cfg": {"chunk_size": 4, "state": {"block_v": 16}}}],
})
FP8_ROUNDED = [(4, "fp8_e4m3/tile16")] * 2  # what FP8_CHUNK4 does to each layer, for the oracle
EXACT = [(4, None)] * 2
EAGER = {"compiler": "eager"}  # no policy option


class Projected(nn.Module):
    """TwoLayers behind a learned projection of q: a model with weights for the checkpoint to carry."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, K)
        self.body = TwoLayers()

    def forward(self, q, *rest):
        return self.body(self.proj(q), *rest)


class BreakingBlock(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.attn = Attention(kind)
        # a parameter the resumed graph reads: its full name gives the graph's module prefix (module_names.py)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, q, k, v, *rest):
        torch._dynamo.graph_break()  # the graph resumes inside the block
        return self.attn(q, k, v * self.gain, *rest)


class BreakingLayers(TwoLayers):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(BreakingBlock(kind) for kind in ("gdn", "kda"))


def run(compiled, inputs):
    outputs = compiled(*inputs)
    return outputs, _grads(outputs, inputs)


def graphs_since(n):
    return last_record().graphs[n:]


def specs_of(graphs):
    return {m.module: RecurrenceSpec.parse(m.spec) for g in graphs for m in g.matches}


def saved_and_loaded(state_dict, tmp_path):
    torch.save(state_dict, tmp_path / "ckpt.pt")
    return torch.load(tmp_path / "ckpt.pt", weights_only=True)


@pytest.mark.parametrize("form", ["recipe", "yaml", "dict", "Policy"])
def test_attach_returns_the_model_and_policy_of_reads_it_back(form, tmp_path):
    import yaml

    expected = load_policy("state_int8_block32")
    given = {"recipe": "state_int8_block32", "dict": expected.to_dict(), "Policy": expected,
             "yaml": tmp_path / "p.yaml"}[form]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(expected.to_dict()))
    model = TwoLayers()
    assert la_compiler.policy_of(model) is None
    assert la_compiler.attach_policy(model, given) is model
    assert la_compiler.policy_of(model) == expected
    assert list(model.state_dict()) == [POLICY_KEY]
    compiled = torch.compile(model, backend="laqat")
    assert la_compiler.attach_policy(compiled, "state_fp8") is compiled  # the wrapper: the model inside
    assert la_compiler.policy_of(model) == la_compiler.policy_of(compiled) == load_policy("state_fp8")
    la_compiler.attach_policy(model, None)
    assert la_compiler.policy_of(model) is None and POLICY_KEY not in model.state_dict()


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_round_trips_through_the_state_dict(recipe, tmp_path):
    model = la_compiler.attach_policy(TwoLayers(), recipe)
    fresh = TwoLayers()
    la_compiler.load_state_dict(fresh, saved_and_loaded(model.state_dict(), tmp_path))
    assert la_compiler.policy_of(fresh) == load_policy(recipe)


def test_module_names_and_graph_do_not_change():
    inputs = make_inputs()
    before = la_compiler.explain(TwoLayers(), *inputs)
    model = la_compiler.attach_policy(TwoLayers(), "exact")
    torch._dynamo.reset()
    after = la_compiler.explain(model, *inputs)
    assert [(m.module, m.node, m.spec) for m in after.matches] == [(m.module, m.node, m.spec) for m in before.matches]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in TwoLayers().named_modules()]
    assert [g.readable for g in after.graphs] == [g.readable for g in before.graphs]


def test_state_dict_round_trip_through_torch_save(tmp_path):
    model = la_compiler.attach_policy(Projected(), FP8_CHUNK4)
    state = saved_and_loaded(model.state_dict(), tmp_path)
    assert state[POLICY_KEY].dtype == torch.uint8  # plain data: a tensor of the policy's JSON
    assert la_compiler.policy_of(state) == load_policy(FP8_CHUNK4)

    plain = Projected()  # a fresh instance has no buffer: strict torch loading names the key, strict=False drops it
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{POLICY_KEY}"'):
        plain.load_state_dict(state)
    assert plain.load_state_dict(state, strict=False).unexpected_keys == [POLICY_KEY]
    assert la_compiler.policy_of(plain) is None

    fresh = Projected()
    la_compiler.load_state_dict(fresh, state)  # strict
    assert la_compiler.policy_of(fresh) == load_policy(FP8_CHUNK4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name

    other = la_compiler.attach_policy(Projected(), "state_int8_hadamard32")  # a longer policy: replaced on load
    assert other.state_dict()[POLICY_KEY].numel() != state[POLICY_KEY].numel()
    other.load_state_dict(state)
    assert la_compiler.policy_of(other) == load_policy(FP8_CHUNK4)

    inputs = make_inputs()
    n = len(last_record().graphs)
    outputs, grads = run(torch.compile(fresh, backend="laqat", options=EAGER), inputs)
    assert {g.policy_source for g in graphs_since(n)} == {"attached to Projected"}
    ref = oracle([model.proj(inputs[0]), *inputs[1:]], FP8_ROUNDED)  # the saved weights, in eager torch
    assert_matches_oracle(outputs, grads, ref, _grads(ref, inputs), 1e-6)


def test_checkpoint_without_a_policy_loads_with_exact_numerics(tmp_path):
    state = saved_and_loaded(Projected().state_dict(), tmp_path)
    assert la_compiler.policy_of(state) is None
    fresh = Projected()
    la_compiler.load_state_dict(fresh, state)
    assert la_compiler.policy_of(fresh) is None
    inputs = make_inputs()
    n = len(last_record().graphs)
    outputs, grads = run(torch.compile(fresh, backend="laqat", options=EAGER), inputs)
    assert {g.policy_source for g in graphs_since(n)} == {"default exact"}
    assert all(not s.quant for s in specs_of(graphs_since(n)).values())
    ref = oracle([fresh.proj(inputs[0]), *inputs[1:]], EXACT)
    assert_matches_oracle(outputs, grads, ref, _grads(ref, inputs), 1e-5)

    attached = la_compiler.attach_policy(Projected(), "state_fp8")  # a checkpoint without one keeps the attached
    attached.load_state_dict(state)
    assert la_compiler.policy_of(attached) == load_policy("state_fp8")


@pytest.mark.parametrize("how", ["module", "bound method", "Module.compile"])
def test_compile_uses_the_attached_policy(how):
    model = la_compiler.attach_policy(TwoLayers(), FP8_CHUNK4)
    if how == "Module.compile":
        model.compile(backend="laqat", options=EAGER)
        compiled = model
    else:
        compiled = torch.compile(model if how == "module" else model.forward, backend="laqat", options=EAGER)
    inputs = make_inputs()
    n = len(last_record().graphs)
    outputs, grads = run(compiled, inputs)
    graphs = graphs_since(n)
    assert [(g.policy, g.policy_source) for g in graphs] == [("fp8_chunk4", "attached to TwoLayers")]
    assert {m: (s.chunk, dict(s.quant)) for m, s in specs_of(graphs).items()} == {
        "layers.0.attn": (4, {"state": "fp8_e4m3/tile16"}), "layers.1.attn": (4, {"state": "fp8_e4m3/tile16"})}
    ref = oracle(inputs, FP8_ROUNDED)
    assert_matches_oracle(outputs, grads, ref, _grads(ref, inputs), 1e-6)


def test_attached_policy_holds_after_graph_breaks():
    """A compiled bound method whose blocks graph-break: the resumed graphs (traced inside a block, reused for
    its sibling) get the attached policy too, per layer."""
    policy = on_reference({**load_policy(FP8_CHUNK4).to_dict(), "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "layers.1.*_state_quantizer", "cfg": FP8_STATE}]})
    model = la_compiler.attach_policy(BreakingLayers(), policy)
    inputs = make_inputs()
    n = len(last_record().graphs)
    outputs, grads = run(torch.compile(model.forward, backend="laqat", options=EAGER), inputs)
    graphs = graphs_since(n)
    assert len(graphs) > 1 and {g.policy_source for g in graphs} == {"attached to BreakingLayers"}
    assert {m: dict(s.quant) for m, s in specs_of(graphs).items()} == {
        "layers.0.attn": {}, "layers.1.attn": {"state": "fp8_e4m3/tile16"}}
    ref = oracle(inputs, [(4, None), (4, "fp8_e4m3/tile16")])
    assert_matches_oracle(outputs, grads, ref, _grads(ref, inputs), 1e-6)


def test_explicit_option_wins_and_explain_names_the_source():
    model = la_compiler.attach_policy(TwoLayers(), FP8_CHUNK4)
    inputs = make_inputs()
    n = len(last_record().graphs)
    exact = on_reference({"name": "exact_chunk4", "linear_attention": [{"module_name": "*",
                                                                        "cfg": {"chunk_size": 4}}]})
    outputs, grads = run(torch.compile(model, backend="laqat", options={**EAGER, "policy": exact}), inputs)
    assert [g.policy_source for g in graphs_since(n)] == ["option"]
    assert all(not s.quant for s in specs_of(graphs_since(n)).values())
    ref = oracle(inputs, EXACT)
    assert_matches_oracle(outputs, grads, ref, _grads(ref, inputs), 1e-6)

    torch._dynamo.reset()
    assert la_compiler.explain(model, *inputs, policy="exact").policy == "exact (option)"
    torch._dynamo.reset()
    report = la_compiler.explain(model, *inputs)
    assert report.policy == "fp8_chunk4 (attached to TwoLayers)" and "policy: fp8_chunk4 (attached" in str(report)
    torch._dynamo.reset()
    assert la_compiler.explain(TwoLayers(), *inputs).policy.startswith("exact (default exact")


def test_a_compiled_graph_runs_only_for_a_module_with_its_policy():
    """Dynamo reuses a compiled graph for another instance of the class and after a policy is attached anew: the
    graph runs where the module's policy is its own, and raises where it is another."""
    inputs = make_inputs()
    model = la_compiler.attach_policy(TwoLayers(), FP8_CHUNK4)
    compiled = torch.compile(model, backend="laqat", options=EAGER)
    compiled(*inputs)
    model.load_state_dict(model.state_dict())  # the same policy again: runs on
    la_compiler.attach_policy(model, FP8_CHUNK4)
    compiled(*inputs)
    twin = TwoLayers()
    la_compiler.load_state_dict(twin, model.state_dict())
    n = len(last_record().graphs)
    torch.compile(twin, backend="laqat", options=EAGER)(*inputs)
    assert len(last_record().graphs) == n  # Dynamo reused the graph: the same policy, so it runs
    compiled_for = r"this graph was compiled with the policy 'fp8_chunk4' and now runs for a TwoLayers whose policy is"
    with pytest.raises(PolicyError, match=f"{compiled_for} 'exact'"):
        torch.compile(TwoLayers(), backend="laqat", options=EAGER)(*inputs)
    la_compiler.attach_policy(model, "state_int8_block32")
    with pytest.raises(PolicyError, match=f"{compiled_for} 'state_int8_block32'"):
        compiled(*inputs)
    torch.compile(TwoLayers(), backend="laqat", options={**EAGER, "policy": on_reference("exact")})(*inputs)
    assert [g.policy_source for g in graphs_since(n)] == ["option"]  # an option: a graph of its own


def _state_with(config_or_bytes) -> dict:
    data = config_or_bytes if isinstance(config_or_bytes, bytes) else json.dumps(config_or_bytes).encode()
    return {POLICY_KEY: torch.tensor(list(data), dtype=torch.uint8)}


def test_a_policy_of_a_newer_schema_version_is_refused():
    newer = {**load_policy("state_fp8").to_dict(), "version": "laqat.policy/2"}
    message = r"'laqat.policy/2' was written by a newer laqat; this laqat reads policies of version 'laqat.policy/1'"
    with pytest.raises(PolicyError, match=rf"state_dict\['laqat_policy'\]: version: {message}"):
        la_compiler.load_state_dict(TwoLayers(), _state_with(newer))
    attached = la_compiler.attach_policy(TwoLayers(), "exact")
    with pytest.raises(PolicyError, match=message):
        attached.load_state_dict(_state_with(newer))
    assert la_compiler.policy_of(attached) == load_policy("exact")  # unchanged
    with pytest.raises(PolicyError, match=message):
        la_compiler.attach_policy(TwoLayers(), newer)


@pytest.mark.parametrize("policy, message", [
    (3, r"attach_policy\(model, policy\): must be None, a Policy, a dict, a path or a recipe name, got int"),
    ("state_fp9", r"attach_policy\(model, policy\): 'state_fp9' is neither a recipe name nor a .yaml/.json file"),
    ({"quant_cfg": [{"quantizer_name": "*_state_quantizer", "cfg": {"num_bits": 5}}]}, r"quant_cfg\[0\]\.cfg"),
])
def test_bad_policy_values_are_named_and_change_nothing(policy, message):
    model = la_compiler.attach_policy(TwoLayers(), "state_fp8")
    with pytest.raises(PolicyError, match=message):
        la_compiler.attach_policy(model, policy)
    assert la_compiler.policy_of(model) == load_policy("state_fp8")


@pytest.mark.parametrize("stored, message", [
    (b"{not json", r"state_dict\['laqat_policy'\]: not a policy's JSON"),
    (b"[1, 2]", r"state_dict\['laqat_policy'\]: must be a policy dict, got list"),
    (torch.ones(3), r"state_dict\['laqat_policy'\]: must be a 1-D uint8 tensor holding a policy's JSON, "
                    r"got torch.float32"),
])
def test_a_damaged_stored_policy_is_named(stored, message):
    state = _state_with(stored) if isinstance(stored, bytes) else {POLICY_KEY: stored}
    with pytest.raises(PolicyError, match=message):
        la_compiler.load_state_dict(TwoLayers(), state)


def test_a_non_module_is_refused():
    with pytest.raises(PolicyError, match=r"attach_policy\(model, \.\.\.\): model must be a torch.nn.Module, got str"):
        la_compiler.attach_policy("model", "state_fp8")
