"""Every policy validation error: the message names the key and the allowed values."""
import re
import warnings

import pytest

import la_compiler
from la_compiler.ir.spec import GEMM_SITES
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy, load_policy

FP8_STATE = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}
NVFP4 = {"num_bits": [2, 1], "type": "dynamic", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": [4, 3]}}


def la(cfg, module="*"):
    return {"linear_attention": [{"module_name": module, "cfg": cfg}]}


def qc(*entries):
    return {"quant_cfg": list(entries)}


LOAD_ERRORS = [
    # unknown keys
    ({"quant_cfgs": []}, "policy: unknown key(s) ['quant_cfgs']; allowed: ['version', 'name', 'description', "
                         "'quant_cfg', 'linear_attention', 'algorithm']"),
    (qc({"quantizer_name": "*", "enabled": False}), "quant_cfg[0]: unknown key(s) ['enabled']; allowed: "
                                                    "['quantizer_name', 'cfg', 'enable']"),
    (qc({"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bit": 8}}),
     "quant_cfg[0].cfg (quantizer_name '*gdn_state_quantizer', site 'state'): quant cfg key 'num_bit' is not known"),
    ({"linear_attention": [{"module": "*"}]}, "linear_attention[0]: unknown key(s) ['module']; allowed: "
                                              "['module_name', 'cfg']"),
    (la({"chunksize": 64}), "linear_attention[0].cfg: unknown key(s) ['chunksize']; allowed: ['backend', "
                            "'chunk_size', 'state', 'solve', 'decode', 'matmul', 'numerics', 'serving', 'precision']"),
    (la({"solve": {"method": "exact", "order": 2}}), "linear_attention[0].cfg.solve: unknown key(s) ['order']; "
                                                     "allowed: ['method', 'degree', 'implementation']"),
    (la({"decode": {"mode": "replay", "replay": {"window": 4, "refresh": 2}}}),
     "linear_attention[0].cfg.decode.replay: unknown key(s) ['refresh']; allowed: ['window', 'factor_qdq']"),
    (la({"matmul": {"wy_keys": {"accumulator_dtype": "fp16", "reduction_block": 16}}}),
     "linear_attention[0].cfg.matmul: unknown key(s) ['wy_keys']; allowed: ['key_interaction', 'wy_value', "
     "'wy_key', 'state_read', 'state_update', 'output_state', 'output_score', 'output_value']"),
    (la({"matmul": {"wy_key": {"dtype": "fp16"}}}), "linear_attention[0].cfg.matmul.wy_key: unknown key(s) "
                                                    "['dtype']; allowed: ['accumulator_dtype', 'reduction_block']"),
    # wrong types and values
    ({"quant_cfg": {"quantizer_name": "*"}}, "quant_cfg: must be a list of entries, got dict"),
    (qc({"quantizer_name": "*", "enable": "no"}), "quant_cfg[0].enable: must be true or false, got str 'no'"),
    (qc({"quantizer_name": 3, "enable": False}), "quant_cfg[0].quantizer_name: must be a non-empty string, got int 3"),
    (qc({"enable": False}), "quant_cfg[0].quantizer_name: required"),
    (qc({"quantizer_name": "*"}), "quant_cfg[0].cfg: an entry needs 'cfg' or 'enable' (or both)"),
    (qc({"quantizer_name": "*", "cfg": [8]}), "quant_cfg[0].cfg: must be a mapping of ModelOpt quantizer attributes"),
    (qc({"quantizer_name": "*gdn_w_quantizer", "cfg": {**FP8_STATE, "enable": False}, "enable": True}),
     "quant_cfg[0].enable: True contradicts cfg.enable=False"),
    (qc({"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": 5, "type": "dynamic"}}),
     "quant_cfg[0].cfg (quantizer_name '*gdn_state_quantizer', site 'state'): quant cfg key 'num_bits' must be"),
    (qc({"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": 8, "type": "dynamic", "axis": [0, 1, 2]}}),
     "quant_cfg[0].cfg (quantizer_name '*gdn_state_quantizer', site 'state'): the state site takes scale groups "
     "['tile', 'block']"),
    (la({"chunk_size": "64"}), "linear_attention[0].cfg.chunk_size: must be an integer, got str '64'"),
    (la({"chunk_size": 48}), "linear_attention[0].cfg.chunk_size: must be a positive power of two, got 48"),
    (la({"backend": "triton"}), "linear_attention[0].cfg.backend: must be one of ['auto', 'matmul', 'fla_chunk', "
                                "'fused_recurrent'"),
    (la({"state": {"block_v": 48}}), "linear_attention[0].cfg.state.block_v: must be one of [16, 32, 64, 128], "
                                     "got 48"),
    (la({"state": {"block_v": True}}), "linear_attention[0].cfg.state.block_v: must be an integer, got bool True"),
    (la({"solve": {"method": "cholesky"}}), "linear_attention[0].cfg.solve.method: must be one of ['exact', "
                                            "'neumann'], got 'cholesky'"),
    (la({"solve": {"method": "exact", "implementation": "cuda"}}),
     "linear_attention[0].cfg.solve.implementation: must be one of ['auto', 'triton', 'torch'], got 'cuda'"),
    (la({"decode": {"mode": "prefill"}}), "linear_attention[0].cfg.decode.mode: must be one of ['none', 'token', "
                                          "'replay'], got 'prefill'"),
    (la({"decode": {"mode": "token", "readout": "rounded"}}),
     "linear_attention[0].cfg.decode.readout: must be one of ['working', 'stored'], got 'rounded'"),
    (la({"decode": {"mode": "token", "state_codec": "nvfp4"}}),
     "linear_attention[0].cfg.decode.state_codec: must be one of ['quantizer', 'hadamard32'], got 'nvfp4'"),
    (la({"decode": {"mode": "token", "decay_log_step": "1/256"}}),
     "linear_attention[0].cfg.decode.decay_log_step: must be a positive finite number, got '1/256'"),
    (la({"decode": {"mode": "replay", "replay": {"window": 4, "factor_qdq": 1}}}),
     "linear_attention[0].cfg.decode.replay.factor_qdq: must be true or false, got int 1"),
    (la({"matmul": {"wy_key": {"accumulator_dtype": "fp8", "reduction_block": 16}}}),
     "linear_attention[0].cfg.matmul.wy_key.accumulator_dtype: must be one of ['fp32', 'fp16', 'bf16'], got 'fp8'"),
    (la({"matmul": {"wy_key": {"accumulator_dtype": "fp16"}}}),
     "linear_attention[0].cfg.matmul.wy_key.reduction_block: required with accumulator_dtype='fp16'"),
    (la({"matmul": {"wy_key": {"accumulator_dtype": "bf16", "reduction_block": 24}}}),
     "linear_attention[0].cfg.matmul.wy_key.reduction_block: must be a positive power of two, got 24"),
    (la({"matmul": {"wy_key": {"accumulator_dtype": "fp32", "reduction_block": 16}}}),
     "linear_attention[0].cfg.matmul.wy_key.reduction_block: only with accumulator_dtype 'fp16' or 'bf16'"),
    ({"version": "laqat.policy/0"}, "version: this laqat reads policies of version 'laqat.policy/1', "
                                    "got 'laqat.policy/0'"),
    ({"algorithm": "max"}, "algorithm: laqat scales are dynamic (no calibration): must be null/None, got 'max'"),
    # impossible combinations
    (la({"solve": {"method": "exact", "degree": 3}}),
     "linear_attention[0].cfg.solve.degree: an exact solve takes no degree (got degree=3)"),
    (la({"solve": {"method": "neumann"}}),
     "linear_attention[0].cfg.solve.degree: required with solve.method='neumann' (no default degree)"),
    (la({"solve": {"method": "neumann", "degree": 0}}), "linear_attention[0].cfg.solve.degree: must be >= 1, got 0"),
    (la({"chunk_size": 16, "solve": {"method": "neumann", "degree": 16}}),
     "linear_attention[0].cfg.solve.degree: must be below chunk_size=16"),
    (la({"state": {"block_v": 16}, "decode": {"mode": "token", "state_codec": "hadamard32"}}),
     "linear_attention[0].cfg.decode.state_codec: 'hadamard32' needs state.block_v >= 32 (one 32-point Hadamard "
     "per block), got state.block_v=16"),
    (la({"decode": {"mode": "replay", "replay": {"window": 0}}}),
     "linear_attention[0].cfg.decode.replay.window: must be in 1..64, got 0"),
    (la({"decode": {"mode": "replay", "replay": {"window": 65}}}),
     "linear_attention[0].cfg.decode.replay.window: must be in 1..64, got 65"),
    (la({"decode": {"mode": "replay"}}), "linear_attention[0].cfg.decode.replay: required with decode.mode='replay'"),
    (la({"decode": {"mode": "replay", "replay": {"factor_qdq": True}}}),
     "linear_attention[0].cfg.decode.replay.window: required (1..64)"),
    (la({"decode": {"mode": "token", "replay": {"window": 8}}}),
     "linear_attention[0].cfg.decode.replay: only with decode.mode='replay', got decode.mode='token'"),
    (la({"decode": {"readout": "stored"}}),
     "linear_attention[0].cfg.decode.readout: only with decode.mode 'token' or 'replay', got decode.mode='none'"),
    (la({"solve": {"method": "exact", "implementation": "torch"},
         "decode": {"mode": "token", "implementation": "triton"}}),
     "linear_attention[0].cfg.decode.implementation: one kernel runs both the solve and the decode phase"),
    (qc({"quantizer_name": "*linear_attn_sites.*", "cfg": {**NVFP4, "block_sizes": {-1: 32, "type": "dynamic",
                                                                                    "scale_bits": [4, 3]}}}),
     "quant_cfg[0].cfg (quantizer_name '*linear_attn_sites.*', site 'key_interaction.lhs'): quant cfg for "
     "num_bits=(2, 1) must set block_sizes={-1: 16"),
    (qc({"quantizer_name": "*gdn_w_quantizer", "cfg": {"num_bits": [2, 1], "type": "dynamic"}}),
     "quant_cfg[0].cfg (quantizer_name '*gdn_w_quantizer', site 'w'): quant cfg for num_bits=(2, 1) must set "
     "block_sizes={-1: 16"),
]


