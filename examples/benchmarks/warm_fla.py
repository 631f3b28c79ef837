"""Compiles (and autotunes) FLA's KDA kernels for the shapes and dtypes the other GPU scripts use, so
that they find them in Triton's disk cache (FLA caches its autotune results there too). Run it in the
background on a fresh GPU machine (`examples/benchmarks/gpu_chores.sh warm` starts one process per group,
as the groups compile different kernels); it times nothing.

    python warm_fla.py [--group bf16-128|bf16-64|fp32-64] ...
"""
import argparse
import time

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from bench_common import make_inputs

# (B, T, H, D, dtype) of decode_bench, chunk_bench / recurrent_vs_fla, by autotune key (dtype, D)
GROUPS = {
    "bf16-128": [(1, 257, 4, 128, torch.bfloat16), (1, 4096, 16, 128, torch.bfloat16),
                 (8, 4096, 16, 128, torch.bfloat16)],
    "bf16-64": [(2, 512, 4, 64, torch.bfloat16), (1, 1024, 4, 64, torch.bfloat16)],
    "fp32-64": [(2, 512, 4, 64, torch.float32)],
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--group", nargs="+", choices=sorted(GROUPS), default=sorted(GROUPS))
args = parser.parse_args()
for group in args.group:
    for B, T, H, D, dtype in GROUPS[group]:
        t0 = time.perf_counter()
        xs, _ = make_inputs("kda", B, T, H, H, D, D, dtype)
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]
        o, _ = chunk_kda(*leaves, scale=D ** -0.5, output_final_state=True)
        o.float().sum().backward()
        with torch.no_grad():
            fused_recurrent_kda(*xs, scale=D ** -0.5, output_final_state=True)
        torch.cuda.synchronize()
        print(f"warm chunk_kda fwd+bwd {B}x{T}x{H}x{D} {dtype}: {time.perf_counter() - t0:.1f} s", flush=True)
