"""Compiles (and autotunes) FLA's KDA kernels for the shapes and dtypes the other GPU scripts use, so
that they find them in Triton's disk cache. Run it in the background at the start of a GPU session
(run_gpu.sh's `warm` stage); it times nothing."""
import time

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from bench_common import make_inputs

CASES = [  # (B, T, H, D, dtype) of compiled_step_vs_eager, decode_bench, chunk_bench / recurrent_vs_fla
    (2, 512, 4, 64, torch.float32), (2, 512, 4, 64, torch.bfloat16), (1, 257, 4, 128, torch.bfloat16),
    (1, 1024, 4, 64, torch.bfloat16), (1, 4096, 16, 128, torch.bfloat16), (8, 4096, 16, 128, torch.bfloat16),
]

for B, T, H, D, dtype in CASES:
    t0 = time.perf_counter()
    xs, _ = make_inputs("kda", B, T, H, H, D, D, dtype)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    o, _ = chunk_kda(*leaves, scale=D ** -0.5, output_final_state=True)
    o.float().sum().backward()
    with torch.no_grad():
        fused_recurrent_kda(*xs, scale=D ** -0.5, output_final_state=True)
    torch.cuda.synchronize()
    print(f"warm chunk_kda fwd+bwd {B}x{T}x{H}x{D} {dtype}: {time.perf_counter() - t0:.1f} s", flush=True)