@pytest.mark.parametrize("config, message", LOAD_ERRORS, ids=[m[:48] for _, m in LOAD_ERRORS])
def test_load_error_names_the_key(config, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        Policy.from_dict(config)


def test_policy_error_is_public():
    assert la_compiler.PolicyError is PolicyError
    assert la_compiler.Policy is Policy
    assert issubclass(PolicyError, ValueError)


# Errors that depend on which module a rule meets: raised when the policy is resolved
# (the annotate pass, at compile time), naming the rule.
RESOLVE_ERRORS = [
    ({"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "enable": True}]},
     "quant_cfg: quantizer 'layers.0.attn.gdn_state_quantizer' is enabled but no quant_cfg entry gives it a cfg"),
    ({"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer",
                     "cfg": {"num_bits": 8, "type": "dynamic", "axis": [0, 1], "rotate": True}}],
      **la({"state": {"block_v": 16}})},
     "quant_cfg[0].cfg (quantizer_name '*gdn_state_quantizer', site 'state'): quant block_v for format 'int8_h32' "
     "must be a multiple of 32 (Hadamard-32 groups), got 16 (state.block_v=16 from linear_attention[0].cfg)"),
    ({"quant_cfg": [{"quantizer_name": "*gdn_w_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic",
                                                                   "axis": [0, 1, 2]}},
                    {"quantizer_name": "*state_read.lhs_quantizer", "cfg": {"num_bits": 8, "type": "dynamic",
                                                                            "axis": [0, 1, 2]}}]},
     "the gdn_w_quantizer and linear_attn_sites.state_read.lhs_quantizer round the same operand (W) but are set "
     "to fp8_e4m3/row and int8/row"),
    (la({"decode": {"mode": "replay", "replay": {"window": 4, "factor_qdq": True}}}),
     "linear_attention[0].cfg.decode.replay.factor_qdq: rounds the replay factors in the state codec's format, but "
     "there is no state codec (module 'layers.0.attn': no enabled state quantizer)"),
]


