"""The annotate pass end to end: a tiny two-layer model compiled with a policy has the
expected spec on each node (per-layer globs, last match wins) and runs forward/backward
through the reference lowering, against an independent fp64 computation."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import la_compiler
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from la_compiler.kernels.reference.rounding import ChunkRounding
from la_compiler.passes.annotate import UnmatchedPolicyRuleWarning
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import load_policy
from la_compiler.quant import fake_quant
from tests.helpers import assert_close_rel, rel_l2

SCALE = 0.4
B, T, H, K = 2, 10, 2, 8
KINDS = ("gdn", "kda")  # layers.0.attn is GDN, layers.1.attn is KDA
FP8_STATE = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}


class Attention(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, g, beta, h0):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, None, SCALE, f"{self.kind}[src=user]")


class Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.attn = Attention(kind)

    def forward(self, *args):
        return self.attn(*args)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(kind) for kind in KINDS)

    def forward(self, q, k, v, g_gdn, g_kda, beta, h0):
        o0, ht0 = self.layers[0](q, k, v, g_gdn, beta, h0)
        o1, ht1 = self.layers[1](q, k, v, g_kda, beta, h0)
        return o0 + o1, ht0, ht1


def make_inputs(V=16, T=T, K=K):
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g_gdn = F.logsigmoid(torch.randn(B, T, H)) * 0.3
    g_kda = F.logsigmoid(torch.randn(B, T, H, K)) * 0.3
    beta = torch.rand(B, T, H).sigmoid()
    h0 = torch.randn(B, H, K, V)
    return [x.requires_grad_(True) for x in (q, k, v, g_gdn, g_kda, beta, h0)]


def on_reference(policy):
    """``policy`` (a recipe name or a dict) with every module lowered to the reference variant
    (the kernels have their own tests; this file tests the policy end to end)."""
    config = load_policy(policy).to_dict()
    config["linear_attention"] = [{"module_name": r["module_name"], "cfg": {**r["cfg"], "backend": "reference"}}
                                  for r in config["linear_attention"]] or [{"module_name": "*",
                                                                            "cfg": {"backend": "reference"}}]
    return config


def compiled_run(policy, inputs):
    """explain() compiles and runs once; returns (report, outputs, gradients of a random loss)."""
    torch._dynamo.reset()
    report = la_compiler.explain(TwoLayers(), *inputs, policy=policy)
    return report, report.output, _grads(report.output, inputs)


def _grads(outputs, inputs):
    torch.manual_seed(1)
    weights = [torch.randn(o.shape, dtype=torch.float64) for o in outputs]  # not randn_like: o's strides differ
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs)


def specs_by_module(report):
    return {m.module: RecurrenceSpec.parse(m.spec) for m in report.matches}


def oracle(inputs, layer_specs):
    """fp64, token by token, with the state rounded by this test's own hook: on load, after
    every chunk of the layer's chunk size and after the last token (docs/numerics.md, "Where the rounding happens")."""
    q, k, v, g_gdn, g_kda, beta, h0 = inputs
    length = q.shape[1]
    outs = []
    for kind, g, (chunk, fmt) in zip(KINDS, (g_gdn, g_kda), layer_specs):
        state = h0 if fmt is None else fake_quant(h0.double(), fmt)

        def hook(S, n, t_end, chunk=chunk, fmt=fmt):
            return fake_quant(S, fmt) if fmt and (t_end % chunk == 0 or t_end == length) else S

        outs.append(delta_rule_reference(q, k, v, g, beta, kind=kind, scale=SCALE, initial_state=state,
                                         state_hook=hook))
    (o0, ht0), (o1, ht1) = outs
    return o0 + o1, ht0, ht1


