"""A policy attached to a tiny transformers model travels through save_pretrained / from_pretrained (as
config.json's ``laqat_policy``) and through state_dict / torch.save, and the reloaded model compiles with it;
run_policy_round_trip.py (its own process: transformers must not see FLA) prints what this test asserts."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.models.transformers_models import BY_NAME

SCRIPT = Path(__file__).with_name("run_policy_round_trip.py")
ROOT = Path(__file__).parents[2]
FP8_MOVES = 2e-7


def test_policy_round_trips_through_save_pretrained_and_state_dict():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, f"the runner failed:\n{run.stderr[-6000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    policy = result["expected_policy"]

    saved = result["saved"]
    assert saved["config_entry"] == policy and not saved["weights_hold_the_policy"]

    reloaded = result["from_pretrained"]
    assert reloaded["policy"] == policy and reloaded["same_weights"]
    assert reloaded["policy_sources"] == [f"state_fp8 (attached to {reloaded['class']} (config.laqat_policy))"]
    layers = len(BY_NAME["qwen3_5"].linear_attention)  # the runner's model
    assert len(reloaded["specs"]) == layers and all("q.state=fp8_e4m3/tile64" in spec for spec in reloaded["specs"])
    assert reloaded["specs"] == reloaded["option_specs"]
    assert reloaded["loss_equal"] and reloaded["grads_equal"]  # as compiled with options={"policy": "state_fp8"}
    # the FP8 state moved the loss: exact compiled losses are within 5e-8 (relative) of eager, this one is 7e-7 away
    assert abs(reloaded["loss"] - reloaded["eager_loss"]) > FP8_MOVES * abs(reloaded["eager_loss"])

    state = result["state_dict"]
    assert state["before"] is None and state["policy"] == policy and state["config_entry"] == policy
    assert state["same_weights"]

    assert result["nvfp4_equal"]
    assert result["newer"] is not None and "config.laqat_policy: version: 'laqat.policy/2' was written by a " \
                                          "newer laqat" in result["newer"]
