"""Fixtures of the serving parity tests: vLLM's kernels (the oracle), Triton's interpreter as the GPU."""
import os
import sys

import pytest

from tests.serving import vllm_oracle
from tests.serving.interpreter_as_gpu import interpreter_as_gpu


@pytest.fixture(scope="package")
def vllm():
    """vLLM 0.33.0's kernel modules (tests/serving/vllm_oracle.py), from ``$VLLM_SRC`` where set (a directory
    ``python -m tests.serving.vllm_oracle --prepare`` wrote, for a machine without the package index); skipped only
    if the wheel can be neither found in the cache nor downloaded from the package index."""
    try:
        modules = vllm_oracle.load(src=os.environ.get("VLLM_SRC") or None)
    except vllm_oracle.IndexUnreachable as e:
        pytest.skip(f"vLLM {vllm_oracle.VERSION} oracle unavailable: {e}")
    yield modules
    # The stand-in package stays importable as ``vllm`` while it is loaded, and a serving profile's
    # ``forward: auto`` picks the server's kernels wherever vllm imports: tests outside this package that the
    # same worker runs later must not see it.
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture
def as_gpu():
    """In Triton's interpreter, fp32 -> bf16 casts round to nearest even and bf16 dots multiply the values,
    as on the GPU (tests/serving/interpreter_as_gpu.py); compiled kernels are left alone."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    with interpreter_as_gpu():
        yield
