"""One training step of FLA's causal LMs on CUDA, all rows in one process, timed interleaved: the user's path.

    python examples/benchmarks/model_bench.py --family kda gdn [--layers 4 --hidden 1024 --heads 8
        --head-dim 128 --batch 2 --seq 4096 --vocab 32000] [--rows "eager FLA,laqat exact,..."]
        [--rounds 10] [--warmup 2] [--lift-fla-gdn-guard] [--budget-s 500] [--no-oracle]
    python examples/benchmarks/model_bench.py --list     # each family's rows, policies and kernels; no GPU needed
    python examples/benchmarks/model_bench.py --smoke --rows "laqat exact,laqat state_fp8"   # tiny, on the CPU

Rows: ``eager FLA`` (the uncompiled model), ``torch.compile (Inductor)``, and ``torch.compile(model,
backend="laqat")`` with the default options (Inductor hand-off) under every shipped recipe
(la_compiler/recipes/*.yaml; ``laqat exact`` is the ``exact`` recipe) that applies to the family, plus ``laqat exact
(laqat chunk kernels)``; where ``--rows`` names them, the hand-off settings ``laqat exact (whole graph)``
(``options={"regional": False}``) and ``laqat exact (1 layer per piece)`` (``{"regional": 1}``). A recipe with a
decode phase (``decode_token_state_fp8``, the serving profiles ``vllm_gdn_state_bf16`` for GDN and
``vllm_kda_state_bf16`` for KDA) runs inside ``la_compiler.phase(...)`` with the first half of every sequence its
prefix. A recipe the family refuses (a serving profile of the other kind) is
no row of that family. FLA's ``KDAForCausalLM`` / ``GatedDeltaNetForCausalLM`` with FLA's default fusions, bf16.

Method, per family (one process holds all its rows):

1. build: for each row a fresh bf16 copy of the same weights, AdamW, the compile; the first step (its wall time,
   compiles included), then ``--warmup`` steps. Every row's model and optimizer stay on the device; each step's
   graph is freed by its backward.
2. rounds: ``--rounds`` rounds of one training step (forward with labels, backward, AdamW) of every row, in a
   rotating order (round r starts at row r mod n), each step alone on the device (synchronised before and after,
   CUDA events around it, the peak-memory counter reset before it).

Reported per row (``$OUT/model_bench.json``, a table):

- ``step_ms``: the median step over the rounds (``step_ms_rounds`` all of them); ``x_eager``: its ratio to the
  ``eager FLA`` row of the same process, ``x_laqat_exact`` to ``laqat exact``'s;
- ``peak_extra_mib``: the largest over the rounds of the step's peak allocation above what was allocated before
  it (every row's weights and optimizer state and the other rows' gradients are in that baseline; the row's own
  gradients, freed before the step, and its activations are not);
- ``first_step_peak_extra_mib``: the first step's peak allocation above what was allocated before it; unlike the
  rounds' figure it holds the row's gradients and AdamW's state, both created in that step, and whatever the
  step's compiles and searches allocate on the device (FLA's searches, laqat's FLA backward compile-ahead);
- ``first_step_s`` (Dynamo, laqat, Inductor and Triton compiles included), ``compile_s`` (the seconds of each of
  torch's timed compile phases during the first step: ``torch._dynamo.utils.compilation_time_metrics``, Dynamo's
  and Inductor's nested ones; what the first step spends beyond them is run-time compiling and autotuning of the
  Triton kernels, laqat's and FLA's), ``laqat_pass_s`` (laqat's passes, per pass), ``warmup_ms``, ``loss`` (the first
  step's), ``nodes`` / ``kernels`` / ``graphs`` (laqat's rewritten sites, their kernels, the graphs it compiled),
  ``compiles_in_rounds`` (Dynamo graphs compiled during the rounds: 0 unless a guard failed);
- for exact rows (unless ``--no-oracle``), ``grad_rel_max``: the largest relative L2 distance of a first-step
  parameter gradient from an fp32 oracle: eager FLA in fp32 for KDA; for GDN (FLA's chunk backward refuses some
  GPU/Triton pairs) the same fp32 model compiled with laqat's fp64 torch reference kernel.

A row that fails reports its error and the table goes on. ``--lift-fla-gdn-guard``: GDN's eager FLA and Inductor
rows run FLA's chunk backward past its Hopper guard (Triton >= 3.4, < 3.7.1), timing only (wrong gradients, real
time). ``--budget-s``: rows not built by 70 % of it are skipped, and the rounds are cut to what the rest allows.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

from bench_common import (Marks, ensure_la_compiler, fla_gdn_blocker, fla_gdn_guard_lifted, rel_l2,  # noqa: E402
                          start_cuda_run, sync)

ensure_la_compiler()

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402
from la_compiler.options import fla_compile_ahead  # noqa: E402
from la_compiler.policy.file_format import PolicyError  # noqa: E402
from la_compiler.policy.resolution import load_policy  # noqa: E402
from la_compiler.recipes import recipe_names  # noqa: E402

MODULE = "model.layers.0.attn"  # how FLA's causal LMs name a layer's attention (policies match it)
CHUNK_EXACT = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "chunk"}}]}
BASE_ROWS = {  # row -> (compile backend or None, policy)
    "eager FLA": (None, None),
    "torch.compile (Inductor)": ("inductor", None),
    "laqat exact": ("laqat", "exact"),
    "laqat exact (laqat chunk kernels)": ("laqat", CHUNK_EXACT),
    "laqat exact (whole graph)": ("laqat", "exact"),
    "laqat exact (1 layer per piece)": ("laqat", "exact"),
}
ROW_OPTIONS = {"laqat exact (whole graph)": {"regional": False},  # laqat options beside the policy
               "laqat exact (1 layer per piece)": {"regional": 1}}
# the shipped recipes in table order; a recipe added to la_compiler/recipes/ later becomes a row after these
RECIPE_ORDER = ("state_fp8", "state_int8_block32", "state_int8_hadamard32", "w_fp8", "prefill_operands_fp8",
                "prefill_operands_nvfp4", "decode_token_state_fp8", "vllm_gdn_state_bf16", "vllm_kda_state_bf16")


def recipe_rows() -> dict:
    names = recipe_names()
    ordered = [n for n in RECIPE_ORDER if n in names] + [n for n in names if n not in RECIPE_ORDER and n != "exact"]
    return {f"laqat {n}": ("laqat", n) for n in ordered}


ROWS = {**BASE_ROWS, **recipe_rows()}
ONLY = {"laqat vllm_gdn_state_bf16": "gdn", "laqat vllm_kda_state_bf16": "kda"}  # a serving profile of one kind
REFERENCE_KERNEL = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}


def plan(name: str, family: str):
    """(backend, policy, decode-phase prefix?) of a row for a family, or (None, why it is no row of that family)."""
    backend, policy = ROWS[name]
    if ONLY.get(name, family) != family:
        return None, f"{name} is vLLM's {ONLY[name].upper()} serving profile"
    if backend != "laqat":
        return (backend, policy, False), None
    try:
        resolution = load_policy(policy).resolve(MODULE, family)
    except PolicyError as e:
        return None, str(e)
    return (backend, policy, resolution.phase != "none"), None


def expected_kernel(policy, family: str, args) -> str:
    """The variant the selection table gives the row's spec on CUDA in bf16 (FLA's own GPU guards not evaluated)."""
    from la_compiler.kernels.selection import select_kernel
    from la_compiler.ir.spec import RecurrenceSpec

    res = load_policy(policy).resolve(MODULE, family)
    spec = RecurrenceSpec(family, src="fla", quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                          chunk=res.chunk, phase=res.phase, extra=res.extra, numerics=res.numerics)
    try:
        return select_kernel(spec, device="cuda", dtype=torch.bfloat16, head_k=args.head_dim, head_v=args.head_dim,
                             requested=res.backend, family=res.implementation, seq_len=args.seq).variant
    except Exception as e:
        return f"none ({type(e).__name__}: {str(e)[:200]})"


def list_rows(families, names, args) -> None:
    for family in families:
        print(f"{family}:")
        for name in names:
            planned, why = plan(name, family)
            if planned is None:
                print(f"  {name:38} not a row of {family}: {why[:150]}")
                continue
            backend, policy, prefix = planned
            what = backend or "eager"
            if backend == "laqat":
                policy_text = policy if isinstance(policy, str) else json.dumps(policy)
                what += f", policy {policy_text}, kernel {expected_kernel(policy, family, args)}"
            if prefix:
                what += f", decode phase (prefix {args.seq // 2} of {args.seq})"
            print(f"  {name:38} {what}")


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


def raise_recompile_limits() -> None:
    """Every row compiles the same model class (with its own backend): Dynamo keeps one cache entry per row on the
    same code objects, more than its default limit of 8 recompiles."""
    config = torch._dynamo.config
    for names, value in ((("recompile_limit", "cache_size_limit"), 256),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4096)):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None and getattr(config, name) < value:
            setattr(config, name, value)


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Row:
    def __init__(self, name, family, backend, policy, prefix, lift):
        self.name, self.family, self.backend, self.policy, self.prefix, self.lift = (
            name, family, backend, policy, prefix, lift)
        self.record = {"model": family, "row": name}
        if prefix:
            self.record["decode_phase"] = True
        if lift:
            self.record["note"] = f"FLA's GDN chunk backward past its guard, timing only: {lift}"
        self.model = self.optimizer = self.fn = None
        self.times, self.peaks, self.compiles = [], [], 0

    @property
    def ready(self) -> bool:
        return self.fn is not None and "error" not in self.record

    def fail(self, e: BaseException, stage: str) -> None:
        self.record["error"] = f"{stage}: {type(e).__name__}: {str(e)[:400]}"
        self.record["where"] = traceback.format_exc().strip().splitlines()[-3:]
        self.free()

    def free(self) -> None:
        self.model = self.optimizer = self.fn = None

    def step(self, ids) -> torch.Tensor:
        """One training step: forward with labels, backward (which frees the graph), AdamW."""
        B, T = ids.shape
        phase = (la_compiler.phase(prefill_lengths=[T // 2] * B, sequence_lengths=[T] * B) if self.prefix
                 else contextlib.nullcontext())
        with fla_gdn_guard_lifted(bool(self.lift)), phase:
            loss = self.fn(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        self.optimizer.step()
        return loss.detach()


def build(row: Row, base, ids, args, oracle, dtype) -> None:
    """The row's model, optimizer and compile; its first step (timed) and warm-up steps."""
    try:
        row.model = copy.deepcopy(base).to(dtype)
        row.optimizer = torch.optim.AdamW(row.model.parameters(), lr=1e-4)
        start = len(la_compiler.backend.last_record().graphs)
        if row.backend is None:
            row.fn = row.model
        elif row.backend == "inductor":
            row.fn = torch.compile(row.model)
        else:
            options = {"policy": row.policy, **ROW_OPTIONS.get(row.name, {})}
            if args.laqat_compiler:
                options["compiler"] = args.laqat_compiler
            row.fn = torch.compile(row.model, backend="laqat", options=options)
        sync()
        metrics = torch._dynamo.utils.compilation_time_metrics
        counted = {name: len(times) for name, times in metrics.items()}
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        row.optimizer.zero_grad(set_to_none=True)
        loss = row.step(ids)
        sync()
        row.record["first_step_s"] = round(time.perf_counter() - t0, 2)
        if cuda:
            row.record["first_step_peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20)
        row.record["compile_s"] = {name: round(sum(times[counted.get(name, 0):]), 2) for name, times in metrics.items()
                                   if len(times) > counted.get(name, 0)}
        row.record["loss"] = round(loss.item(), 5)
        exact = row.backend is None or row.name.startswith("laqat exact")
        if oracle is not None and exact and row.backend != "inductor" and not row.lift:
            grads = grads_of(row.model)
            row.record["grad_rel_max"] = max(rel_l2(grads[n], g) for n, g in oracle.items())
            del grads
        if row.backend == "laqat":
            matches = [m for g in la_compiler.backend.last_record().graphs[start:] for m in g.matches]
            row.record["nodes"] = len(matches)
            row.record["kernels"] = ",".join(sorted({m.kernel for m in matches}))
            row.record["graphs"] = len(la_compiler.backend.last_record().graphs) - start
            passes: dict = {}
            for g in la_compiler.backend.last_record().graphs[start:]:
                for name, seconds in g.pass_seconds.items():
                    passes[name] = passes.get(name, 0.0) + seconds
            row.record["laqat_pass_s"] = {name: round(seconds, 2) for name, seconds in passes.items()}
        warm = []
        for _ in range(args.warmup):
            row.optimizer.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            row.step(ids)
            sync()
            warm.append(round((time.perf_counter() - t0) * 1000, 2))
        row.record["warmup_ms"] = warm
    except Exception as e:  # a failing row is a result to report
        row.fail(e, "build")


def timed_step(row: Row, ids, cuda: bool) -> None:
    row.optimizer.zero_grad(set_to_none=True)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    graphs = unique_graphs()
    marks = Marks()
    marks.mark()
    row.step(ids)
    marks.mark()
    (ms,) = marks.ms()  # waits for the device
    row.times.append(ms)
    if cuda:
        row.peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
    row.compiles += unique_graphs() - graphs


def finish(rows: list[Row]) -> None:
    """Medians, ratios and memory of the rounds into each row's record."""
    for row in rows:
        if row.times:
            row.record["step_ms"] = round(statistics.median(row.times), 2)
            row.record["step_ms_min"] = round(min(row.times), 2)
            row.record["step_ms_rounds"] = [round(t, 2) for t in row.times]
            row.record["rounds"] = len(row.times)
            row.record["compiles_in_rounds"] = row.compiles
        if row.peaks:
            row.record["peak_extra_mib"] = round(max(row.peaks))
    by_name = {r.name: r.record.get("step_ms") for r in rows}
    for row in rows:
        step = row.record.get("step_ms")
        for key, ref in (("x_eager", by_name.get("eager FLA")), ("x_laqat_exact", by_name.get("laqat exact"))):
            if step is not None and ref:
                row.record[key] = round(step / ref, 3)


def run_family(family, names, args, result, out, dtype, device, t_start) -> None:
    cuda = device == "cuda"
    base = build_model(family, args).to(device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    oracle = None
    if not args.no_oracle:
        try:
            oracle = oracle_grads(family, base, ids)
        except Exception as e:
            result["rows"].append({"model": family, "row": "fp32 oracle", "error": f"{type(e).__name__}: {e}"[:400]})
    torch._dynamo.reset()
    blocker = fla_gdn_blocker() if family == "gdn" and args.lift_fla_gdn_guard else None

    rows = []
    for name in names:
        planned, why = plan(name, family)
        if planned is None:
            result["skipped"].append({"model": family, "row": name, "why": why[:300]})
            print(f"{family} {name}: not a row of this family ({why[:120]})", flush=True)
            continue
        backend, policy, prefix = planned
        rows.append(Row(name, family, backend, policy, prefix, blocker if backend in (None, "inductor") else None))

    def save():
        (out / "model_bench.json").write_text(json.dumps(result, indent=1))

    for row in rows:
        result["rows"].append(row.record)
        if args.budget_s and time.perf_counter() - t_start > 0.7 * args.budget_s:
            row.record["error"] = f"not built: 70 % of --budget-s {args.budget_s} spent before it"
        else:
            build(row, base, ids, args, oracle, dtype)
        print(json.dumps(row.record), flush=True)
        save()
    del oracle
    gc.collect()
    if cuda:
        held = torch.cuda.memory_allocated() / 2**30
        free, total = torch.cuda.mem_get_info()
        result["memory_after_build_gib"][family] = {"allocated": round(held, 2), "device_free": round(free / 2**30, 2),
                                                   "device_total": round(total / 2**30, 2)}
        print(f"{family}: {sum(r.ready for r in rows)} rows built and held at once: {held:.2f} GiB allocated, "
              f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the device", flush=True)

    timed = []
    for row in rows:
        if not row.ready:
            continue
        warm = row.record.get("warmup_ms") or [row.record["first_step_s"] * 1000]
        if warm[-1] > args.max_step_s * 1000:
            note = (f"not in the rounds: its last warm-up step took {warm[-1] / 1000:.1f} s "
                    f"(--max-step-s {args.max_step_s})")
            row.record["note"] = "; ".join(filter(None, (row.record.get("note"), note)))
            row.free()
            continue
        timed.append(row)
    rounds = args.rounds
    if timed and args.budget_s:
        round_s = sum((r.record.get("warmup_ms") or [r.record["first_step_s"] * 1000])[-1] for r in timed) / 1000
        left = args.budget_s - (time.perf_counter() - t_start)
        rounds = max(1, min(args.rounds, int(0.9 * left / max(round_s, 1e-3))))
        if rounds < args.rounds:
            result["rounds_cut"][family] = f"{rounds} of {args.rounds} rounds: --budget-s {args.budget_s}"
            print(f"{family}: {result['rounds_cut'][family]}", flush=True)
    for r in range(rounds if timed else 0):
        start = r % len(timed)
        for row in timed[start:] + timed[:start]:
            if not row.ready:
                continue
            try:
                timed_step(row, ids, cuda)
            except Exception as e:
                row.fail(e, f"round {r}")
        finish(rows)
        save()
    finish(rows)
    for row in rows:
        row.free()
    del base, rows, timed
    gc.collect()
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()


def print_table(rows):
    header = (f"{'model':5} {'row':36} {'step ms':>8} {'x eager':>8} {'x exact':>8} {'extra MiB':>9} {'1st MiB':>8} "
              f"{'1st s':>7} {'loss':>9} {'grad rel':>9}  kernels")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['model']:5} {r['row']:36} error: {r['error'][:140]}")
            continue
        step = f"{r['step_ms']:8.2f}" if "step_ms" in r else f"{'-':>8}"
        ratio = lambda key: f"{r[key]:8.2f}" if key in r else f"{'-':>8}"  # noqa: E731
        extra = f"{r['peak_extra_mib']:9d}" if "peak_extra_mib" in r else f"{'-':>9}"
        first_extra = f"{r['first_step_peak_extra_mib']:8d}" if "first_step_peak_extra_mib" in r else f"{'-':>8}"
        grad = f"{r['grad_rel_max']:.2e}" if "grad_rel_max" in r else "-"
        first = f"{r['first_step_s']:7.1f}" if "first_step_s" in r else f"{'-':>7}"
        loss = f"{r['loss']:9.4f}" if "loss" in r else f"{'-':>9}"
        print(f"{r['model']:5} {r['row']:36} {step} {ratio('x_eager')} {ratio('x_laqat_exact')} {extra} {first_extra} "
              f"{first} {loss} {grad:>9}  {r.get('kernels', '')} {r.get('nodes', '')}"
              + (" [decode phase]" if r.get("decode_phase") else "")
              + (f"  ({r['note']})" if "note" in r else ""))
    for r in rows:
        phases = sorted(r.get("compile_s", {}).items(), key=lambda kv: -kv[1])[:8]
        if phases:
            passes = sum(r.get("laqat_pass_s", {}).values())
            print(f"first step of {r['model']} {r['row']}: {r['first_step_s']} s; compile phases (s): "
                  + ", ".join(f"{name} {seconds}" for name, seconds in phases) + f"; laqat passes {passes:.2f}")


def add_model_shape_arguments(parser) -> None:
    """The model's and the batch's shape: --layers, --hidden, --heads, --head-dim, --batch, --seq, --vocab."""
    for name, default in (("layers", 4), ("hidden", 1024), ("heads", 8), ("head-dim", 128), ("batch", 2),
                          ("seq", 4096), ("vocab", 32000)):
        parser.add_argument(f"--{name}", type=int, default=default)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=["kda", "gdn"], choices=["kda", "gdn"])
    add_model_shape_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per row after its first step")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (one step of every row each)")
    parser.add_argument("--rows", default=",".join(r for r in ROWS if r not in ROW_OPTIONS),
                        help="comma-separated rows of: " + ", ".join(ROWS) + " (default: all but the rows of a "
                             "hand-off setting, " + ", ".join(ROW_OPTIONS) + ")")
    parser.add_argument("--no-oracle", action="store_true", help="skip the fp32 gradient oracle")
    parser.add_argument("--lift-fla-gdn-guard", action="store_true",
                        help="GDN's eager FLA and Inductor rows: FLA's chunk backward past its Hopper guard, timing "
                             "only (wrong gradients, real time)")
    parser.add_argument("--max-step-s", type=float, default=20.0,
                        help="a row whose last warm-up step takes longer stays out of the rounds")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds this call may take: rows not built by 70%% of it are skipped, rounds cut to fit")
    parser.add_argument("--laqat-compiler", choices=["inductor", "eager"], default=None,
                        help="laqat's hand-off (default: laqat's default, Inductor)")
    parser.add_argument("--list", action="store_true",
                        help="print each family's rows, policies and kernels; run nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="without CUDA: a tiny fp32 model on the CPU (Triton's interpreter), 1 warm-up step, 2 "
                             "rounds, laqat's eager hand-off (checks the script, times nothing meaningful)")
    args = parser.parse_args()
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROWS]
    if unknown:
        parser.error(f"unknown --rows {unknown}; known: {list(ROWS)}")
    if args.list:
        list_rows(args.family, names, args)
        return
    cuda = torch.cuda.is_available()
    device, dtype = "cuda", torch.bfloat16
    if args.smoke and not cuda:
        device, dtype = "cpu", torch.float32
        args.layers, args.hidden, args.heads, args.head_dim = 1, 64, 2, 32
        args.batch, args.seq, args.vocab = 1, 128, 128
        args.warmup, args.rounds = 1, 2
        args.laqat_compiler = args.laqat_compiler or "eager"
    raise_recompile_limits()

    t_start = time.perf_counter()
    out, result = start_cuda_run("model_bench.py", "rows", "skipped", cpu_ok=args.smoke)
    result["shape"] = vars(args)
    result["timing"] = "interleaved"
    result["fla_compile_ahead"] = fla_compile_ahead()
    result["memory_after_build_gib"], result["rounds_cut"] = {}, {}
    for family in args.family:
        run_family(family, names, args, result, out, dtype, device, t_start)
        (out / "model_bench.json").write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    print(f"wrote {out / 'model_bench.json'}")


if __name__ == "__main__":
    main()
