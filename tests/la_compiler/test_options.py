"""Typed options (la_compiler/options.py): every field validated wherever it is given (the dataclass, the policy,
the backend's options, the spec string) with an error naming the key; a numerics option reaches the spec string,
explain and the kernels' constexprs, and only variants that apply it run it; a tuning option reaches the spec and
changes no output bit; docs/options.md is the rendered table; the package reads the environment in options.py only."""
from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import torch

import la_compiler
from la_compiler.backend import BackendOptions, BackendOptionsError
from la_compiler.ir.spec import RecurrenceSpec, SpecError
from la_compiler.kernels.chunk.blocks import intra_key_block
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.precision import gemm_precision
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.kernels.selection import KernelSelectionError, select_kernel
from la_compiler.options import ENVIRONMENT, NumericsOptions, OptionsError, TuningOptions
from la_compiler.options_doc import DOC_PATH, render
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs

ROOT = Path(__file__).parents[2]
# a value each field refuses (a wrong type or a value outside its choices) and one it takes besides its default
BAD = {"gemm": "fp8", "fp32_dot": "tf32", "key_block": 48, "bwd_key_block": True,
       "keep_residual": "1", "serial_stages": 0, "autotune": 1, "compile_ahead": "off", "nan_fill": "yes"}
GOOD = {"gemm": "tf32", "fp32_dot": "tf32x3", "key_block": 16, "bwd_key_block": 32,
        "keep_residual": "all", "serial_stages": 2, "autotune": True, "compile_ahead": False, "nan_fill": False}
FIELDS = [(cls, f.name) for cls in (NumericsOptions, TuningOptions) for f in dataclasses.fields(cls)]


def test_every_field_has_a_bad_and_a_good_value_here():
    assert sorted(name for _, name in FIELDS) == sorted(BAD) == sorted(GOOD)


@pytest.mark.parametrize("cls,name", FIELDS, ids=lambda x: getattr(x, "__name__", x))
def test_a_bad_value_is_refused_by_name_everywhere(cls, name):
    prefix = cls.SPEC_PREFIX
    with pytest.raises(OptionsError, match=rf"^{name}: must be one of .*, got {re.escape(repr(BAD[name]))}"
                                          rf"( \(did you mean .*\?\))?$"):
        cls(**{name: BAD[name]})
    assert getattr(cls(**{name: GOOD[name]}), name) == GOOD[name]
    spelled = "true" if BAD[name] is True else str(BAD[name])
    with pytest.raises(SpecError, match=rf"spec {re.escape(prefix)}{name}: must be one of"):
        RecurrenceSpec.parse(f"gdn[chunk=64; {prefix}{name}={spelled}]")
    if cls is NumericsOptions:
        cfg = {"linear_attention": [{"module_name": "*", "cfg": {"numerics": {name: BAD[name]}}}]}
        with pytest.raises(PolicyError, match=rf"^linear_attention\[0\]\.cfg\.numerics\.{name}: must be one of"):
            Policy.from_dict(cfg)
    else:
        with pytest.raises(BackendOptionsError, match=rf"^options\['tuning'\]\.{name}: must be one of"):
            BackendOptions.from_user({"tuning": {name: BAD[name]}})


def test_unknown_keys_and_defaults_written_out_are_refused():
    with pytest.raises(BackendOptionsError, match=r"options\['tuning'\]\.stages: unknown key"):
        BackendOptions.from_user({"tuning": {"stages": 2}})
    with pytest.raises(BackendOptionsError, match=r"options\['tuning'\]: must be a mapping"):
        BackendOptions.from_user({"tuning": "fast"})
    with pytest.raises(PolicyError, match=r"linear_attention\[0\]\.cfg\.numerics\.precision: unknown key"):
        Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": {"numerics": {"precision": "tf32"}}}]})
    with pytest.raises(SpecError, match="spec n.solve: unknown NumericsOptions field"):
        RecurrenceSpec.parse("gdn[chunk=64; n.solve=rows]")
    with pytest.raises(SpecError, match="spec t.keep_residual=intra is the default: leave it out"):
        RecurrenceSpec.parse("gdn[chunk=64; t.keep_residual=intra]")
    with pytest.raises(SpecError, match=r"spec t.serial_stages: must be one of \[None, 1, 2, 3, 4\], got 5"):
        RecurrenceSpec(kind="gdn").replace(tuning={"serial_stages": 5})


