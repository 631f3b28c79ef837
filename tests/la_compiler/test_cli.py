"""The ``laqat`` command line a user reaches for: --version, recipes, policy check (with a model built from a
config), policy schema, spec, and source resolving kernel=auto; output that pipes cleanly."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import la_compiler
from la_compiler.cli import LAYER_CLASSES, compact, main
from la_compiler.policy.json_schema import SCHEMA_PATH
from la_compiler.policy.resolution import load_policy
from la_compiler.recipes import SERVES, recipe_names, recipe_path

ROOT = Path(__file__).parents[2]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert re.fullmatch(rf"laqat {re.escape(la_compiler.__version__)} \(torch \S+, triton \S+\)\n",
                        capsys.readouterr().out)


def test_recipes_lists_what_each_rounds_and_serves(capsys):
    code, out, _ = run(capsys, "recipes")
    assert code == 0
    lines = out.splitlines()
    for name in recipe_names():
        block = lines[lines.index(name) + 1:lines.index(name) + 3]
        assert block == [f"  rounds: {load_policy(name).description}", f"  serves: {SERVES[name]}"], name
    code, out, _ = run(capsys, "recipes", "state_fp8")
    assert code == 0 and out == f"# {recipe_path('state_fp8')}\n{recipe_path('state_fp8').read_text()}"
    code, _, err = run(capsys, "recipes", "state_fp9")
    assert code == 2 and "recipe 'state_fp9' does not exist" in err and "(did you mean 'state_fp8'?)" in err


def test_policy_check_validates_at_load_and_says_what_is_wrong(capsys, tmp_path):
    code, out, _ = run(capsys, "policy", "check", "state_fp8")
    assert (code, out) == (0, "policy 'state_fp8' (state_fp8): valid, 2 quant_cfg and 1 linear_attention rule(s)\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("quant_cfg:\n  - {quantizer_name: 'model.layers.*.attn.gdn_state_quantizer',\n"
                    "     cfg: {num_bits: e4m4, type: dynamic, axis: [0, 1]}}\n")
    code, out, err = run(capsys, "policy", "check", str(typo))
    assert code == 2 and out == ""
    assert err.startswith(f"laqat policy check: invalid: policy file {str(typo)!r}: quant_cfg[0].cfg")
    assert "got 'e4m4' (did you mean 'e4m3'?)" in err and "Traceback" not in err
    glob = tmp_path / "glob.json"
    glob.write_text(json.dumps({"quant_cfg": [{"quantizer_name": "*gdn_state_quantiser", "enable": False}]}))
    code, out, _ = run(capsys, "policy", "check", str(glob))
    assert code == 0 and "warning: policy 'glob': quant_cfg[0] (quantizer_name '*gdn_state_quantiser') matches no " \
                         "laqat quantizer of any model (did you mean '*gdn_state_quantizer'?)" in out
    assert run(capsys, "policy", "check", str(glob), "--strict")[0] == 1


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Every transformers architecture of the conformance suite, as a config.json of its tiny model."""
    transformers = pytest.importorskip("transformers")
    from tests.models.transformers_models import MODELS

    out = {}
    for case in MODELS:
        config = getattr(transformers, case.config_class)(**case.overrides)
        config.architectures = [case.model_class]
        directory = tmp_path_factory.mktemp(case.name)
        config.save_pretrained(directory)
        out[case.name] = (case, directory)
    return out


def test_policy_check_finds_every_architectures_layers(capsys, configs):
    for name, (case, directory) in configs.items():
        code, out, _ = run(capsys, "policy", "check", "state_fp8", "--model", str(directory / "config.json"))
        assert code == 0, (name, out)
        layers = out.split("layers:\n")[1].splitlines()
        assert layers == [f"  {compact(list(case.linear_attention))} ({case.kind}): q.state=fp8_e4m3/tile64; chunk=64; "
                          f"solve=exact; phase=none"], (name, out)
        assert f"model: {case.model_class} ({directory / 'config.json'}): {len(case.linear_attention)}" in out
    assert {case.kind for case, _ in configs.values()} == set(LAYER_CLASSES.values())


