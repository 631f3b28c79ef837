"""The quality study's CPU smoke run (``examples/qat/study.py --smoke``): the whole pipeline (pretrain, the
pretrained model under exact numerics and the decode-phase FP8 recipe, a control, QAT and QAD over two seeds,
the table) with its own checks (the files it writes, finite NLLs, one compile per policy by Dynamo's graph count,
QAT lowers the loss of the batch it trained on, a run resumed from its halfway checkpoint logs the losses of the
uninterrupted run). Here, in addition: the exact NLLs it reports against an eager evaluation of the saved weights
with FLA's torch references, and the policy's NLL against the exact one (the rounding reaches the loss)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fla")

import la_compiler  # noqa: E402
from tests.passes.fla_oracle import naive_fla  # noqa: E402

QAT = Path(__file__).resolve().parents[2] / "examples" / "qat"
sys.path.insert(0, str(QAT))
import corpus  # noqa: E402
import train  # noqa: E402
from checkpoint import read_checkpoint  # noqa: E402

POLICY = "decode_token_state_fp8"


def test_the_smoke_study(tmp_path):
    """One test (pytest-xdist would run a shared fixture once per worker): the run, then the checks below."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(QAT / "study.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "study.json").read_text())
    check_the_run_and_the_table(tmp_path, proc.stdout, results)
    check_the_exact_nll_against_an_eager_evaluation_of_the_saved_weights(tmp_path, results)


def check_the_run_and_the_table(out, stdout, results):
    assert "smoke checks passed" in stdout
    table = (out / "study.md").read_text()
    assert "| policy | scored | exact | no QAT | control | after QAT | after QAD |" in table
    assert f"| {POLICY} | suffix |" in table and "not run" not in table
    assert f"**{POLICY}**" in table and "noise" in table
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {(r["policy"], r["mode"]) for r in results["runs"]} == {
        ("exact", "control"), (POLICY, "qat"), (POLICY, "qad")}
    assert all(len(r["losses"]) == 4 for r in results["runs"]) and not results["skipped"]


def _eager_per_sequence(model, batches, start):
    out = []
    with naive_fla(), torch.no_grad():
        for tokens in batches:
            logits = model(tokens[:, :-1])
            nll = F.cross_entropy(logits[:, start:].transpose(1, 2), tokens[:, 1 + start:], reduction="none")
            out += nll.mean(1).tolist()
    return torch.tensor(out, dtype=torch.float64)


def check_the_exact_nll_against_an_eager_evaluation_of_the_saved_weights(out, results):
    state = read_checkpoint(out / "pretrained.pt")
    model = train.build_model(state["model_config"], "cpu", torch.float32)
    la_compiler.load_state_dict(model, state["model"])
    assert la_compiler.policy_of(model).name == "exact"
    data = corpus.load_corpus()
    assert data.fingerprint == results["corpus"]["fingerprint"]
    config = results["config"]
    batches = corpus.eval_batches(data, config["eval_sequences"], config["seq_len"], config["batch_size"])
    prefill = results["prefill"]
    assert 0 < prefill < config["seq_len"]

    def record(under, scoring):
        found = [e for e in results["evals"] if (e["model"], e["under"], e["scoring"]) == ("pretrained", under,
                                                                                          scoring)]
        assert len(found) == 1
        return found[0]

    for scoring, start in (("full", 0), ("suffix", prefill)):
        eager = _eager_per_sequence(model.train(), batches, start)
        got = torch.tensor(record("exact", scoring)["per_sequence"], dtype=torch.float64)
        assert got.shape == eager.shape == (config["eval_sequences"],)
        assert ((got - eager).abs() / eager.abs()).max() < 1e-5, (scoring, got, eager)
    policy, exact = (torch.tensor(record(u, "suffix")["per_sequence"]) for u in (POLICY, "exact"))
    assert ((policy - exact).abs() / exact.abs()).max() > 1e-5, "the decode-phase rounding did not reach the loss"