def test_defaults_write_nothing_and_options_round_trip():
    assert str(RecurrenceSpec(kind="kda")) == ("kda[src=user; layout=bthd; state=kv; chunk=64; solve=exact; "
                                             "phase=none; kernel=auto]")
    numerics = NumericsOptions(**{k: GOOD[k] for k in NumericsOptions.keys()})
    tuning = TuningOptions(**{k: GOOD[k] for k in TuningOptions.keys()})
    spec = RecurrenceSpec(kind="kda").replace(numerics=numerics, tuning=tuning)
    assert str(spec).endswith("kernel=auto; n.bwd_key_block=32; n.fp32_dot=tf32x3; n.gemm=tf32; n.key_block=16; "
                              "t.autotune=true; t.compile_ahead=false; t.keep_residual=all; t.nan_fill=false; "
                              "t.serial_stages=2]")
    again = RecurrenceSpec.parse(str(spec))
    assert again == spec and again.numerics_options == numerics and again.tuning_options == tuning
    assert NumericsOptions.from_dict(numerics.to_dict()) == numerics
    assert TuningOptions.from_dict(tuning.to_dict()) == tuning
    policy = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": {"numerics": {"gemm": "tf32"}}}]})
    assert Policy.from_dict(policy.to_dict()) == policy
    assert policy.resolve("layers.0", "gdn").numerics == (("gemm", "tf32"),)
    assert Policy.exact().resolve("layers.0", "gdn").numerics == ()


def test_a_numerics_option_enters_the_kernels_constexprs_and_changes_bits():
    """ChunkParams carries the spec's numerics, and each option reaches a constexpr of the launched kernels (so
    Triton compiles them apart): n.gemm=tf32 the GEMM precision of 16-bit inputs, n.key_block the forward intra
    stage's key block; n.key_block=16 sums GDN's pair products over two key blocks at K = 24 (whole rows by
    default): other bits, the same contract."""
    default = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8))
    tf32 = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8).replace(numerics={"gemm": "tf32"}))
    assert tf32.numerics != default.numerics
    assert gemm_precision(tf32, torch.bfloat16) == "tf32" != gemm_precision(default, torch.bfloat16)
    keyed = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8).replace(numerics={"key_block": 16}))
    assert keyed.numerics != default.numerics
    assert intra_key_block(keyed, 32, 16) == 16 != intra_key_block(default, 32, 16)
    (q, k, v, g, beta, _), _ = random_inputs("gdn", B=1, T=19, H=1, K=24, V=8, requires_grad=False)
    blocked = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8).replace(numerics={"key_block": 16}))
    o, ht = chunk_fwd(default, q, k, v, g, beta, 0.4)
    o16, ht16 = chunk_fwd(blocked, q, k, v, g, beta, 0.4)
    assert not torch.equal(o, o16)
    want, want_ht = chunk_delta_rule_reference(*(x.double() for x in (q, k, v, g, beta)),
                                               spec=RecurrenceSpec(kind="gdn", chunk=8), scale=0.4)
    for got, ref in ((o, want), (o16, want), (ht, want_ht), (ht16, want_ht)):
        assert rel_l2(got, ref) <= 1e-5


def test_only_variants_that_apply_a_numerics_option_run_it():
    spec = RecurrenceSpec.parse("gdn[chunk=64; n.gemm=tf32]")
    choice = select_kernel(spec, device="cpu", dtype=torch.float32, head_k=16, head_v=16)
    assert choice.variant == "chunk"
    assert "not fused_recurrent: the numerics options ['n.gemm=tf32'] are not fused_recurrent's" in choice.explain()
    with pytest.raises(KernelSelectionError, match="n.gemm=tf32.*not reference's"):
        select_kernel(spec, device="cpu", dtype=torch.float32, head_k=16, head_v=16, requested="reference")
    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=3, requires_grad=False)
    with pytest.raises(KernelSelectionError, match="not fused_recurrent's"):  # a spec naming its kernel
        torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 0.5, str(spec.replace(kernel="fused_recurrent")))