def assert_matches_oracle(outputs, grads, ref_outputs, ref_grads, tol):
    for name, a, b in zip(("o", "ht0", "ht1"), outputs, ref_outputs):
        assert_close_rel(a, b, tol, name)
    for name, a, b in zip(("dq", "dk", "dv", "dg_gdn", "dg_kda", "dbeta", "dh0"), grads, ref_grads):
        assert_close_rel(a, b, tol, name)


def test_per_layer_globs_last_match_wins_and_reference_lowering_matches_fp64():
    policy = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*_state_quantizer", "cfg": FP8_STATE},
            {"quantizer_name": "*layers.1.*", "enable": False},  # KDA layer: off ...
            {"quantizer_name": "layers.1.attn.kda_state_quantizer", "enable": True},  # ... but its state back on
        ],
        "linear_attention": [
            {"module_name": "*", "cfg": {"chunk_size": 4, "state": {"block_v": 16}}},
            {"module_name": "layers.1.*", "cfg": {"chunk_size": 8, "state": {"block_v": 32}}},  # last match wins
        ],
    }
    inputs = make_inputs()
    report, outputs, grads = compiled_run(on_reference(policy), inputs)
    specs = specs_by_module(report)
    assert set(specs) == {"layers.0.attn", "layers.1.attn"}
    assert specs["layers.0.attn"].to_string() == ("gdn[src=user; layout=bthd; state=kv; chunk=4; solve=exact; "
                                                  "phase=none; kernel=reference; q.state=fp8_e4m3/tile16]")
    assert specs["layers.1.attn"].to_string() == ("kda[src=user; layout=bthd; state=kv; chunk=8; solve=exact; "
                                                  "phase=none; kernel=reference; q.state=fp8_e4m3/tile32]")
    layer_specs = [(4, "fp8_e4m3/tile16"), (8, "fp8_e4m3/tile32")]
    ref_outputs = oracle(inputs, layer_specs)
    assert_matches_oracle(outputs, grads, ref_outputs, _grads(ref_outputs, inputs), 1e-6)
    exact = oracle(inputs, [(4, None), (8, None)])  # the rounding is really there
    assert rel_l2(outputs[0], exact[0]) > 1e-3 and rel_l2(outputs[2], exact[2]) > 1e-3


@pytest.mark.parametrize("recipe, state_fmt", [("state_fp8", "fp8_e4m3/tile64"),
                                               ("state_int8_block32", "int8/block32"),
                                               ("state_int8_hadamard32", "int8_h32/tile64")])
def test_state_recipes_compile_and_match_fp64(recipe, state_fmt):
    inputs = make_inputs(V=32)
    report, outputs, grads = compiled_run(on_reference(recipe), inputs)
    for module, kind in zip(("layers.0.attn", "layers.1.attn"), KINDS):
        assert specs_by_module(report)[module] == RecurrenceSpec(kind=kind, kernel="reference",
                                                                 quant=(("state", state_fmt),))
    ref_outputs = oracle(inputs, [(64, state_fmt)] * 2)
    assert_matches_oracle(outputs, grads, ref_outputs, _grads(ref_outputs, inputs), 1e-6)


def test_w_recipe_runs_through_the_chunked_reference():
    inputs = make_inputs()
    report, outputs, grads = compiled_run(on_reference("w_fp8"), inputs)
    assert {m.spec.split("; q.")[-1] for m in report.matches} == {"w=fp8_e4m3/row]"}
    q, k, v, g_gdn, g_kda, beta, h0 = inputs
    rounding = ChunkRounding(w=lambda W: fake_quant(W, "fp8_e4m3/row"))  # this test's own rounding
    refs = [chunk_delta_rule_reference(q, k, v, g, beta, spec=RecurrenceSpec(kind=kind), scale=SCALE,
                                       initial_state=h0, rounding=rounding) for kind, g in zip(KINDS, (g_gdn, g_kda))]
    ref_outputs = (refs[0][0] + refs[1][0], refs[0][1], refs[1][1])
    assert_matches_oracle(outputs, grads, ref_outputs, _grads(ref_outputs, inputs), 1e-6)
    exact = oracle(inputs, [(64, None), (64, None)])
    assert rel_l2(outputs[0], exact[0]) > 1e-4


