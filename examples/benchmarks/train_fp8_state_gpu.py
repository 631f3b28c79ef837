"""On CUDA: a GDN + KDA model compiled with the FP8-state recipe trains through laqat's chunk kernels.

    OUT=./out python examples/benchmarks/train_fp8_state_gpu.py [--steps 30] [--seq-len 512]

1. The model (FLA layers; bf16 on CUDA, fp32 on the CPU) is compiled with ``options={"policy": "state_fp8"}``; ``explain``
   must report every GDN/KDA call on the ``chunk`` kernel with ``q.state=fp8_e4m3/tile64``.
2. First step, same weights and tokens: loss and every parameter gradient of the compiled model
   against the same recipe lowered to the torch reference (``solve.implementation: torch``,
   the fp64 chunk reference that rounds at the same sites); with --compare-exact also against the
   exact (unquantized) compiled model, to show the rounding is really applied (a nonzero difference).
3. ``--steps`` AdamW steps on a fixed batch of a repeating token pattern: the loss must fall.
Prints a table and writes $OUT/train_fp8_state_gpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():  # a CPU smoke run (small --seq-len/--hidden) in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_common import ensure_la_compiler, rel_l2  # noqa: E402

ensure_la_compiler()

import la_compiler  # noqa: E402
from la_compiler.tiny_models import TinyConfig, TinyHybridLM  # noqa: E402

RECIPE = "state_fp8"
TORCH_REFERENCE = {  # the same recipe, lowered to the torch reference variant
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}},
        {"quantizer_name": "*kda_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}},
    ],
    "linear_attention": [{"module_name": "*", "cfg": {"state": {"block_v": 64},
                                                       "solve": {"method": "exact", "implementation": "torch"}}}],
}


def grads_of(model, loss_fn, tokens):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(tokens)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled(model, policy):
    torch._dynamo.reset()
    return torch.compile(model.loss, backend="laqat", fullgraph=True, options={"policy": policy})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="model dtype (default: bfloat16 on CUDA, where fp32 kernels compile their dots as slow "
                             "IEEE FMA loops; float32 on the CPU)")
    parser.add_argument("--compare-exact", action="store_true",
                        help="also report the first step's distance from the exact (unquantized) compiled model")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size; heads = hidden / 64 (or 2 below 128)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    heads = args.hidden // 64 if args.hidden >= 128 else 2
    cfg = TinyConfig(vocab_size=256, hidden_size=args.hidden, num_heads=heads, head_dim=args.hidden // heads,
                     layers=("gdn", "kda"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    model = TinyHybridLM(cfg).to(device=device, dtype=dtype)
    pattern = torch.randint(0, cfg.vocab_size, (args.batch, 37), device=device)
    tokens = pattern.repeat(1, args.seq_len // 37 + 2)[:, : args.seq_len + 1].contiguous()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "dtype": str(dtype), "torch": torch.__version__, "recipe": RECIPE,
              "shape": f"B={args.batch} T={args.seq_len} H={cfg.num_heads} D={cfg.head_dim}"}

    torch._dynamo.reset()
    report = la_compiler.explain(model.loss, tokens, policy=RECIPE)
    result["matches"] = [dict(kind=m.kind, module=m.module, kernel=m.kernel, spec=m.spec) for m in report.matches]
    print("\n".join(f"  {m.kind} {m.module}: {m.kernel}  {m.spec}" for m in report.matches))
    kernels_ok = bool(report.matches) and all(m.kernel == "chunk" and "q.state=fp8_e4m3/tile64" in m.spec
                                              for m in report.matches)

    loss_q, grads_q = grads_of(model, compiled(model, RECIPE), tokens)
    loss_r, grads_r = grads_of(model, compiled(model, TORCH_REFERENCE), tokens)
    result["first_step"] = {
        "loss_fp8_chunk": loss_q, "loss_fp8_torch_reference": loss_r,
        "grad_rel_max_vs_torch_reference": max(rel_l2(grads_q[n], g) for n, g in grads_r.items()),
    }
    if args.compare_exact:  # on CUDA the exact KDA layer goes to FLA's chunk_kda: minutes of compilation
        loss_x, grads_x = grads_of(model, compiled(model, None), tokens)
        result["first_step"].update(loss_exact=loss_x, grad_rel_max_vs_exact=max(
            rel_l2(grads_q[n], g) for n, g in grads_x.items()))
    print(json.dumps(result["first_step"], indent=1))

    step_fn = compiled(model, RECIPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        loss = step_fn(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    result["losses"] = losses
    result["seconds_per_step"] = (time.perf_counter() - t0) / max(args.steps, 1)
    result["ok"] = kernels_ok and losses[-1] < 0.5 * losses[0] and all(map(lambda x: x == x, losses))
    print(f"{'recipe':10s} {'nodes':>5s} {'kernels':10s} {'loss 0':>8s} {'loss end':>9s} {'s/step':>7s} "
          f"{'grad rel vs torch ref':>22s} {'vs exact':>9s}")
    fs = result["first_step"]
    print(f"{RECIPE:10s} {len(report.matches):5d} {','.join(sorted({m.kernel for m in report.matches})):10s} "
          f"{losses[0]:8.4f} {losses[-1]:9.4f} {result['seconds_per_step']:7.3f} "
          f"{fs['grad_rel_max_vs_torch_reference']:22.2e} {fs.get('grad_rel_max_vs_exact', float('nan')):9.2e}  "
          f"{'ok' if result['ok'] else 'FAIL'}")
    with open(os.path.join(out, "train_fp8_state_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
