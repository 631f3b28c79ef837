"""Policy loader (YAML / JSON / dict / recipe names, versioned round trip) and resolution
(quantizer naming, glob precedence, per-layer rules, spec encodings)."""
import dataclasses
import json
import re

import pytest
import yaml

from la_compiler.ir.spec import GEMM_SITES, RecurrenceSpec
from la_compiler.options import decode_options
from la_compiler.policy.file_format import LinearAttentionCfg, ModuleRule, PolicyError, QuantRule, SolveCfg
from la_compiler.policy.resolution import Policy, load_policy, load_recipe
from la_compiler.recipes import recipe_names

FP8 = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}
FP8_ROW = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1, 2]}
INT8_STATE = {"num_bits": 8, "type": "dynamic", "axis": [0, 1]}
OPERANDS = [f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if (s, side) != ("state_read", "lhs")]

EXPECTED_RECIPES = {  # recipe -> (quant of a GDN and of a KDA node, phase, extra)
    "exact": ({}, "none", {}),
    "state_fp8": ({"state": "fp8_e4m3/tile64"}, "none", {}),
    "state_int8_block32": ({"state": "int8/block32"}, "none", {}),
    "state_int8_hadamard32": ({"state": "int8_h32/tile64"}, "none", {}),
    "w_fp8": ({"w": "fp8_e4m3/row"}, "none", {}),
    "prefill_operands_fp8": ({"w": "fp8_e4m3/row", **{s: "fp8_e4m3/row" for s in OPERANDS}}, "none", {}),
    "prefill_operands_nvfp4": ({"w": "nvfp4/block16", **{s: "nvfp4/block16" for s in OPERANDS}}, "none", {}),
    "decode_token_state_fp8": ({"state": "fp8_e4m3/tile64"}, "token", {"readout": "working"}),
    "vllm_gdn_state_bf16": ({}, "token", {"readout": "working", "serving": "vllm-0.33", "state_dtype": "bfloat16"}),
    "vllm_kda_state_bf16": ({}, "token", {"readout": "working", "serving": "vllm-0.33", "state_dtype": "bfloat16"}),
}
RECIPE_KINDS = {"vllm_kda_state_bf16": ("kda",)}  # vLLM's Kimi-K3 profile: a GDN node is an error (test_serving_policy)


def test_every_recipe_is_shipped_and_tested():
    assert recipe_names() == sorted(EXPECTED_RECIPES)


@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPES))
def test_recipe_loads_by_name_and_resolves(name):
    policy = load_policy(name)
    assert policy == load_recipe(name) and policy.name == name
    quant, phase, extra = EXPECTED_RECIPES[name]
    for kind in RECIPE_KINDS.get(name, ("gdn", "kda")):
        res = policy.resolve("model.layers.0.self_attn", kind)
        assert dict(res.quant) == quant
        assert (res.phase, dict(res.extra), res.solve, res.degree, res.chunk, res.acc) == (phase, extra, "exact",
                                                                                            None, 64, ())


@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPES))
def test_round_trip_dict_json_yaml(name, tmp_path):
    policy = load_recipe(name)
    as_dict = policy.to_dict()
    assert as_dict["version"] == "laqat.policy/1"
    assert Policy.from_dict(as_dict) == policy
    assert Policy.from_dict(json.loads(json.dumps(as_dict))) == policy  # JSON: lists, string axis keys
    (tmp_path / "p.json").write_text(json.dumps(as_dict))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(as_dict))
    assert Policy.from_file(tmp_path / "p.json") == policy
    assert load_policy(str(tmp_path / "p.yaml")) == policy
    assert Policy.from_dict(Policy.from_dict(as_dict).to_dict()).to_dict() == as_dict


def test_yaml_json_and_dict_give_one_policy(tmp_path):
    config = {
        "quant_cfg": [{"quantizer_name": "*", "enable": False},
                      {"quantizer_name": "*linear_attn_sites.*", "cfg": {
                          "num_bits": [2, 1], "type": "dynamic",
                          "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": [4, 3]}}}],
        "linear_attention": [{"module_name": "*", "cfg": {"chunk_size": 32, "solve": {"method": "neumann", "degree": 3},
                                                          "matmul": {"wy_key": {"accumulator_dtype": "fp16",
                                                                                "reduction_block": 16}}}}],
    }
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "mine.json").write_text(json.dumps(config))  # block_sizes' -1 becomes the string "-1"
    from_dict = Policy.from_dict(config, name="mine")
    assert Policy.from_file(tmp_path / "mine.yaml") == from_dict == Policy.from_file(tmp_path / "mine.json")
    assert load_policy(config) == dataclasses.replace(from_dict, name="custom")
    res = from_dict.resolve("layers.0.attn", "kda")
    assert (res.chunk, res.solve, res.degree, res.acc) == (32, "neumann", 3, (("wy_key", "fp16:16"),))
    assert dict(res.quant)["wy_key.lhs"] == "nvfp4/block16"


