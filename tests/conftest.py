"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
