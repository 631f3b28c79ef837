"""Megatron-Core's GDN under laqat with two gloo processes on the CPU: tensor parallelism 2, context
parallelism 2, and a distributed checkpoint restored at TP=2 and TP=1 (tests/megatron/parallel_worker.py
runs the scenarios; this module starts two ranks once and asserts on what each rank measured).

The oracle is the TP=1 model every rank also builds (same seed): run eagerly with FLA's torch references
(megatron_oracle.py) for exact numerics, compiled with laqat at TP=1 for ``state_fp8``.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("fla") is None:
    pytest.skip("megatron-core (and FLA) are not installed: `make test` installs megatron-core==0.19.2",
                allow_module_level=True)

TOL = 1e-5
ROOT = Path(__file__).parents[2]
WORLD = 2
TIMEOUT_S = 540
SCENARIOS = ("tp", "cp", "checkpoint")
LAYER = "decoder.layers.0.self_attention"


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results, or the failure with each rank's output (its traceback) in the message."""
    from tests.megatron.megatron_cpu import free_port

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        logs = [open(Path(out, f"rank{r}.log"), "w+") for r in range(WORLD)]
        procs = [subprocess.Popen([sys.executable, "-m", "tests.megatron.parallel_worker", str(r), str(WORLD),
                                   str(port), out, *SCENARIOS], cwd=ROOT, env=env, stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in range(WORLD)]
        try:
            for p in procs:
                p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
        tails = []
        for r, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{log.read()[-6000:]}")
            log.close()
        missing = [r for r in range(WORLD) if not Path(out, f"rank{r}.json").exists()]
        assert not missing, f"ranks {missing} wrote no results within {TIMEOUT_S} s:\n" + "\n".join(tails)
        yield [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


def _scenario(ranks, name):
    results = [r[name] for r in ranks]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}, scenario {name!r} failed:\n{result['traceback']}"
    return results


def _check_errors(result, label):
    errors = {"loss": result["loss"], **result["grads"]}
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{label}: relative L2 above {TOL}: {bad}"


@pytest.mark.parametrize("policy", ["exact", "state_fp8"])
def test_tp2_equals_tp1(ranks, policy):
    """TP=2 (gloo, ``initialize_model_parallel(2, 1)``), each rank's recurrence one laqat node over its 2 of the
    4 value heads: the per-token loss and every gradient shard equal the TP=1 run (eager for exact numerics,
    laqat's TP=1 ``state_fp8`` for the FP8 state: the state's scale tiles lie within one head, so each rank
    rounds the same tiles). Gradients after summing GDN's per-rank ``out_norm.weight`` gradient over TP."""
    for rank, result in enumerate(_scenario(ranks, "tp")):
        run = result[policy]
        _check_errors(run, f"rank {rank}, {policy}")
        (node,) = run["nodes"]
        assert node[0] == LAYER and node[2] == 2, node
        assert "src=fla" in node[1] and (("q.state=fp8_e4m3/tile64" in node[1]) == (policy == "state_fp8"))
        assert run["out_norm_grad_ranks_differ"] > 0.1, "each rank's out_norm gradient covers its own heads only"
        assert result["fp8_vs_exact_tp1"] > 3e-7, "the FP8 state moves the TP=1 loss"


def test_cp2_equals_tp1(ranks):
    """Context parallelism 2: Megatron's GDN all-to-alls from sequence shards to head shards before the
    recurrence and back after it, so each rank's node runs whole sequences of 2 of the 4 value heads: exact.
    Each rank's per-token losses equal the TP=1 model's at its tokens (Megatron's load-balanced halves), the
    gradients summed over the CP group equal the TP=1 gradients; one graph."""
    for rank, result in enumerate(_scenario(ranks, "cp")):
        _check_errors(result, f"rank {rank}, CP=2")
        (node,) = result["nodes"]
        assert node[0] == LAYER and node[2] == 2, node
        assert result["graphs"] == 1
    assert sorted(ranks[0]["cp"]["tokens"] + ranks[1]["cp"]["tokens"]) == list(range(32))


def test_dist_checkpoint_restores_at_tp2_and_tp1(ranks):
    """A TP=2 model trained two SGD steps under laqat's FP8 state, saved with Megatron's ``dist_checkpointing``
    (the policy in the common state), restores at TP=2 and TP=1: the policy comes back equal, the next batch's
    loss is the saved model's, and one more SGD step gives the same loss at TP=1 and TP=2."""
    for result in _scenario(ranks, "checkpoint"):
        assert result["policy_restored"] == [True, True]
        assert result["resumed_tp2"] <= TOL and result["resumed_tp1"] <= TOL, result
        assert result["after_tp1_vs_tp2"] <= TOL, result
        assert result["step_moved_tp2"] > 1e-3, "the step after the restore changed the model"
