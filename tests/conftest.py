"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist runs one worker per core: more intra-op threads only oversubscribe (small fp64
    # ops ran ~100x slower with two threads per worker on two cores).
    torch.set_num_threads(1)
    # Inductor's own CPU kernels (everything around the laqat nodes) as scalar C++, compiled in the calling
    # process: g++ takes a third of the time that at::vec kernels and a compile worker pool take on two shared
    # cores (tests/models' runner measured it). What laqat hands to Inductor, and gets back, is the same. Set
    # for the whole process before any compile (Inductor caches its ISA list per process; every worker scalar,
    # so no FX-graph cache entry holds a vectorized kernel), and in the environment for the processes the tests
    # start (tests/models, the compile cache, the distributed and Megatron ranks, the QAT study).
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])

import pytest  # noqa: E402

from tests.interpreter_speedups import install as install_interpreter_speedups  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    install_interpreter_speedups()  # the interpreter's repeated patching skipped; the kernels compute the same


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
