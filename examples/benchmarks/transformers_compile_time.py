"""Compile time of a transformers model whose layers are all linear attention, under laqat, with and without the
torch frontend's shared algebra check (docs/torch_frontend.md, "Identical layers share one algebra check").

Not a test: each configuration runs in a process of its own (no Dynamo cache or compile record shared), the
configurations alternating; prints a table and writes JSON to $OUT/transformers_compile_time.json (or ./out/).
The model is a row of tests/models/transformers_models.py with ``--layers`` linear-attention layers; one forward
with labels under ``torch.compile(model, backend="laqat", options={"compiler": "eager"})`` on the CPU (FLA
hidden: transformers' torch fallbacks). ``unshared`` patches ``region_key`` to return None, so that every region
is checked on its own.

    TRITON_INTERPRET=1 python examples/benchmarks/transformers_compile_time.py --model kimi_linear --layers 4 --seq 4096
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one(model: str, layers: int, seq: int, shared: bool) -> dict:
    sys.modules["fla"] = None  # transformers' torch fallbacks, not FLA's kernels
    sys.path.insert(0, str(ROOT))
    import importlib

    import torch
    import transformers
    from torch._dynamo.utils import compilation_time_metrics

    import la_compiler.backend
    from tests.models.transformers_models import BY_NAME, VOCAB

    if not shared:
        importlib.import_module("la_compiler.passes.frontends.torch_recurrence.repeats")  # and its package
        sys.modules["la_compiler.passes.frontends.torch_recurrence"].region_key = lambda flow, region: None
    case = BY_NAME[model]
    overrides = dict(case.overrides, num_hidden_layers=layers, layer_types=["linear_attention"] * layers,
                     max_position_embeddings=max(seq, 256))
    if "mlp_layer_types" in overrides:
        overrides["mlp_layer_types"] = ["dense"] * layers
    torch.manual_seed(0)
    net = getattr(transformers, case.model_class)(getattr(transformers, case.config_class)(**overrides))
    ids = torch.randint(0, VOCAB, (1, seq))
    compiled = torch.compile(net, backend="laqat", options={"compiler": "eager"})
    compiled(input_ids=ids, labels=ids, use_cache=False)
    graphs = la_compiler.backend.last_record().graphs
    return dict(model=model, layers=layers, seq=seq, shared=shared,
                frontend_s=sum(g.pass_seconds.get("torch_recurrence", 0.0) for g in graphs),
                shared_checks=sum(g.pass_counts.get("torch_recurrence.shared_check", 0) for g in graphs),
                rewrites=sum(g.pass_counts.get("torch_recurrence", 0) for g in graphs),
                compile_inner_s=sum(compilation_time_metrics.get("_compile.compile_inner", [0.0])),
                bytecode_tracing_s=sum(compilation_time_metrics.get("bytecode_tracing", [0.0])))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kimi_linear")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=2, help="processes per configuration")
    parser.add_argument("--one", choices=("shared", "unshared"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.layers, args.seq, args.one == "shared")))
        return
    rows = []
    for _ in range(args.repeat):
        for mode in ("unshared", "shared"):
            cmd = [sys.executable, __file__, "--model", args.model, "--layers", str(args.layers), "--seq",
                   str(args.seq), "--one", mode]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['model']:12s} layers={r['layers']} T={r['seq']} {mode:8s} frontend={r['frontend_s']:6.2f}s "
                  f"shared_checks={r['shared_checks']} rewrites={r['rewrites']} "
                  f"compile_inner={r['compile_inner_s']:6.2f}s tracing={r['bytecode_tracing_s']:6.2f}s", flush=True)
    import torch

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "transformers_compile_time.json").write_text(json.dumps(dict(
        torch=torch.__version__, cpu_count=os.cpu_count(), rows=rows), indent=2))
    print(f"wrote {out / 'transformers_compile_time.json'}")


if __name__ == "__main__":
    main()
