"""The autotuning searches of the FLA kernels that laqat's ops launch: fewer candidates, compiled at once in
parallel threads, each timed over a short window.

FLA autotunes its module kernels (SwiGLU, the short convolution, the l2, gated and plain norms, ...) over 3 to 30
configurations per key, and Triton's ``Autotuner`` compiles and times them one after another, each over 25 ms of
warm-up and 100 ms of repetitions: on a cold Triton cache most of a model's first step (docs/model-bench.md, "Every
compile and search of the first step"). Inside ``quick_searches()``, a search that Triton's Autotuner starts (a key
not in its cache, more than one candidate):

- keeps, for a kernel ``NARROWED`` lists, only the candidates it names: those within 1 % of the fastest on the H200
  at hidden sizes 1024 and 2048. A list that matches none of FLA's candidates (another FLA release) keeps them all,
  as does ``LAQAT_FLA_SEARCHES=full`` (la_compiler.options.fla_searches), for GPUs where other candidates win;
- compiles the candidates in threads first (kernels/common/parallel_compile.py);
- then runs as Triton runs it, each candidate timed over ``SEARCH_WARMUP_MS`` and ``SEARCH_REP_MS`` (unless the
  kernel names its own bench), and keeps the fastest in the autotuner's own cache (shared with FLA's eager calls)
  and, where FLA asks for it, Triton's disk cache.

Inside ``requests_only()`` (kernels/fla/compile_requests.py) a launch of an autotuned kernel runs nothing: it
compiles, in parallel threads, the candidates its search would time (the key has no choice yet) or its choice.

The kernels compute what they compute under any candidate; where a candidate splits a reduction differently, the
last bits of that reduction follow the choice, as they follow FLA's own search from one machine to the next. The
wrapper is installed on ``Autotuner.run`` at the first ``quick_searches()`` and passes every call through unchanged
outside one.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

from la_compiler.kernels.common.parallel_compile import compiles_in_threads
from la_compiler.options import fla_searches

SEARCH_WARMUP_MS = 5
SEARCH_REP_MS = 20

# FLA kernel -> the candidates its search keeps: (meta-parameters, warps) pairs
NARROWED = {
    "swiglu_fwd_kernel": (({"B": 512}, 4), ({"B": 1024}, 8)),
    "swiglu_fwdbwd_kernel": (({"B": 512}, 8), ({"B": 1024}, 16)),
    "l2norm_fwd_kernel": (({"BT": 8}, 2), ({"BT": 32}, 1), ({"BT": 16}, 4)),
    "l2norm_bwd_kernel": (({"BT": 16}, 8), ({"BT": 8}, 2), ({"BT": 32}, 8)),
    "causal_conv1d_fwd_kernel": (({"BD": 32}, 4), ({"BD": 32}, 8), ({"BD": 64}, 4)),
    "causal_conv1d_bwd_kernel": (({"BD": 32}, 4), ({"BD": 16}, 4)),
    "layer_norm_gated_fwd_kernel": (({"BT": 32}, 8), ({"BT": 32}, 4), ({"BT": 64}, 8)),
    "layer_norm_gated_bwd_kernel": (({"BT": 32}, 16), ({"BT": 64}, 16)),
    "layer_norm_fwd_kernel_row": (({}, 2), ({}, 4), ({}, 8)),
    "layer_norm_bwd_kernel_row": (({}, 8), ({}, 4)),
}

_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("laqat_quick_searches", default=False)
requests_only: contextvars.ContextVar[bool] = contextvars.ContextVar("laqat_fla_requests_only", default=False)
_lock = threading.Lock()
_installed = False


@contextlib.contextmanager
def quick_searches():
    """Autotuning searches started inside compile their candidates in parallel and time each briefly."""
    _install()
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def tuning_key(tuner, args, kwargs) -> tuple:
    """The key Triton's Autotuner.run files a choice under: the key arguments' values, then every tensor
    argument's dtype."""
    named = {k: v for k, v in {**dict(zip(tuner.arg_names, args)), **kwargs}.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def quick_bench(kernel_call, quantiles):
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=SEARCH_WARMUP_MS, rep=SEARCH_REP_MS, quantiles=quantiles)