def _op(kind, spec):
    def fn(q, k, v, g, beta, h0):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, None, 0.5, spec)
    return fn


def test_policy_numerics_and_tuning_reach_the_spec_and_explain():
    """A policy's numerics and the backend's tuning options are written into the node's spec: explain shows both,
    the kernel reason says why the exact-numerics variants were passed over."""
    xs, _ = random_inputs("gdn", T=5, H=1, K=8, V=8, initial_state=True)
    policy = {"linear_attention": [{"module_name": "*", "cfg": {"numerics": {"key_block": 16}}}]}
    report = la_compiler.explain(_op("gdn", str(RecurrenceSpec(kind="gdn", chunk=8))), *xs, policy=policy,
                                 tuning={"keep_residual": "none", "nan_fill": True})
    (match,) = report.matches
    assert match.spec.endswith("kernel=chunk; n.key_block=16; t.keep_residual=none; t.nan_fill=true]")
    assert "n.key_block=16" in str(report) and "not fused_recurrent: the numerics options" in str(report)


def test_tuning_options_change_no_output_bit():
    """The same forward and every gradient, bit for bit, under every residual mode, serial stages and NaN fill
    (the op, the chunk variant, the interpreter)."""
    xs, cu = random_inputs("gdn", B=1, T=13, H=1, HV=2, K=8, V=8, initial_state=True, cu_seqlens=[0, 5, 13])
    base = RecurrenceSpec(kind="gdn", chunk=8, kernel="chunk")

    def run(tuning):
        o, ht = torch.ops.laqat.delta_rule(*xs[:6], cu, 0.5, str(base.replace(tuning=tuning)))
        return (o, ht, *torch.autograd.grad((o * o).sum() + ht.sum(), xs))

    want = run({})
    for tuning in ({"keep_residual": "all", "serial_stages": 2},
                   {"keep_residual": "none", "nan_fill": False, "compile_ahead": False}):
        for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), run(tuning), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} under {tuning}")


def test_the_options_page_is_the_rendered_table():
    assert DOC_PATH.read_text() == render(), "run `python -m la_compiler.options_doc --write`"
    for cls, name in FIELDS:
        assert f"| `{name}` |" in render() and f"`{cls.SPEC_PREFIX}{name}=`" in render()


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.split()]


# the package reads no environment variable but in options.py; Megatron-Core's own setting is read where laqat
# mirrors Megatron's warning about it
ENVIRONMENT_READERS = {"la_compiler/options.py", "passes/frontends/megatron.py"}


def test_the_package_reads_the_environment_in_options_only():
    readers = {str(path.relative_to(ROOT)) for path in _tracked("la_compiler", "passes", "kernels")
               if path.suffix == ".py" and path.exists() and re.search(r"os\.environ|getenv\(", path.read_text())}
    assert readers <= ENVIRONMENT_READERS, sorted(readers - ENVIRONMENT_READERS)
    megatron = (ROOT / "passes/frontends/megatron.py").read_text()
    assert set(re.findall(r"environ\.get\(\"(\w+)\"", megatron)) == {"CUDA_DEVICE_MAX_CONNECTIONS"}


# the measurement records and their tests quote the commands of earlier runs, settings of then included
RECORDS = ("examples/benchmarks/results/", "tests/benchmarks/")


def _code() -> list[Path]:
    return [path for path in _tracked("*.py", "*.sh", "Makefile") if path.exists()
            and not str(path.relative_to(ROOT)).startswith(RECORDS) and path.name != "test_options.py"]


def test_every_laqat_variable_in_the_code_is_documented():
    """Every LAQAT_* name the code reads or sets is in options.ENVIRONMENT (docs/options.md's table); so none of
    the settings that became options or were deleted (LAQAT_CHUNK_*, LAQAT_QDQ_*, LAQAT_AUTOTUNE, LAQAT_FP32_DOT,
    LAQAT_NAN_FILL) is left anywhere."""
    documented = {v.name for v in ENVIRONMENT}
    for path in _code():
        used = set(re.findall(r"\bLAQAT_[A-Z0-9_]+", path.read_text(errors="replace")))
        assert used <= documented, (str(path.relative_to(ROOT)), sorted(used - documented))
