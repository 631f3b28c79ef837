"""laqat quick start: quantization-aware training of a tiny GDN + KDA model, in four steps.

    make demo        # or: python examples/quickstart.py [--policy RECIPE] [--seq-len N] [--graph]

1. what laqat rewrites under exact numerics and under a quantized recipe, and the spec fields that differ;
2. the loss under each, at a length of more than one chunk of 64 tokens (the rounded state is carried from
   one chunk into the next: with a single chunk, the state's rounding never reaches the loss);
3. a few QAT steps with the recipe attached to the model (``la_compiler.attach_policy``);
4. the policy saved with the weights and loaded into a fresh instance.
"""
import argparse
import io
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the CPU interpreter

import la_compiler  # noqa: E402
from la_compiler.backend import last_record  # noqa: E402
from la_compiler.policy.attach import POLICY_KEY  # noqa: E402
from la_compiler.tiny_models import TinyConfig, TinyHybridLM  # noqa: E402

QAT_STEPS = 3


def spec_fields(spec: str) -> dict[str, str]:
    """'gdn[src=fla; chunk=64; q.state=fp8_e4m3/tile64]' -> {'src': 'fla', 'chunk': '64', 'q.state': ...}."""
    body = spec[spec.index("[") + 1: spec.rindex("]")]
    return dict(field.split("=", 1) for field in body.split("; "))


def show_sites(exact, quantized, name: str) -> None:
    print(f"\n1. Rewritten sites: exact numerics vs {name}")
    common = None
    for a, b in zip(exact.matches, quantized.matches):
        fa, fb = spec_fields(a.spec), spec_fields(b.spec)
        differ = sorted(k for k in {*fa, *fb} if fa.get(k) != fb.get(k))
        same = {k: v for k, v in fa.items() if k not in differ}
        common = same if common is None else {k: v for k, v in common.items() if same.get(k) == v}
        left = "; ".join(f"{k}={fa[k]}" for k in differ if k in fa) or "-"
        right = "; ".join(f"{k}={fb[k]}" for k in differ if k in fb) or "(the same)"
        print(f"   {a.module:<14} {a.kind.upper()} via {a.frontend:<6} exact: {left:<24} {name}: {right}")
    if common:
        print("   the same in both: " + "; ".join(f"{k}={v}" for k, v in common.items()))


def compiled_loss(model, compiler: str):
    return torch.compile(model.loss, backend="laqat", options={"compiler": compiler})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="state_fp8", help="a recipe name or a YAML/JSON policy file")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (chunks are 64 tokens)")
    parser.add_argument("--graph", action="store_true", help="also print explain's full report (the FX graphs)")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # on the CPU the rest of the graph runs eagerly: Inductor's C++ compile would take longer than the demo
    compiler = "inductor" if device == "cuda" else "eager"
    model = TinyHybridLM(TinyConfig()).to(device)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, args.seq_len + 1), device=device)
    chunks = -(-args.seq_len // 64)
    print(f"laqat quick start: TinyHybridLM ({', '.join(model.cfg.layers)}; "
          f"{sum(p.numel() for p in model.parameters()):,} parameters), batch 2 x {args.seq_len} tokens "
          f"({chunks} chunk{'s' * (chunks > 1)} of 64), {device}"
          + (" (Triton interpreter)" if device == "cpu" else ""))

    # explain compiles model.loss, runs it once and reports every rewritten site; .output is the loss
    exact = la_compiler.explain(model.loss, tokens, policy="exact")
    quantized = la_compiler.explain(model.loss, tokens, policy=args.policy)
    name = la_compiler.load_policy(args.policy).name
    show_sites(exact, quantized, name)

    loss_exact, loss_quantized = exact.output.item(), quantized.output.item()
    carried = ": the rounded state carried from chunk to chunk" if chunks > 1 else \
        "; with one chunk no rounded state is carried into a next one: try --seq-len 128"
    width = max(len(name), 5) + 2
    print(f"\n2. Loss of the compiled model\n   {'exact':<{width}} {loss_exact:.6f}\n"
          f"   {name:<{width}} {loss_quantized:.6f}   ({loss_quantized - loss_exact:+.1e} from exact{carried})")

    la_compiler.attach_policy(model, args.policy)
    compiled = compiled_loss(model, compiler)  # no policy option: the attached one
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    print(f'\n3. QAT: la_compiler.attach_policy(model, "{args.policy}"); '
          f'torch.compile(model.loss, backend="laqat")')
    for step in range(QAT_STEPS):
        loss = compiled(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            record = last_record().graphs[-1]
            print(f"   compiled with policy {record.policy} ({record.policy_source})")
        print(f"   step {step + 1}  loss {loss.item():.6f}")

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    fresh = TinyHybridLM(TinyConfig()).to(device)  # other random weights, no policy
    la_compiler.load_state_dict(fresh, state)  # weights and the attached policy
    same_weights = all(torch.equal(t, fresh.state_dict()[k]) for k, t in model.state_dict().items())
    with torch.no_grad():
        trained, reloaded = compiled(tokens).item(), compiled_loss(fresh, compiler)(tokens).item()
    same_policy = la_compiler.policy_of(fresh) == la_compiler.policy_of(model)
    print(f"\n4. Saved and reloaded: torch.save(model.state_dict()) holds '{POLICY_KEY}' "
          f"({state[POLICY_KEY].numel()} bytes of JSON in a uint8 tensor)\n"
          f"   la_compiler.load_state_dict(fresh_model, torch.load(..., weights_only=True)):\n"
          f"   policy {la_compiler.policy_of(fresh).name} (the same: {same_policy}), weights the same: {same_weights}, "
          f"loss {reloaded:.6f} (the trained model's: {trained:.6f})")

    if args.graph:
        print("\n" + str(quantized))
    print("\nNext: examples/qat/train.py trains a model under a policy (QAT / QAD); docs/qat.md walks through it; "
          "--graph prints the rewritten FX graphs.")


if __name__ == "__main__":
    main()
