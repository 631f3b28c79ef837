"""kernels/common/compile_workers.py: a compile Triton queues (``JITFunction._do_compile``'s async-compile closure,
built here by Triton itself for an sm90 target, which compiles without a GPU) is redone by a worker process into
Triton's on-disk cache, where Triton's own compile of it then finds a kernel with the same binary as a compile in a
fresh cache; what a worker cannot redo (a kernel defined in a function, another source, a dead worker) is left to
the requesting thread."""
import os
import time
from concurrent.futures import Future

import pytest
import triton

from la_compiler.kernels.common import compile_workers
from la_compiler.kernels.common.compile_workers import CompileWorkers, job_of
from la_compiler.options import OptionsError
from tests.kernels.worker_kernels import scaled_exp_kernel

SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}


def queued_compile(kernel, block: int, warps: int):
    """The async-compile closure Triton's ``_do_compile`` hands the active AsyncCompileMode for ``kernel``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, CompiledKernel, compile as triton_compile
    from triton.compiler.compiler import make_backend
    from triton.runtime import _async_compile

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kernel.device_caches[0] = ({}, {}, target, backend, None)  # what create_binder gives on an sm90 device
    kernel.CompiledKernel, kernel.compile, kernel.ASTSource = CompiledKernel, triton_compile, ASTSource
    queued = []

    class Queue:
        def submit(self, fn, *args, **kwargs):
            queued.append(fn)
            return Future()

    token = _async_compile.active_mode.set(_async_compile.AsyncCompileMode(Queue()))
    try:
        kernel._do_compile(("test", block, warps), SIGNATURE, 0, {"BLOCK": block},
                           backend.parse_options({"num_warps": warps}), {(0,): [["tt.divisibility", 16]]}, True)
    finally:
        _async_compile.active_mode.reset(token)
    assert len(queued) == 1
    return queued[0]


def started(workers: CompileWorkers, count: int = 1, timeout_s: float = 120) -> CompileWorkers:
    workers.start(count)
    deadline = time.monotonic() + timeout_s
    while workers._idle.empty():
        assert time.monotonic() < deadline, "no compile worker became ready"
        time.sleep(0.1)
    return workers


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    return tmp_path / "triton"


@pytest.fixture(scope="module")
def workers():
    pool = CompileWorkers()
    yield started(pool)
    pool.stop()


def compiled_with_listener(compile_fn):
    hits = []
    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        return compile_fn(), hits
    finally:
        triton.knobs.compilation.listener = previous


def test_a_worker_compiles_what_triton_queued_and_triton_finds_it_in_its_cache(workers, cache_dir, tmp_path):
    compile_fn = queued_compile(scaled_exp_kernel, block=256, warps=4)
    job = job_of(compile_fn)
    assert (job.module, job.qualname) == ("tests.kernels.worker_kernels", "scaled_exp_kernel")
    assert workers.compile(job)
    kernel, hits = compiled_with_listener(compile_fn)
    assert hits == [True]
    triton.knobs.cache.dir = str(tmp_path / "fresh")  # the oracle: Triton's own compile in an empty cache
    fresh, fresh_hits = compiled_with_listener(queued_compile(scaled_exp_kernel, block=256, warps=4))
    assert fresh_hits == [False]
    assert kernel.asm["cubin"] == fresh.asm["cubin"] and kernel.metadata.num_warps == 4


def test_another_source_is_not_compiled_and_the_thread_compiles_it(workers, cache_dir):
    compile_fn = queued_compile(scaled_exp_kernel, block=128, warps=2)
    job = job_of(compile_fn)
    stale = type(job)(**{**job.__dict__, "source_key": "0" * 64})
    assert not workers.compile(stale)
    _, hits = compiled_with_listener(compile_fn)
    assert hits == [False]


def test_a_kernel_defined_in_a_function_or_another_callable_is_not_a_job(cache_dir):
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def local_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)))

    assert job_of(queued_compile(JITFunction(local_kernel), block=64, warps=1)) is None
    assert job_of(lambda: None) is None and job_of(len) is None


def test_a_worker_exits_when_idle_and_then_takes_no_job(cache_dir, monkeypatch):
    monkeypatch.setattr(compile_workers, "IDLE_EXIT_S", 0.5)
    pool = started(CompileWorkers())
    process = pool._processes[0]
    process.wait(timeout=30)
    assert not pool.compile(job_of(queued_compile(scaled_exp_kernel, block=512, warps=4)))
    assert pool._idle.empty()


def test_workers_start_only_for_graphs_on_a_cuda_device(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(compile_workers.WORKERS, "start", calls.append)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compile_workers.start_for([torch.zeros(2)])
    assert calls == []
    cuda_like = type("Fake", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.setenv("LAQAT_COMPILE_WORKERS", "3")
    compile_workers.start_for([torch.zeros(2), cuda_like])
    assert calls == [3]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compile_workers.start_for([cuda_like])
    assert calls == [3]
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("LAQAT_COMPILE_WORKERS", "0")
    compile_workers.start_for([cuda_like])
    assert calls == [3]
    monkeypatch.setenv("LAQAT_COMPILE_WORKERS", "many")
    with pytest.raises(OptionsError, match="LAQAT_COMPILE_WORKERS"):
        compile_workers.start_for([cuda_like])
    assert os.environ["LAQAT_COMPILE_WORKERS"] == "many"
