"""Every transformers architecture with a GDN/KDA torch fallback, tiny and random, trains under laqat.

For each row of transformers_models.MODELS, run_transformers_model.py (a process of its own: transformers must
not see FLA; forked from model_processes.py's server, which has only imported what every run imports) compiles
the model with ``backend="laqat", fullgraph=True`` three times and returns one JSON line; this test asserts on
it:

- ``{"compiler": "inductor"}`` (the GPU's default; one model per kind of linear-attention code) and
  ``{"compiler": "eager"}`` (the CPU's default): exactly one laqat node per linear-attention
  layer, of the architecture's kind, named by the layer's fully qualified module name (in a model of two
  linear-attention layers the second takes the first one's algebra check); the loss within
  TOL of eager fp32; every parameter's gradient within TOL of eager fp32, or of the fp64 run where eager
  fp32 itself is farther than TOL / 10 from it (sums over tokens that cancel: A_log, dt_bias);
- ``{"policy": "state_fp8", "compiler": "eager"}``: the same nodes, with an FP8 state in their spec; the
  per-token losses move away from the exact ones, and an AdamW step lowers the loss.
- no run raises a laqat warning (a shipped recipe meets all its rules on a GDN-only and a KDA-only model).

All failed checks of a model are reported together. ``LAQAT_MODELS_RESULTS=<dir>`` keeps each model's
JSON (with its CPU and wall seconds) as ``<dir>/<name>.json``.
"""
import json
import os
import time
from pathlib import Path

import pytest

from tests.models.model_processes import ModelProcesses
from tests.models.transformers_models import LINEAR_ATTENTION_KEYS, MODELS, ModelCase

TOL = 1e-5  # relative L2, exact numerics in fp32
# state_fp8's per-token losses are farther than this (relative L2) from the exact ones: exact compiled
# runs are 1e-8..5e-8 from eager, the FP8 state moves them by 8e-7..2e-4
FP8_MOVES = 3e-7
ROOT = Path(__file__).parents[2]
RESULTS_ENV = "LAQAT_MODELS_RESULTS"
RUNS = {"inductor": 'options={"compiler": "inductor"}', "eager_handoff": 'options={"compiler": "eager"}'}


@pytest.fixture(scope="module")  # every model of this module: one server per pytest worker
def model_processes():
    processes = ModelProcesses(dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)))
    yield processes
    processes.close()


def run_model(processes: ModelProcesses, name: str, workdir: Path) -> dict:
    t0 = time.perf_counter()
    returncode, cpu_seconds, stdout, stderr = processes.run(name, workdir)
    wall = time.perf_counter() - t0
    assert returncode == 0, f"{name}: the runner failed (exit code {returncode}):\n{stderr[-6000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    result["test_seconds"] = wall
    result["test_cpu_seconds"] = cpu_seconds
    if os.environ.get(RESULTS_ENV):
        Path(os.environ[RESULTS_ENV], f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def check_matches(case: ModelCase, run: dict, label: str) -> list[str]:
    expected = sorted([case.kind, "torch", module] for module in case.linear_attention)
    failures = []
    if sorted(run["matches"]) != expected:
        failures.append(f"{label}: laqat nodes {run['matches']}, expected one per linear-attention layer {expected}; "
                        f"near misses: {run['near_misses']}")
    # the layers after the first take its algebra check (the layers' regions are alike)
    if "shared_checks" in run and run["shared_checks"] != len(case.linear_attention) - 1:
        failures.append(f"{label}: {run['shared_checks']} of {len(case.linear_attention)} linear-attention layers "
                        f"took the first one's algebra check, expected all but the first")
    return failures


def check_exact(case: ModelCase, result: dict, key: str) -> list[str]:
    label, run = RUNS[key], result[key]
    failures = check_matches(case, run, label)
    if "error" in run:
        return [f"{label}: {run['error']}"] + failures
    eager = result["eager"]
    if abs(run["loss"] - eager["loss"]) > TOL * abs(eager["loss"]):
        failures.append(f"{label}: loss {run['loss']!r} vs eager {eager['loss']!r}")
    if run["grad_names"] != eager["grad_names"]:
        failures.append(f"{label}: gradients of {run['grad_names']} vs eager's {eager['grad_names']}")
    eager_vs_fp64 = result["fp64"]["eager_vs_fp64"]
    for name, err in run["vs_eager"].items():
        if eager_vs_fp64[name] <= TOL / 10:
            if err > TOL:
                failures.append(f"{label}: grad {name} {err:.1e} from eager fp32 (> {TOL:.0e})")
        elif run["vs_fp64"][name] > TOL:
            failures.append(f"{label}: grad {name} {run['vs_fp64'][name]:.1e} from fp64 (> {TOL:.0e}; "
                            f"eager fp32 is {eager_vs_fp64[name]:.1e} from fp64)")
    return failures


def check_state_fp8(case: ModelCase, result: dict) -> list[str]:
    label, run = 'options={"policy": "state_fp8", "compiler": "eager"}', result["state_fp8"]
    failures = check_matches(case, run, label)
    if "error" in run:
        return [f"{label}: {run['error']}"] + failures
    failures += [f"{label}: spec without an FP8 state: {spec}" for spec in run["specs"] if "q.state=fp8" not in spec]
    moved = run["token_losses_vs_exact"]
    if not moved > FP8_MOVES:
        failures.append(f"{label}: the per-token losses are {moved:.1e} from the exact ones "
                        f"(<= {FP8_MOVES:.0e}: the FP8 state moved nothing)")
    first, *_, last = run["losses"]
    if not last < first:
        failures.append(f"{label}: {len(run['losses']) - 1} AdamW steps did not lower the loss: {run['losses']}")
    return failures


def test_table_keeps_the_linear_attention_defaults():
    for case in MODELS:
        keys = set(case.overrides)
        keys |= {k for sub in case.overrides.values() if isinstance(sub, dict) for k in sub}
        assert not keys & set(LINEAR_ATTENTION_KEYS), (case.name, sorted(keys & set(LINEAR_ATTENTION_KEYS)))
        assert case.kind in ("gdn", "kda") and case.linear_attention, case.name


@pytest.mark.parametrize("case", MODELS, ids=[case.name for case in MODELS])
def test_transformers_model_trains_under_laqat(case: ModelCase, model_processes, tmp_path):
    result = run_model(model_processes, case.name, tmp_path)
    failures = [f"module {name} is not in the model" for name, cls in result["linear_attention_classes"].items()
                if cls is None]
    runs = (["inductor"] if case.inductor else []) + ["eager_handoff"]
    assert ("inductor" in result) == case.inductor, f"{case.name}: the Inductor run is missing or unexpected"
    for key in runs:
        failures += check_exact(case, result, key)
    failures += check_state_fp8(case, result)
    failures += [f"{RUNS.get(key, key)}: {w}" for key in runs + ["state_fp8"]
                 for w in result[key].get("laqat_warnings", ["no laqat_warnings recorded"])]
    assert not failures, f"{case.name}:\n- " + "\n- ".join(failures)


def test_a_failing_run_is_reported_with_its_traceback(model_processes, tmp_path):
    """A run that raises outside the compiled runs (here: no such row) exits nonzero, with its traceback."""
    returncode, _, stdout, stderr = model_processes.run("no_such_model", tmp_path)
    assert returncode == 1 and stdout == ""
    assert "KeyError: 'no_such_model'" in stderr and "run_transformers_model.py" in stderr
