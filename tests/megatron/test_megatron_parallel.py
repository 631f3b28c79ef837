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

# One pytest worker runs every Megatron test (`make test` distributes with --dist loadgroup): Megatron takes
# about 8 CPU seconds to import, and a module fixture would run once per worker.
pytestmark = pytest.mark.xdist_group("megatron")

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


def _scenario(ranks, name, failures):
    results = [r[name] for r in ranks]
    for rank, result in enumerate(results):
        if not result["ok"]:
            failures.append(f"rank {rank}, scenario {name!r} failed:\n{result['traceback']}")
    return results if all(r["ok"] for r in results) else []


def _errors_above(result, label, failures):
    errors = {"loss": result["loss"], **result["grads"]}
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= TOL}
    if bad:
        failures.append(f"{label}: relative L2 above {TOL}: {bad}")


def _expect(ok, message, failures):
    if not ok:
        failures.append(message)


def test_tp2_cp2_and_dist_checkpoint_on_two_ranks(ranks):
    """One test (the two ranks run once, on one pytest worker); every failed check is reported together.

    TP=2 (``initialize_model_parallel(2, 1)``), exact and ``state_fp8``: each rank's recurrence is one laqat
    node over its 2 of the 4 value heads; the per-token loss and every gradient shard equal the TP=1 run
    (eager for exact numerics, laqat's TP=1 ``state_fp8`` for the FP8 state: the state's scale tiles lie
    within one head, so each rank rounds the same tiles); one graph (``fullgraph=True``). Gradients after
    summing GDN's per-rank ``out_norm.weight`` gradient over TP.

    CP=2: Megatron's GDN all-to-alls from sequence shards to head shards before the recurrence and back after
    it, so each rank's node runs whole sequences of 2 of the 4 value heads: exact. Each rank's per-token
    losses equal the TP=1 model's at its tokens (Megatron's load-balanced halves); the gradients summed over
    the CP group equal the TP=1 gradients; one graph.

    Checkpoint: a TP=2 model trained one SGD step under laqat's FP8 state (the policy attached: a buffer in
    the sharded state dict), saved with Megatron's ``dist_checkpointing``, restores at TP=2 and TP=1: the
    policy comes back equal, the next batch's loss is the saved model's, and one more SGD step gives the same
    loss at TP=1 and TP=2."""
    failures = []
    for rank, result in enumerate(_scenario(ranks, "tp", failures)):
        for policy in ("exact", "state_fp8"):
            run = result[policy]
            _errors_above(run, f"rank {rank}, TP=2 {policy}", failures)
            nodes = run["nodes"]
            _expect(len(nodes) == 1 and nodes[0][0] == LAYER and nodes[0][2] == 2 and "src=fla" in nodes[0][1]
                    and ("q.state=fp8_e4m3/tile64" in nodes[0][1]) == (policy == "state_fp8"),
                    f"rank {rank}, TP=2 {policy}: laqat nodes {nodes}, expected one over 2 local value heads",
                    failures)
            _expect(run["graphs"] == 1, f"rank {rank}, TP=2 {policy}: {run['graphs']} graphs", failures)
            _expect(run["out_norm_grad_ranks_differ"] > 0.1,
                    f"rank {rank}: each rank's out_norm gradient covers its own heads only", failures)
        _expect(result["fp8_vs_exact_tp1"] > 3e-7, "the FP8 state moves the TP=1 loss", failures)

    cp = _scenario(ranks, "cp", failures)
    for rank, result in enumerate(cp):
        _errors_above(result, f"rank {rank}, CP=2", failures)
        nodes = result["nodes"]
        _expect(len(nodes) == 1 and nodes[0][0] == LAYER and nodes[0][2] == 2,
                f"rank {rank}, CP=2: laqat nodes {nodes}", failures)
        _expect(result["graphs"] == 1, f"rank {rank}, CP=2: {result['graphs']} graphs", failures)
    if cp:
        _expect(sorted(cp[0]["tokens"] + cp[1]["tokens"]) == list(range(32)), "CP ranks cover every token once",
                failures)

    for rank, result in enumerate(_scenario(ranks, "checkpoint", failures)):
        _expect(result["policy_restored"] == [True, True], f"rank {rank}: policy not restored", failures)
        _expect(result["resumed_tp2"] <= TOL and result["resumed_tp1"] <= TOL and result["after_tp1_vs_tp2"] <= TOL,
                f"rank {rank}, checkpoint: {result}", failures)
        _expect(result["step_moved_tp2"] > 1e-3, "the step after the restore changed the model", failures)
    assert not failures, "\n".join(failures)
