"""Serving profiles in the policy (linear_attention cfg.serving, ModelOpt's precision alias): loading, round
trips, what they resolve to in the spec, and every refusal naming its key."""
import json
import sys

import pytest
import torch
import yaml

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.options import DecodeOptions, DecodeOptionsError, decode_options
from la_compiler.policy.file_format import PolicyError, ServingCfg
from la_compiler.policy.resolution import Policy, load_policy

INT8_STATE = {"num_bits": 8, "type": "dynamic", "axis": [0, 1]}


def _policy(cfg, quant_cfg=()):
    return Policy.from_dict({"quant_cfg": list(quant_cfg), "linear_attention": [{"module_name": "*", "cfg": cfg}]})


def _spec(policy, kind):
    res = policy.resolve("model.layers.0.attn", kind)
    return RecurrenceSpec(kind, phase=res.phase, quant=res.quant, extra=res.extra)


@pytest.mark.parametrize("version", ["0.33", 0.33, "0.33.0"])
def test_serving_key_loads_decodes_token_by_token_and_round_trips(version):
    policy = _policy({"serving": {"engine": "vllm", "version": version, "state_dtype": "bfloat16"}})
    cfg = policy.linear_attention[0].cfg
    assert cfg.serving == ServingCfg("vllm", "0.33", "bfloat16") and cfg.decode.mode == "token"
    as_dict = policy.to_dict()
    assert Policy.from_dict(json.loads(json.dumps(as_dict))) == policy
    assert Policy.from_dict(yaml.safe_load(yaml.safe_dump(as_dict))) == policy
    assert dict(policy.resolve("m", "gdn").extra) == {"readout": "working", "serving": "vllm-0.33",
                                                       "state_dtype": "bfloat16"}


@pytest.mark.parametrize("kind,model_dtype,cache", [("gdn", torch.bfloat16, "bfloat16"),
                                                    ("gdn", torch.float16, "float16"),
                                                    ("gdn", torch.float32, "float32"),
                                                    ("kda", torch.bfloat16, "float32")])
def test_precision_vllm_is_the_auto_cache_of_vllm(kind, model_dtype, cache):
    spec = _spec(_policy({"precision": "vllm"}), kind)
    opts = decode_options(spec)
    assert opts.serving == "vllm-0.33" and opts.state_dtype == "auto" and opts.vllm_order
    assert opts.cache_dtype(kind, model_dtype) == cache  # vLLM 0.33's MambaStateDtypeCalculator


def test_precision_vllm_kimi_k3_is_the_kda_profile_and_refuses_gdn():
    policy = _policy({"precision": "vllm_kimi_k3"})
    assert policy.linear_attention[0].cfg.serving == ServingCfg(model="kimi_k3")
    assert decode_options(_spec(policy, "kda")).cache_dtype("kda", torch.bfloat16) == "float32"
    with pytest.raises(PolicyError, match=r"linear_attention\[0\]\.cfg\.serving\.model: 'kimi_k3' is vLLM's KDA"):
        policy.resolve("m", "gdn")
    with pytest.raises(PolicyError, match=r"\.cfg\.serving\.model: 'kimi_k3' is vLLM's KDA"):
        load_policy("vllm_kda_state_bf16").resolve("m", "gdn")


def test_precision_replayssm_is_the_replayssm_emulation():
    policy = _policy({"precision": "replayssm"}, [{"quantizer_name": "*state_quantizer", "cfg": INT8_STATE}])
    spec = _spec(policy, "gdn")
    assert spec.phase == "replay" and spec.quant_map["state"] == "int8_h32/tile64"
    assert dict(spec.extra)["replay_window"] == "1" and policy.linear_attention[0].cfg.serving is None
    wider = _policy({"precision": "replayssm", "decode": {"replay": {"window": 4}}},
                    [{"quantizer_name": "*state_quantizer", "cfg": INT8_STATE}])
    assert dict(_spec(wider, "kda").extra)["replay_window"] == "4"  # the cfg's own decode keys win


@pytest.mark.parametrize("cfg,message", [
    ({"serving": {"state_dtype": "float8"}}, "cfg.serving.state_dtype: must be one of"),
    ({"serving": {"version": "0.30"}}, "cfg.serving.version: must be one of ['0.33']"),
    ({"serving": {"engine": "sglang"}}, "cfg.serving.engine: must be one of ['vllm']"),
    ({"serving": {"cache": "bfloat16"}}, "cfg.serving: unknown key(s) ['cache']"),
    ({"serving": {"model": "kimi_k3", "state_dtype": "float16"}}, "cfg.serving.state_dtype: must be one of"),
    ({"serving": {}, "decode": {"mode": "replay", "replay": {"window": 2}}}, "cfg.decode.mode: a serving profile"),
    ({"serving": {}, "decode": {"mode": "none"}}, "cfg.decode.mode: a serving profile"),
    ({"serving": {}, "decode": {"readout": "stored"}}, "cfg.decode.readout: vllm reads each decode output"),
    ({"serving": {}, "decode": {"decay_log_step": 0.1}}, "cfg.decode.decay_log_step: vllm does not round"),
    ({"serving": {}, "decode": {"state_codec": "hadamard32"}}, "cfg.decode.state_codec: 'hadamard32' is ReplaySSM"),
    ({"precision": "vllm", "serving": {}}, "cfg.precision: 'vllm' and serving both choose"),
    ({"precision": "sglang"}, "cfg.precision: must be one of ['vllm', 'vllm_kimi_k3', 'replayssm']"),
])
def test_bad_serving_cfg_names_the_key(cfg, message):
    with pytest.raises(PolicyError) as e:
        _policy(cfg)
    assert str(e.value).startswith("linear_attention[0].") and message in str(e.value), str(e.value)


