"""On CUDA: one training step of FLA models, eager vs torch.compile(backend="laqat").

Compares the loss and every parameter gradient (relative L2) of a GatedDeltaNet / KimiDeltaAttention
model run eagerly with FLA's kernels and compiled with laqat (exact policy), and records which
kernel variant laqat chose per layer. Prints a table and writes JSON to $OUT (default ./out).

    python examples/benchmarks/compiled_step_vs_eager.py
"""
import argparse
import json
import os
import sys

import torch

import la_compiler
from la_compiler.tiny_models import TinyConfig, TinyHybridLM

from bench_common import rel_l2


def step(model, tokens, compiler=None):
    model.zero_grad(set_to_none=True)
    fn = (torch.compile(model.loss, backend="laqat", fullgraph=True, options={"compiler": compiler})
          if compiler else model.loss)
    loss = fn(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(name, layers, dtype, compiler, hidden=256, heads=4, head_dim=64, T=512, B=2):
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=512, hidden_size=hidden, num_heads=heads, head_dim=head_dim, layers=layers)
    model = TinyHybridLM(cfg).cuda().to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")
    row = {"case": name, "dtype": str(dtype).replace("torch.", ""), "compiler": compiler,
           "shape": f"B={B} T={T} H={heads} D={head_dim}"}
    try:
        eager_loss, eager_grads = step(model, tokens)
        torch._dynamo.reset()
        report = la_compiler.explain(model.loss, tokens)
        laqat_loss, laqat_grads = step(model, tokens, compiler)
        row["kernels"] = ",".join(sorted({m.kernel for m in report.matches}))
        row["nodes"] = len(report.matches)
        row["loss_rel"] = abs(laqat_loss.item() - eager_loss.item()) / abs(eager_loss.item())
        row["grad_rel_max"] = max(rel_l2(laqat_grads[n], g) for n, g in eager_grads.items())
        row["missing_grads"] = sorted(set(eager_grads) ^ set(laqat_grads))
    except Exception as e:  # a failing case is a result to report, not a crash of the table
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def _keep_first_autotune_config():
    """FLA autotunes every kernel over many configs on first use (minutes for chunk_kda fwd+bwd).
    This check compares numerics, not speed: keep each autotuner's first config only."""
    import triton

    original = triton.autotune

    def autotune(configs, *args, **kwargs):
        return original(configs[:1], *args, **kwargs)

    triton.autotune = autotune


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small fp32 case, eager hand-off")
    parser.add_argument("--first-autotune-config", action="store_true",
                        help="patch triton.autotune to its first config before FLA is imported (numerics only)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    if args.first_autotune_config:
        _keep_first_autotune_config()
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    # GDN is left out: FLA's eager GDN chunk backward refuses to run on Hopper with Triton < 3.7.1.
    if args.quick:
        rows = [run_case("KDA model fp32", ("kda", "kda"), torch.float32, "eager", hidden=128, heads=2, T=256, B=1)]
    else:
        rows = [
            run_case("KDA model fp32", ("kda", "kda"), torch.float32, "inductor"),
            run_case("KDA model bf16", ("kda", "kda"), torch.bfloat16, "eager"),
        ]
    print(f"{'case':22s} {'dtype':9s} {'compiler':9s} {'nodes':>5s} {'kernels':28s} {'loss rel':>10s} {'max grad rel':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22s} {r['dtype']:9s} ERROR {r['error']}")
        else:
            print(f"{r['case']:22s} {r['dtype']:9s} {r['compiler']:9s} {r['nodes']:5d} {r['kernels']:28s} {r['loss_rel']:10.2e} "
                  f"{r['grad_rel_max']:12.2e}")
    with open(os.path.join(out, "compiled_step_vs_eager.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows,
                   "first_autotune_config": args.first_autotune_config}, f, indent=1)


if __name__ == "__main__":
    main()
