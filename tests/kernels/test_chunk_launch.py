"""The chunk kernels' launch: a shared-memory refusal retries with fewer pipeline stages, nothing else."""
import pytest
from triton.runtime.errors import OutOfResources

from la_compiler.kernels.chunk.launch import LaunchConfig, StageLaunch, launch, launch_config


class FakeKernel:
    """kernel[grid](...) that refuses more than `max_stages` stages the way Triton does."""

    def __init__(self, max_stages, error=None):
        self.max_stages, self.error, self.calls = max_stages, error, []

    def __getitem__(self, grid):
        def run(*, num_warps, num_stages, **arguments):
            self.calls.append(num_stages)
            if self.error is not None:
                raise self.error
            if num_stages > self.max_stages:
                raise OutOfResources(262656, 232448, "shared memory")
            return ("ran", grid, num_warps, num_stages, arguments)
        return run


def test_refused_launch_retries_with_fewer_stages_and_remembers():
    kernel = FakeKernel(max_stages=1)
    result = launch(StageLaunch(kernel, (2, 3), LaunchConfig(4, 3), {"BK": 64}), {"x": "x"}, STORE_T=True)
    assert result == ("ran", (2, 3), 4, 1, {"x": "x", "BK": 64, "STORE_T": True}) and kernel.calls == [3, 2, 1]
    launch(StageLaunch(kernel, (2, 3), LaunchConfig(4, 3), {"BK": 64}), {"x": "y"}, STORE_T=True)
    assert kernel.calls == [3, 2, 1, 1]  # the working depth is remembered per kernel and constants
    launch(StageLaunch(kernel, (2, 3), LaunchConfig(4, 3), {"BK": 64}), {"x": "y"}, STORE_T=False)
    assert kernel.calls[-3:] == [3, 2, 1]  # other constants (the launcher's too): tried afresh