def test_kind_checks_at_resolution_name_the_key():
    with pytest.raises(PolicyError, match=r"cfg\.serving\.state_dtype: vLLM 0\.33 keeps a KDA state in one of"):
        _policy({"serving": {"state_dtype": "float16"}}).resolve("m", "kda")
    rotating = _policy({"serving": {}}, [{"quantizer_name": "*state_quantizer", "cfg": {**INT8_STATE, "rotate": True}}])
    with pytest.raises(PolicyError, match=r"Hadamard-32.*ReplaySSM's codec"):
        rotating.resolve("m", "gdn")


def test_a_state_quantizer_composes_with_the_cache_dtype():
    fp8 = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}
    spec = _spec(_policy({"serving": {"state_dtype": "bfloat16"}, "state": {"block_v": 32}},
                         [{"quantizer_name": "*state_quantizer", "cfg": fp8}]), "gdn")
    opts = decode_options(spec)
    assert (opts.codec, opts.block_v, opts.state_dtype) == ("fp8_e4m3", 32, "bfloat16")


def test_spec_level_serving_options_are_checked():
    with pytest.raises(DecodeOptionsError, match="x.state_dtype: the serving cache's dtype, only with x.serving"):
        DecodeOptions(mode="token", state_dtype="bfloat16")
    with pytest.raises(DecodeOptionsError, match="x.serving: must be one of"):
        DecodeOptions(mode="token", serving="vllm-0.30")
    with pytest.raises(DecodeOptionsError, match="x.readout=working"):
        DecodeOptions(mode="token", serving="vllm-0.33", readout="stored")
    with pytest.raises(DecodeOptionsError, match="phase=token"):
        DecodeOptions(mode="replay", serving="vllm-0.33", window=2)


@pytest.fixture
def no_vllm(monkeypatch):
    """vllm not importable (whatever this process imported before: the serving tests' stand-in)."""
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.mark.parametrize("recipe,kind,flag", [("vllm_gdn_state_bf16", "gdn", "--gdn-prefill-backend triton"),
                                              ("vllm_kda_state_bf16", "kda", "--kda-prefill-backend triton")])
def test_the_prefill_backend_defaults_to_the_triton_kernels_laqat_reproduces(recipe, kind, flag, no_vllm):
    assert ServingCfg().prefill_backend == "triton" and ServingCfg().forward == "auto"
    assert _policy({"serving": {}}).linear_attention[0].cfg.serving.prefill_backend == "triton"
    res = load_policy(recipe).resolve("model.layers.0.attn", kind)
    (rule,) = [r for r in res.rules if ".serving -> " in r]
    assert rule.startswith("linear_attention[0].cfg.serving -> vllm 0.33.0 " + kind.upper()), rule
    for said in (flag, "VLLM_TRITON_FORCE_FIRST_CONFIG=1", "--mamba-ssm-cache-dtype bfloat16",
                 "forward: laqat's reproduction, laqat's backward (auto: vllm is not importable"):
        assert said in rule, (said, rule)
    assert "forward" not in dict(res.extra)  # laqat's forward: the spec of before


@pytest.mark.parametrize("cfg,names", [
    ({"prefill_backend": "flashinfer"}, ["'flashinfer' is FlashInfer's GDN prefill", "Hopper",
                                         "laqat does not reproduce FlashInfer's GDN prefill",
                                         "`--gdn-prefill-backend triton`"]),
    ({"prefill_backend": "flashkda", "model": "kimi_k3"}, ["'flashkda' is FlashKDA", "laqat does not reproduce "
                                                           "FlashKDA", "`--kda-prefill-backend triton`"]),
])
def test_compiled_prefill_backends_are_refused_with_the_servers_flag(cfg, names):
    with pytest.raises(PolicyError) as e:
        _policy({"serving": cfg})
    text = str(e.value)
    assert text.startswith("linear_attention[0].cfg.serving.prefill_backend: "), text
    for name in names:
        assert name in text, (name, text)


def test_forward_server_without_vllm_is_refused(no_vllm):
    with pytest.raises(PolicyError, match=r"cfg\.serving\.forward: 'server' runs vllm 0\.33\.0's own kernels, but "
                                          r"vllm is not importable .*use serving\.forward: laqat"):
        _policy({"serving": {"forward": "server"}}).resolve("m", "gdn")
    res = _policy({"serving": {"forward": "laqat"}}).resolve("m", "gdn")
    assert "forward" not in dict(res.extra) and any("forward: laqat's reproduction" in r for r in res.rules)
    with pytest.raises(DecodeOptionsError, match="x.forward: the server's own forward kernels, only with x.serving"):
        DecodeOptions(mode="token", forward="server")


def test_explain_shows_the_servers_release_backend_and_flags(no_vllm):
    import la_compiler
    from tests.ir_inputs import random_inputs

    spec = RecurrenceSpec(kind="gdn").to_string()

    def fn(q, k, v, g, beta, h0, cu):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, cu, 0.5, spec)

    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=4, H=1, HV=1, K=8, V=8)
    with la_compiler.phase([2]):
        text = str(la_compiler.explain(fn, q, k, v, g, beta, None, None, policy="vllm_gdn_state_bf16"))
    assert "x.serving=vllm-0.33" in text, text
    assert "policy: linear_attention[0].cfg.serving -> vllm 0.33.0 GDN" in text, text
    assert "--gdn-prefill-backend triton" in text and "VLLM_TRITON_FORCE_FIRST_CONFIG=1" in text, text
