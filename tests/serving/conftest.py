"""Fixtures of the serving parity tests: vLLM's kernels (the oracle) and the GPU's bf16 rounding."""
import os

import pytest

from tests.serving import vllm_oracle
from tests.serving.interpreter_rounding import gpu_bf16_rounding


@pytest.fixture(scope="session")
def vllm():
    """vLLM 0.33.0's kernel modules (tests/serving/vllm_oracle.py); skipped only if the wheel can be neither
    found in the cache nor downloaded from the package index."""
    try:
        return vllm_oracle.load()
    except vllm_oracle.IndexUnreachable as e:
        pytest.skip(f"vLLM {vllm_oracle.VERSION} oracle unavailable: {e}")


@pytest.fixture
def gpu_rounding():
    """In Triton's interpreter, fp32 -> bf16 casts round to nearest even, as on the GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    with gpu_bf16_rounding():
        yield
