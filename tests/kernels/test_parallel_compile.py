"""kernels/common/parallel_compile.py: a compile thread readies the kernel it compiled (binary loaded, launcher
built) on the device current where the compile was requested, and a kernel that cannot be readied is still
returned as compiled."""
import threading
from concurrent.futures import ThreadPoolExecutor

from la_compiler.kernels.common.parallel_compile import CompileAndReady, async_compile_mode, compiles_in_threads


class StandInKernel:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.readied_on = None

    def _init_handles(self):
        if self.fail:
            raise RuntimeError("out of shared memory")
        self.readied_on = (threading.current_thread().name, devices.current())


class Devices:
    """A per-thread current device, as CUDA keeps it."""
    def __init__(self):
        self._local = threading.local()

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def set(self, device: int) -> None:
        self._local.device = device


devices = Devices()


def test_a_compile_thread_readies_the_kernel_on_the_requesting_threads_device():
    devices.set(3)
    with ThreadPoolExecutor(2, thread_name_prefix="compile") as pool:
        executor = CompileAndReady(pool, (devices.current, devices.set))
        kernels = [executor.submit(StandInKernel).result() for _ in range(4)]
    for kernel in kernels:
        thread, device = kernel.readied_on
        assert thread.startswith("compile") and thread != threading.current_thread().name
        assert device == 3


def test_a_kernel_that_cannot_be_readied_is_returned_compiled():
    with ThreadPoolExecutor(1) as pool:
        kernel = CompileAndReady(pool, (devices.current, devices.set)).submit(StandInKernel, fail=True).result()
    assert isinstance(kernel, StandInKernel) and kernel.readied_on is None


def test_a_failed_compile_fails_its_future():
    def compile_fails():
        raise ValueError("bad kernel")
    with ThreadPoolExecutor(1) as pool:
        future = CompileAndReady(pool, (devices.current, devices.set)).submit(compile_fails)
        assert isinstance(future.exception(), ValueError)


def test_the_compile_threads_ready_what_they_compile():
    from triton.runtime import _async_compile

    assert async_compile_mode() is not None  # the Triton this suite installs has it
    with compiles_in_threads(2):
        mode = _async_compile.active_mode.get()
        assert isinstance(mode.executor, CompileAndReady) and mode.ignore_errors
    assert _async_compile.active_mode.get() is None
