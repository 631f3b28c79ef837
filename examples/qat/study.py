"""The quality study: what each serving policy costs a small GDN + KDA model, and how much QAT and QAD recover.

    python examples/qat/study.py --smoke --out out/qat-smoke                     # the whole pipeline on the CPU
    python examples/qat/study.py --stage pretrain --out $OUT                     # H200, command 1
    python examples/qat/study.py --stage finetune --from $OUT/pretrained.pt --out $OUT   # H200, command 2
    python examples/qat/study.py --out $OUT                                      # both stages in one process
    python examples/qat/study.py --preset state-cache --out $OUT                 # the state formats, 114M GDN LM
    python examples/qat/study.py --merge A/study.json B/study.json --out C        # commands on one checkpoint

1. pretrain: the model (la_compiler.tiny_models.TinyHybridLM: FLA GatedDeltaNet / KimiDeltaAttention blocks)
   learns the standard library's source with exact numerics, compiled with laqat's backend, for
   --pretrain-steps or --pretrain-budget-s, whichever ends first; pretrained.pt keeps the weights.
2. finetune: held-out NLL of the pretrained model under exact numerics and under each policy; a control per
   seed (exact training for --finetune-steps, evaluated under every policy); per policy, mode and seed a QAT or
   QAD run of the same steps on the same batches; the table (report.py), study.json, study.md, runs.jsonl,
   curves.png. Runs that would not finish inside --budget-s are skipped and listed, never cut short.

Every model instance is compiled once per process, one per policy: weights move between runs with
load_state_dict (in place), so Dynamo never recompiles (the smoke checks Dynamo's graph count). The pretrain
stage also compiles every policy at the study's shapes in --warm-processes background processes, so that a
second command with the compile caches carried over (examples/qat/gpu_study.sh) starts warm.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import train as qat  # examples/qat/train.py: sets TRITON_INTERPRET on the CPU before laqat loads
import torch
from checkpoint import read_checkpoint, restore_weights, save_checkpoint, weights_of
from corpus import SOURCES, eval_batches, load_corpus, train_batch
from metrics import MetricsLog, read_records
from plot import plot_curves, plot_spans
from report import markdown, rows, span_differences

POLICIES = ("state_fp8", "decode_token_state_fp8", "state_int8_block32", "state_int8_hadamard32",
            "prefill_operands_fp8", "prefill_operands_nvfp4")
STATE_POLICIES = ("decode_state_fp8_tile64", "decode_state_int8_block32", "decode_state_int8_head",
                  "decode_state_int8_hadamard32", "decode_cache_bf16", "decode_cache_fp16")
POLICY_DIR = Path(__file__).resolve().parent / "policies"  # the study's own policies: <name>.yaml
MODES = ("qat", "qad")

GPU_DEFAULTS = dict(hidden=384, heads=6, head_dim=64, layers="gdn,kda,gdn,kda", seq_len=512, batch_size=32,
                    eval_sequences=512, pretrain_steps=8000, pretrain_lr=2e-3, pretrain_warmup=200,
                    pretrain_budget_s=200.0, finetune_steps=200, finetune_lr=3e-4, finetune_warmup=20,
                    seeds="0,1", policies=",".join(POLICIES), modes="qat,qad", budget_s=460.0, warm_processes=3)
HELP = {"pretrain_budget_s": "pretraining ends inside this many seconds (its compile included)",
        "budget_s": "wall seconds from the start of the process: runs that would end later are skipped",
        "warm_processes": "pretrain stage on CUDA: processes compiling every policy in the background",
        "seeds": "comma-separated; a seed chooses the fine-tuning batches", "policies": "comma-separated recipes",
        "modes": "comma-separated: qat, qad", "layers": "comma-separated: gdn, kda"}
# The state-cache study (docs/qat-study.md, "State caches over a long decode"): a ~113M-parameter GDN LM on English
# prose, 2048-byte windows decoded from the state over their second half, one policy per state format.
STATE_CACHE = dict(hidden=1024, heads=8, head_dim=128, layers="gdn*12", seq_len=2048, batch_size=16,
                   eval_sequences=128, pretrain_steps=1000, pretrain_lr=1e-3, pretrain_warmup=100,
                   pretrain_budget_s=240.0, finetune_steps=60, finetune_lr=2e-4, finetune_warmup=6, seeds="0",
                   policies=",".join(STATE_POLICIES), modes="qat,qad", budget_s=540.0, warm_processes=3,
                   corpus="prose")
PRESETS = {"policies": {}, "state-cache": STATE_CACHE}
SMOKE = dict(hidden=32, heads=2, head_dim=8, layers="gdn,kda", seq_len=32, batch_size=2, eval_sequences=4,
             pretrain_steps=8, pretrain_lr=3e-3, pretrain_warmup=2, pretrain_budget_s=None, finetune_steps=4,
             finetune_lr=3e-3, finetune_warmup=1, seeds="0,1", policies="decode_token_state_fp8", modes="qat,qad",
             budget_s=None, warm_processes=0, compiler="eager", kernel_family="torch", device="cpu")


STARTED = time.perf_counter()  # --budget-s counts from the start of the process (the command)


class StudyError(ValueError):
    """A study argument that cannot work; the message names the flag."""


# ---- arguments ----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stage", default="all", choices=("all", "pretrain", "finetune", "warm"))
    p.add_argument("--smoke", action="store_true", help="the CPU pipeline: tiny model, a few steps, checks")
    p.add_argument("--from", dest="pretrained", default=None, help="finetune: the pretrain stage's checkpoint")
    p.add_argument("--out", default=os.environ.get("OUT", "out/qat-study"))
    p.add_argument("--preset", default="policies", choices=tuple(PRESETS),
                   help="policies: the serving recipes on the small hybrid model (the defaults below); state-cache: "
                        "the state formats over a long decode on a ~113M GDN LM (flags given still win)")
    p.add_argument("--corpus", default=None, choices=SOURCES, help="default stdlib (state-cache: prose)")
    p.add_argument("--corpus-dir", default=None,
                   help="prose: the folder holding examples/qat/prose.py's tarballs (default: fetched into the cache)")
    for name, value in GPU_DEFAULTS.items():
        kind = type(value) if value is not None else float
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=" ".join(filter(None, [HELP.get(name), f"(default {value})"])))
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--kd-lm-weight", type=float, default=0.0)
    p.add_argument("--prefill-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0, help="pretraining: initialisation and batches")
    p.add_argument("--compiler", default=None, choices=qat.COMPILERS, help="default inductor")
    p.add_argument("--kernel-family", default=None, choices=qat.KERNEL_FAMILIES,
                   help="default auto on CUDA, torch on the CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=qat.DTYPES, help="auto: bfloat16 on CUDA, float32 elsewhere")
    args = p.parse_args(argv)
    defaults = {**GPU_DEFAULTS, "compiler": "inductor", "kernel_family": None, "device": None, "corpus": "stdlib",
                **PRESETS[args.preset]}
    if args.smoke:
        defaults.update(SMOKE)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.kernel_family = args.kernel_family or ("auto" if args.device == "cuda" else "torch")
    args.seed_list = [int(s) for s in str(args.seeds).split(",") if s != ""]
    args.policy_list = [p for p in str(args.policies).split(",") if p]
    args.mode_list = [m for m in str(args.modes).split(",") if m]
    _check(args)
    return args


def _check(args) -> None:
    from la_compiler.recipes import recipe_names

    unknown = [p for p in args.policy_list if policy_source(p) is None]
    if unknown or not args.policy_list:
        raise StudyError(f"--policies: {unknown or 'none given'}: choose from the recipes "
                         f"{[r for r in recipe_names() if r != 'exact']} and the study's "
                         f"{sorted(f.stem for f in POLICY_DIR.glob('*.yaml'))} (exact is always evaluated)")
    bad_modes = [m for m in args.mode_list if m not in MODES]
    if bad_modes:
        raise StudyError(f"--modes: {bad_modes} are not modes; choose from {MODES}")
    if not args.seed_list:
        raise StudyError("--seeds: give at least one seed, e.g. --seeds 0,1")
    if args.stage == "finetune" and not args.pretrained:
        raise StudyError("--from: the finetune stage starts from the pretrain stage's checkpoint (pretrained.pt)")
    if args.smoke and args.stage != "all":
        raise StudyError("--smoke runs every stage: leave --stage out")


def policy_source(name: str):
    """A recipe's name as it is, a study policy's file (examples/qat/policies/<name>.yaml), else None."""
    from la_compiler.recipes import recipe_names

    if name in recipe_names() and name != "exact":
        return name
    path = POLICY_DIR / f"{name}.yaml"
    return str(path) if path.is_file() else None


def train_config(args, *, stage: str, seed: int, mode: str = "qat", **overrides) -> qat.TrainConfig:
    pre = stage == "pretrain"
    return qat.TrainConfig(
        mode=mode, steps=args.pretrain_steps if pre else args.finetune_steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.pretrain_lr if pre else args.finetune_lr,
        warmup_steps=args.pretrain_warmup if pre else args.finetune_warmup, seed=seed,
        kd_temperature=args.kd_temperature, kd_lm_weight=args.kd_lm_weight, prefill_fraction=args.prefill_fraction,
        budget_s=args.pretrain_budget_s if pre else None,
        log_every=max(1, (args.pretrain_steps if pre else args.finetune_steps) // (20 if pre else 4)), **overrides)


def environment(args) -> dict:
    import triton

    try:
        import fla

        fla_version = getattr(fla, "__version__", "unknown")
    except ImportError:
        fla_version = None
    commit = os.environ.get("LAQAT_COMMIT")
    if not commit:
        try:  # a copied tree (a GPU machine) may have no .git, or no git
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or None
        except OSError:
            commit = None
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
            "python": sys.version.split()[0], "commit": commit, "compiler": args.compiler,
            "kernel_family": args.kernel_family}


# ---- models: one compiled instance per policy ---------------------------------------------------

class Zoo:
    """One model instance per policy, each compiled once; weights are copied in, never re-compiled."""

    def __init__(self, args, model_config: dict):
        self.args, self.model_config = args, model_config
        self.instances: dict[str, qat.CompiledModel] = {}

    def get(self, policy: str) -> qat.CompiledModel:
        if policy not in self.instances:
            model = qat.build_model(self.model_config, self.args.device, qat.model_dtype(self.args.dtype,
                                                                                         self.args.device))
            self.instances[policy] = qat.CompiledModel(model, "exact" if policy == "exact" else policy_source(policy),
                                                       compiler=self.args.compiler,
                                                       kernel_family=self.args.kernel_family)
        return self.instances[policy]


def scoring_of(instance: qat.CompiledModel) -> str:
    return "suffix" if instance.decode else "full"


# ---- stage 1: pretrain --------------------------------------------------------------------------

def pretrain(args, corpus, zoo: Zoo, out: Path) -> dict:
    torch.manual_seed(args.seed)
    model_config = zoo.model_config
    exact = zoo.get("exact")
    cfg = train_config(args, stage="pretrain", seed=args.seed, eval_every=max(1, args.pretrain_steps // 4))
    held_out = eval_batches(corpus, args.eval_sequences, args.seq_len, args.batch_size)
    warmers = start_warm_processes(args, out)
    began = time.perf_counter()
    log = MetricsLog(out / "pretrain.jsonl", "pretrain")
    result = qat.train(exact, corpus, cfg, batches=held_out, log=log, label="pretrain")
    seconds = time.perf_counter() - began
    summary = {"steps": result.steps, "planned_steps": result.planned_steps, "seconds": seconds,
               "first_step_seconds": result.step_seconds[0], "seconds_per_step": result.seconds_per_step,
               "tokens": result.steps * args.batch_size * args.seq_len, "nll": result.final.nll,
               "ppl": result.final.ppl,
               "parameters": sum(p.numel() for p in exact.model.parameters() if p.requires_grad),
               "dtype": str(qat.model_dtype(args.dtype, args.device)), "train_config": dataclasses.asdict(cfg)}
    save_checkpoint(out / "pretrained.pt", exact.model, step=result.steps, train_config=dataclasses.asdict(cfg),
                    model_config=model_config, extra={"pretrain": summary})
    summary["warm"] = finish_warm_processes(warmers)
    plot_curves(log.records, out / "pretrain.png", title="pretraining, exact numerics")
    (out / "pretrain.json").write_text(json.dumps({"environment": environment(args), "corpus": corpus.describe(),
                                                   "model_config": model_config, "pretrain": summary}, indent=1))
    print(f"pretrained: {result.steps} steps ({result.planned_steps} planned) in {seconds:.0f} s, "
          f"{1e3 * result.seconds_per_step:.1f} ms a step, held-out NLL {result.final.nll:.4f} "
          f"(PPL {result.final.ppl:.3f}); {out / 'pretrained.pt'}", flush=True)
    return summary


def start_warm_processes(args, out: Path) -> list:
    """Background processes that compile every policy at the study's shapes (one training step each), filling
    the compile caches for the finetune command while this process pretrains."""
    if args.warm_processes <= 0 or args.device != "cuda":
        return []
    groups = [args.policy_list[i::args.warm_processes] for i in range(args.warm_processes)]
    procs = []
    for i, group in enumerate(g for g in groups if g):
        command = [sys.executable, __file__, "--stage", "warm", "--policies", ",".join(group),
                   *size_flags(args)]
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "4"}  # leave cores to the pretraining process
        log = open(out / f"warm{i}.log", "w")
        procs.append((group, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env),
                      time.perf_counter(), log))
    print(f"compiling {args.policy_list} in {len(procs)} background processes", flush=True)
    return procs


def finish_warm_processes(procs, timeout_s: float = 150.0) -> list[dict]:
    done = []
    deadline = time.perf_counter() + timeout_s
    for group, proc, started, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        done.append({"policies": group, "returncode": proc.returncode,
                     "seconds": time.perf_counter() - started})
    for d in done:
        print(f"warm {d['policies']}: exit {d['returncode']} after {d['seconds']:.0f} s", flush=True)
    return done


def size_flags(args) -> list[str]:
    names = ("hidden", "heads", "head_dim", "layers", "seq_len", "batch_size", "eval_sequences", "compiler",
             "kernel_family", "device", "dtype", "prefill_fraction", "corpus", "corpus_dir")
    return [x for n in names if getattr(args, n) is not None for x in ("--" + n.replace("_", "-"), str(getattr(args, n)))]


def warm(args, corpus) -> None:
    zoo = Zoo(args, qat.model_config_of(args))
    for policy in args.policy_list:
        began = time.perf_counter()
        instance = zoo.get(policy)
        cfg = dataclasses.replace(train_config(args, stage="finetune", seed=0), steps=1)
        qat.train(instance, corpus, cfg, batches=eval_batches(corpus, args.batch_size, args.seq_len,
                                                              args.batch_size), label=f"warm {policy}")
        print(f"warm {policy}: {time.perf_counter() - began:.1f} s", flush=True)


# ---- stage 2: finetune --------------------------------------------------------------------------

class Study:
    def __init__(self, args, corpus, zoo: Zoo, state: dict, out: Path):
        self.args, self.corpus, self.out, self.zoo = args, corpus, out, zoo
        self.exact = self.zoo.get("exact")
        restore_weights(self.exact.model, state, expected_policy="exact")
        self.base = {k: v.detach().clone() for k, v in weights_of(self.exact.model).items()}
        self.held_out = eval_batches(corpus, args.eval_sequences, args.seq_len, args.batch_size)
        self.prefill = None
        self.evals: list[dict] = []
        self.runs: list[dict] = []
        self.skipped: list[dict] = []
        self.pretrain = state["extra"].get("pretrain")
        self.log_path = out / "runs.jsonl"
        if self.log_path.exists():
            self.log_path.unlink()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - STARTED

    def record(self, result: qat.EvalResult, *, model: str, under: str, scoring: str, seed=None,
               trained_under=None) -> dict:
        entry = {"model": model, "under": under, "scoring": scoring, "seed": seed, "trained_under": trained_under,
                 **result.to_dict()}
        self.evals.append(entry)
        return entry

    def evaluate_under(self, policy: str, weights: dict, *, model: str, seed=None, trained_under=None) -> None:
        """``weights`` evaluated under ``policy`` (exact: on the full windows and on the decode suffix)."""
        instance = self.zoo.get(policy)
        instance.load_weights(weights)
        if policy == "exact":
            self.record(qat.evaluate(instance, self.held_out), model=model, under="exact", scoring="full",
                        seed=seed, trained_under=trained_under)
            if self.prefill is not None:
                self.record(qat.evaluate(instance, self.held_out, start=self.prefill), model=model, under="exact",
                            scoring="suffix", seed=seed, trained_under=trained_under)
            return
        prefill = instance.prefill_tokens(self.args.seq_len, self.args.prefill_fraction)
        self.record(qat.evaluate(instance, self.held_out, prefill), model=model, under=policy,
                    scoring=scoring_of(instance), seed=seed, trained_under=trained_under)

    def before(self) -> None:
        """The pretrained model under exact numerics and under every policy (this compiles every instance)."""
        for policy in self.args.policy_list:
            instance = self.zoo.get(policy)
            if instance.decode:
                self.prefill = instance.prefill_tokens(self.args.seq_len, self.args.prefill_fraction)
        for policy in ["exact", *self.args.policy_list]:
            began = time.perf_counter()
            self.evaluate_under(policy, self.base, model="pretrained")
            print(f"before: {policy}: NLL {self.evals[-1]['nll']:.4f} ({time.perf_counter() - began:.1f} s, "
                  f"the first call compiles)", flush=True)
        self.exact.load_weights(self.base)

    def fits(self, steps_seconds: float, what: str) -> bool:
        budget = self.args.budget_s
        if budget is None or self.elapsed + steps_seconds <= budget:
            return True
        self.skipped.append({"run": what, "needed_s": steps_seconds, "left_s": budget - self.elapsed})
        print(f"skipped {what}: needs ~{steps_seconds:.0f} s, {budget - self.elapsed:.0f} s of the budget left",
              flush=True)
        return False

    def estimate(self, policy: str, mode: str) -> float:
        """Seconds a run will take: its policy's measured step time (QAD: x 1.3 for the teacher where only QAT
        was timed), else twice the control's, plus its evaluations."""
        def per_step(p, m):
            return [r["seconds_per_step"] for r in self.runs if r["policy"] == p and r["mode"] == m]

        known = per_step(policy, mode) or [s * (1.3 if mode == "qad" else 1.0) for s in per_step(policy, "qat")]
        step = known[-1] if known else 2.0 * (per_step("exact", "control") or [0.05])[-1]
        evaluation = len(self.held_out) * step / 2
        return self.args.finetune_steps * step + 3 * evaluation

    def run(self, policy: str, mode: str, seed: int) -> None:
        label = f"{policy}/{mode}/seed{seed}"
        if not self.fits(self.estimate(policy, mode), label):
            return
        instance = self.zoo.get(policy)
        instance.load_weights(self.base)
        cfg = train_config(self.args, stage="finetune", seed=seed, mode="qat" if mode == "control" else mode,
                           eval_every=max(1, self.args.finetune_steps // 2))
        prefill = instance.prefill_tokens(cfg.seq_len, cfg.prefill_fraction)
        first_batch = [train_batch(self.corpus, 1, seed, cfg.batch_size, cfg.seq_len)]
        result = qat.train(instance, self.corpus, cfg, teacher=self.exact if mode == "qad" else None,
                           batches=self.held_out if mode != "control" else None,
                           log=MetricsLog(self.log_path, label), label=label)
        self.runs.append({
            "policy": policy, "mode": mode, "seed": seed, "steps": result.steps,
            "seconds_per_step": result.seconds_per_step, "first_step_seconds": result.step_seconds[0],
            "losses": result.losses, "lm_losses": result.lm_losses,
            "first_batch_lm_loss_after": qat.evaluate(instance, first_batch, prefill).nll})
        if mode == "control":
            weights = {k: v.detach().clone() for k, v in weights_of(instance.model).items()}
            for under in ["exact", *self.args.policy_list]:
                self.evaluate_under(under, weights, model="control", seed=seed, trained_under="exact")
            self.exact.load_weights(self.base)  # the teacher of the QAD runs
        else:
            self.record(result.final, model=mode, under=policy, scoring=scoring_of(instance), seed=seed,
                        trained_under=policy)
        print(f"{label}: {result.steps} steps, {1e3 * result.seconds_per_step:.1f} ms a step"
              + ("" if result.final is None else f", held-out NLL {result.final.nll:.4f}"), flush=True)
        write_results(self.results(), self.out, final=False)  # a command cut short still leaves its table

    def results(self) -> dict:
        decode = [p for p in self.args.policy_list if self.zoo.get(p).decode]
        return {
            "config": {"preset": self.args.preset, "seeds": self.args.seed_list, "policies": self.args.policy_list, "modes": self.args.mode_list,
                       "finetune_steps": self.args.finetune_steps, "finetune_lr": self.args.finetune_lr,
                       "batch_size": self.args.batch_size, "seq_len": self.args.seq_len,
                       "eval_sequences": self.args.eval_sequences, "prefill_fraction": self.args.prefill_fraction,
                       "kd_temperature": self.args.kd_temperature, "kd_lm_weight": self.args.kd_lm_weight,
                       "budget_s": self.args.budget_s, "model_config": self.zoo.model_config},
            "environment": environment(self.args), "corpus": self.corpus.describe(), "pretrain": self.pretrain,
            "decode_policies": decode, "prefill": self.prefill, "evals": self.evals, "runs": self.runs,
            "skipped": self.skipped, "seconds": self.elapsed, "command": " ".join(sys.argv),
            "dynamo_unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "instances": len(self.zoo.instances)}


def finetune(args, corpus, zoo: Zoo, state: dict, out: Path) -> Study:
    study = Study(args, corpus, zoo, state, out)
    study.before()
    for seed in args.seed_list:
        study.run("exact", "control", seed)
    for policy in args.policy_list:
        for mode in args.mode_list:
            for seed in args.seed_list:
                study.run(policy, mode, seed)
    study.summary = study.results()
    write_results(study.summary, out)
    return study


def write_results(results: dict, out: Path, final: bool = True) -> None:
    """study.json and study.md; at the end also the table on stdout and curves.png."""
    (out / "study.json").write_text(json.dumps(results))
    text = markdown(results)
    env = results["environment"]
    head = (f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, FLA {env['fla']}, Python "
            f"{env['python']}, commit {env['commit']}; {results['seconds']:.0f} s from the start of the process"
            + ("" if final else " (in progress)"))
    skipped = "".join(f"\n- skipped (budget): {s['run']}" for s in results["skipped"])
    (out / "study.md").write_text(f"{head}\n\n{text}\n{skipped}\n")
    if not final:
        return
    print(f"\n{head}\n\n{text}{skipped}\n", flush=True)
    records = read_records(out / "runs.jsonl") if (out / "runs.jsonl").exists() else []
    plot_curves(records, out / "curves.png", title="QAT / QAD / control runs")
    plot_positions(results, out / "positions.png")


def plot_positions(results: dict, path: Path):
    """positions.png: the by-position differences of every decode-phase policy (report.span_differences)."""
    by_comparison: dict[str, dict[str, list]] = {}
    starts = None
    for row in rows(results):
        for comparison, values in span_differences(row).items():
            by_comparison.setdefault(comparison, {})[row.policy] = values
            starts = row.exact["span_starts"]
    if starts:
        plot_spans(by_comparison, starts, path, title="NLL differences along the scored positions")


# ---- the smoke run's checks ---------------------------------------------------------------------

def smoke_checks(study: Study) -> None:
    """The pipeline's invariants on the CPU run (tests/examples/test_qat_study.py also checks the exact NLL
    against an eager evaluation of the saved weights)."""
    args, results, out = study.args, study.summary, study.out
    for name in ("pretrained.pt", "pretrain.json", "pretrain.jsonl", "study.json", "study.md", "runs.jsonl"):
        assert (out / name).is_file(), f"the smoke run wrote no {name}"
    nlls = [e["nll"] for e in results["evals"]] + [x for e in results["evals"] for x in e["per_sequence"]]
    assert nlls and all(math.isfinite(x) for x in nlls), "a held-out NLL is not finite"
    expected = 1 + len(args.policy_list)  # exact + one instance per policy, each traced once
    assert results["instances"] == expected and results["dynamo_unique_graphs"] == expected, (
        f"{results['dynamo_unique_graphs']} graphs compiled for {expected} instances: a recompile")
    for run in results["runs"]:
        first = run["lm_losses"][0]
        assert run["mode"] != "qat" or run["first_batch_lm_loss_after"] < first, (
            f"{run['policy']}/qat/seed{run['seed']}: the first batch's loss went {first} -> "
            f"{run['first_batch_lm_loss_after']}")
    assert all(r.qat and r.qad and r.control and r.before for r in rows(results)), "a run of the table is missing"
    check_resume(study)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == expected, "resuming recompiled"
    print("smoke checks passed: files, finite NLLs, one compile per policy, QAT lowers the loss, resume", flush=True)


def check_resume(study: Study) -> None:
    """A QAT run interrupted halfway and resumed from its checkpoint logs what the uninterrupted run logged."""
    args = study.args
    policy, seed = args.policy_list[0], args.seed_list[0]
    whole = next(r for r in study.runs if (r["policy"], r["mode"], r["seed"]) == (policy, "qat", seed))
    instance = study.zoo.get(policy)
    instance.load_weights(study.base)
    cfg = train_config(args, stage="finetune", seed=seed, eval_every=max(1, args.finetune_steps // 2))
    half = args.finetune_steps // 2
    path = study.out / "resume-check.pt"
    qat.train(instance, study.corpus, cfg, checkpoint_path=path, stop_at=half, label="resume-check")
    state = read_checkpoint(path)
    assert state["step"] == half and qat.la_compiler.policy_of(state["model"]) == instance.policy
    instance.load_weights({k: torch.zeros_like(v) for k, v in weights_of(instance.model).items()})
    restore_weights(instance.model, state, expected_policy=instance.policy)
    rest = qat.train(instance, study.corpus, cfg, resume_state=state, label="resume-check")
    assert rest.losses == whole["losses"][half:], (rest.losses, whole["losses"][half:])
    path.unlink()


def merge_command(paths: list[str], out: Path) -> None:
    """``study.py --merge A/study.json B/study.json --out C``: one table from commands that fine-tuned the same
    checkpoint (report.merge), written as a study's files (study.json, study.md, positions.png)."""
    from report import merge

    results = merge(*(json.loads(Path(p).read_text()) for p in paths))
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(results))
    env = results["environment"]
    head = (f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, FLA {env['fla']}, Python "
            f"{env['python']}, commit {env['commit']}; {len(paths)} commands, {results['seconds']:.0f} s")
    skipped = "".join(f"\n- skipped (budget): {s['run']}" for s in results["skipped"])
    (out / "study.md").write_text(f"{head}\n\n{markdown(results)}\n{skipped}\n")
    plot_positions(results, out / "positions.png")
    print((out / "study.md").read_text())


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["--merge"]:
        rest = sys.argv[2:]
        if len(rest) < 3 or rest[-2] != "--out":
            raise StudyError("--merge: write study.py --merge A/study.json B/study.json ... --out FOLDER")
        return merge_command(rest[:-2], Path(rest[-1]))
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    qat.prepare_dynamo()
    corpus = load_corpus(source=args.corpus, root=args.corpus_dir).to(args.device)
    print(f"corpus: {corpus.describe()}", flush=True)
    if args.stage == "warm":
        return warm(args, corpus)
    zoo = Zoo(args, qat.model_config_of(args))
    if args.stage in ("all", "pretrain"):
        pretrain(args, corpus, zoo, out)
    if args.stage in ("all", "finetune"):
        state = read_checkpoint(args.pretrained or out / "pretrained.pt")
        if state["model_config"] != zoo.model_config:
            zoo = Zoo(args, state["model_config"])  # the checkpoint's size, not the flags'
        study = finetune(args, corpus, zoo, state, out)
        if args.smoke:
            smoke_checks(study)


if __name__ == "__main__":
    try:
        main()
    except (StudyError, *qat.USER_ERRORS) as e:
        sys.exit(f"study.py: {type(e).__name__}: {e}")
