"""examples/benchmarks/sm90_resources.py: the launches the real launchers make, compiled for sm_90 on a CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_launch_of_a_training_step_compiles_for_sm90(tmp_path):
    """GDN exact at head 16: the training forward's and the backward's kernels (the W / U recompute, not the
    whole intra stage, since the forward kept its residual), each at the launch table's warps and at 8 more,
    with registers and spills read back from the cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), LAQAT_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "examples/benchmarks/sm90_resources.py", "--kind", "gdn", "--head", "16",
                          "--chunk", "16", "--policies", "laqat exact", "--warps", "8"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "sm90_resources.json").read_text())["rows"]
    table = [r for r in rows if r["launch_table"]]
    assert [r["kernel"] for r in table] == ["chunk_fwd_kernel_intra_gdn", "chunk_fwd_kernel_h",
                                            "chunk_fwd_kernel_o", "chunk_fwd_kernel_wu",
                                            "chunk_bwd_kernel_dh", "chunk_bwd_kernel_intra_key_blocks"]
    assert all("error" not in r and 0 < r["registers"] <= 255 and r["spill_bytes"] >= 0 for r in rows)
    assert {r["warps"] for r in rows} >= {4, 8} and len(rows) > len(table)
    assert "chunk_bwd_kernel_intra_key_blocks" in run.stdout


def test_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "examples/benchmarks/sm90_resources.py"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "unset TRITON_INTERPRET" in run.stderr