@pytest.mark.parametrize("recipe", ["prefill_operands_fp8", "prefill_operands_nvfp4"])
def test_operand_recipes_with_solve_and_accumulator_run_through_the_reference(recipe):
    """Every site of a GEMM-operand spec (plus a Neumann solve and an emulated accumulator)
    reaches the chunked reference: the compiled model equals it called with the node's spec."""
    config = load_policy(recipe).to_dict()
    config["linear_attention"] = [{"module_name": "*", "cfg": {
        "backend": "reference", "chunk_size": 4, "solve": {"method": "neumann", "degree": 2},
        "matmul": {"output_value": {"accumulator_dtype": "bf16", "reduction_block": 4}}}}]
    inputs = make_inputs(T=6)
    report, outputs, grads = compiled_run(config, inputs)
    specs = specs_by_module(report)
    q, k, v, g_gdn, g_kda, beta, h0 = inputs
    refs = []
    for module, kind, g in zip(("layers.0.attn", "layers.1.attn"), KINDS, (g_gdn, g_kda)):
        spec = specs[module]
        assert (spec.kind, spec.kernel, spec.chunk, spec.solve, spec.degree) == (kind, "reference", 4, "neumann", 2)
        assert spec.acc == (("output_value", "bf16:4"),) and len(spec.quant) == 16  # 15 operands + W
        refs.append(chunk_delta_rule_reference(q, k, v, g, beta, spec=spec, scale=SCALE, initial_state=h0))
    ref_outputs = (refs[0][0] + refs[1][0], refs[0][1], refs[1][1])
    assert_matches_oracle(outputs, grads, ref_outputs, _grads(ref_outputs, inputs), 1e-6)
    exact = oracle(inputs, [(4, None), (4, None)])
    assert rel_l2(outputs[0], exact[0]) > 1e-3


def test_exact_recipe_is_bitwise_no_policy():
    inputs = make_inputs(T=4)
    report_none, out_none, grads_none = compiled_run(None, inputs)
    report_exact, out_exact, grads_exact = compiled_run("exact", inputs)
    assert [m.spec for m in report_none.matches] == [m.spec for m in report_exact.matches]
    assert all(RecurrenceSpec.parse(m.spec).is_exact for m in report_exact.matches)
    for a, b in zip(out_none + grads_none, out_exact + grads_exact):
        assert torch.equal(a, b)


def test_backend_that_cannot_apply_the_spec_is_a_policy_error_at_compile_time():
    policy = {"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": FP8_STATE}],
              "linear_attention": [{"module_name": "*", "cfg": {"backend": "fused_recurrent"}}]}
    with pytest.raises(Exception) as info:
        compiled_run(policy, make_inputs(T=2))
    message = str(info.value)
    assert isinstance(getattr(info.value, "inner_exception", info.value), PolicyError), message
    assert re.search(r"laqat node delta_rule \(module 'layers.0.attn', gdn\): linear_attention\[0\].cfg.backend="
                     r"'fused_recurrent' cannot apply gdn\[.*q.state=fp8_e4m3/tile64\]: .*fused_recurrent: the "
                     r"fused recurrent kernel has no quant sites", message), message