def test_python_api_builds_the_same_policy():
    built = Policy(quant_cfg=(QuantRule("*gdn_state_quantizer", {"num_bits": (4, 3), "type": "dynamic",
                                                                 "axis": (0, 1)}),),
                   linear_attention=(ModuleRule("*", LinearAttentionCfg(chunk_size=32, solve=SolveCfg())),))
    loaded = Policy.from_dict({"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": FP8}],
                               "linear_attention": [{"module_name": "*", "cfg": {"chunk_size": 32}}]})
    assert built == loaded
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.name = "other"
    hash(built)


def test_seed_modelopt_config_verbatim():
    """The KDA prefill config of the seeds (ModelOpt #2506), tuples and all."""
    seed = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*linear_attn_sites.*", "cfg": {"num_bits": (4, 3), "type": "dynamic",
                                                               "axis": (0, 1, 2)}},
            {"quantizer_name": "*kda_w_quantizer", "cfg": {"num_bits": (4, 3), "type": "dynamic", "axis": (0, 1, 2)}},
        ],
        "algorithm": None,
        "linear_attention": [{"module_name": "model.layers.*.self_attn", "cfg": {"backend": "matmul"}}],
    }
    policy = Policy.from_dict(seed)
    res = policy.resolve("model.layers.7.self_attn", "kda")
    assert dict(res.quant) == EXPECTED_RECIPES["prefill_operands_fp8"][0]
    assert res.backend is None  # "matmul": laqat picks a kernel that applies the numerics
    assert policy.resolve("model.layers.7.mlp", "kda").rules[0] != res.rules[0]


# ---- quantizer naming and glob precedence ---------------------------------------------------

def test_quantizer_names_are_module_fqn_plus_quantizer():
    policy = Policy.from_dict({"quant_cfg": [
        {"quantizer_name": "model.layers.3.attn.gdn_state_quantizer", "cfg": FP8},
        {"quantizer_name": "model.layers.3.attn.linear_attn_sites.wy_key.rhs_quantizer", "cfg": FP8_ROW},
    ]})
    assert dict(policy.resolve("model.layers.3.attn", "gdn").quant) == {"state": "fp8_e4m3/tile64",
                                                                        "wy_key.rhs": "fp8_e4m3/row"}
    assert policy.resolve("model.layers.13.attn", "gdn").quant == ()
    assert policy.resolve("model.layers.3.attn", "kda").quant == (("wy_key.rhs", "fp8_e4m3/row"),)  # kind-free
    assert policy.resolve("model.layers.3", "gdn").quant == ()


def test_quant_cfg_later_entries_win():
    policy = Policy.from_dict({"quant_cfg": [
        {"quantizer_name": "*state_quantizer", "cfg": FP8},
        {"quantizer_name": "*", "enable": False},  # switches off, keeps each quantizer's cfg
        {"quantizer_name": "*layers.[02].*gdn_state_quantizer", "enable": True},  # ... which this switches back on
        {"quantizer_name": "*layers.2.*gdn_state_quantizer", "cfg": INT8_STATE},  # a cfg replaces the cfg
    ]})
    got = {i: dict(policy.resolve(f"layers.{i}.attn", "gdn").quant) for i in range(4)}
    assert got == {0: {"state": "fp8_e4m3/tile64"}, 1: {}, 2: {"state": "int8/tile64"}, 3: {}}
    assert policy.resolve("layers.2.attn", "gdn").rules == ("quant_cfg[3] ('*layers.2.*gdn_state_quantizer') -> "
                                                            "state=int8/tile64",)
    assert policy.resolve("layers.0.attn", "kda").quant == ()


def test_linear_attention_last_match_wins_whole_cfg():
    policy = Policy.from_dict({
        "quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": FP8}],
        "linear_attention": [
            {"module_name": "*", "cfg": {"chunk_size": 32, "solve": {"method": "neumann", "degree": 3}}},
            {"module_name": "*layers.1.*", "cfg": {"chunk_size": 16, "state": {"block_v": 32}}},
            {"module_name": "*layers.1[0-9].*", "cfg": {"chunk_size": 128}},
        ],
    })
    r0, r1, r12 = (policy.resolve(f"layers.{i}.attn", "gdn") for i in (0, 1, 12))
    assert (r0.chunk, r0.solve, r0.degree, r0.quant) == (32, "neumann", 3, (("state", "fp8_e4m3/tile64"),))
    assert (r1.chunk, r1.solve, r1.degree, r1.quant) == (16, "exact", None, (("state", "fp8_e4m3/tile32"),))
    assert (r12.chunk, r12.solve) == (128, "exact")
    assert r1.rules[0] == "linear_attention[1] (module_name '*layers.1.*') sets the execution policy"


def test_state_read_lhs_is_the_w_quantizer():
    policy = Policy.from_dict({"quant_cfg": [{"quantizer_name": "*state_read.lhs_quantizer", "cfg": FP8_ROW}]})
    assert policy.resolve("a", "gdn").quant == (("w", "fp8_e4m3/row"),)
    same = Policy.from_dict({"quant_cfg": [{"quantizer_name": "*state_read.lhs_quantizer", "cfg": FP8_ROW},
                                           {"quantizer_name": "*gdn_w_quantizer", "cfg": FP8_ROW}]})
    assert same.resolve("a", "gdn").quant == (("w", "fp8_e4m3/row"),)


