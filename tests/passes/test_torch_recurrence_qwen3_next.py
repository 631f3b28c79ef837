"""A tiny random Qwen3-Next trains one step under laqat with eager's loss and gradients.

Runs in its own process (torch_recurrence_qwen3_next_step.py): transformers must not see FLA.
Gradients are compared with eager fp32 and with the fp64 oracle (the same eager code in
float64): where eager fp32 itself is farther than 1e-5 from the oracle (A_log and dt_bias
are sums over tokens that cancel), laqat must be within 1e-5 of the oracle instead.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

TOL = 1e-5
SCRIPT = Path(__file__).with_name("torch_recurrence_qwen3_next_step.py")


def test_tiny_qwen3_next_train_step_matches_eager():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[2]))
    run = subprocess.run([sys.executable, str(SCRIPT), "72", "reference"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [m[:3] for m in result["matches"]] == [["gdn", "torch", "model.layers.0.linear_attn"]], result
    assert abs(result["loss_laqat"] - result["loss_eager"]) <= TOL * abs(result["loss_eager"])
    assert result["grad_names_laqat"] == result["grad_names"] > 0
    for name, err in result["laqat_vs_eager"].items():
        if result["eager_vs_fp64"][name] <= TOL / 10:
            assert err <= TOL, (name, err)
        assert result["laqat_vs_fp64"][name] <= TOL, (name, result["laqat_vs_fp64"][name])
