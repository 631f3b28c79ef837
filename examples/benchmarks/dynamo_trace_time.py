"""Dynamo's tracing time for a 16-layer FLA causal LM under ``torch.compile(backend="laqat")``, with and without
the einops substitution (passes/frontends/einops_recipes.py), each in its own process.

    python examples/benchmarks/dynamo_trace_time.py [--family gdn kda] [--layers 16] [--out out/dynamo_trace.json]

One forward with labels per process (the eager hand-off, so that only Dynamo and laqat's passes compile); each row
reports torch's compile phase times (``bytecode_tracing``, ``_compile.compile_inner``, ``build_guards``) and the
first call's wall seconds. On the CPU laqat's kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("bytecode_tracing", "_compile.compile_inner", "build_guards")


def one(family: str, layers: int, substitution: bool) -> dict:
    import types

    if not substitution:  # the module registers on import: a stand-in keeps it out
        sys.modules["la_compiler.passes.frontends.einops_recipes"] = types.ModuleType("einops_recipes")
    import torch
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM
    from torch._dynamo.utils import compilation_time_metrics

    import la_compiler.backend  # noqa: F401
    config_class, model_class = ((GatedDeltaNetConfig, GatedDeltaNetForCausalLM) if family == "gdn"
                                 else (KDAConfig, KDAForCausalLM))
    config = config_class(hidden_size=64, num_hidden_layers=layers, num_heads=2, head_dim=32, vocab_size=128,
                          expand_v=1)
    torch.manual_seed(0)
    model = model_class(config)
    ids = torch.randint(0, 128, (1, 16))
    compiled = torch.compile(model, backend="laqat", fullgraph=True, options={"compiler": "eager"})
    t0 = time.perf_counter()
    compiled(input_ids=ids, labels=ids, use_cache=False)
    return {"family": family, "layers": layers, "substitution": substitution,
            "first_call_s": round(time.perf_counter() - t0, 2),
            **{k: round(sum(compilation_time_metrics.get(k, [])), 2) for k in PHASES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--out", default="out/dynamo_trace.json")
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # family layers on|off: one row, in this process
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.one[2] == "on")))
        return
    rows = []
    for family in args.family:
        for substitution in ("off", "on"):
            run = subprocess.run([sys.executable, __file__, "--one", family, str(args.layers), substitution],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"{'family':6} {'einops substitution':19} {'first call s':>12} " + " ".join(f"{k:>22}" for k in PHASES))
    for r in rows:
        print(f"{r['family']:6} {('on' if r['substitution'] else 'off'):19} {r['first_call_s']:12.2f} "
              + " ".join(f"{r[k]:22.2f}" for k in PHASES))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