def test_backend_and_implementation_resolution():
    policy = Policy.from_dict({"linear_attention": [
        {"module_name": "*", "cfg": {"backend": "matmul"}},
        {"module_name": "*.1.*", "cfg": {"backend": "reference"}},
        {"module_name": "*.2.*", "cfg": {"solve": {"method": "exact", "implementation": "torch"}}},
    ]})
    r0, r1, r2 = (policy.resolve(f"layers.{i}.attn", "gdn") for i in range(3))
    assert (r0.backend, r0.backend_key, r0.implementation) == (None, None, None)
    assert (r1.backend, r1.backend_key) == ("reference", "linear_attention[1].cfg.backend")
    assert (r2.implementation, r2.implementation_key) == ("torch", "linear_attention[2].cfg.solve.implementation")


@pytest.mark.parametrize("decode, state, quant, extra", [
    ({"mode": "token", "readout": "stored", "decay_log_step": 0.00390625}, FP8, "fp8_e4m3/tile64",
     {"readout": "stored", "decay_log_step": "0.00390625"}),
    ({"mode": "token", "state_codec": "hadamard32"}, INT8_STATE, "int8_h32/tile64", {"readout": "working"}),
    ({"mode": "replay", "replay": {"window": 8, "factor_qdq": True}}, FP8, "fp8_e4m3/tile64",
     {"readout": "working", "replay_window": "8", "replay_factor_qdq": "1"}),
    ({"mode": "replay", "replay": {"window": 1}}, None, None,
     {"readout": "working", "replay_window": "1", "replay_factor_qdq": "0"}),
])
def test_decode_options_encode_into_spec_extras(decode, state, quant, extra):
    quant_cfg = [{"quantizer_name": "*gdn_state_quantizer", "cfg": state}] if state else []
    policy = Policy.from_dict({"quant_cfg": quant_cfg, "linear_attention": [{"module_name": "*",
                                                                            "cfg": {"decode": decode}}]})
    res = policy.resolve("layers.0.attn", "gdn")
    assert (res.phase, dict(res.quant).get("state"), dict(res.extra)) == (decode["mode"], quant, extra)
    spec = RecurrenceSpec(kind="gdn", quant=res.quant, phase=res.phase, extra=res.extra)
    options = decode_options(RecurrenceSpec.parse(spec.to_string()))  # the decode kernels' reader
    assert (options.mode, options.readout) == (decode["mode"], extra["readout"])
    assert options.codec == (quant.split("/")[0] if quant else None)
    assert options.window == int(extra.get("replay_window", 1))
    assert options.factor_format == {"1": quant.split("/")[0] if quant else None}.get(
        extra.get("replay_factor_qdq"), "none")


def test_hadamard_codec_applies_to_the_int8_state_in_every_phase():
    policy = Policy.from_dict({"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": INT8_STATE}],
                               "linear_attention": [{"module_name": "*", "cfg": {
                                   "state": {"block_v": 32}, "decode": {"state_codec": "hadamard32"}}}]})
    assert policy.resolve("a", "gdn").quant == (("state", "int8_h32/tile32"),)
    with pytest.raises(PolicyError, match=re.escape("linear_attention[0].cfg.decode.state_codec: 'hadamard32' is a "
                                                    "codec of the INT8 state quantizer, but module 'a' has no enabled "
                                                    "state quantizer")):
        policy.resolve("a", "kda")  # no KDA state quantizer
    fp8 = Policy.from_dict({"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": FP8}],
                            "linear_attention": [{"module_name": "*",
                                                  "cfg": {"decode": {"state_codec": "hadamard32"}}}]})
    with pytest.raises(PolicyError, match=re.escape("linear_attention[0].cfg.decode.state_codec: 'hadamard32' is an "
                                                    "INT8 codec: the state quantizer needs num_bits=8, got "
                                                    "fp8_e4m3/tile64 for module 'a'")):
        fp8.resolve("a", "gdn")


def test_unmatched_rules_are_reported():
    policy = Policy.from_dict({"name": "mine", "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*kda_state_quantizer", "cfg": FP8},
        {"quantizer_name": "*weight_quantizer", "cfg": FP8},
    ], "linear_attention": [{"module_name": "*layers.0.*", "cfg": {}}, {"module_name": "*layers.9.*", "cfg": {}}]})
    notes = policy.unmatched_rules([("layers.0.attn", "gdn"), ("layers.1.attn", "gdn")])
    assert notes == [
        "policy 'mine': quant_cfg[1] (quantizer_name '*kda_state_quantizer') matched no quantizer in this graph",
        "policy 'mine': quant_cfg[2] (quantizer_name '*weight_quantizer') matched no quantizer in this graph",
        "policy 'mine': linear_attention[1] (module_name '*layers.9.*') matched no module in this graph",
    ]
    assert policy.unmatched_rules([("layers.9.attn", "kda")])[:1] == [notes[1]]
