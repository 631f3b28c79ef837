"""QAT and QAD of a transformers model with transformers' Trainer, under a laqat policy.

    python examples/qat/hf_trainer.py --smoke                      # seconds on a CPU: QAT, resume, QAD
    python examples/qat/hf_trainer.py --config CONFIG --policy state_fp8 --steps 300 --out out/hf-qat
    python examples/qat/hf_trainer.py --resume out/hf-qat/checkpoint-300 --steps 600 --out out/hf-qat
    python examples/qat/hf_trainer.py --init out/hf-qat/checkpoint-600 --mode qad --steps 300 --out out/hf-qad

The recipe (docs/qat.md, "transformers' Trainer"):

- The policy is attached to the model (``la_compiler.attach_policy``) and the model compiled in place,
  ``model.compile(backend="laqat")``, before the ``Trainer`` is built. ``TrainingArguments(torch_compile=True,
  torch_compile_backend="laqat")`` does not work: accelerate checks the name against its own closed list of Dynamo
  backends and refuses it.
- QAD: ``DistillationTrainer.compute_loss`` adds a frozen teacher (the starting weights, compiled with
  ``options={"policy": "exact"}`` so that Dynamo does not hand it the student's graph): T^2 KL(teacher || student)
  at temperature T, plus ``--kd-lm-weight`` times the LM loss.
- Checkpoints: Trainer's ``save_pretrained`` writes the policy into the checkpoint's config.json
  (``laqat_policy``); resuming builds the model with ``from_pretrained(checkpoint)``, which brings the policy
  back, compiles it the same way and calls ``train(resume_from_checkpoint=checkpoint)``.
- Models whose layers are all linear attention train with ``use_cache=False`` (transformers' cache refuses them);
  on a CPU, FLA is hidden before transformers is imported (transformers calls FLA's kernels wherever it imports)
  and the policy restricted to laqat's torch references (``--kernel-family torch``, as in train.py).

Data: byte-level windows of the Python standard library's source (``corpus.py``), one deterministic window per
example index. ``--config`` is a transformers config.json (or a directory holding one) or a model type; without
it, ``--smoke`` builds a tiny Qwen3.5. ``<out>/summary-<mode>-<step>.json`` says what ran (steps, losses, the
policy, the rewritten specs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # laqat's Triton kernels run in the CPU interpreter
    sys.modules.setdefault("fla", None)  # transformers calls FLA's kernels wherever fla imports: GPU only

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import la_compiler  # noqa: E402
from corpus import VOCAB_SIZE, load_corpus, train_batch  # noqa: E402
from train import KERNEL_FAMILIES, with_kernel_family  # noqa: E402

SMOKE_CONFIG = dict(  # a Qwen3.5 of two GDN layers, small enough for the Triton interpreter
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    layer_types=["linear_attention"] * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)


class Windows(torch.utils.data.Dataset):
    """``length`` windows of ``seq_len`` bytes of the training split; window i is a function of (seed, i)."""

    def __init__(self, corpus, length: int, seq_len: int, seed: int = 0):
        self.corpus, self.length, self.seq_len, self.seed = corpus, length, seq_len, seed

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        tokens = train_batch(self.corpus, i, self.seed, 1, self.seq_len)[0, :self.seq_len].long()
        return {"input_ids": tokens, "labels": tokens}


class DistillationTrainer(Trainer):
    """QAD: the student's loss is T^2 KL(teacher || student) of the logits at temperature T, plus ``lm_weight``
    times its LM loss. The teacher is frozen and compiled under exact numerics."""

    def __init__(self, *args, teacher, temperature: float = 1.0, lm_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.temperature, self.lm_weight = teacher, temperature, lm_weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        with torch.no_grad():
            target = self.teacher(**inputs).logits
        t = self.temperature
        student = F.log_softmax(outputs.logits.flatten(0, 1).float() / t, dim=-1)
        teacher = F.log_softmax(target.flatten(0, 1).float() / t, dim=-1)
        loss = t * t * F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        if self.lm_weight:
            loss = loss + self.lm_weight * outputs.loss
        return (loss, outputs) if return_outputs else loss


def build_model(args) -> torch.nn.Module:
    """From a checkpoint (``--resume`` / ``--init``: its config.json brings the policy back), else from a config."""
    source = args.resume or args.init
    if source:
        model = AutoModelForCausalLM.from_pretrained(source)
    else:
        if args.config is None:
            config = transformers.Qwen3_5TextConfig(**SMOKE_CONFIG)
        elif os.path.exists(args.config):
            config = transformers.AutoConfig.from_pretrained(args.config)
        else:
            config = transformers.AutoConfig.for_model(args.config)
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False  # all-linear-attention configs: transformers' cache refuses them in training
    return model.float()


def compiled(model, options: dict) -> torch.nn.Module:
    model.compile(backend="laqat", options=options)  # in place: Trainer gets the module, save_pretrained works
    return model


def run(args) -> dict:
    corpus = load_corpus()
    student = build_model(args)
    family = args.kernel_family or ("auto" if torch.cuda.is_available() else "torch")
    if args.policy is not None and args.resume is None:
        # config.json of every checkpoint will carry it
        la_compiler.attach_policy(student, with_kernel_family(args.policy, family))
    policy = la_compiler.policy_of(student) or la_compiler.load_policy(None)
    if args.resume and args.policy:
        raise SystemExit(f"--policy {args.policy}: a resumed run trains under its checkpoint's policy "
                         f"({policy.name}); leave --policy out")
    options = {"compiler": args.compiler}
    compiled(student, options)  # no policy option: the attached policy
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=min(10, args.steps // 10),
        seed=args.seed,
        logging_steps=1, save_steps=args.save_steps or args.steps, report_to=[], use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, disable_tqdm=not sys.stderr.isatty())
    data = Windows(corpus, args.steps * args.batch_size, args.seq_len, args.seed)
    n_graphs = len(la_compiler.backend.last_record().graphs)
    if args.mode == "qad":
        teacher = build_model(argparse.Namespace(**{**vars(args), "resume": None}))
        la_compiler.attach_policy(teacher, None)  # the teacher is the starting weights under exact numerics
        teacher.requires_grad_(False).eval()
        compiled(teacher, {**options, "policy": with_kernel_family("exact", family)})
        trainer = DistillationTrainer(model=student, args=training, train_dataset=data, teacher=teacher,
                                      temperature=args.kd_temperature, lm_weight=args.kd_lm_weight)
    else:
        trainer = Trainer(model=student, args=training, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume)
    graphs = la_compiler.backend.last_record().graphs[n_graphs:]
    summary = {"mode": args.mode, "policy": policy.name, "steps": trainer.state.global_step,
               "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
               "specs": sorted({m.spec for g in graphs for m in g.matches}),
               "checkpoint": str(Path(args.out) / f"checkpoint-{trainer.state.global_step}")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"summary-{args.mode}-{summary['steps']}.json").write_text(json.dumps(summary, indent=1))
    print(f"{args.mode} under {policy.name}: {summary['steps']} steps, loss {summary['losses'][0]:.4f} -> "
          f"{summary['losses'][-1]:.4f}; checkpoint {summary['checkpoint']}", flush=True)
    return summary


def smoke(args) -> list[dict]:
    """The whole recipe in seconds: QAT for 3 steps with a checkpoint, resumed to step 4, then QAD from it."""
    out = Path(args.out)
    base = {**vars(args), "smoke": False, "batch_size": 2, "seq_len": 72, "compiler": "eager",
            "policy": args.policy or "state_fp8"}
    qat = run(argparse.Namespace(**{**base, "steps": 3, "out": str(out / "qat")}))
    torch._dynamo.reset()  # each run compiles afresh, as in a process of its own
    resumed = run(argparse.Namespace(**{**base, "policy": None, "steps": 4, "out": str(out / "qat"),
                                        "resume": qat["checkpoint"]}))
    torch._dynamo.reset()
    qad = run(argparse.Namespace(**{**base, "steps": 1, "mode": "qad", "kd_lm_weight": 0.5, "out": str(out / "qad"),
                                    "init": resumed["checkpoint"]}))
    return [qat, resumed, qad]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny Qwen3.5: QAT 3 steps under --policy (default "
                                                        "state_fp8), resumed to step 4, QAD 1 step from there")
    p.add_argument("--config", help="a transformers config.json, a directory holding one, or a model type "
                                    "(default: the smoke model's config)")
    p.add_argument("--init", help="start from this checkpoint's weights (a Trainer checkpoint directory); QAD's "
                                  "teacher")
    p.add_argument("--resume", help="go on from this Trainer checkpoint (weights, policy, optimizer, schedule)")
    p.add_argument("--policy", help="recipe name or .yaml/.json path (default: the checkpoint's, else exact)")
    p.add_argument("--mode", choices=("qat", "qad"), default="qat", help="qat: the LM loss; qad: distillation from "
                                                                         "the --init weights (default qat)")
    p.add_argument("--steps", type=int, default=200, help="training steps in all (default 200)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=512, help="bytes per sequence (default 512)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--kd-temperature", type=float, default=1.0, help="QAD: the temperature T (default 1)")
    p.add_argument("--kd-lm-weight", type=float, default=0.0, help="QAD: the weight of the LM loss (default 0)")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (default: at the end)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialization and the data order (default 0)")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                   help="what runs the rest of each graph (default inductor)")
    p.add_argument("--kernel-family", choices=KERNEL_FAMILIES, default=None,
                   help="auto on CUDA; torch (laqat's torch references, same numerics) on the CPU: written into the "
                        "attached policy (solve / decode implementation)")
    p.add_argument("--out", default="out/hf", help="Trainer's output directory (default out/hf)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return smoke(args) if args.smoke else run(args)


if __name__ == "__main__":
    main()