def narrowed(name: str, configs: list) -> list:
    """The candidates of ``configs`` that ``NARROWED`` keeps for kernel ``name`` (all where it keeps none)."""
    keep = NARROWED.get(name) if fla_searches() == "narrowed" else None
    if not keep:
        return configs
    kept = [c for c in configs
            if any(c.num_warps == warps and all(c.kwargs.get(k) == v for k, v in meta.items()) for meta, warps in keep)]
    return kept or configs


def search_candidates(tuner, args, kwargs) -> list:
    """The candidates a search of this launch times: ``narrowed`` and Triton's early pruning, computed without
    touching the autotuner's state (another thread may be running it)."""
    configs = narrowed(getattr(tuner.base_fn, "__name__", ""), tuner.configs)
    if tuner.early_config_prune:
        configs = tuner.early_config_prune(configs, dict(zip(tuner.arg_names, args)), **kwargs) or configs
    return configs


def compile_requests(tuner, args, kwargs) -> None:
    """The compiles a launch of ``tuner`` needs, nothing launched: the candidates its search will time where its
    key has no choice yet, else the choice."""
    if len(tuner.configs) == 1:
        configs = tuner.configs
    else:
        chosen = tuner.cache.get(tuning_key(tuner, args, kwargs))
        configs = [chosen] if chosen is not None else search_candidates(tuner, args, kwargs)
    compile_candidates(tuner, configs, args, kwargs)


def compile_candidates(tuner, configs, args, kwargs) -> None:
    """``configs`` compiled for this launch in parallel threads, nothing launched."""
    meta = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # the launch's own
    with compiles_in_threads():
        for config in configs:
            try:
                tuner.fn.run(*args, grid=(1,), warmup=True, **meta, **config.all_kwargs())
            except Exception:  # noqa: BLE001 - the search's own launch of this candidate reports it
                pass


def _search(run, tuner, args, kwargs):
    full = tuner.configs
    tuner.configs = narrowed(getattr(tuner.base_fn, "__name__", ""), full)
    try:
        return _timed_search(run, tuner, args, kwargs)
    finally:
        tuner.configs = full


def _timed_search(run, tuner, args, kwargs):
    tuner.nargs = dict(zip(tuner.arg_names, args))
    candidates = tuner.prune_configs(kwargs)
    if len(candidates) > 1:
        compile_candidates(tuner, candidates, args, kwargs)
    # the autotuner's own bench where the kernel names one (FLA's warmup / rep, a do_bench), else the short one
    swap = "_do_bench" in tuner.__dict__ and tuner._do_bench is None
    if swap:
        tuner._do_bench = quick_bench
    try:
        return run(tuner, *args, **kwargs)
    finally:
        if swap:
            tuner._do_bench = None


def _install() -> None:
    global _installed
    if _installed:  # every call of a searched FLA function comes here
        return
    with _lock:
        if _installed:
            return
        from triton.runtime.autotuner import Autotuner

        run = Autotuner.run

        @functools.wraps(run)
        def run_with_quick_searches(tuner, *args, **kwargs):
            if requests_only.get():
                return compile_requests(tuner, args, kwargs)
            if _inside.get() and len(tuner.configs) > 1 and tuning_key(tuner, args, kwargs) not in tuner.cache:
                return _search(run, tuner, args, kwargs)
            return run(tuner, *args, **kwargs)

        Autotuner.run = run_with_quick_searches
        _installed = True


@functools.lru_cache(maxsize=None)
def searched(fn):
    """``fn`` called inside ``quick_searches()`` (one wrapper per function: the ops call this at every launch)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with quick_searches():
            return fn(*args, **kwargs)
    return call
