"""QAT and QAD of a GDN + KDA language model under a laqat policy, on the Python standard library's source.

    python examples/qat/train.py --policy exact --steps 2000 --out out/pretrain            # from scratch
    python examples/qat/train.py --policy state_fp8 --init out/pretrain/checkpoint.pt --steps 300 --out out/qat
    python examples/qat/train.py --policy state_fp8 --mode qad --init out/pretrain/checkpoint.pt --out out/qad
    python examples/qat/train.py --resume out/qat/checkpoint.pt --steps 600 --out out/qat   # go on training
    python examples/qat/train.py --smoke --policy state_fp8                                 # seconds: a set-up check

- QAT: the language-model loss (next-byte cross-entropy) of the model compiled under the policy.
- QAD: a frozen exact teacher (the starting weights, compiled with exact numerics);
  loss = T^2 KL(teacher || student) at temperature T on the student's logits, plus ``--kd-lm-weight`` times
  the LM loss.
- A policy with a decode mode (``decode_token_state_fp8``) trains decode-phase: each batch runs inside
  ``la_compiler.phase(prefill_lengths=[P])`` with P = ``--prefill-fraction`` x seq_len, forward and backward,
  and every loss (and the held-out NLL) is taken on the suffix positions [P, T), the tokens the serving
  stack decodes from its rounded state.
- The policy is attached to the model (``la_compiler.attach_policy``), so the checkpoint carries it;
  ``--resume`` trains on under the checkpoint's policy.
- ``--out`` receives metrics.jsonl (a record per step and per evaluation), checkpoint.pt and curves.png.

Each model instance is compiled once, under its policy: held-out evaluation runs the training graph (grad
enabled, outputs detached), because ``torch.no_grad`` would compile a second graph; the model therefore
must have no active dropout (it is refused). examples/qat/study.py builds the quality study from these pieces.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # laqat's Triton kernels run in the CPU interpreter

sys.path.insert(0, str(Path(__file__).resolve().parent))

import la_compiler  # noqa: E402
from checkpoint import CheckpointError, read_checkpoint, restore_weights, save_checkpoint  # noqa: E402
from corpus import VOCAB_SIZE, Corpus, CorpusError, eval_batches, load_corpus, train_batch  # noqa: E402
from metrics import MetricsLog, Progress  # noqa: E402
from plot import plot_curves  # noqa: E402

MODES = ("qat", "qad")
KERNEL_FAMILIES = ("auto", "torch")
COMPILERS = ("inductor", "eager")


class TrainConfigError(ValueError):
    """A training argument that is out of range or contradicts another; the message names it."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    mode: str = "qat"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 3e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay from lr to min_lr_ratio * lr at the last step
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0  # the training batches are a function of (seed, step)
    kd_temperature: float = 1.0
    kd_lm_weight: float = 0.0  # QAD: loss = KD + kd_lm_weight * LM
    prefill_fraction: float = 0.5  # decode-phase policies: the prefix is this fraction of seq_len
    eval_every: int = 0  # 0: evaluate at the end only
    checkpoint_every: int = 0  # 0: at the end only (when a checkpoint path is given)
    log_every: int = 10  # plain progress lines (where no tqdm bar is shown)
    budget_s: float | None = None  # shrink the schedule, once, so that the run ends inside this wall time

    def __post_init__(self):
        if self.mode not in MODES:
            raise TrainConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("steps", "batch_size", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise TrainConfigError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise TrainConfigError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise TrainConfigError(f"seq_len must be an int >= 2, got {self.seq_len!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise TrainConfigError(f"lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr!r}, {self.min_lr_ratio!r}")
        if not 0 < self.prefill_fraction < 1:
            raise TrainConfigError(f"prefill_fraction must be in (0, 1), got {self.prefill_fraction!r}")
        if not self.kd_temperature > 0 or self.kd_lm_weight < 0:
            raise TrainConfigError(f"kd_temperature must be > 0 and kd_lm_weight >= 0, got "
                                   f"{self.kd_temperature!r}, {self.kd_lm_weight!r}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise TrainConfigError(f"budget_s must be > 0 seconds, got {self.budget_s!r}")


# ---- the model under a policy -------------------------------------------------------------------

def prepare_dynamo(recompile_limit: int = 64) -> None:
    """Before the first compile. einops caches a backend per tensor type on first use, and Dynamo guards on
    that cache's size: FLA's layers hand einops a Parameter during the first trace, which adds an entry and
    makes the second call recompile. Registering both types now keeps the first graph valid. Every policy's
    instance is one cache entry of the same forward: raise Dynamo's limit of 8 entries per frame."""
    import einops

    einops.rearrange(torch.zeros(1, 1), "a b -> b a")
    einops.rearrange(torch.nn.Parameter(torch.zeros(1, 1)), "a b -> b a")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, recompile_limit)


def is_decode_policy(policy) -> bool:
    return any(rule.cfg.decode.mode != "none" for rule in la_compiler.load_policy(policy).linear_attention)


def with_kernel_family(policy, family: str):
    """``policy`` with every module restricted to one kernel family (``solve`` / ``decode`` ``implementation``):
    the same numerics, other kernels. ``torch`` selects laqat's fp64 torch references, which run on the CPU in
    milliseconds where the Triton interpreter takes seconds a call."""
    if family not in KERNEL_FAMILIES:
        raise TrainConfigError(f"kernel_family must be one of {KERNEL_FAMILIES}, got {family!r}")
    policy = la_compiler.load_policy(policy)
    if family == "auto":
        return policy
    config = policy.to_dict()
    rules = config["linear_attention"]
    for rule in rules:
        rule["cfg"].setdefault("solve", {})["implementation"] = family
        if rule["cfg"].get("decode", {}).get("mode", "none") != "none":
            rule["cfg"]["decode"]["implementation"] = family
    # modules no rule matches get the family from a first catch-all rule (a later match replaces it whole)
    config["linear_attention"] = [{"module_name": "*", "cfg": {"solve": {"implementation": family}}}] + rules
    return la_compiler.Policy.from_dict(config)


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits  # transformers / FLA model outputs


def check_no_dropout(model: torch.nn.Module) -> None:
    active = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
              and m.p > 0]
    if active:
        raise TrainConfigError(f"model: dropout is active in {active[:3]}: held-out evaluation runs the training "
                               f"graph (one compile per policy), which would drop units; set dropout to 0")


