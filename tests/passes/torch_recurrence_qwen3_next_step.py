"""One training step of a tiny random Qwen3-Next, eager vs laqat; run in its own process.

transformers picks FLA's Triton kernels whenever ``fla`` imports (and crashes on CPU), so this
process hides FLA before importing transformers; the model then runs its torch fallbacks
(torch_chunk_gated_delta_rule for T > 1, causal_conv1d_fn's torch path: no causal_conv1d
package is needed). Prints one JSON line: loss, gradient errors, the laqat matches.
"""
import copy
import inspect
import json
import os
import sys
import time

sys.modules["fla"] = None  # noqa: E402  (before transformers)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

import la_compiler  # noqa: E402


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
        mlp_only_layers=[0, 1], max_position_embeddings=256, use_cache=False,
    )
    return Qwen3NextForCausalLM(config).float()


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def fp64_oracle_grads(model, ids):
    """The same eager model in float64, its GDN fallback included (its explicit fp32 casts
    lifted to fp64): the oracle both fp32 runs are measured against."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen

    original = qwen.torch_chunk_gated_delta_rule
    source = inspect.getsource(inspect.unwrap(original))
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    namespace = dict(vars(qwen))
    exec(compile(source.replace("torch.float32", "torch.float64"), qwen.__file__, "exec"), namespace)
    qwen.torch_chunk_gated_delta_rule = namespace["torch_chunk_gated_delta_rule"]
    try:
        model64 = copy.deepcopy(model).double()
        model64.zero_grad(set_to_none=True)
        model64(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return grads_of(model64)
    finally:
        qwen.torch_chunk_gated_delta_rule = original


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(seq_len: int, backend: str | None):
    policy = {"linear_attention": [{"module_name": "*", "cfg": {"backend": backend}}]} if backend else None
    model = tiny_model()
    ids = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    loss_eager = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss_eager.backward()
    grads_eager = grads_of(model)
    model.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    # explain compiles with the laqat backend (the rest of the graph runs eagerly) and returns the output
    report = la_compiler.explain(model, input_ids=ids, labels=ids, use_cache=False, policy=policy)
    t2 = time.perf_counter()
    loss_laqat = report.output.loss
    loss_laqat.backward()
    grads_laqat = grads_of(model)
    t3 = time.perf_counter()
    grads64 = fp64_oracle_grads(model, ids)
    errors = {n: rel(grads_laqat[n], g) for n, g in grads_eager.items() if n in grads_laqat}
    eager_vs_fp64 = {n: rel(g, grads64[n]) for n, g in grads_eager.items()}
    laqat_vs_fp64 = {n: rel(g, grads64[n]) for n, g in grads_laqat.items()}
    print(json.dumps({
        "loss_eager": loss_eager.item(), "loss_laqat": loss_laqat.item(),
        "seconds": {"eager": t1 - t0, "compile_and_forward": t2 - t1, "backward": t3 - t2},
        "grad_names": len(grads_eager), "grad_names_laqat": len(grads_laqat),
        "max_grad_err": max(errors.values()), "worst": max(errors, key=errors.get),
        "errors": {n: f"{e:.1e}" for n, e in sorted(errors.items(), key=lambda t: -t[1])[:6]},
        "kernels": [m.kernel for m in report.matches],
        "eager_vs_fp64": eager_vs_fp64, "laqat_vs_fp64": laqat_vs_fp64, "laqat_vs_eager": errors,
        "matches": [[m.kind, m.frontend, m.module, m.region_size] for m in report.matches],
        "near_misses": [n.reason for n in report.near_misses],
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 72, sys.argv[2] if len(sys.argv) > 2 else None)
