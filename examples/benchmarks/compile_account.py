"""Where the first training steps of one model-benchmark row spend their time: every Triton compile (kernel, origin,
seconds), every autotuning search (kernel, candidates, seconds, each candidate's time), laqat's compile-ahead,
torch's compile phases, per step.

    python examples/benchmarks/compile_account.py --family gdn --row "laqat exact" [--layers 4 --hidden 1024
        --heads 8 --head-dim 128] [--steps 3] [--caches cold|warm] [--tuning compile_ahead=false]
        [--full-searches] [--ready-on-first-launch] [--profile N] [--lift-fla-gdn-guard] [--tag NAME]

One row per process (model_bench.py's models and rows). The caches are the environment's (``TRITON_CACHE_DIR``,
``LAQAT_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``): a cold measurement gives the process empty folders, a warm one
the folders an earlier process filled, and ``--caches`` labels which. Per step it reports the wall seconds, those of
its forward (its compile included), optimizer step and the rest (the backward) apart (``parts_s``), torch's compile
phases (``compilation_time_metrics``), AOTAutograd's and Inductor's cache counters so far (``cache_counters``: hits,
misses, bypasses), the seconds of laqat's compile-ahead (kernels/chunk/compile_ahead.py)
and of the Triton compiles and autotuning searches in this process by the kernel's origin (``laqat``: laqat's own
kernels; ``fla``: FLA's, those laqat's ops launch included; ``other``), a search's compiles counted in it. A
compile that laqat's compile-ahead requests counts among its requests, not among the compiles: the forward's on the
step's thread (their seconds in the compile-ahead's, which the step waits for), the backward's from the compile-ahead's
background thread (which the step does not wait for); those of FLA's backward that laqat's FLA ops request at
their first forward (kernels/fla/backward_ahead.py) count apart, as ``fla_backward_ahead_requests``. A compiled
kernel's readying for its first launch (binary loaded, C launcher built: ``CompiledKernel._init_handles``) is
counted apart, on the step's threads (the main thread and autograd's device threads) and in other threads (laqat's
compile threads, Inductor's). Inductor's generated kernels compile in its worker processes inside its compile
phases. ``--full-searches``: FLA's searches as Triton runs them, not laqat's quick ones
(kernels/fla/autotune_searches.py). ``--profile N``: the first step's N functions with the most cumulative seconds
and the N with the most seconds of their own, with their callers (cProfile, the main thread; the whole profile in
``$OUT/first_step.prof``, for ``pstats``). Writes
``$OUT/compile_account.json`` (examples/benchmarks/results/record.py turns it into records) and prints a table.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ensure_la_compiler, fla_gdn_blocker, sync  # noqa: E402

ensure_la_compiler()

import la_compiler  # noqa: E402,F401
from la_compiler.kernels.chunk.compile_ahead import BACKGROUND_THREAD  # noqa: E402
from la_compiler.kernels.fla.backward_ahead import BACKGROUND_THREAD as FLA_BACKGROUND_THREAD  # noqa: E402
from la_compiler.options import fla_compile_ahead, process_keys_ahead  # noqa: E402
from model_bench import ROW_OPTIONS, ROWS, Row, add_model_shape_arguments, build_model, plan, raise_recompile_limits  # noqa: E402


def origin(module: str) -> str:
    if module.startswith(("la_compiler", "kernels.")):
        return "laqat"
    if module.startswith("fla"):
        return "fla"
    return "other"


def on_step_thread() -> bool:
    """The training step's own threads: the main thread and autograd's device threads, which run a CUDA backward
    (started outside Python: threading names them ``Dummy-N``)."""
    thread = threading.current_thread()
    return thread is threading.main_thread() or isinstance(thread, threading._DummyThread)


class TritonLog:
    """Triton's compiles and autotuning searches in this process, from wrappers around
    ``JITFunction._do_compile`` and ``Autotuner._bench`` / ``Autotuner.run``."""

    def __init__(self):
        self.compiles: list[dict] = []
        self.searches: list[dict] = []
        self.ahead: list[float] = []  # seconds in laqat's compile-ahead of chunk training steps (per call)
        self.readies: list[dict] = []  # compiled kernels readied for their first launch (binary loaded, launcher)
        self._local = threading.local()
        self.installed = []
        self._install()

    def _install(self):
        from triton.runtime import autotuner, jit

        from la_compiler.kernels.chunk import variant
        from la_compiler.kernels.fla import autotune_searches

        autotune_searches._install()  # laqat's wrapper inside the timing one: a search's compiles count in it
        log = self
        compile_step = variant.compile_training_step

        def timed_compile_step(*args, **kwargs):
            t0 = time.perf_counter()
            log._local.ahead = True
            try:
                return compile_step(*args, **kwargs)
            finally:
                log._local.ahead = False
                log.ahead.append(time.perf_counter() - t0)
        variant.compile_training_step = timed_compile_step
        self.installed.append("chunk variant's compile_training_step")
        do_compile = getattr(jit.JITFunction, "_do_compile", None)
        if do_compile is not None:
            def timed_compile(fn, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return do_compile(fn, *args, **kwargs)
                finally:
                    log.compiles.append({"kernel": fn.__name__, "origin": origin(fn.module or ""),
                                         "s": time.perf_counter() - t0,
                                         "in_search": getattr(log._local, "search", None),
                                         "in_ahead": getattr(log._local, "ahead", False)
                                         or threading.current_thread().name == BACKGROUND_THREAD,
                                         "fla_ahead": threading.current_thread().name == FLA_BACKGROUND_THREAD})
            jit.JITFunction._do_compile = timed_compile
            self.installed.append("JITFunction._do_compile")

        from triton.compiler.compiler import CompiledKernel

        ready = CompiledKernel._init_handles

        def timed_ready(kernel, *args, **kwargs):
            if getattr(kernel, "module", None) is not None:
                return ready(kernel, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return ready(kernel, *args, **kwargs)
            finally:
                log.readies.append({"kernel": getattr(kernel, "name", "?"), "s": time.perf_counter() - t0,
                                    "step_thread": on_step_thread()})
        CompiledKernel._init_handles = timed_ready
        self.installed.append("CompiledKernel._init_handles")

        run = autotuner.Autotuner.run

        def timed_run(tuner, *args, **kwargs):
            before = len(tuner.cache)
            outer = getattr(log._local, "search", None)
            name = getattr(tuner.base_fn, "__name__", "?")
            log._local.search = outer or name
            t0 = time.perf_counter()
            try:
                return run(tuner, *args, **kwargs)
            finally:
                log._local.search = outer
                if len(tuner.cache) > before:
                    module = getattr(tuner.base_fn, "__module__", "") or ""
                    timings = getattr(tuner, "configs_timings", None) or {}
                    log.searches.append({
                        "kernel": name, "origin": origin(module), "configs": len(tuner.configs),
                        "s": time.perf_counter() - t0, "chosen": str(getattr(tuner, "best_config", "")),
                        "timings_ms": {str(c): (t[0] if isinstance(t, (list, tuple)) else t)
                                       for c, t in timings.items()}})
        autotuner.Autotuner.run = timed_run
        self.installed.append("Autotuner.run")

    def mark(self):
        return len(self.compiles), len(self.searches), len(self.ahead), len(self.readies)

    def since(self, mark) -> dict:
        compiles, searches = self.compiles[mark[0]:], self.searches[mark[1]:]
        out = {"laqat_compile_ahead_s": round(sum(self.ahead[mark[2]:]), 2)}
        readies = self.readies[mark[3]:]
        for where, on_step in (("step_thread", True), ("other_threads", False)):
            done = [r for r in readies if r["step_thread"] == on_step]
            out[f"ready_{where}"] = {"kernels": len(done), "s": round(sum(r["s"] for r in done), 2)}
        ahead = [c for c in compiles if c["in_ahead"]]  # compile-ahead's requests: their seconds count in it
        out["ahead_requests"] = {"compiles": len(ahead), "s": round(sum(c["s"] for c in ahead), 2)}
        fla_ahead = [c for c in compiles if c.get("fla_ahead")]  # FLA's backward compiled ahead, in the background
        out["fla_backward_ahead_requests"] = {"compiles": len(fla_ahead),
                                              "s": round(sum(c["s"] for c in fla_ahead), 2)}
        compiles = [c for c in compiles if not c["in_ahead"] and not c.get("fla_ahead")]
        for who in ("laqat", "fla", "other"):
            direct = [c for c in compiles if c["origin"] == who and c["in_search"] is None]
            found = [s for s in searches if s["origin"] == who]
            out[who] = {
                "compiles": len(direct), "compile_s": round(sum(c["s"] for c in direct), 2),
                "searches": len(found), "search_s": round(sum(s["s"] for s in found), 2),
                "search_compiles": sum(1 for c in compiles if c["origin"] == who and c["in_search"] is not None),
            }
        slow = collections.Counter()
        for c in compiles:
            if c["in_search"] is None:
                slow[f"{c['origin']}:{c['kernel']}"] += c["s"]
        for s in searches:
            slow[f"{s['origin']}:{s['kernel']} (search of {s['configs']})"] += s["s"]
        out["slowest"] = {k: round(v, 2) for k, v in slow.most_common(25)}
        return out


class StepParts:
    """The step's forward (its compile included), its optimizer step, and the rest (the backward), in wall seconds,
    each part ended by a device synchronization."""

    def __init__(self, row):
        self.times = {}
        forward, optimizer_step = row.fn, row.optimizer.step

        def timed(name, fn):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
                return out
            return run
        row.fn = timed("forward", forward)
        row.optimizer.step = timed("optimizer", optimizer_step)
        self.t0 = time.perf_counter()

    def clear(self):
        self.times = {}
        self.t0 = time.perf_counter()

    def seconds(self) -> dict:
        total = time.perf_counter() - self.t0
        out = {name: round(s, 2) for name, s in self.times.items()}
        out["backward"] = round(total - sum(self.times.values()), 2)
        return out


def autotune_choices() -> dict:
    """Every autotuner's choices in this process: {module.kernel: {key: configuration}}."""
    import gc

    from triton.runtime.autotuner import Autotuner

    out = {}
    for obj in gc.get_objects():
        try:
            tuned = isinstance(obj, Autotuner) and bool(obj.cache)
        except ReferenceError:  # a dead weak proxy
            continue
        if tuned:
            fn = obj.base_fn
            out[f"{fn.__module__}.{fn.__name__}"] = {
                "key_names": list(obj.keys),
                "choices": {repr(k): {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                            for k, c in obj.cache.items()}}
    return out


def phases_since(counted: dict) -> dict:
    metrics = torch._dynamo.utils.compilation_time_metrics
    return {name: round(sum(times[counted.get(name, 0):]), 2) for name, times in metrics.items()
            if len(times) > counted.get(name, 0)}


def function_name(key: tuple) -> str:
    filename, line, name = key
    where = filename.split("site-packages/")[-1].replace(str(Path(__file__).resolve().parents[2]) + "/", "")
    return f"{where}:{line}({name})"


def cache_counters() -> dict:
    """Dynamo's counters of AOTAutograd's and Inductor's caches so far in this process (hits, misses, bypasses)."""
    return {group: {name: n for name, n in torch._dynamo.utils.counters[group].items() if "cache" in name}
            for group in ("aot_autograd", "inductor")}


def profile_top(profiler, count: int) -> dict:
    """The step's main thread (cProfile): the ``count`` functions with the most cumulative seconds, and the
    ``count`` with the most seconds of their own, each of those with its callers."""
    stats = pstats.Stats(profiler).stats
    rows = [{"function": function_name(key), "calls": calls, "own_s": round(own, 3), "cumulative_s": round(cum, 3),
             "callers": [function_name(c) for c in callers]}
            for key, (_, calls, own, cum, callers) in stats.items()]
    cumulative = sorted(rows, key=lambda r: -r["cumulative_s"])[:count]
    own = sorted(rows, key=lambda r: -r["own_s"])[:count]
    return {"cumulative": [{k: v for k, v in r.items() if k != "callers"} for r in cumulative], "own": own}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["kda", "gdn"], required=True)
    p.add_argument("--row", required=True, choices=list(ROWS))
    add_model_shape_arguments(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lift-fla-gdn-guard", action="store_true")
    p.add_argument("--tag", default="", help="a name for this measurement, in the JSON")
    p.add_argument("--caches", choices=["cold", "warm"], default=None,
                   help="what the cache folders held: cold (empty) or warm (an earlier process's), as a label")
    p.add_argument("--full-searches", action="store_true",
                   help="FLA's autotuning searches as Triton runs them, not laqat's quick ones "
                        "(kernels/fla/autotune_searches.py)")
    p.add_argument("--ready-on-first-launch", action="store_true",
                   help="laqat's compile threads compile only; each kernel is readied (binary loaded, launcher built) "
                        "at its first launch, as Triton does (kernels/common/parallel_compile.py)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the first step's main thread: its N functions with the most cumulative seconds and "
                        "the N with the most seconds of their own (with their callers); the whole profile to "
                        "$OUT/first_step.prof")
    p.add_argument("--tuning", action="append", default=[], metavar="KEY=VALUE",
                   help="a laqat tuning option (options={'tuning': ...}), e.g. compile_ahead=false")
    args = p.parse_args()

    if args.full_searches:
        from la_compiler.kernels.fla import autotune_searches
        autotune_searches.quick_searches = contextlib.nullcontext
    if args.ready_on_first_launch:
        from la_compiler.kernels.common import parallel_compile
        parallel_compile.CompileAndReady = lambda pool: pool
    log = TritonLog()
    raise_recompile_limits()
    tuning = {}
    for item in args.tuning:
        key, _, value = item.partition("=")
        tuning[key] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    planned, why = plan(args.row, args.family)
    if planned is None:
        sys.exit(why)
    backend, policy, prefix = planned
    lift = fla_gdn_blocker() if args.family == "gdn" and args.lift_fla_gdn_guard and backend != "laqat" else None
    row = Row(args.row, args.family, backend, policy, prefix, lift)
    device = "cuda"
    row.model = build_model(args.family, args).to(device).to(torch.bfloat16)
    row.optimizer = torch.optim.AdamW(row.model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    row.fn = (row.model if backend is None else torch.compile(row.model) if backend == "inductor"
              else torch.compile(row.model, backend="laqat", options={"policy": policy, "tuning": tuning,
                                                                   **ROW_OPTIONS.get(args.row, {})}))
    result = {"family": args.family, "row": args.row, "layers": args.layers, "hidden": args.hidden,
              "heads": args.heads, "head_dim": args.head_dim, "tag": args.tag, "caches": args.caches,
              "tuning": tuning, "full_searches": args.full_searches,
              "ready_on_first_launch": args.ready_on_first_launch, "fla_compile_ahead": fla_compile_ahead(),
              "process_keys_ahead": process_keys_ahead(),
              "hooks": log.installed,
              "cache_dirs": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "LAQAT_CACHE_DIR",
                                                             "TORCHINDUCTOR_CACHE_DIR")},
              "steps": []}
    parts = StepParts(row)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    for i in range(args.steps):
        sync()
        parts.clear()
        counted = {name: len(t) for name, t in torch._dynamo.utils.compilation_time_metrics.items()}
        mark = log.mark()
        profiler = cProfile.Profile() if args.profile and i == 0 else None
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        row.optimizer.zero_grad(set_to_none=True)
        loss = row.step(ids)
        sync()
        if profiler is not None:
            profiler.disable()
        step = {"step": i, "wall_s": round(time.perf_counter() - t0, 2), "loss": round(loss.item(), 4),
                "phases_s": phases_since(counted), "parts_s": parts.seconds(), "triton": log.since(mark),
                "cache_counters": cache_counters()}
        if profiler is not None:
            step["profile"] = profile_top(profiler, args.profile)
            profiler.dump_stats(out / "first_step.prof")
        result["steps"].append(step)
        print(json.dumps(step), flush=True)
    result["searches"] = log.searches
    result["autotune_choices"] = autotune_choices()
    (out / "compile_account.json").write_text(json.dumps(result, indent=1))
    print(f"{args.family} {args.row} {args.layers} layers [{args.tag or args.caches or ''}]")
    for s in result["steps"]:
        t = s["triton"]
        top = sorted(s["phases_s"].items(), key=lambda kv: -kv[1])[:4]
        print(f"  step {s['step']}: {s['wall_s']:7.2f} s  "
              + f"laqat compile-ahead {t['laqat_compile_ahead_s']} s  "
              + f"readied on the step's thread {t['ready_step_thread']['kernels']} "
              + f"{t['ready_step_thread']['s']} s  "
              + "  ".join(f"{who} {t[who]['compiles']} compiles {t[who]['compile_s']} s, {t[who]['searches']} "
                          f"searches {t[who]['search_s']} s" for who in ("laqat", "fla", "other"))
              + "  phases: " + ", ".join(f"{n} {v}" for n, v in top))


if __name__ == "__main__":
    main()
