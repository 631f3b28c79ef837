"""The first call and the later steps of a tiny transformers model under ``torch.compile(backend="laqat")``.

    python examples/benchmarks/first_step_time.py                        # the default options
    python examples/benchmarks/first_step_time.py --compiler inductor    # an explicit hand-off
    python examples/benchmarks/first_step_time.py --kernel-family torch  # laqat's torch references (CPU recipe)

The model is examples/qat/hf_trainer.py's smoke model (a Qwen3.5 of two GDN layers, hidden 32), fp32, a batch of
2 x 72 tokens; one process per run, with a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary
folder) so that the first call compiles from nothing, unless ``TORCHINDUCTOR_CACHE_DIR`` is set: a second run with
the first's folder finds its graphs in Inductor's and AOTAutograd's caches. A step is a forward with labels, the
backward and an AdamW step. Prints one JSON line: the hand-off that ran and why, the wall and CPU seconds (this
process and the compilers it waited for) of the first call's forward, of the first step, and of each later step,
and what the compiles found in Inductor's FX graph cache and AOTAutograd's cache (hits, misses, bypasses).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.modules.setdefault("fla", None)  # transformers calls FLA's kernels wherever fla imports: GPU only
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))

import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "qat"))
import la_compiler  # noqa: E402,F401
from la_compiler.backend import last_record  # noqa: E402
from hf_trainer import SMOKE_CONFIG  # noqa: E402
from train import KERNEL_FAMILIES, with_kernel_family  # noqa: E402

BATCH, SEQ_LEN = 2, 72


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(fn) -> tuple[float, float]:
    """(wall s, CPU s) of one call of ``fn``."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return round(time.perf_counter() - t0, 2), round(cpu_seconds() - c0, 2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiler", choices=("inductor", "eager"), default=None, help="unset: laqat's default (by device)")
    p.add_argument("--kernel-family", choices=KERNEL_FAMILIES, default="auto",
                   help="auto: the selection table's kernels (the Triton interpreter on a CPU); torch: laqat's torch "
                        "references, as examples/qat's CPU recipes run")
    p.add_argument("--steps", type=int, default=3, help="later steps timed after the first (default 3)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**SMOKE_CONFIG)).float()
    ids = torch.randint(0, SMOKE_CONFIG["vocab_size"], (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    options = {"policy": with_kernel_family("exact", args.kernel_family)}
    if args.compiler is not None:
        options["compiler"] = args.compiler
    step_fn = torch.compile(model, backend="laqat", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward():
        return step_fn(input_ids=ids, labels=ids, use_cache=False).loss

    def step():
        loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0, c0 = time.perf_counter(), cpu_seconds()
    loss = forward()
    first_forward = (round(time.perf_counter() - t0, 2), round(cpu_seconds() - c0, 2))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    first_step = (round(time.perf_counter() - t0, 2), round(cpu_seconds() - c0, 2))
    later = [timed(step) for _ in range(args.steps)]
    graphs = last_record().graphs
    counters = torch._dynamo.utils.counters
    return {"option": args.compiler or "default", "kernel_family": args.kernel_family,
            "hand_off": sorted({f"{g.hand_off} ({g.hand_off_reason})" for g in graphs}), "graphs": len(graphs),
            "nodes": sum(len(g.matches) for g in graphs),
            "first_forward_s": first_forward[0], "first_forward_cpu_s": first_forward[1],
            "first_step_s": first_step[0], "first_step_cpu_s": first_step[1],
            "later_step_s": [w for w, _ in later], "later_step_cpu_s": [c for _, c in later],
            "caches": {name: n for group in ("inductor", "aot_autograd") for name, n in sorted(counters[group].items())
                       if "_cache_" in name},
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "triton": __import__("triton").__version__},
            "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    print(json.dumps(main()))
