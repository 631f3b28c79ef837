"""One tiny random transformers model (tests/models/transformers_models.py) under laqat; run in its own process.

    python tests/models/run_transformers_model.py qwen3_next

transformers picks FLA's Triton kernels whenever ``fla`` imports (and crashes on CPU), so this process
hides FLA before importing transformers; the model then runs its torch fallbacks (the chunked GDN/KDA
function, causal_conv1d's torch path). Prints one JSON line:

- ``eager`` / ``fp64``: the uncompiled model in fp32, and in fp64 throughout (``float64_everywhere``
  lifts the model's own fp32 casts): loss, gradients' names, each eager gradient's distance to fp64;
- ``inductor`` / ``eager_handoff``: ``torch.compile(model, backend="laqat", fullgraph=True)`` with
  ``{"compiler": "inductor"}`` (the GPU's default hand-off; the CPU's is eager; only for the rows marked
  ``inductor``) and with ``{"compiler": "eager"}``, one forward and backward each: the laqat matches
  (kind, frontend, module) of that compile, its loss, its per-token losses' distance to eager's and,
  per parameter, the relative L2 error of the gradient against eager fp32 and against fp64;
- ``state_fp8``: ``{"policy": "state_fp8", "compiler": "eager"}``: the matches and specs, the per-token
  losses' distance to the exact eager hand-off's, the loss before and after one AdamW step;
- in each compiled run, every warning laqat raised (``laqat_warnings``: a shipped recipe raises none);
- CPU seconds per run (this process and the compilers it waited for) and in all.

A run that raises records ``error`` (type, message, the last traceback lines) and the next one runs.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import traceback
import warnings

sys.modules["fla"] = None  # noqa: E402  (before transformers)
os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's own CPU kernels (everything around the laqat nodes) as scalar C++, compiled in this
# process: g++ then takes a third of the time that at::vec kernels and a compile worker pool take on
# two shared cores. What laqat hands to Inductor, and what it gets back, is the same.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import transformers  # noqa: E402

import la_compiler  # noqa: E402,F401  (registers the backend's frontends)
from la_compiler.backend import last_record  # noqa: E402
from la_compiler.passes.frontends.torch_recurrence import SHARED_CHECKS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.interpreter_speedups import install as install_interpreter_speedups  # noqa: E402
from tests.models.transformers_models import (  # noqa: E402
    BATCH, BY_NAME, LINEAR_ATTENTION_KEYS, SEQ_LEN, VOCAB, ModelCase,
)

install_interpreter_speedups()  # the interpreter's repeated patching skipped; the kernels compute the same

ADAMW_STEPS = 1
ADAMW_LR = 1e-2


def build(case: ModelCase) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, case.config_class)(**case.overrides)
    model = getattr(transformers, case.model_class)(config).float()
    if case.redraw_dt_bias:
        generator = torch.Generator().manual_seed(2)
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name in case.linear_attention:
                dt_bias = modules[name].dt_bias
                u = torch.rand(dt_bias.shape, generator=generator, dtype=torch.float64)
                dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
                dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
    return model


def batch() -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids, use_cache=False)


class float64_everywhere(TorchFunctionMode):
    """Runs a float64 model as float64 throughout: ``x.float()``, ``x.to(torch.float32)`` and
    ``dtype=torch.float32`` (the fallbacks' and norms' explicit fp32 casts) give float64, and the
    default dtype is float64. The oracle both fp32 runs are measured against."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs = dict(kwargs, dtype=torch.float64)
        return func(*args, **kwargs)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def error_of(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {str(exc)[:3000]}\n" + "".join(lines[-6:])[-3000:]


def laqat_warnings(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught if w.category.__module__.startswith("la_compiler")]


def matches_since(n_graphs: int) -> dict:
    graphs = last_record().graphs[n_graphs:]
    return {
        "graphs": len(graphs),
        "matches": [[m.kind, m.frontend, m.module] for g in graphs for m in g.matches],
        "specs": [m.spec for g in graphs for m in g.matches],
        "near_misses": [[n.frontend, n.module, n.reason] for g in graphs for n in g.near_misses],
        # layers that took the algebra check of an identical layer before them (torch_recurrence/repeats.py)
        "shared_checks": sum(g.pass_counts.get(SHARED_CHECKS, 0) for g in graphs),
    }


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (Inductor's C++ compiler)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compiled(model, options):
    torch._dynamo.reset()
    return torch.compile(model, backend="laqat", fullgraph=True, options=options)


def token_losses(output) -> torch.Tensor:
    """The per-token cross entropy behind the model's mean loss: no cancellation between tokens."""
    logits, labels = output.logits[:, :-1].float(), batch()["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").detach()


def train_step(model, options, eager_grads, fp64_grads, eager_token_losses) -> tuple[dict, torch.Tensor | None]:
    """One compile, one forward and backward: matches, loss, every gradient against eager and fp64.
    Also returns the per-token losses (None where the run failed before them)."""
    n_graphs = len(last_record().graphs)
    model.zero_grad(set_to_none=True)
    out: dict = {}
    t0, c0 = time.perf_counter(), cpu_seconds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train_step(model, options, eager_grads, fp64_grads, eager_token_losses, out, t0)
    out["laqat_warnings"] = laqat_warnings(caught)
    out.update(matches_since(n_graphs))
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t0, cpu_seconds() - c0
    model.zero_grad(set_to_none=True)
    return out, losses


def _train_step(model, options, eager_grads, fp64_grads, eager_token_losses, out, t0) -> torch.Tensor | None:
    losses = None
    try:
        output = compiled(model, options)(**batch())
        out["seconds_compile_forward"] = time.perf_counter() - t0
        losses = token_losses(output)
        out["token_losses_vs_eager"] = rel(losses, eager_token_losses)
        t1 = time.perf_counter()
        output.loss.backward()
        out["seconds_backward"] = time.perf_counter() - t1
        grads = grads_of(model)
        out["loss"] = output.loss.item()
        out["grad_names"] = sorted(grads)
        out["vs_eager"] = {n: rel(g, eager_grads[n]) for n, g in grads.items() if n in eager_grads}
        out["vs_fp64"] = {n: rel(g, fp64_grads[n]) for n, g in grads.items() if n in fp64_grads}
    except Exception as exc:  # noqa: BLE001  (reported, the test asserts on it)
        out["error"] = error_of(exc)
    return losses


def adamw_steps(model, options, exact_token_losses) -> dict:
    """A compile with ``options``; the loss before and after each of ADAMW_STEPS AdamW steps, and how
    far the first step's per-token losses are from the exact ones."""
    n_graphs = len(last_record().graphs)
    out: dict = {"losses": []}
    t0, c0 = time.perf_counter(), cpu_seconds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _adamw_steps(model, options, exact_token_losses, out)
    out["laqat_warnings"] = laqat_warnings(caught)
    out.update(matches_since(n_graphs))
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t0, cpu_seconds() - c0
    return out


def _adamw_steps(model, options, exact_token_losses, out) -> None:
    try:
        step = compiled(model, options)
        opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
        for i in range(ADAMW_STEPS + 1):
            output = step(**batch())
            out["losses"].append(output.loss.item())
            if i == 0:
                out["token_losses_vs_exact"] = rel(token_losses(output), exact_token_losses)
            if i == ADAMW_STEPS:
                break
            opt.zero_grad(set_to_none=True)
            output.loss.backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001
        out["error"] = error_of(exc)


def fp64_run(case: ModelCase, model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same model and batch in float64 throughout: loss and gradients."""
    model64 = build(case).double()
    if model64._can_set_experts_implementation():
        model64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    model64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()})
    with float64_everywhere():
        loss = model64(**batch()).loss
    loss.backward()
    return loss, grads_of(model64)


def main(name: str) -> dict:
    case = BY_NAME[name]
    t_start = time.perf_counter()
    model = build(case)
    modules = dict(model.named_modules())
    text_config = model.config.get_text_config()
    result: dict = {
        "name": name,
        "linear_attention_classes": {n: type(modules[n]).__name__ if n in modules else None
                                     for n in case.linear_attention},
        "linear_attention_config": {k: getattr(text_config, k) for k in LINEAR_ATTENTION_KEYS
                                    if hasattr(text_config, k)},
        "params": sum(p.numel() for p in model.parameters()),
    }

    t0 = time.perf_counter()
    output = model(**batch())
    eager_token_losses = token_losses(output)
    output.loss.backward()
    eager_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    result["eager"] = {"loss": output.loss.item(), "grad_names": sorted(eager_grads),
                       "seconds": time.perf_counter() - t0}

    t0 = time.perf_counter()
    loss64, fp64_grads = fp64_run(case, model)
    result["fp64"] = {"loss": loss64.item(), "seconds": time.perf_counter() - t0,
                      "eager_vs_fp64": {n: rel(g, fp64_grads[n]) for n, g in eager_grads.items()}}

    if case.inductor:
        result["inductor"], _ = train_step(model, {"compiler": "inductor"}, eager_grads, fp64_grads,
                                           eager_token_losses)
    result["eager_handoff"], exact = train_step(model, {"compiler": "eager"}, eager_grads, fp64_grads,
                                                eager_token_losses)
    # the policy's effect alone: against the exact run of the same hand-off (eager's where that failed)
    result["state_fp8"] = adamw_steps(model, {"policy": "state_fp8", "compiler": "eager"},
                                      eager_token_losses if exact is None else exact)
    result["seconds"], result["cpu_seconds"] = time.perf_counter() - t_start, cpu_seconds()
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1])))