@pytest.mark.parametrize("config, message", RESOLVE_ERRORS, ids=[m[:48] for _, m in RESOLVE_ERRORS])
def test_resolve_error_names_the_key(config, message):
    policy = Policy.from_dict(config)
    with pytest.raises(PolicyError, match=re.escape(message)):
        policy.resolve("layers.0.attn", "gdn")


@pytest.mark.parametrize("glob", ["net.blk[0-9].gdn_state_quantizer", "model.layers.3.attn.*",
                                  "*layers.1?.linear_attn.*_quantizer", "gdn_state_quantizer"])
def test_a_cfg_is_checked_at_load_for_every_site_its_glob_can_reach(glob):
    """Nothing about the cfg depends on the model: a glob that reaches the state quantizer in some model is
    checked at load time, however its module part is spelt."""
    with pytest.raises(PolicyError, match=re.escape(f"quant_cfg[0].cfg (quantizer_name {glob!r}, site '") +
                       r"[\w.]+'\): " + re.escape("quant cfg key 'type' must be 'dynamic'")):
        Policy.from_dict({"quant_cfg": [{"quantizer_name": glob, "cfg": {"num_bits": 8, "type": "static",
                                                                         "axis": [0, 1]}}]})


@pytest.mark.parametrize("glob, sites", [
    ("*", None), ("*_state_quantizer", {"state"}), ("*gdn_state_quantizer", {"state"}),
    ("net.blk[0-9].gdn_state_quantizer", {"state"}), ("model.layers.*.attn.kda_w_quantizer", {"w"}),
    ("*wy_key.rhs_quantizer", {"wy_key.rhs"}), ("*layers.[!0]*.*state_quantizer", {"state"}), ("*gdn*", {"state", "w"}),
    ("*weight_quantizer", set()), ("*gdn_state_quantiser", set()), ("model.layers.*.attn", set()),
    ("*linear_attn_sites.*", {f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs")}),
])
def test_reachable_sites_of_a_glob(glob, sites):
    from la_compiler.policy.quantizer_names import all_quantizers, reachable_sites

    assert reachable_sites(glob) == (set(all_quantizers().values()) if sites is None else sites)


@pytest.mark.parametrize("glob, hint", [
    ("*gdn_state_quantiser", " (did you mean '*gdn_state_quantizer'?)"),
    ("model.layers.*.attn.kda_stat_quantizer", " (did you mean 'model.layers.*.attn.kda_state_quantizer'?)"),
    ("*linear_attn_sites.wy_keys.lhs_quantizer", " (did you mean '*linear_attn_sites.wy_key.lhs_quantizer'?)"),
    ("*weight_quantizer", "; laqat's quantizers are <module>.<quantizer> with <quantizer> one of"),
])
def test_a_glob_that_reaches_no_quantizer_warns_at_load_with_the_closest_names(glob, hint):
    config = {"name": "mine", "quant_cfg": [{"quantizer_name": glob, "cfg": {"num_bits": 8, "type": "dynamic"}}]}
    with pytest.warns(la_compiler.UnmatchedPolicyRuleWarning,
                      match=re.escape(f"policy 'mine': quant_cfg[0] (quantizer_name {glob!r}) matches no laqat "
                                      f"quantizer of any model{hint}")) as record:
        Policy.from_dict(config)
    assert record[0].filename == __file__  # the caller's line, not laqat's
    with warnings.catch_warnings():  # strict mode: the documented filter turns it into an error
        warnings.simplefilter("error", la_compiler.PolicyWarning)
        with pytest.raises(la_compiler.UnmatchedPolicyRuleWarning):
            Policy.from_dict(config)


@pytest.mark.parametrize("config, hint", [
    ({"quant_cfgs": []}, "(did you mean 'quant_cfg'?)"),
    (la({"chunksize": 64}), "(did you mean 'chunk_size'?)"),
    (la({"decode": {"mode": "tokens"}}), "got 'tokens' (did you mean 'token'?)"),
    (la({"solve": {"method": "nuemann", "degree": 2}}), "got 'nuemann' (did you mean 'neumann'?)"),
    (la({"numerics": {"gem": "tf32"}}), "numerics.gem: unknown key; allowed: ['gemm', 'fp32_dot', 'key_block', "
                                        "'bwd_key_block'] (did you mean 'gemm'?)"),
    (la({"serving": {"state_dtype": "bfloat"}}), "got 'bfloat' (did you mean 'bfloat16'?)"),
    (la({"backend": "fused_recurent"}), "got 'fused_recurent' (did you mean 'fused_recurrent'"),
    (qc({"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bit": 8, "type": "dynamic"}}),
     "(did you mean 'num_bits'?)"),
    (qc({"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": "e4m4", "type": "dynamic", "axis": [0, 1]}}),
     "got 'e4m4' (did you mean 'e4m3'?)"),
])
def test_misspellings_get_a_did_you_mean(config, hint):
    with pytest.raises(PolicyError, match=re.escape(hint)):
        Policy.from_dict(config)