def test_policy_check_on_a_model_shows_the_rules_layers_and_what_fails(capsys, configs, tmp_path):
    policy = tmp_path / "mine.yaml"
    policy.write_text("""
quant_cfg:
  - {quantizer_name: "*", enable: false}
  - {quantizer_name: "*layers.1*gdn_state_quantizer", cfg: {num_bits: 8, type: dynamic, axis: [0, 1], rotate: true}}
  - {quantizer_name: "*kda_state_quantizer", cfg: {num_bits: [4, 3], type: dynamic, axis: [0, 1]}}
linear_attention:
  - {module_name: "*", cfg: {chunk_size: 32}}
  - {module_name: "*layers.1[2-3].*", cfg: {state: {block_v: 16}}}
""")
    code, out, _ = run(capsys, "policy", "check", str(policy), "--model", "qwen3_5_text")  # its default config
    assert code == 1, out
    assert "model: Qwen3_5ForCausalLM (the default qwen3_5_text config): 24 linear-attention layer(s)" in out
    assert "  quant_cfg[0] ('*', enable, off): every quantizer of model.layers.{0-2,4-6,8-10,12-14,16-18,20-22," \
           "24-26,28-30}.linear_attn\n" in out
    assert "  quant_cfg[1] ('*layers.1*gdn_state_quantizer', cfg): gdn_state_quantizer of " \
           "model.layers.{1,10,12-14,16-18}.linear_attn\n" in out
    assert "  quant_cfg[2] ('*kda_state_quantizer', cfg): nothing\n" in out
    assert "  linear_attention[1] ('*layers.1[2-3].*'): model.layers.{12-13}.linear_attn\n" in out
    assert "  model.layers.{1,10,14,16-18}.linear_attn (gdn): q.state=int8_h32/tile64; chunk=32; " in out
    assert ("  model.layers.{12-13}.linear_attn (gdn): error: quant_cfg[1].cfg (quantizer_name '*layers.1*gdn_state_"
            "quantizer', site 'state'): quant block_v for format 'int8_h32' must be a multiple of 32") in out
    assert "warning: policy 'mine': quant_cfg[2] (quantizer_name '*kda_state_quantizer') matched no quantizer of " \
           "this model" in out
    code, _, err = run(capsys, "policy", "check", "state_fp8", "--model", "qwen3_5_txt")
    assert code == 2 and "(did you mean 'qwen3_5_text'?)" in err


def test_policy_schema_prints_the_shipped_schema(capsys):
    code, out, _ = run(capsys, "policy", "schema")
    assert code == 0 and out == SCHEMA_PATH.read_text() and json.loads(out)["properties"]["quant_cfg"]


def test_spec_shows_each_field_with_what_it_means(capsys):
    code, out, _ = run(capsys, "spec", "kda[src=fla; q.state=fp8_e4m3/tile64; acc.wy_key=fp16:16; n.gemm=tf32]")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("kda[src=fla; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=auto; "
                        "q.state=fp8_e4m3/tile64; acc.wy_key=fp16:16; n.gemm=tf32]")
    assert re.fullmatch(r"  kernel +auto +the kernel variant \(auto: the selection table chooses\)", lines[8])
    assert re.fullmatch(r"  q\.state +fp8_e4m3/tile64 +quantizer of site state", lines[9])
    assert re.fullmatch(r"  acc\.wy_key +fp16:16 +fp16 accumulator of wy_key, rounded every 16 products", lines[10])
    assert "RecurrenceSpec(" not in out and "degree" not in out and "chunk_passed" not in out
    code, out, _ = run(capsys, "spec", "gdn[src=fla; chunk=16:passed]")
    assert code == 0 and re.search(r"^  chunk_passed +True +the program passed the chunk length", out, re.M)


def test_source_resolves_kernel_auto_as_the_selection_table_would(capsys):
    spec = "gdn[src=fla; q.state=fp8_e4m3/tile64]"
    code, out, _ = run(capsys, "source", spec, "--device", "cuda", "--paths")
    assert code == 0
    assert out.splitlines()[0].startswith("kernel: chunk (kernel=auto selects chunk on cuda, bfloat16, head dims "
                                          "128x128: chunked (WY) Triton kernels")
    assert "forward h: " in out and re.search(r"^constexpr: .*\bKDA=False\b", out, re.M)
    code, out, _ = run(capsys, "source", "gdn[src=fla]", "--device", "cpu", "--paths")  # the interpreter's table
    assert code == 0 and out.startswith("kernel: fused_recurrent (kernel=auto selects fused_recurrent on cpu, "
                                        "float32, head dims 128x128")
    code, out, _ = run(capsys, "source", "gdn[src=fla]", "--device", "cuda", "--dtype", "float64", "--paths")
    assert code == 2 and out == ""  # the fp64 reference runs no Triton kernel


def test_output_pipes_cleanly():
    """``laqat source SPEC | head -1``: no BrokenPipeError traceback, exit status 0."""
    script = (f"set -o pipefail; {sys.executable} -m la_compiler.cli source "
              f"'gdn[src=fla; kernel=chunk; q.state=fp8_e4m3/tile64]' | head -1")
    run_ = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (run_.returncode, run_.stderr) == (0, ""), run_.stderr
    assert run_.stdout.startswith("# ---- forward intra_gdn: ")
