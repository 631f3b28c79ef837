"""laqat quick start: compile a tiny GDN + KDA model with backend="laqat", show what was
rewritten, and run one QAT optimizer step.

    make demo                    # or: TRITON_INTERPRET=1 python examples/quickstart.py [--policy RECIPE]
"""
import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the CPU interpreter

import la_compiler  # noqa: E402
from la_compiler.tiny_models import TinyConfig, TinyHybridLM  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None, help="a recipe name or a YAML/JSON policy file (default: exact)")
    parser.add_argument("--seq-len", type=int, default=12)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyHybridLM(TinyConfig()).to(device)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, args.seq_len + 1), device=device)

    report = la_compiler.explain(model.loss, tokens, policy=args.policy)
    print(report)

    compiled = torch.compile(model.loss, backend="laqat", fullgraph=True,
                             options={"policy": args.policy} if args.policy else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = compiled(tokens)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model.loss(tokens) if device == "cuda" else compiled(tokens)
    print(f"\nQAT step: loss {loss.item():.4f} -> {after.item():.4f} (grad norm {grad_norm.item():.3f}, "
          f"{len(report.matches)} laqat nodes: {', '.join(m.kind for m in report.matches)})")


if __name__ == "__main__":
    main()