def test_refusal_at_one_stage_and_other_errors_propagate():
    with pytest.raises(OutOfResources):
        launch(StageLaunch(FakeKernel(max_stages=0), (1,), LaunchConfig(8, 2), {}), {})
    kernel = FakeKernel(max_stages=3, error=ValueError("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        launch(StageLaunch(kernel, (1,), LaunchConfig(4, 3), {}), {})
    assert kernel.calls == [3]


def test_launch_table():
    assert launch_config("fwd_h", 128, 64) == LaunchConfig(4, 1)
    assert launch_config("fwd_h", 256, 64) == LaunchConfig(8, 1)  # four warps measured at K = 128 only
    # rounded operands: four warps measured faster on the H200 although they spill (3.5 KB in dh on sm_90)
    assert launch_config("bwd_dh", 128, 64, rounds_operands=True) == LaunchConfig(4, 1)
    assert launch_config("fwd_h", 128, 64, rounds_operands=True) == LaunchConfig(4, 1)
    assert launch_config("fwd_o", 128, 64, rounds_operands=True) == LaunchConfig(4, 2)
    for stage in ("fwd_h", "fwd_o", "bwd_dh"):  # NVFP4 operands: eight (dh measured 3.66 ms against 5.10 at four)
        assert launch_config(stage, 128, 64, rounds_operands=True, nvfp4_operands=True) == LaunchConfig(8, 1)
    assert launch_config("fwd_pairs", 128, 64) == LaunchConfig(8, 1)  # KDA's rounded pairs: whole key rows
    assert launch_config("fwd_o", 128, 64) == LaunchConfig(4, 2)
    assert launch_config("bwd_intra", 32, 64) == LaunchConfig(8, 3)
    assert launch_config("bwd_intra", 64, 64) == LaunchConfig(8, 3)
    assert launch_config("fwd_o", 64, 64) == LaunchConfig(8, 3)
    assert launch_config("bwd_pairs", 64, 64) == LaunchConfig(4, 3)  # one sub-chunk x one key block per program
    # the exact forward's row-block products at key blocks of 64 (autotuned on the H200); rounded pairs at K = 64
    assert launch_config("fwd_pairs", 64, 64) == LaunchConfig(4, 1)
    assert launch_config("fwd_pairs", 64, 64, rounds_operands=True) == LaunchConfig(4, 3)
    assert launch_config("fwd_h", 32, 16) == LaunchConfig(4, 3)
    with pytest.raises(ValueError, match="unknown stage 'fwd_x'"):
        launch_config("fwd_x", 64, 64)


def test_serial_stages_override():
    from la_compiler.options import OptionsError, TuningOptions

    assert launch_config("fwd_h", 128, 64, serial_stages=2) == LaunchConfig(4, 2)
    assert launch_config("bwd_dh", 128, 64, serial_stages=2) == LaunchConfig(4, 2)
    assert launch_config("fwd_intra", 128, 64, serial_stages=2) == LaunchConfig(8, 1)  # only the serial loops
    with pytest.raises(OptionsError, match=r"serial_stages: must be one of \[None, 1, 2, 3, 4\], got 'two'"):
        TuningOptions(serial_stages="two")


def test_autotune_times_candidates_once_and_persists(tmp_path):
    from la_compiler.kernels.chunk.autotune import Tuner, candidates

    table = LaunchConfig(8, 1)
    configs = candidates(table)
    assert configs[0] == table and len(configs) == len(set(configs)) == 6
    fake_ms = {LaunchConfig(8, 1): 3.0, LaunchConfig(8, 2): 1.0, LaunchConfig(4, 2): 2.0}
    timed = []

    def timer(fn):
        config = fn()
        timed.append(config)
        if config not in fake_ms:
            raise OutOfResources(300000, 232448, "shared memory")
        return fake_ms[config]

    path = tmp_path / "autotune" / "chunk.json"
    tuner = Tuner(path, timer)
    assert tuner.best("k", configs, lambda c: c) == LaunchConfig(8, 2)
    assert len(timed) == 6
    assert tuner.best("k", configs, lambda c: c) == LaunchConfig(8, 2) and len(timed) == 6  # remembered
    assert Tuner(path, timer).best("k", configs, lambda c: c) == LaunchConfig(8, 2)  # and persisted
    assert len(timed) == 6
    with pytest.raises(OutOfResources):
        Tuner(tmp_path / "other.json", timer).best("k", [LaunchConfig(4, 3)], lambda c: c)


def test_autotune_is_off_unless_asked():
    from la_compiler.kernels.chunk import autotune as chunk_autotune
    from la_compiler.options import OptionsError, TuningOptions

    assert TuningOptions().autotune is False and not chunk_autotune.active(False)
    assert not chunk_autotune.active(True)  # no CUDA / the interpreter: the table's configuration
    with pytest.raises(OptionsError, match=r"autotune: must be one of \[False, True\], got 'yes'"):
        TuningOptions(autotune="yes")


def test_launch_takes_the_tuned_configuration(monkeypatch, tmp_path):
    from la_compiler.kernels.chunk import autotune as chunk_autotune

    def timer(fn):
        return {2: 1.0}.get(fn()[3], 5.0)  # the launch result's num_stages: 2 stages fastest

    monkeypatch.setattr(chunk_autotune, "active", lambda requested: requested)
    monkeypatch.setattr(chunk_autotune, "key_of", lambda kernel, grid, constexprs: f"fake|{grid}")
    monkeypatch.setattr(chunk_autotune, "tuner", lambda: chunk_autotune.Tuner(tmp_path / "t.json", timer))
    kernel = FakeKernel(max_stages=3)
    result = launch(StageLaunch(kernel, (4,), LaunchConfig(8, 1), {"BK": 128}, autotune=True), {"x": "x"})
    assert result[2:4] == (8, 2)
    untuned = StageLaunch(FakeKernel(max_stages=3), (4,), LaunchConfig(8, 1), {"BK": 128})
    assert launch(untuned, {"x": "x"})[2:4] == (8, 1)  # not asked: the table


def test_fp32_dot_precision_knob():
    import torch

    from la_compiler.kernels.chunk.params import ChunkParams
    from la_compiler.kernels.chunk.precision import dot_precision
    from la_compiler.ir.spec import RecurrenceSpec, SpecError

    def params(text):
        return ChunkParams.from_spec(RecurrenceSpec.parse(text))

    exact = params("gdn[chunk=64]")
    assert dot_precision(exact, torch.float32) == "ieee" and dot_precision(exact, torch.bfloat16) == "tf32"
    tf32x3 = params("gdn[chunk=64; n.fp32_dot=tf32x3]")
    assert dot_precision(tf32x3, torch.float32) == "tf32x3" and dot_precision(tf32x3, torch.float16) == "tf32"
    with pytest.raises(SpecError, match=r"n.fp32_dot: must be one of \['ieee', 'tf32x3'\], got 'tf32'"):
        params("gdn[chunk=64; n.fp32_dot=tf32]")


def test_autotune_keeps_the_warps_where_the_table_says_so():
    from la_compiler.kernels.chunk.autotune import candidates

    configs = candidates(LaunchConfig(8, 1, keep_warps=True))
    assert [(c.num_warps, c.num_stages) for c in configs] == [(8, 1), (8, 2), (8, 3)]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_only_gdns_key_blocked_backward_intra_keeps_its_warps(kind):
    """GDN's key-blocked backward intra stage faulted at four warps on the H200: the autotuner must not try them."""
    import dataclasses

    import torch

    from la_compiler.kernels.chunk.params import ChunkParams
    from la_compiler.kernels.chunk.plan import ChunkPlan, ChunkShape, chunk_plan
    from la_compiler.options import TuningOptions
    from la_compiler.ir.spec import RecurrenceSpec

    p = ChunkParams.from_spec(RecurrenceSpec(kind=kind, chunk=16, kernel="chunk"))
    plan = chunk_plan(p, ChunkShape(B=1, T=20, H=1, HV=1, K=16, V=16, N=1, NT=2, varlen=False), torch.float32,
                      TuningOptions())
    launches = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ChunkPlan) if f.name.startswith("bwd_")}
    assert launches["bwd_intra"].config.keep_warps == (kind == "gdn")
    assert not any(s.config.keep_warps for name, s in launches.items() if s is not None and name != "bwd_intra")


def test_host_integer_helpers_match_tritons():
    import triton

    from la_compiler.kernels.chunk.launch import cdiv, next_power_of_2

    for n in [0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 4095, 4096, 4097]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 16, 32, 64):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
