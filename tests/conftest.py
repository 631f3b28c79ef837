"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist runs one worker per core: more intra-op threads only oversubscribe (small fp64
    # ops ran ~100x slower with two threads per worker on two cores).
    torch.set_num_threads(1)

import pytest  # noqa: E402

from tests.interpreter_speedups import install as install_interpreter_speedups  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    install_interpreter_speedups()  # the interpreter's repeated patching skipped; the kernels compute the same


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
