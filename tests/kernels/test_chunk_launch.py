"""The chunk kernels' launch: a shared-memory refusal retries with fewer pipeline stages, nothing else."""
import pytest
from triton.runtime.errors import OutOfResources

from la_compiler.kernels.chunk_launch import LaunchConfig, launch, launch_config


class FakeKernel:
    """kernel[grid](...) that refuses more than `max_stages` stages the way Triton does."""

    def __init__(self, max_stages, error=None):
        self.max_stages, self.error, self.calls = max_stages, error, []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **constexprs):
            self.calls.append(num_stages)
            if self.error is not None:
                raise self.error
            if num_stages > self.max_stages:
                raise OutOfResources(262656, 232448, "shared memory")
            return ("ran", grid, args, num_warps, num_stages, constexprs)
        return run


def test_refused_launch_retries_with_fewer_stages_and_remembers():
    kernel = FakeKernel(max_stages=1)
    result = launch(kernel, (2, 3), "x", config=LaunchConfig(4, 3), BK=64)
    assert result == ("ran", (2, 3), ("x",), 4, 1, {"BK": 64}) and kernel.calls == [3, 2, 1]
    launch(kernel, (2, 3), "y", config=LaunchConfig(4, 3), BK=64)
    assert kernel.calls == [3, 2, 1, 1]  # the working depth is remembered per kernel and constants
    launch(kernel, (2, 3), "y", config=LaunchConfig(4, 3), BK=128)
    assert kernel.calls[-3:] == [3, 2, 1]  # other constants: tried afresh


def test_refusal_at_one_stage_and_other_errors_propagate():
    with pytest.raises(OutOfResources):
        launch(FakeKernel(max_stages=0), (1,), config=LaunchConfig(8, 2))
    kernel = FakeKernel(max_stages=3, error=ValueError("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        launch(kernel, (1,), config=LaunchConfig(4, 3))
    assert kernel.calls == [3]


def test_launch_table():
    assert launch_config("fwd_h", 128, 64) == LaunchConfig(8, 1)
    assert launch_config("bwd_intra", 64, 64) == LaunchConfig(8, 3)
    assert launch_config("fwd_o", 64, 64) == LaunchConfig(8, 3)
    assert launch_config("fwd_h", 32, 16) == LaunchConfig(4, 3)
    with pytest.raises(ValueError, match="unknown stage 'fwd_x'"):
        launch_config("fwd_x", 64, 64)


def test_serial_stages_override(monkeypatch):
    monkeypatch.setenv("LAQAT_CHUNK_SERIAL_STAGES", "2")
    assert launch_config("fwd_h", 128, 64) == LaunchConfig(8, 2)
    assert launch_config("bwd_dh", 128, 64) == LaunchConfig(8, 2)
    assert launch_config("fwd_intra", 128, 64) == LaunchConfig(8, 1)  # only the serial loops
    monkeypatch.setenv("LAQAT_CHUNK_SERIAL_STAGES", "two")
    with pytest.raises(ValueError, match="LAQAT_CHUNK_SERIAL_STAGES must be 1, 2, 3 or 4, got 'two'"):
        launch_config("fwd_h", 128, 64)