def test_implementation_key_selects_the_kernel_family():
    torch_impl = {"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": FP8_STATE}],
                  "linear_attention": [{"module_name": "*", "cfg": {"solve": {"method": "exact",
                                                                              "implementation": "torch"}}}]}
    report, _, _ = compiled_run(torch_impl, make_inputs(T=3))
    assert [m.kernel for m in report.matches] == ["reference", "reference"]
    assert "(requested by the policy)" in report.matches[0].kernel_reason
    triton_impl = {"linear_attention": [{"module_name": "*", "cfg": {"solve": {"method": "exact",
                                                                               "implementation": "triton"}}}]}
    with pytest.raises(Exception) as info:  # no Triton kernel takes head dims above 256
        compiled_run(triton_impl, make_inputs(T=2, K=320))
    assert isinstance(getattr(info.value, "inner_exception", info.value), PolicyError)
    message = str(info.value)
    assert "linear_attention[0].cfg.solve.implementation='triton' cannot apply gdn[" in message, message
    assert "reference: a torch kernel; the policy asks for implementation='triton'" in message, message


def test_unmatched_rules_are_explain_notes_and_warnings():
    policy = {"name": "mine", "quant_cfg": [{"quantizer_name": "*layers.7.*", "enable": False}],
              "linear_attention": [{"module_name": "*layers.1.*", "cfg": {}}]}
    with pytest.warns(UnmatchedPolicyRuleWarning, match=re.escape("quant_cfg[0] (quantizer_name '*layers.7.*')")):
        report, _, _ = compiled_run(policy, make_inputs(T=2))
    assert report.notes == ["policy 'mine': quant_cfg[0] (quantizer_name '*layers.7.*') matched no quantizer in "
                            "this graph"]
    assert "Notes:" in str(report)


def test_decode_recipe_annotates_the_phase():
    """The decode-phase numerics are the decode variants' (their tests compare them with the
    decode reference); here: the spec each node gets, and that it runs in a phase context."""
    config = load_policy("decode_token_state_fp8").to_dict()
    config["linear_attention"][0]["cfg"]["decode"]["implementation"] = "torch"  # the fp64 decode reference
    with la_compiler.phase(prefill_lengths=[4]):
        report, outputs, _ = compiled_run(config, make_inputs())
    assert [m.spec for m in report.matches] == [
        f"{kind}[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=token; kernel=decode_reference; "
        f"q.state=fp8_e4m3/tile64; x.readout=working]" for kind in KINDS]
    assert all(torch.isfinite(o).all() for o in outputs)


def test_torch_compile_with_a_recipe_name():
    """options={"policy": "<recipe>"}: whatever kernel the table picks, it gets the recipe's spec."""
    from la_compiler.backend import last_record

    model = torch.compile(TwoLayers(), backend="laqat", options={"policy": "state_fp8", "compiler": "eager"})
    before = len(last_record().graphs)
    outputs = model(*make_inputs(T=2))
    (graph,) = last_record().graphs[before:]
    assert [(m.module, RecurrenceSpec.parse(m.spec).replace(kernel="auto")) for m in graph.matches] == [
        (f"layers.{i}.attn", RecurrenceSpec(kind=kind, quant=(("state", "fp8_e4m3/tile64"),)))
        for i, kind in enumerate(KINDS)]
    assert all(torch.isfinite(o).all() for o in outputs)


def test_reference_variant_rounds_a_v_first_state_by_key_tiles():
    from la_compiler.kernels.reference.variant import reference_forward

    q, k, v, g, _, beta, h0 = (x.detach() for x in make_inputs(T=6, V=32))
    spec = RecurrenceSpec(kind="gdn", chunk=4, quant=(("state", "fp8_e4m3/tile16"),))
    o_kv, ht_kv = reference_forward(spec, q, k, v, g, beta, h0, None, SCALE)
    o_vk, ht_vk = reference_forward(spec.replace(state="vk"), q, k, v, g, beta, h0.transpose(-1, -2).contiguous(),
                                    None, SCALE)
    assert torch.equal(o_kv, o_vk) and torch.equal(ht_kv, ht_vk.transpose(-1, -2))
    _, ref_ht, _ = oracle([q, k, v, g, g.new_zeros(B, 6, H, K), beta, h0], [(4, "fp8_e4m3/tile16"), (4, None)])
    assert_close_rel(ht_kv, ref_ht, 1e-6, "final state")