class CompiledModel:
    """One model instance with a policy attached, compiled once (``fullgraph``, laqat backend). Weights are
    copied in with ``load_weights`` (in place), so Dynamo keeps the compiled graph."""

    def __init__(self, model: torch.nn.Module, policy, *, compiler: str = "inductor", kernel_family: str = "auto"):
        if compiler not in COMPILERS:
            raise TrainConfigError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        check_no_dropout(model)
        self.model = la_compiler.attach_policy(model.train(), policy)
        self.policy = la_compiler.policy_of(model)
        self.decode = is_decode_policy(self.policy)
        # The policy goes in as an option too, although the backend would find the attached one: Dynamo tells
        # compiles apart by their options, and with equal options it would reuse one instance's graph for the
        # next instance of the class (laqat then refuses to run it under another policy).
        options = {"compiler": compiler, "policy": with_kernel_family(self.policy, kernel_family)}
        self.forward = torch.compile(model, backend="laqat", fullgraph=True, options=options)

    @property
    def name(self) -> str:
        return self.policy.name

    def prefill_tokens(self, seq_len: int, fraction: float) -> int | None:
        """Where the decode suffix starts (None: no decode phase, every position counts)."""
        return max(1, min(seq_len - 1, int(fraction * seq_len))) if self.decode else None

    def phase(self, prefill: int | None):
        return contextlib.nullcontext() if prefill is None else la_compiler.phase(prefill_lengths=[prefill])

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return logits_of(self.forward(inputs))

    def load_weights(self, weights: dict) -> None:
        self.model.load_state_dict(weights)


