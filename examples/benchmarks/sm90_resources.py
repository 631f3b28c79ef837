"""Registers, spills and shared memory of the chunk kernels as built for sm_90 (H100 / H200), without a GPU.

    OUT=./out python examples/benchmarks/sm90_resources.py --kind gdn --head 128 --dtype bf16 \
        --policies "laqat exact,laqat FP8 all sites" [--warps 4,8] [--stages 1,2]

The real recipes (kernels/chunk/fwd.py, chunk/bwd.py) run a training forward (keeping its residual) and its
backward on small CPU tensors with a recorder in place of the stage launchers' ``chunk.launch.launch``: nothing
executes, and every kernel they would launch is compiled by Triton for sm_90 (its bundled ptxas) with the
launch's own constants, warps and pipeline stages, then read back with ``cuobjdump -res-usage``. ``--warps`` /
``--stages`` compile each kernel at other settings too. Prints a table and writes $OUT/sm90_resources.json.

This is the machine-independent half of "where the time goes": a stage at 255 registers with spills runs one
program per SM and waits on local memory. A register count is a guide, not a timing (docs/kernels-chunk.md,
"Launch configurations"; the builds beside the timings: docs/kernels-chunk-measurements.md). Must run without
TRITON_INTERPRET (the interpreter's kernels cannot be compiled); the launches are those of a GPU (16-bit GEMMs
for bf16 inputs).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("sm90_resources.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled for sm_90)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench_common import ensure_la_compiler  # noqa: E402

ensure_la_compiler()

from la_compiler.ir.spec import RecurrenceSpec  # noqa: E402
from la_compiler.kernels.chunk import bwd as chunk_bwd_module  # noqa: E402
from la_compiler.kernels.chunk import fwd as chunk_fwd_module  # noqa: E402
from la_compiler.kernels.chunk import stages as chunk_stages  # noqa: E402
from la_compiler.kernels.chunk.launch import StageLaunch  # noqa: E402
from la_compiler.kernels.chunk.params import ChunkParams  # noqa: E402
from la_compiler.kernels.chunk.residual import residual_size  # noqa: E402
from la_compiler.kernels.common import qdq  # noqa: E402
from la_compiler.kernels.common.canonical_inputs import check_canonical_inputs  # noqa: E402

# as on an sm_90 GPU (qdq.hardware_fp8_cast): E4M3 through the conversion instruction; set before any kernel
# compiles, since the QDQ device functions read it as a constant
qdq.FP8_CAST = triton.language.constexpr(True)

SM90 = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int64: "*i64"}


def recorded_launches(spec: RecurrenceSpec, head: int, dtype: torch.dtype, chunks: int = 2) -> list[dict]:
    """Every launch of a training forward and its backward for ``spec`` at head_k = head_v = ``head``, in order,
    one per distinct (kernel, constants, config)."""
    p = ChunkParams.from_spec(spec)
    B, T, H = 1, chunks * spec.chunk, 2
    q, k = torch.randn(B, T, H, head, dtype=dtype), torch.randn(B, T, H, head, dtype=dtype)
    v = torch.randn(B, T, H, head, dtype=dtype)
    g = torch.zeros((B, T, H) if spec.kind == "gdn" else (B, T, H, head), dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype)
    h0 = torch.zeros(B, H, head, head)
    launches, seen = [], set()

    def record(stage: StageLaunch, arguments: dict, **launcher_constexprs):
        constexprs = {**stage.constexprs, **launcher_constexprs}
        key = (stage.kernel.fn.__name__, stage.config, tuple(sorted((n, repr(x)) for n, x in constexprs.items())))
        if key not in seen:
            seen.add(key)
            launches.append(dict(kernel=stage.kernel, args=arguments, config=stage.config, constexprs=constexprs))

    def check_on_the_cpu(*a, **kw):  # the input check asks for CUDA tensors unless the interpreter runs them
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            return check_canonical_inputs(*a, **kw)
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before

    saved = {m: m.launch for m in set(chunk_stages.STAGES.values())}  # each stage module's launchers call it
    try:
        for m in saved:
            m.launch = record
        chunk_fwd_module.check_canonical_inputs = check_on_the_cpu
        residual = torch.empty(residual_size(p, q, v, None))
        o, _ = chunk_fwd_module.chunk_fwd(p, q, k, v, g, beta, head ** -0.5, h0, None, save_to=residual)
        chunk_bwd_module.chunk_bwd(p, q, k, v, g, beta, head ** -0.5, torch.randn_like(o), torch.randn_like(h0), h0,
                                   None, saved=residual)
    finally:
        for m, fn in saved.items():
            m.launch = fn
        chunk_fwd_module.check_canonical_inputs = check_canonical_inputs
    return launches


def _argument_types(kernel, args, constexprs) -> tuple[dict, dict, dict]:
    """(signature, constants, attributes) as Triton's launcher would specialize this call (``args``: the launcher's
    arguments by name): tensors as pointers aligned to 16 bytes, None and constexpr parameters as constants, T
    (never specialized) as i32."""
    signature, constants, attrs = {}, {}, {}
    values = dict(args, **constexprs)
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constants, attrs


def compile_for_sm90(launch: dict, warps: int, stages: int, cuobjdump: Path) -> dict:
    kernel = launch["kernel"]
    signature, constants, attrs = _argument_types(kernel, launch["args"], launch["constexprs"])
    started = time.time()
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=SM90,
                                  options=dict(num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 -- a refusal (shared memory, say) is a result, reported
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    seconds = time.time() - started
    cubin = Path(tempfile.gettempdir()) / f"laqat_sm90_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    cubin.unlink()
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if not found:
        return {"error": f"cuobjdump gave no resource line: {usage[-200:]!r}"}
    registers, stack, _, local = (int(x) for x in found.groups())
    return {"registers": registers, "spill_bytes": stack, "local_bytes": local,
            "shared_kb": compiled.metadata.shared / 1024, "compile_s": round(seconds, 1)}


def _nvidia_tool(name: str) -> Path:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        sys.exit(f"sm90_resources.py: {path} is missing (Triton's NVIDIA backend ships it)")
    return path


def main() -> None:
    from chunk_bench import POLICIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="gdn", choices=("gdn", "kda"))
    parser.add_argument("--head", type=int, default=128, help="head_k = head_v")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--policies", default="laqat exact",
                        help="comma-separated rows of chunk_bench.POLICIES: " + ", ".join(POLICIES))
    parser.add_argument("--warps", default="", help="also compile at these warps (comma-separated)")
    parser.add_argument("--stages", default="", help="also compile at these pipeline stages (comma-separated)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    names = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in names if x not in POLICIES]
    if unknown:
        sys.exit(f"--policies: unknown {unknown}; known: {list(POLICIES)}")
    cuobjdump = _nvidia_tool("cuobjdump")
    extra_warps = [int(x) for x in args.warps.split(",") if x]
    extra_stages = [int(x) for x in args.stages.split(",") if x]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"triton": triton.__version__, "target": "sm_90", "kind": args.kind, "head": args.head,
              "dtype": args.dtype, "chunk": args.chunk, "rows": []}
    print(f"{args.kind} K = V = {args.head}, {args.dtype}, C = {args.chunk}, sm_90 (Triton {triton.__version__})")
    print(f"{'policy':28s} {'kernel':34s} {'warps':>5s} {'stages':>6s} {'regs':>4s} {'spills B':>8s} "
          f"{'smem KB':>7s}")
    for name in names:
        spec = RecurrenceSpec(kind=args.kind, chunk=args.chunk, kernel="chunk").replace(quant=POLICIES[name])
        for launch in recorded_launches(spec, args.head, dtype):
            config = launch["config"]
            settings = {(config.num_warps, config.num_stages)}
            settings |= {(w, config.num_stages) for w in extra_warps} | {(config.num_warps, s) for s in extra_stages}
            for warps, stages in sorted(settings):
                row = {"policy": name, "kernel": launch["kernel"].fn.__name__, "warps": warps, "stages": stages,
                       "launch_table": (warps, stages) == (config.num_warps, config.num_stages),
                       **compile_for_sm90(launch, warps, stages, cuobjdump)}
                result["rows"].append(row)
                mark = "" if row["launch_table"] else " (not the launch table's)"
                if "error" in row:
                    print(f"{name:28s} {row['kernel']:34s} {warps:5d} {stages:6d}  {row['error']}{mark}")
                else:
                    print(f"{name:28s} {row['kernel']:34s} {warps:5d} {stages:6d} {row['registers']:4d} "
                          f"{row['spill_bytes']:8d} {row['shared_kb']:7.0f}{mark}", flush=True)
                (out / "sm90_resources.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'sm90_resources.json'}")


if __name__ == "__main__":
    main()
