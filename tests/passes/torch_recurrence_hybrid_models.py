"""One training step of a tiny config-built OLMo-Hybrid, Bailing-hybrid or GLM5-next model,
eager vs laqat, with each family's DEFAULT linear-attention settings; run in its own process.

    python torch_recurrence_hybrid_models.py FAMILY[,FAMILY...] COMPILER [T [CHUNK [HC_MULT]]] [--fp64]

FAMILY: olmo_hybrid (GDN, ``linear_allow_neg_eigval=True``: beta in [0, 2]), bailing_hybrid
(KDA, ``kda_safe_gate=True``: g = lower_bound * sigmoid(...)), glm5_next (KDA,
``linear_lower_bound=-5``); COMPILER: inductor | eager. transformers picks FLA's Triton kernels
whenever ``fla`` imports, so this process hides FLA first (the models then run their torch
fallbacks: the chunked delta rule, chunk size 64 or CHUNK, which the models pass through their
kwargs). Prints one JSON line per family; ``--fp64`` adds every gradient's error against the
same eager code in float64 (where eager fp32 itself is off, e.g. OLMo's A_log at T = 72).
"""
import json
import os
import sys
import time
import warnings

sys.modules["fla"] = None  # noqa: E402  (before transformers)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import la_compiler  # noqa: E402
from la_compiler.backend import _ACTIVE_RECORD  # noqa: E402
from la_compiler.record import CompileRecord  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.interpreter_speedups import install as install_interpreter_speedups  # noqa: E402

install_interpreter_speedups()  # the interpreter's repeated patching skipped; the kernels compute the same

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=128,
             use_cache=False, pad_token_id=0)
LINEAR = ["linear_attention", "linear_attention"]
HC_MULT = [2]  # GLM5-next's hyper-connection streams (its default is 4)


def olmo_hybrid():
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    config = OlmoHybridConfig(**SMALL, layer_types=LINEAR + ["full_attention"], num_attention_heads=2,
                              num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
                              linear_key_head_dim=8, linear_value_head_dim=8, eos_token_id=1)
    assert config.linear_allow_neg_eigval  # the default
    return OlmoHybridForCausalLM(config)


def bailing_hybrid():
    from transformers import BailingHybridConfig, BailingHybridForCausalLM
    config = BailingHybridConfig(**SMALL, moe_intermediate_size=16, layer_types=LINEAR + ["full_attention"],
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                 num_experts_per_tok=2, n_group=1, topk_group=1, mlp_layer_types=["dense"] * 3,
                                 eos_token_id=1)
    assert config.kda_safe_gate and config.kda_lower_bound == -5.0  # the defaults
    return BailingHybridForCausalLM(config)


def glm5_next():
    from transformers.models.glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
    config = Glm5NextTextConfig(**dict(SMALL, num_hidden_layers=2), moe_intermediate_size=16, layer_types=LINEAR,
                                num_attention_heads=2, num_key_value_heads=2, linear_head_dim=8, linear_num_heads=2,
                                n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=8,
                                qk_nope_head_dim=8, v_head_dim=8, index_topk=128, index_head_dim=8, index_n_heads=2,
                                index_kpool=4, mlp_layer_types=["dense"] * 2, hc_mult=HC_MULT[0],
                                hc_sinkhorn_iters=3)
    assert config.linear_lower_bound == -5.0  # the default
    return Glm5NextTextModel(config)


CHUNK = {}  # {"chunk_size": C}: passed through the model's kwargs to the chunked fallback


def loss_of(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False, **CHUNK) if hasattr(model, "lm_head") else \
        model(input_ids=ids, use_cache=False, **CHUNK)
    if getattr(out, "loss", None) is not None:
        return out.loss
    h = out.last_hidden_state
    weights = torch.randn(h.shape, generator=torch.Generator().manual_seed(2)).to(h.dtype)
    return (h * weights).sum() / h.numel()


class _Float64(torch.overrides.TorchFunctionMode):
    """Runs eager code in float64: float32 dtype arguments and ``.float()`` become float64 (the
    fallbacks cast to float32 explicitly); the fp64 oracle both fp32 runs are measured against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        lift = lambda x: torch.float64 if x is torch.float32 else x  # noqa: E731
        args = tuple(lift(a) for a in args)
        kwargs = {k: lift(v) for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*args, **kwargs)


def fp64_grads(model, ids):
    import copy
    model64 = copy.deepcopy(model).double()
    model64.zero_grad(set_to_none=True)
    with _Float64():
        loss_of(model64, ids).backward()
    return grads_of(model64)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(family: str, compiler: str, seq_len: int, fp64: bool) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = globals()[family]().float()
    linear_layers = model.config.layer_types.count("linear_attention")
    ids = torch.randint(2, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    loss_eager = loss_of(model, ids)
    loss_eager.backward()
    grads_eager = grads_of(model)
    model.zero_grad(set_to_none=True)
    record = CompileRecord()
    _ACTIVE_RECORD.append(record)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(model, backend="inductor") if compiler == "plain_inductor" else \
                torch.compile(model, backend="laqat", options={"compiler": compiler})
            loss = loss_of(compiled, ids)
            loss.backward()
    finally:
        _ACTIVE_RECORD.pop()
    seconds = time.perf_counter() - t0
    grads = grads_of(model)
    out = {
        "family": family, "compiler": compiler, "linear_layers": linear_layers,
        "loss_eager": loss_eager.item(), "loss_laqat": loss.item(), "seconds": seconds,
        "grad_names": sorted(grads_eager), "grad_names_laqat": sorted(grads),
        "errors": {n: rel(grads[n], g) for n, g in grads_eager.items() if n in grads},
        "matches": [[m.kind, m.frontend, m.module, m.kernel] for g in record.graphs for m in g.matches],
        "near_misses": [n.reason for g in record.graphs for n in g.near_misses],
    }
    if fp64:
        grads64 = fp64_grads(model, ids)
        out["eager_vs_fp64"] = {n: rel(g, grads64[n]) for n, g in grads_eager.items()}
        out["laqat_vs_fp64"] = {n: rel(g, grads64[n]) for n, g in grads.items()}
    return out


def main(argv):
    """FAMILY[,FAMILY...] COMPILER [T [CHUNK [HC_MULT]]] [--fp64]: one JSON line per family."""
    fp64 = "--fp64" in argv
    argv = [a for a in argv if a != "--fp64"]
    families, compiler = argv[0].split(","), argv[1]
    seq_len = int(argv[2]) if len(argv) > 2 else 72
    if len(argv) > 3 and int(argv[3]):
        CHUNK["chunk_size"] = int(argv[3])
    if len(argv) > 4:
        HC_MULT[0] = int(argv[4])
    for family in families:
        print(json.dumps(check(family, compiler, seq_len, fp64)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
