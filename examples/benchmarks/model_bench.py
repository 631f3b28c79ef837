"""One training step of FLA's causal LMs, eager and compiled, on CUDA: the user's path, measured.

    python examples/benchmarks/model_bench.py --family kda gdn [--layers 4 --hidden 1024 --heads 8
        --head-dim 128 --batch 2 --seq 4096 --vocab 32000] [--rows "eager FLA,laqat exact,..."]

For each model (FLA's ``KDAForCausalLM`` / ``GatedDeltaNetForCausalLM`` with FLA's default fusions, bf16)
and each row, a fresh copy of the same weights runs ``--warmup`` + ``--steps`` training steps (forward with
labels, backward, AdamW) and reports:

- ``step_ms``: the median step time over ``--steps`` (CUDA events);
- ``peak_mib``: the peak allocation over those steps;
- ``first_step_s``: the first step's wall time (Dynamo, laqat, Inductor and Triton compiles included);
- ``loss``: the first step's loss; ``nodes`` / ``kernels``: laqat's rewritten sites and their kernels;
- for exact rows, ``grad_rel_max``: the largest relative L2 distance of a first-step parameter gradient
  from an fp32 oracle: eager FLA in fp32 for KDA; for GDN (FLA's chunk backward refuses on some
  GPU/Triton pairs) the same fp32 model compiled with laqat's fp64 torch reference kernel.

Rows: ``eager FLA`` (the uncompiled model), ``torch.compile (Inductor)``, and laqat with the default options
(Inductor hand-off) under ``exact``, ``state_fp8``, ``state_int8_block32``, ``prefill_operands_fp8`` and
``decode_token_state_fp8`` (decode-phase training, the first half of every sequence its prefix). A row that
fails reports its error and the table goes on. Prints a table; writes $OUT/model_bench.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import traceback

import torch

from bench_common import ensure_la_compiler, rel_l2, start_cuda_run

ensure_la_compiler()

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402

ROWS = {  # row -> (compile backend or None, policy, decode-phase prefix)
    "eager FLA": (None, None, False),
    "torch.compile (Inductor)": ("inductor", None, False),
    "laqat exact": ("laqat", None, False),
    "laqat exact (laqat chunk kernels)": ("laqat", {"linear_attention": [{"module_name": "*",
                                                                          "cfg": {"backend": "chunk"}}]}, False),
    "laqat state_fp8": ("laqat", "state_fp8", False),
    "laqat state_int8_block32": ("laqat", "state_int8_block32", False),
    "laqat prefill_operands_fp8": ("laqat", "prefill_operands_fp8", False),
    "laqat decode_token_state_fp8": ("laqat", "decode_token_state_fp8", True),
}
REFERENCE_KERNEL = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}


def build_model(family: str, args):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

    config_class, model_class = ((GatedDeltaNetConfig, GatedDeltaNetForCausalLM) if family == "gdn"
                                 else (KDAConfig, KDAForCausalLM))
    extra = {"expand_v": 1}
    config = config_class(hidden_size=args.hidden, num_hidden_layers=args.layers, num_heads=args.heads,
                          head_dim=args.head_dim, vocab_size=args.vocab, **extra)
    torch.manual_seed(0)
    return model_class(config)


def grads_of(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_step(fn, model, ids, optimizer, prefix):
    optimizer.zero_grad(set_to_none=True)
    if prefix:
        T = ids.shape[1]
        with la_compiler.phase(prefill_lengths=[T // 2] * ids.shape[0], sequence_lengths=[T] * ids.shape[0]):
            loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
    else:
        loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return loss


def oracle_grads(family, base, ids):
    """First-step gradients of the fp32 model, independent of the bf16 rows' kernels."""
    model = copy.deepcopy(base).float()
    torch._dynamo.reset()
    if family == "kda":
        fn = model
    else:
        fn = torch.compile(model, backend="laqat", options={"policy": REFERENCE_KERNEL})
    fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return grads_of(model)


def run_row(name, family, base, ids, args, oracle):
    backend, policy, prefix = ROWS[name]
    row = {"model": family, "row": name}
    try:
        torch._dynamo.reset()
        model = copy.deepcopy(base).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        start = len(la_compiler.backend.last_record().graphs)
        if backend is None:
            fn = model
        elif backend == "inductor":
            fn = torch.compile(model)
        else:
            fn = torch.compile(model, backend="laqat", options={"policy": policy} if policy else None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = run_step(fn, model, ids, optimizer, prefix)
        torch.cuda.synchronize()
        row["first_step_s"] = round(time.perf_counter() - t0, 2)
        row["loss"] = round(loss.item(), 5)
        if oracle is not None and (policy is None or name.startswith("laqat exact")) and backend != "inductor":
            row["grad_rel_max"] = max(rel_l2(grads_of(model)[n], g) for n, g in oracle.items())
        optimizer.step()
        if backend == "laqat":
            matches = [m for g in la_compiler.backend.last_record().graphs[start:] for m in g.matches]
            row["nodes"] = len(matches)
            row["kernels"] = ",".join(sorted({m.kernel for m in matches}))
            row["graphs"] = len(la_compiler.backend.last_record().graphs) - start
        for _ in range(args.warmup):
            run_step(fn, model, ids, optimizer, prefix)
            optimizer.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run_step(fn, model, ids, optimizer, prefix)
            optimizer.step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        row["step_ms"] = round(statistics.median(times), 2)
        row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    except Exception as e:  # a failing row is a result to report
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["where"] = traceback.format_exc().strip().splitlines()[-3:]
    print(json.dumps(row), flush=True)
    return row


def print_table(rows):
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    header = f"{'model':5} {'row':32} {'step ms':>8} {'x eager':>8} {'peak MiB':>9} {'1st s':>7} {'loss':>9} " \
             f"{'grad rel':>9}  kernels"
    print(header)
    for model, group in by_model.items():
        eager = next((r.get("step_ms") for r in group if r["row"] == "eager FLA"), None)
        for r in group:
            if "error" in r:
                print(f"{model:5} {r['row']:32} error: {r['error'][:120]}")
                continue
            ratio = f"{r['step_ms'] / eager:.2f}" if eager else "-"
            grad = f"{r['grad_rel_max']:.2e}" if "grad_rel_max" in r else "-"
            print(f"{model:5} {r['row']:32} {r['step_ms']:8.2f} {ratio:>8} {r['peak_mib']:9d} {r['first_step_s']:7.1f} "
                  f"{r['loss']:9.4f} {grad:>9}  {r.get('kernels', '')} {r.get('nodes', '')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=["kda", "gdn"], choices=["kda", "gdn"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows of: " + ", ".join(ROWS))
    parser.add_argument("--no-oracle", action="store_true", help="skip the fp32 gradient oracle")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown --rows {unknown}; known: {list(ROWS)}")

    out, result = start_cuda_run("model_bench.py", "rows")
    result["shape"] = vars(args)
    for family in args.family:
        base = build_model(family, args).cuda()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
        oracle = None
        if not args.no_oracle:
            try:
                oracle = oracle_grads(family, base, ids)
            except Exception as e:
                result["rows"].append({"model": family, "row": "fp32 oracle", "error": f"{type(e).__name__}: {e}"[:400]})
        for name in rows:
            result["rows"].append(run_row(name, family, base, ids, args, oracle))
            (out / "model_bench.json").write_text(json.dumps(result, indent=1))
        del base, oracle
        torch.cuda.empty_cache()
    print_table(result["rows"])


if __name__ == "__main__":
    main()
