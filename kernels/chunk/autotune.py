"""Opt-in autotuning of the chunk kernels' launch configurations (the tuning option ``t.autotune=true``, CUDA only).

Without it every launch takes ``chunk.launch.launch_config``'s table. With it, the first launch of a
kernel for a given (kernel, constexpr values, grid, GPU, Triton) times a small list of
configurations around the table's (warps 4/8 x stages 1-3, at most six), keeps the fastest and writes
the choice to ``<cache dir>/autotune/chunk.json`` (``la_compiler.options.cache_dir``; atomically), so later
processes skip the timing. Configurations Triton refuses for shared memory are skipped. Every chunk kernel writes its
outputs without reading them, so timing a launch several times leaves the same results.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import threading
from pathlib import Path
from typing import Callable

from triton.runtime.errors import OutOfResources

from la_compiler.kernels.common import cache
from la_compiler.options import cache_dir, interpreter


def active(requested: bool) -> bool:
    """Whether a launch autotunes: asked for (t.autotune), on CUDA, not under Triton's interpreter."""
    if not requested or interpreter():
        return False
    import torch

    return torch.cuda.is_available()


def candidates(config):
    """The table's configuration first, then the others of warps {4, 8} x stages {1, 2, 3} (the table's warps
    only where ``config.keep_warps``)."""
    out = [config]
    other = 4 if config.num_warps == 8 else 8
    for warps in (config.num_warps,) if config.keep_warps else (config.num_warps, other):
        for stages in (1, 2, 3):
            c = dataclasses.replace(config, num_warps=warps, num_stages=stages)
            if c not in out:
                out.append(c)
    return out


def cuda_timer(fn: Callable[[], None], repeats: int = 5) -> float:
    """Median ms of ``fn`` over ``repeats`` runs after one warm-up run (which compiles)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Tuner:
    """Chosen configurations by key, read from and written to one JSON file."""

    def __init__(self, path: Path, timer: Callable[[Callable[[], None]], float] = cuda_timer):
        self.path, self.timer = path, timer
        self._lock = threading.Lock()
        self._results: dict[str, dict] | None = None

    def _load(self) -> dict[str, dict]:
        if self._results is None:
            try:
                self._results = json.loads(self.path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                self._results = {}
        return self._results

    def best(self, key: str, configs, run: Callable[[object], None]):
        """The fastest of ``configs`` for ``key`` (``run(config)`` launches once), timed on first use."""
        with self._lock:
            known = self._load().get(key)
            if known is not None:
                return type(configs[0])(**known)
            times = {}
            for config in configs:
                try:
                    times[config] = self.timer(lambda config=config: run(config))
                except OutOfResources:
                    continue
            if not times:
                raise OutOfResources(0, 0, f"shared memory (every candidate configuration of {key})")
            choice = min(times, key=times.get)
            self._results[key] = dataclasses.asdict(choice)
            cache.write_atomic(self.path, json.dumps(self._results, indent=1, sort_keys=True))
            return choice


_TUNER: Tuner | None = None


def tuner() -> Tuner:
    global _TUNER
    path = cache_dir() / "autotune" / "chunk.json"
    if _TUNER is None or _TUNER.path != path:
        _TUNER = Tuner(path)
    return _TUNER


def key_of(kernel, grid, constexprs: dict) -> str:
    import torch
    import triton

    fn = getattr(kernel, "fn", kernel)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', repr(fn))}"
    consts = ",".join(f"{k}={v}" for k, v in sorted(constexprs.items()))
    return f"{name}|{consts}|grid={tuple(grid)}|{torch.cuda.get_device_name()}|triton={triton.__version__}"
