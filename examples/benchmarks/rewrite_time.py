"""Rewrite time of the torch frontend (passes/frontends/torch_recurrence) on Dynamo graphs.

Not a test: prints a table and writes JSON to $OUT/rewrite_time.json (or ./out/). For each
workload the Dynamo graph is captured once; the frontend then runs on fresh copies of it
(best of ``--repeat``), with verify=False (the default) and verify=True (which also runs the
whole original region and the IR op on random inputs at compile time). Graphs of several identical
layers are also timed with each region checked on its own (``unshared``: ``region_key`` returning None,
so that no region takes another's algebra check; docs/torch_frontend.md, "Identical layers share one
algebra check").

    python examples/benchmarks/rewrite_time.py            # T = 64, 256, 1024 token loops + chunked graphs
    python examples/benchmarks/rewrite_time.py --quick    # smaller, for a smoke run
    python examples/benchmarks/rewrite_time.py --rows layers   # the workloads whose name holds "layers"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.modules.setdefault("fla", None)  # transformers' torch fallbacks, not FLA's kernels

from la_compiler.passes.frontends.torch_recurrence import rewrite_torch_recurrences  # noqa: E402
from la_compiler.passes.module_names import function_behind  # noqa: E402
from la_compiler.record import GraphRecord  # noqa: E402


def _torch_fallback(module: str, name: str):
    import importlib

    return function_behind(getattr(importlib.import_module(f"transformers.models.{module}"), name))


def capture(fn, *args, **kwargs) -> tuple[torch.fx.GraphModule, float]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(fn, backend=backend)(*args, **kwargs)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one graph, got {len(graphs)}")
    return graphs[0], time.perf_counter() - start


def fresh_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def time_rewrite(gm, verify: bool, repeat: int, shared: bool = True) -> tuple[float, int, list[str], int]:
    """(best seconds, rewrites, near misses, regions that took another's algebra check)."""
    package = sys.modules[rewrite_torch_recurrences.__module__]
    region_key = package.region_key
    best, count, misses, shares = float("inf"), 0, [], 0
    try:
        if not shared:
            package.region_key = lambda flow, region: None
        for _ in range(repeat):
            g = fresh_copy(gm)
            record = GraphRecord(graph_id=0)
            start = time.perf_counter()
            count = rewrite_torch_recurrences(g, record, verify=verify)
            best = min(best, time.perf_counter() - start)
            misses = [n.reason for n in record.near_misses]
            shares = record.pass_counts.get(package.SHARED_CHECKS, 0)
    finally:
        package.region_key = region_key
    return best, count, misses, shares


def stacked(fn, layers: int):
    """``layers`` calls of ``fn``, each reading the last one's output, each with a state of its own."""
    def model(q, k, v, g, beta, **kwargs):
        o, states = v, []
        for _ in range(layers):
            o, s = fn(q, k, torch.tanh(o) + v, g, beta, **kwargs)
            states.append(s)
        return o, states
    return model


def workloads(quick: bool):
    B, H, K, V = 1, 4, 32, 32
    gen = torch.Generator().manual_seed(0)

    def inputs(T, kda=False):
        q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
        v = torch.randn(B, T, H, V, generator=gen)
        g = -0.1 * torch.rand((B, T, H, K) if kda else (B, T, H), generator=gen)
        return q, k, v, g, torch.rand(B, T, H, generator=gen)

    recurrent = _torch_fallback("qwen3_next.modeling_qwen3_next", "torch_recurrent_gated_delta_rule")
    chunk_gdn = _torch_fallback("qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule")
    chunk_kda = _torch_fallback("kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention")
    for T in ((16, 64) if quick else (64, 256, 1024)):
        q, k, v, g, beta = inputs(T)
        yield f"token loop GDN (Qwen3-Next recurrent), T={T}", recurrent, (q, k, v, g, beta), \
            dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    T = 128 if quick else 1024
    q, k, v, g, beta = inputs(T)
    yield f"chunked GDN (Qwen3-Next, solve_triangular), T={T}, C=64", chunk_gdn, (q, k, v, g, beta), \
        dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = inputs(T, kda=True)
    yield f"chunked KDA (Kimi-Linear, 63-step substitution), T={T}, C=64", chunk_kda, (q, k, v, g, beta), \
        dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = inputs(T)
    yield f"4 chunked GDN layers (Qwen3-Next), T={T}, C=64", stacked(chunk_gdn, 4), (q, k, v, g, beta), \
        dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = inputs(T, kda=True)
    yield f"4 chunked KDA layers (Kimi-Linear), T={T}, C=64", stacked(chunk_kda, 4), (q, k, v, g, beta), \
        dict(output_final_state=True, use_qk_l2norm_in_kernel=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", default="", help="only the workloads whose name contains this")
    args = parser.parse_args()
    # warm-up: imports (networkx) and first-call costs are not part of the figures
    warm_gm, _ = capture(_torch_fallback("qwen3_next.modeling_qwen3_next", "torch_recurrent_gated_delta_rule"),
                         *[torch.randn(1, 4, 1, 4) for _ in range(3)], -torch.rand(1, 4, 1), torch.rand(1, 4, 1))
    time_rewrite(warm_gm, False, 1)
    rows = []
    for name, fn, fargs, kwargs in workloads(args.quick):
        if args.rows not in name:
            continue
        gm, trace_s = capture(fn, *fargs, **kwargs)
        nodes = len(gm.graph.nodes)
        t_default, count, misses, shares = time_rewrite(gm, False, args.repeat)
        t_verify, count_v, _, _ = time_rewrite(gm, True, 1)
        t_unshared = time_rewrite(gm, False, args.repeat, shared=False)[0] if shares else None
        rows.append(dict(workload=name, nodes=nodes, dynamo_trace_s=trace_s, rewrite_s=t_default,
                         us_per_node=1e6 * t_default / nodes, rewrite_verify_s=t_verify, rewrites=count,
                         rewrites_verify=count_v, shared_checks=shares, rewrite_unshared_s=t_unshared,
                         near_misses=misses))
        unshared = f" unshared={t_unshared:7.3f}s shared={shares}" if shares else ""
        print(f"{name:62s} nodes={nodes:6d} rewrite={t_default:7.3f}s ({rows[-1]['us_per_node']:5.1f} us/node) "
              f"verify={t_verify:7.3f}s rewrites={count}{unshared} trace={trace_s:6.1f}s", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "rewrite_time.json").write_text(json.dumps(dict(
        torch=torch.__version__, cpu_count=os.cpu_count(), rows=rows), indent=2))
    print(f"wrote {out / 'rewrite_time.json'}")


if __name__ == "__main__":
    main()
