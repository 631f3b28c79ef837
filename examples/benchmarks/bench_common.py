"""Shared benchmark helpers. ``ensure_la_compiler``: make ``la_compiler`` importable from this
checkout when it is not pip-installed (e.g. on a
GPU machine with only torch, triton and FLA), mapping kernels/ and passes/ as pyproject's
package-dir does. Benchmarks call ``ensure_la_compiler()`` before importing laqat. ``Marks``: time points of
one call (CUDA events); ``fla_gdn_guard_lifted``: FLA's GDN chunk backward past its Hopper guard, timing only."""
import contextlib
import importlib.util
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ensure_la_compiler() -> None:
    try:
        import la_compiler.kernels  # noqa: F401
        import la_compiler.passes  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(REPO))
    import la_compiler  # noqa: F401

    for folder in ("kernels", "passes"):
        name = f"la_compiler.{folder}"
        spec = importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(kind, B, T, H, HV, K, V, dtype, *, h0=False, n_seqs=None, state="kv", device="cuda"):
    """The benchmarks' inputs: q, v randn; k l2-normalised; g = 0.1*logsigmoid(randn) (per channel
    for KDA); beta = sigmoid(rand). Returns ([q, k, v, g, beta] in dtype, fp32 initial state or None)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(B, T, H, K, device=device)
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    v = torch.randn(B, T, HV, V, device=device)
    g_shape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    g = 0.1 * F.logsigmoid(torch.randn(g_shape, device=device))
    beta = torch.rand(B, T, HV, device=device).sigmoid()
    N = n_seqs or B
    shape = (N, HV, K, V) if state == "kv" else (N, HV, V, K)
    initial = torch.randn(shape, device=device) if h0 else None
    return [x.to(dtype) for x in (q, k, v, g, beta)], initial


def peak_extra_mib(fn) -> float:
    """Peak CUDA allocation above the pre-run baseline while ``fn`` runs, in MiB."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def start_cuda_run(script: str, *sections: str, cpu_ok: bool = False):
    """Common start of a GPU benchmark: exit unless CUDA is there (``cpu_ok``: a CPU smoke run goes on), seed 0,
    create $OUT (default ./out). Returns ($OUT as a Path, the result dict: device, torch, triton and an empty list
    per section)."""
    import os

    import torch
    import triton

    cuda = torch.cuda.is_available()
    if not cuda and not cpu_ok:
        sys.exit(f"{script} needs a CUDA device")
    torch.manual_seed(0)
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": triton.__version__}
    result.update({name: [] for name in sections})
    return out, result


def kernel_times(fn, repeats=3) -> dict:
    """Device time per kernel name (ms per call of fn), largest first: where the time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            times[e.key[:80]] = times.get(e.key[:80], 0.0) + t / 1000 / repeats
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:10])


def sync() -> None:
    """Wait for the device (CUDA); nothing elsewhere."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Marks:
    """Time points of one call on the device's timeline: ``mark()`` records one (a CUDA event; perf_counter without
    CUDA), ``ms()`` waits for the device and returns the milliseconds between consecutive points."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.points = []

    def mark(self) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def ms(self) -> list:
        sync()
        pairs = zip(self.points[:-1], self.points[1:])
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1000 for a, b in pairs]


def fla_gdn_blocker():
    """Why FLA's GDN chunk backward refuses this machine (FLA's Hopper guard), or None."""
    from la_compiler.kernels.fla.chunk_variant import gdn_backward_blocker

    return gdn_backward_blocker()


@contextlib.contextmanager
def fla_gdn_guard_lifted(lift: bool = True):
    """FLA's GDN chunk backward past its guard (Triton >= 3.4, < 3.7.1 on Hopper miscompiles chunk_bwd_dqkwg): wrong
    gradients, real time; timing only, as chunk_bench.py --lift-fla-gdn-guard. ``lift=False``: no change."""
    if not lift:
        yield
        return
    import fla.ops.common.chunk_o as fla_chunk_o

    saved, fla_chunk_o.TRITON_ABOVE_3_7_1 = fla_chunk_o.TRITON_ABOVE_3_7_1, True
    try:
        yield
    finally:
        fla_chunk_o.TRITON_ABOVE_3_7_1 = saved
