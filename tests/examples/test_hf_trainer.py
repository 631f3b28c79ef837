"""transformers' Trainer under a laqat policy (examples/qat/hf_trainer.py --smoke, the recipe of docs/qat.md): QAT
trains three steps with the policy attached and compiled in place, the checkpoint's config.json carries the policy,
a run resumed from it trains under that policy, QAD distils from an exact teacher; accelerate's backend list
refuses ``torch_compile_backend="laqat"`` (what the docs say to do instead is the recipe)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import la_compiler

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

QAT = Path(__file__).resolve().parents[2] / "examples" / "qat"
FP8 = "q.state=fp8_e4m3/tile64"


def test_the_trainer_recipe_trains_resumes_with_the_policy_and_distils(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(QAT / "hf_trainer.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]

    def summary(mode, step):
        return json.loads((tmp_path / mode / f"summary-{mode}-{step}.json").read_text())

    qat, resumed, qad = summary("qat", 3), summary("qat", 4), summary("qad", 1)
    assert (qat["steps"], resumed["steps"], qad["steps"]) == (3, 4, 1)
    assert qat["policy"] == resumed["policy"] == qad["policy"] == "state_fp8"
    assert qat["specs"] and all(FP8 in spec for spec in qat["specs"]), qat["specs"]
    assert resumed["specs"] and all(FP8 in spec for spec in resumed["specs"]), resumed["specs"]  # the checkpoint's
    assert resumed["losses"][:3] == qat["losses"] and len(resumed["losses"]) == 4  # the history goes on
    assert all(math.isfinite(x) for x in resumed["losses"] + qad["losses"])
    assert sorted(FP8 in spec for spec in qad["specs"]) == [False, True]  # the exact teacher, the student
    for checkpoint in (qat["checkpoint"], resumed["checkpoint"], qad["checkpoint"]):
        stored = json.loads((Path(checkpoint) / "config.json").read_text())["laqat_policy"]
        assert la_compiler.Policy.from_dict(stored).name == "state_fp8"


def test_accelerate_refuses_laqat_as_torch_compile_backend(tmp_path):
    """Why the recipe compiles the model itself: TrainingArguments takes the name, the Trainer (accelerate's closed
    DynamoBackend list) refuses it. Should this start to work, docs/qat.md's advice is to be revisited."""
    import torch

    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="laqat",
                                          use_cpu=True, report_to=[])
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'LAQAT' is not a valid DynamoBackend"):
        transformers.Trainer(model=model, args=args)
