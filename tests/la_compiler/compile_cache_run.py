"""One process of tests/la_compiler/test_compile_cache.py: compiles a tiny FLA GDN step under the Inductor hand-off
once per compile named on the command line, in the TORCHINDUCTOR_CACHE_DIR of the environment, and writes what each
found in Inductor's and AOTAutograd's caches (JSON) and its loss and gradients (torch.save).

    python -m tests.la_compiler.compile_cache_run OUT_PREFIX exact [state_fp8] [exact:edited] ...

A compile is a recipe name; ``:edited`` compiles as though laqat's sources had changed (another source hash).
"""
from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # Inductor's C++ kernels are keyed by the thread count: the same in every process

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402,F401
from la_compiler.hand_off import cache_key  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402


def policy_of(recipe: str) -> la_compiler.Policy:
    """The recipe with laqat's torch references (milliseconds on the CPU, where the Triton interpreter takes
    seconds)."""
    config = la_compiler.load_policy(recipe).to_dict()
    config["linear_attention"] = ([{"module_name": "*", "cfg": {"solve": {"implementation": "torch"}}}]
                                  + config["linear_attention"])
    return la_compiler.Policy.from_dict(config)


class Block(torch.nn.Module):
    def __init__(self, hidden=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.gates = torch.nn.Linear(hidden, 2 * heads, bias=False)
        self.out = torch.nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        a, b = self.gates(x).view(B, T, 2, self.heads).unbind(2)
        k = torch.nn.functional.normalize(k, dim=-1)
        o, _ = chunk_gated_delta_rule(q, k, v, torch.nn.functional.logsigmoid(a), b.sigmoid())
        return self.out(o.reshape(B, T, -1)).square().mean()


def step(recipe: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="laqat", fullgraph=True,
                             options={"policy": policy_of(recipe), "compiler": "inductor"})
    loss = compiled(x)
    loss.backward()
    return {"loss": loss.detach(), **{f"d{name}": p.grad for name, p in model.named_parameters()}}


def main(prefix: str, compiles: list[str]) -> None:
    found, tensors = {}, {}
    real_source_hash = cache_key.source_hash
    for name in compiles:
        recipe, _, edited = name.partition(":")
        cache_key.source_hash = (lambda: "edited " + real_source_hash()) if edited else real_source_hash
        tensors[name] = step(recipe)
        found[name] = {"inductor": {k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k},
                       "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k}}
    torch.save(tensors, f"{prefix}.pt")
    with open(f"{prefix}.json", "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
