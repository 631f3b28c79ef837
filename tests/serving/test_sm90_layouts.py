"""The decode state tile of a serving profile is laid out, compiled for Hopper, as in vLLM's packed decode kernels
(tests/serving/sm90_layouts.py: TTGIR for SM90 built on the CPU): the condition for the sums over K to add their
terms in vLLM's order on the GPU (docs/serving.md, "The GPU check"). And the two launch choices that make it so:
without them (the state tiles in fp32 for a 16-bit cache, a kv spec's states not transposed) the layout differs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import vllm_oracle

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def layouts():
    try:
        root = vllm_oracle.cache_dir()
        src = vllm_oracle.extract(vllm_oracle.fetch_wheel(root), root, interpreter=False)
    except vllm_oracle.IndexUnreachable as e:
        pytest.skip(f"vLLM {vllm_oracle.VERSION} oracle unavailable: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JIT functions, compiled for SM90
    done = subprocess.run([sys.executable, "-m", "tests.serving.sm90_layouts", str(src)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["gdn:bfloat16", "gdn:float32", "kda:bfloat16"])
def test_the_serving_decode_tile_is_laid_out_as_vllms_packed_decode(layouts, case):
    row = layouts[case]
    assert len(row["vllm_packed"]) == 2  # the sum over K of the state update and of the readout
    assert row["laqat_vk"] == row["vllm_packed"], row
    assert row["laqat_kv"] == row["vllm_packed"], row
    assert row["laqat_kv_not_transposed"] != row["vllm_packed"], row
    if "laqat_fp32_tiles" in row:
        assert row["laqat_fp32_tiles"] != row["vllm_packed"], row