def test_a_cfg_typo_in_a_policy_file_fails_at_load_not_at_compile(tmp_path):
    """The user's path: a file whose glob names the model's own modules, loaded by attach_policy."""
    import torch

    path = tmp_path / "mine.yaml"
    path.write_text("quant_cfg:\n  - quantizer_name: 'model.layers.*.linear_attn.gdn_state_quantizer'\n"
                    "    cfg: {num_bits: e4m4, type: dynamic, axis: [0, 1]}\n")
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(path)!r}: quant_cfg[0].cfg (quantizer_name "
                                                    f"'model.layers.*.linear_attn.gdn_state_quantizer', site 'state'):"
                                                    f" quant cfg key 'num_bits' must be")):
        la_compiler.attach_policy(torch.nn.Linear(2, 2), str(path))


def test_file_and_name_errors(tmp_path):
    bad_suffix = tmp_path / "p.toml"
    bad_suffix.write_text("")
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(bad_suffix)!r}: the suffix must be .yaml")):
        Policy.from_file(bad_suffix)
    bad_yaml = tmp_path / "p.yaml"
    bad_yaml.write_text("quant_cfg: [\n")
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(bad_yaml)!r}: not valid YAML")):
        Policy.from_file(bad_yaml)
    bad_json = tmp_path / "p.json"
    bad_json.write_text('{"quant_cfg": [}')
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(bad_json)!r}: not valid JSON")):
        Policy.from_file(bad_json)
    wrong = tmp_path / "w.yaml"
    wrong.write_text("linear_attention:\n  - {module_name: '*', cfg: {chunk_size: 3}}\n")
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(wrong)!r}: linear_attention[0].cfg."
                                                    f"chunk_size: must be a positive power of two, got 3")):
        Policy.from_file(wrong)
    with pytest.raises(PolicyError, match=re.escape(f"policy file {str(tmp_path / 'none.yaml')!r}: cannot read it")):
        Policy.from_file(tmp_path / "none.yaml")
    with pytest.raises(PolicyError, match=r"options\['policy'\]: 'state_fp9' is neither a recipe name nor a "
                                          r"\.yaml/\.json file; recipes: \['decode_token_state_fp8', 'exact'.*\] "
                                          r"\(did you mean 'state_fp8'\?\)"):
        load_policy("state_fp9")
    with pytest.raises(PolicyError, match=r"options\['policy'\]: must be None, a Policy, a dict, a path or a "
                                          r"recipe name, got int"):
        load_policy(3)
