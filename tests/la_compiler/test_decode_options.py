"""The decode options (``la_compiler.options.DecodeOptions``): one typed definition that refuses a bad value once,
naming the key, wherever it comes from (the dataclass, a spec string, a policy); the policy writes them into the
spec and the decode kernels read the same options back."""
from __future__ import annotations

import dataclasses

import pytest

from la_compiler import options as opts
from la_compiler.ir.spec import PHASE_MODES, RecurrenceSpec
from la_compiler.options import DecodeOptions, DecodeOptionsError, OptionsError, decode_options
from la_compiler.policy import file_format
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy

# a value each field refuses, with the fields it needs besides (a window is a replay option)
BAD = {"mode": ("prefill", {}), "state_codec": ("nvfp4/block16", {}), "readout": ("both", {}),
       "decay_log_step": (-0.5, {}), "window": (65, {"mode": "replay"}), "factor_qdq": (1, {"mode": "replay"}),
       "serving": ("vllm-0.30", {}), "state_dtype": ("float8", {"serving": "vllm-0.33"}),
       "forward": ("server", {})}  # the server's kernels without a serving profile
SPELLED = {"state_codec": "nvfp4/block16", "readout": "both", "decay_log_step": "-0.5",
           "window": "65", "serving": "vllm-0.30", "state_dtype": "float8", "forward": "server"}


def test_every_field_has_a_bad_value_here():
    assert sorted(BAD) == sorted(f.name for f in dataclasses.fields(DecodeOptions))


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_once_naming_the_spec_key(name):
    value, given = BAD[name]
    with pytest.raises(DecodeOptionsError) as e:
        DecodeOptions(**given, **{name: value})
    assert e.value.field == name and isinstance(e.value, OptionsError)
    key = DecodeOptions.spec_key(name)
    assert str(e.value) == f"{key}: {e.value.reason}" and key not in e.value.reason


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_a_spec_string_is_refused_by_the_same_check(name):
    """The spec reader builds the dataclass: its refusal is the dataclass's, with the spec in front (a phase the
    spec itself refuses: ``PHASE_MODES``, the decode modes and none)."""
    value, given = BAD[name]
    with pytest.raises(DecodeOptionsError) as direct:
        DecodeOptions(**given, **{name: value})
    fields = {"mode": "token", **given, name: SPELLED[name]}
    items = [f"phase={fields.pop('mode')}"]
    if "state_codec" in fields:
        items.append(f"q.state={fields.pop('state_codec')}")
    items += sorted(f"{DecodeOptions.spec_key(k)}={v}" for k, v in fields.items())
    spec = RecurrenceSpec.parse(f"gdn[{'; '.join(items)}]")
    with pytest.raises(DecodeOptionsError) as parsed:
        decode_options(spec)
    assert (parsed.value.field, parsed.value.reason) == (name, direct.value.reason)
    assert str(parsed.value) == f"spec {spec}: {DecodeOptions.spec_key(name)}: {direct.value.reason}"


def test_the_replay_window_is_bounded_in_one_place():
    lo, hi = opts.REPLAY_WINDOW
    window = [f for f in dataclasses.fields(file_format.ReplayCfg) if f.name == "window"][0].metadata
    assert (window["lo"], window["hi"]) == (lo, hi)
    for bad in (lo - 1, hi + 1):
        with pytest.raises(DecodeOptionsError, match=rf"^x\.replay_window: must be in {lo}\.\.{hi}, got {bad}$"):
            DecodeOptions(mode="replay", window=bad)
    assert DecodeOptions(mode="replay", window=hi).window == hi


def test_the_policy_schema_takes_its_decode_values_from_the_options():
    assert file_format.READOUTS is opts.READOUTS
    assert file_format.SERVING_STATE_DTYPES is opts.SERVING_STATE_DTYPES
    assert {f"{e}-{v}" for e, vs in file_format.SERVING_VERSIONS.items() for v in vs} == set(opts.SERVING_PROFILES)
    modes = [f for f in dataclasses.fields(file_format.DecodeCfg) if f.name == "mode"][0].metadata["choices"]
    assert modes == PHASE_MODES == ("none",) + opts.DECODE_MODES


def test_a_refusal_that_needs_the_quantizer_names_the_policy_key():
    """What the policy alone cannot know (the state quantizer of a module) is refused by the decode options at
    resolution, with the policy's key in front of the options' reason."""
    policy = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": {
        "decode": {"mode": "replay", "replay": {"window": 4, "factor_qdq": True}}}}]})
    with pytest.raises(DecodeOptionsError) as direct:
        DecodeOptions(mode="replay", window=4, factor_qdq=True)
    with pytest.raises(PolicyError) as e:
        policy.resolve("layers.0.attn", "gdn")
    assert str(e.value).startswith(f"linear_attention[0].cfg.decode.replay.factor_qdq: {direct.value.reason} ")
    nvfp4 = Policy.from_dict({
        "quant_cfg": [{"quantizer_name": "*state_quantizer", "cfg": {
            "num_bits": [2, 1], "type": "dynamic", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": [4, 3]}}}],
        "linear_attention": [{"module_name": "*", "cfg": {"decode": {"mode": "token"}}}]})
    with pytest.raises(PolicyError, match=r"^quant_cfg: the decode state codec must be one of .* got 'nvfp4/block16'"):
        nvfp4.resolve("layers.0.attn", "kda")


@pytest.mark.parametrize("options", [
    DecodeOptions(),
    DecodeOptions(mode="replay", state_codec="int8_h32/tile32", readout="stored", decay_log_step=0.0039, window=8,
                  factor_qdq=True),
    DecodeOptions(state_codec="int8/block32", decay_log_step=1),
    DecodeOptions(state_codec="fp8_e4m3/tile16", serving="vllm-0.33", state_dtype="auto"),
])
def test_the_spec_carries_the_options_and_reads_back_equal(options):
    quant = () if options.state_codec is None else (("state", options.state_codec.to_string()),)
    spec = RecurrenceSpec("kda", phase=options.mode, quant=quant, extra=options.spec_extra())
    assert decode_options(RecurrenceSpec.parse(spec.to_string())) == options


def test_the_spec_reader_refuses_what_is_no_decode_option():
    with pytest.raises(DecodeOptionsError, match=r"unknown decode option\(s\) \['x\.decode_impl'\]"):
        decode_options(RecurrenceSpec("gdn", phase="token", extra=(("decode_impl", "torch"),)))
    with pytest.raises(DecodeOptionsError, match=r"x\.replay_factor_qdq: must be 0 or 1, got 'yes'"):
        decode_options(RecurrenceSpec("gdn", phase="replay", extra=(("replay_factor_qdq", "yes"),)))