# ---- losses and evaluation ----------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, targets: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over positions [start, T)."""
    return F.cross_entropy(logits[:, start:].flatten(0, 1).float(), targets[:, start:].flatten())


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, start: int = 0, temperature: float = 1.0):
    """T^2 KL(teacher || student) of the softened distributions, averaged over the positions [start, T)."""
    s = F.log_softmax(student[:, start:].flatten(0, 1).float() / temperature, dim=-1)
    t = F.log_softmax(teacher[:, start:].flatten(0, 1).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


@dataclasses.dataclass
class EvalResult:
    nll: float  # mean NLL (nats per byte) over every scored token
    per_sequence: list[float]  # each sequence's mean NLL, for paired comparisons
    tokens: int
    start: int  # the first scored position
    # the scored positions cut into equal spans (the last ones one shorter where they do not divide): per sequence,
    # the mean NLL of each span, for where along the decode suffix a difference grows
    per_span: list[list[float]] = dataclasses.field(default_factory=list)
    span_starts: list[int] = dataclasses.field(default_factory=list)  # each span's first position

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def to_dict(self) -> dict:
        return {"nll": self.nll, "ppl": self.ppl, "tokens": self.tokens, "start": self.start,
                "per_sequence": self.per_sequence, "per_span": self.per_span, "span_starts": self.span_starts}


def evaluate(compiled: CompiledModel, batches: list[torch.Tensor], prefill: int | None = None,
             start: int | None = None, spans: int = 8) -> EvalResult:
    """Held-out NLL through the training graph. ``prefill`` runs a decode phase; ``start`` (default: the
    prefill length, else 0) is the first scored position; ``spans``: how many position spans ``per_span`` has."""
    start = (prefill or 0) if start is None else start
    per_sequence, per_span, total, count, span_starts = [], [], 0.0, 0, []
    with torch.enable_grad():
        for tokens in batches:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with compiled.phase(prefill):
                logits = compiled.logits(inputs)
            nll = F.cross_entropy(logits[:, start:].float().transpose(1, 2), targets[:, start:],
                                  reduction="none").detach()
            per_sequence += nll.mean(1).tolist()
            pieces = torch.tensor_split(nll, min(spans, nll.shape[1]), dim=1)
            per_span += torch.stack([piece.mean(1) for piece in pieces], dim=1).tolist()
            span_starts = [start + int(s) for s in torch.tensor([0] + [p.shape[1] for p in pieces[:-1]]).cumsum(0)]
            total += nll.sum().item()
            count += nll.numel()
    return EvalResult(total / count, per_sequence, count, start, per_span, span_starts)


# ---- optimizer and schedule ---------------------------------------------------------------------

class MixedPrecisionAdamW:
    """AdamW over fp32 master copies of low-precision (bf16) parameters: the model's weights are the masters
    rounded after every step, so small updates accumulate. fp32 parameters are their own masters."""

    def __init__(self, params, lr: float, weight_decay: float):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
                        for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self) -> None:
        for p in (*self.params, *self.masters):
            p.grad = None

    def state_dict(self) -> dict:
        return {"adamw": self.inner.state_dict(),
                "masters": [m.detach().clone() if m is not p else None for p, m in zip(self.params, self.masters)]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["adamw"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                if saved is not None:
                    m.copy_(saved)


def learning_rate(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then a cosine from lr down to min_lr_ratio * lr at ``total``."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- the loop -----------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    label: str
    steps: int  # the last step trained
    planned_steps: int  # cfg.steps, or fewer where the budget shrank the schedule
    losses: list[float]
    lm_losses: list[float]
    step_seconds: list[float]  # wall time of each step, loss.item() included (the first one may compile)
    evals: list[dict]
    final: EvalResult | None

    @property
    def seconds_per_step(self) -> float:
        """Mean wall time of the steps after the first."""
        later = self.step_seconds[1:]
        return sum(later) / len(later) if later else float("nan")


def train(student: CompiledModel, corpus: Corpus, cfg: TrainConfig, *, teacher: CompiledModel | None = None,
          batches: list[torch.Tensor] | None = None, log: MetricsLog | None = None,
          checkpoint_path: str | Path | None = None, resume_state: dict | None = None, label: str = "",
          model_config: dict | None = None, extra: dict | None = None, stop_at: int | None = None) -> TrainResult:
    """Trains ``student`` from its current weights (or from ``resume_state``'s optimizer and step: load the
    weights first with ``checkpoint.restore_weights``) for ``cfg.steps`` steps in all. ``stop_at`` ends the run
    after that step of the same schedule (and checkpoints it), as a run that was interrupted there."""
    if cfg.mode == "qad" and teacher is None:
        raise TrainConfigError("mode 'qad' needs a teacher (the frozen exact model)")
    if teacher is not None and teacher.decode:
        raise TrainConfigError(f"teacher: must run exact numerics, not the decode policy {teacher.name!r}")
    label = label or f"{student.name}/{cfg.mode}/seed{cfg.seed}"
    log = log or MetricsLog(None, label)
    optimizer = MixedPrecisionAdamW(student.model.parameters(), cfg.lr, cfg.weight_decay)
    first = 1
    if resume_state is not None:
        optimizer.load_state_dict(resume_state["optimizer"])
        first = resume_state["step"] + 1
    total = cfg.steps
    prefill = student.prefill_tokens(cfg.seq_len, cfg.prefill_fraction)
    start = prefill or 0
    result = TrainResult(label, first - 1, total, [], [], [], [], None)
    progress = Progress(total, first - 1, label, cfg.log_every)
    began = time.perf_counter()

    def save(step):
        if checkpoint_path is not None:
            save_checkpoint(checkpoint_path, student.model, step=step, optimizer=optimizer,
                            train_config=dataclasses.asdict(cfg), model_config=model_config, extra=extra)

    step = first - 1
    while step < min(total, stop_at or total):
        step += 1
        t0 = time.perf_counter()
        tokens = train_batch(corpus, step, cfg.seed, cfg.batch_size, cfg.seq_len)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        lr = learning_rate(step, cfg, total)
        optimizer.set_lr(lr)
        target_logits = teacher.logits(inputs).detach() if cfg.mode == "qad" else None
        with student.phase(prefill):
            logits = student.logits(inputs)
            lm = lm_loss(logits, targets, start)
            loss = lm if target_logits is None else (
                kd_loss(logits, target_logits, start, cfg.kd_temperature) + cfg.kd_lm_weight * lm)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(student.model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        loss_value, lm_value = loss.item(), lm.item()
        seconds = time.perf_counter() - t0
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{label}: the loss is {loss_value} at step {step}")
        result.losses.append(loss_value)
        result.lm_losses.append(lm_value)
        result.step_seconds.append(seconds)
        result.steps = step
        log.write(kind="train", step=step, loss=loss_value, lm_loss=lm_value, lr=lr, grad_norm=grad_norm.item(),
                  seconds=seconds)
        progress.update(step, loss=loss_value, lr=lr)
        if cfg.budget_s is not None and step - first == 10:
            total = _fit_budget(cfg, step, total, time.perf_counter() - began, result.step_seconds[1:], progress)
            result.planned_steps = total
        if batches is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total):
            evaluation = evaluate(student, batches, prefill)
            result.evals.append(log.write(kind="eval", step=step, nll=evaluation.nll, ppl=evaluation.ppl))
            result.final = evaluation
            progress.note(f"step {step}: held-out NLL {evaluation.nll:.4f} (PPL {evaluation.ppl:.3f})")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != total:
            save(step)
    save(step)
    progress.close()
    return result


def _fit_budget(cfg: TrainConfig, step: int, total: int, elapsed: float, measured: list[float], progress) -> int:
    per_step = sum(measured) / len(measured)
    fits = step + int((cfg.budget_s - elapsed) / per_step)
    if fits >= total:
        return total
    fits = max(step, fits)
    progress.note(f"{per_step * 1e3:.1f} ms a step: {fits} of {total} steps fit the {cfg.budget_s:.0f} s budget")
    return fits


# ---- the command line ---------------------------------------------------------------------------

def build_model(model_config: dict, device, dtype) -> torch.nn.Module:
    from la_compiler.tiny_models import TinyConfig, TinyHybridLM

    config = dict(model_config)
    config["layers"] = tuple(config["layers"])
    return TinyHybridLM(TinyConfig(**config)).to(device=device, dtype=dtype)


MODEL_FLAGS = {"hidden": ("hidden_size", 256), "heads": ("num_heads", 4), "head_dim": ("head_dim", 64),
               "layers": ("layers", "gdn,kda,gdn,kda")}


def layer_kinds(text) -> list[str]:
    """``"gdn,kda"`` -> ["gdn", "kda"]; ``"gdn*12"`` (or ``"gdn*2,kda"``) repeats an entry."""
    kinds = []
    for entry in str(text).split(","):
        kind, star, times = entry.partition("*")
        if star and not (times.isdigit() and int(times) > 0):
            raise TrainConfigError(f"--layers: {entry!r}: write kind*N with N a positive integer")
        kinds += [kind] * int(times or 1)
    return kinds


def model_config_of(args, stored: dict | None = None) -> dict:
    """The model's size from the flags, or the checkpoint's (``stored``), which a given flag may not contradict."""
    given = {flag: getattr(args, flag) for flag in MODEL_FLAGS if getattr(args, flag, None) is not None}
    values = {flag: given.get(flag, default) for flag, (_, default) in MODEL_FLAGS.items()}
    config = {"vocab_size": VOCAB_SIZE, "hidden_size": values["hidden"], "num_heads": values["heads"],
              "head_dim": values["head_dim"], "layers": layer_kinds(values["layers"]), "use_short_conv": True}
    if stored is None:
        return config
    for flag in given:
        key = MODEL_FLAGS[flag][0]
        if config[key] != stored[key]:
            raise TrainConfigError(f"--{flag.replace('_', '-')}: the checkpoint's model has {key}={stored[key]!r}, "
                                   f"not {config[key]!r}; leave the flag out")
    return stored


DTYPES = ("auto", "float32", "bfloat16")


def model_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: bf16 on CUDA, where fp32 Triton dots compile as slow IEEE loops (fp32 masters in the
    optimizer), fp32 elsewhere."""
    if name not in DTYPES:
        raise TrainConfigError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


TRAIN_FLAGS = {f.name: f for f in dataclasses.fields(TrainConfig)}
TRAIN_HELP = {  # what each TrainConfig flag does (its default follows in --help)
    "mode": "qat: the language-model loss; qad: distillation from the --init weights as a frozen exact teacher",
    "steps": "training steps in all (with --resume: up to this step)",
    "batch_size": "sequences per step",
    "seq_len": "bytes per sequence (the model's tokens)",
    "lr": "peak learning rate of AdamW",
    "warmup_steps": "steps of linear warm-up to --lr",
    "min_lr_ratio": "after warm-up a cosine decays the rate to this fraction of --lr at the last step",
    "weight_decay": "AdamW's weight decay",
    "grad_clip": "clip the gradients' global norm to this",
    "seed": "the training batches are a function of (seed, step), so a resumed run sees the same batches",
    "kd_temperature": "QAD: the temperature T of the loss T^2 KL(teacher || student)",
    "kd_lm_weight": "QAD: the loss is KD + this times the LM loss",
    "prefill_fraction": "decode-phase policies: the prefix is this fraction of --seq-len, the loss on the rest",
    "eval_every": "held-out evaluation every N steps (0: at the end only)",
    "checkpoint_every": "write checkpoint.pt every N steps (0: at the end only)",
    "log_every": "a progress line every N steps (where no tqdm bar is shown)",
    "budget_s": "shrink the schedule, once, so that the run ends within this many seconds",
}
# --smoke: seconds, not hours; any flag given wins
SMOKE = {"steps": 3, "batch_size": 2, "seq_len": 64, "warmup_steps": 1, "log_every": 1, "eval_sequences": 4,
         "hidden": 32, "heads": 2, "head_dim": 16, "layers": "gdn,kda", "compiler": "eager", "out": "out/smoke"}
RESUMABLE = ("steps", "eval_every", "checkpoint_every", "log_every", "budget_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", default=None, help="recipe name, .yaml/.json path (default: the --resume "
                                                  "checkpoint's policy, else exact)")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights (and model config); "
                                                "QAD's teacher")
    p.add_argument("--resume", default=None, help="go on from this checkpoint (weights, policy, optimizer, step)")
    p.add_argument("--out", default=None, help="metrics.jsonl, checkpoint.pt and curves.png go here "
                                               "(default out/qat; with --smoke out/smoke)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a run of seconds that checks the set-up end to end (the flags not given: "
                        f"{', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in SMOKE.items())})")
    for name, field in TRAIN_FLAGS.items():
        kind = {"budget_s": float}.get(name, type(field.default) if field.default is not None else float)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       choices=MODES if name == "mode" else None,
                       help=f"{TRAIN_HELP[name]} (default {field.default})")
    p.add_argument("--eval-sequences", type=int, default=None,
                   help="held-out sequences per evaluation (default 64)")
    for flag, (key, default) in MODEL_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), type=type(default), default=None,
                       help=f"the model's {key} (default {default}; from --init / --resume: the checkpoint's)")
    p.add_argument("--compiler", default=None, choices=COMPILERS,
                   help="what runs the rest of each graph (default inductor; eager for bisecting)")
    p.add_argument("--kernel-family", default=None, choices=KERNEL_FAMILIES,
                   help="auto on CUDA; torch (laqat's torch references, same numerics) on the CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model trains (default: cuda where available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 elsewhere")
    args = p.parse_args(argv)
    for flag, value in (SMOKE.items() if args.smoke else ()):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for flag, value in (("out", "out/qat"), ("eval_sequences", 64), ("compiler", "inductor")):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    return args


def train_config_of(args, stored: dict | None) -> TrainConfig:
    given = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name) is not None}
    if stored is None:
        return TrainConfig(**given)
    fixed = sorted(set(given) - set(RESUMABLE))
    if fixed:
        raise TrainConfigError(f"--{fixed[0].replace('_', '-')}: a resumed run keeps its checkpoint's training "
                               f"config; only {['--' + n.replace('_', '-') for n in RESUMABLE]} may change")
    return TrainConfig(**{**stored, **given})


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    resume = read_checkpoint(args.resume) if args.resume else None
    init = read_checkpoint(args.init) if args.init else None
    cfg = train_config_of(args, resume and resume["train_config"])
    source = resume or init
    model_config = model_config_of(args, source and source["model_config"])
    device, dtype = args.device, model_dtype(args.dtype, args.device)
    family = args.kernel_family or ("auto" if device == "cuda" else "torch")
    prepare_dynamo()
    corpus = load_corpus().to(device)
    held_out = eval_batches(corpus, args.eval_sequences, cfg.seq_len, cfg.batch_size)

    model = build_model(model_config, device, dtype)
    if resume is not None:
        policy = restore_weights(model, resume, expected_policy=args.policy)
    else:
        if init is not None:
            restore_weights(model, init)
        policy = args.policy or "exact"
    student = CompiledModel(model, policy, compiler=args.compiler, kernel_family=family)
    teacher = None
    if cfg.mode == "qad":
        teacher_source = init or (resume["extra"].get("init") and read_checkpoint(resume["extra"]["init"]))
        if not teacher_source:
            raise TrainConfigError("--init: QAD needs the teacher's (the starting) weights")
        teacher_model = build_model(model_config, device, dtype)
        restore_weights(teacher_model, teacher_source)
        teacher = CompiledModel(teacher_model, "exact", compiler=args.compiler, kernel_family=family)
    print(f"policy {student.name}: {cfg.mode}, {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} bytes, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {dtype}, {device}"
          + (f", decode phase from token {student.prefill_tokens(cfg.seq_len, cfg.prefill_fraction)}"
             if student.decode else ""), flush=True)
    log = MetricsLog(out / "metrics.jsonl", f"{student.name}/{cfg.mode}", resume_step=resume and resume["step"])
    result = train(student, corpus, cfg, teacher=teacher, batches=held_out, log=log,
                   checkpoint_path=out / "checkpoint.pt", resume_state=resume, label=log.run,
                   model_config=model_config, extra={"init": args.init or (resume and resume["extra"].get("init"))})
    held = "" if result.final is None else f"; held-out NLL {result.final.nll:.4f} (PPL {result.final.ppl:.3f})"
    print(f"{result.steps} steps, {result.seconds_per_step * 1e3:.1f} ms a step{held}; checkpoint "
          f"{out / 'checkpoint.pt'}", flush=True)
    plot_curves(log.records, out / "curves.png", title=log.run)


USER_ERRORS = (TrainConfigError, CheckpointError, CorpusError, la_compiler.PolicyError)

if __name__ == "__main__":
    try:
        main()
    except USER_ERRORS as e:
        sys.exit(f"train.py: {type(e).__name__}: {e}")
