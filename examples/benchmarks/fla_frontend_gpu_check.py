"""On CUDA: the FLA frontend's opaque ops and whole FLA layers, laqat vs FLA's own kernels.

    OUT=./out python examples/benchmarks/fla_frontend_gpu_check.py    (after `pip install -e .`, as gpu_chores.sh setup does)

1. ``laqat::causal_conv1d`` (FLA's causal_conv1d_fwd/bwd on CUDA) against its fp32 torch reference
   (the CPU path): output, final state and every gradient, with bias, residual, initial state,
   varlen; fp32 and bf16 inputs;
2. ``laqat::layer_norm_gated`` / ``laqat::layer_norm`` (FLA's layer_norm_gated_fwd/bwd,
   layer_norm_fwd/bwd on CUDA) against their fp32 torch references, likewise;
3. GatedDeltaNet / KimiDeltaAttention layers (short conv, grouped heads, training mode -> chunk;
   eval + no_grad -> fused_recurrent): FLA eager (its own kernels) vs
   ``torch.compile(layer, backend="laqat", fullgraph=True)``: output and every gradient.
   FLA's GDN chunk backward refuses to run with Triton < 3.7.1 on Hopper: that row reports the
   error instead of a number.
Prints a table of relative L2 errors and writes $OUT/fla_frontend_gpu.json. Expected: fp32 rows
<= 1e-5 (ops) and <= 1e-4 (layers: FLA's chunk kernels vs the kernel laqat selects), bf16 rows
at bf16 rounding (<= 1e-2).
"""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch

import la_compiler
import la_compiler.backend  # noqa: F401  (installs the FLA substitutions)
from la_compiler.kernels.fla.conv_op import causal_conv1d_reference
from la_compiler.kernels.fla.norm_op import layer_norm_gated_reference

ROWS: list[dict] = []


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def record(check, case, errors=None, error=None):
    ROWS.append({"check": check, "case": case, "errors": errors or {}, "error": error})
    worst = max(errors.values()) if errors else None
    print(f"{check:28s} {case:44s} " + (f"max rel L2 {worst:.2e}  " + ", ".join(
        f"{k}={v:.1e}" for k, v in errors.items()) if errors else f"ERROR {error}"), flush=True)


def leaves(tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def grads_of(outputs, weights, inputs):
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights))
    wrt = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, wrt)


def check_conv(dtype, varlen):
    dev = "cuda"
    B, T, D, W = (1, 37, 48, 4) if varlen else (2, 37, 48, 4)
    cu = torch.tensor([0, 5, 20, 37], device=dev) if varlen else None
    N = 3 if varlen else B
    x = torch.randn(B, T, D, device=dev, dtype=dtype)
    tensors = [x, torch.randn(D, W, device=dev, dtype=dtype), torch.randn(D, device=dev, dtype=dtype),
               torch.randn(B, T, D, device=dev, dtype=dtype), torch.randn(N, D, W, device=dev, dtype=dtype)]
    mine, ref = leaves(tensors), leaves(tensors)
    y, fs = torch.ops.laqat.causal_conv1d(*mine, cu, "silu", True)
    y_ref, fs_ref = causal_conv1d_reference(*ref, cu, "silu")
    weights = [torch.randn_like(y, dtype=torch.float32), torch.randn_like(fs, dtype=torch.float32)]
    errors = {"y": rel_l2(y, y_ref), "final_state": rel_l2(fs, fs_ref)}
    for name, a, b in zip(("dx", "dweight", "dbias", "dresidual", "dh0"), grads_of([y, fs], weights, mine),
                          grads_of([y_ref, fs_ref], weights, ref)):
        errors[name] = rel_l2(a, b)
    record("laqat::causal_conv1d", f"{dtype} varlen={varlen}", errors)


def check_norm(dtype, gated, is_rms_norm):
    dev = "cuda"
    x, g = torch.randn(3, 11, 4, 64, device=dev, dtype=dtype), torch.randn(3, 11, 4, 64, device=dev, dtype=dtype)
    w, b = torch.randn(64, device=dev, dtype=dtype), torch.randn(64, device=dev, dtype=dtype)
    mine, ref = leaves([x, g, w, b]), leaves([x, g, w, b])
    if gated:
        y = torch.ops.laqat.layer_norm_gated(*mine, "swish", 1e-5, is_rms_norm)
    else:
        y = torch.ops.laqat.layer_norm(mine[0], mine[2], mine[3], 1e-5, is_rms_norm)
    y_ref = layer_norm_gated_reference(ref[0], ref[1] if gated else None, ref[2], ref[3], "swish", 1e-5, is_rms_norm)
    weights = [torch.randn_like(y, dtype=torch.float32)]
    names = ("dx", "dg", "dweight", "dbias") if gated else ("dx", "dweight", "dbias")
    if not gated:
        mine[1].requires_grad_(False)
        ref[1].requires_grad_(False)
    errors = {"y": rel_l2(y, y_ref)}
    for name, a, c in zip(names, grads_of([y], weights, mine), grads_of([y_ref], weights, ref)):
        errors[name] = rel_l2(a, c)
    op = "laqat::layer_norm_gated" if gated else "laqat::layer_norm"
    record(op, f"{dtype} {'rms' if is_rms_norm else 'layer'} norm", errors)


def check_layer(family, dtype, train):
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    cls = GatedDeltaNet if family == "gdn" else KimiDeltaAttention
    torch.manual_seed(0)
    layer = cls(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, expand_v=1.0, use_short_conv=True)
    layer = layer.to("cuda", dtype).train(train)
    x = torch.randn(2, 100 if train else 40, 256, device="cuda", dtype=dtype)
    compiled = torch.compile(layer, backend="laqat", fullgraph=True)
    x_mine, x_ref = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    with torch.set_grad_enabled(train):
        y = compiled(x_mine)[0]
        y_ref = layer(x_ref)[0]
    errors = {"y": rel_l2(y, y_ref)}
    if train:
        dy = torch.randn_like(y)
        params = list(layer.parameters())
        g = torch.autograd.grad((y.float() * dy).sum(), [x_mine, *params])
        g_ref = torch.autograd.grad((y_ref.float() * dy).sum(), [x_ref, *params])
        names = ["x"] + [n for n, _ in layer.named_parameters()]
        errors.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(names, g, g_ref)})
    kernels = [m.kernel for m in la_compiler.backend.last_record().graphs[-1].matches]
    record(f"{family} layer ({'chunk' if train else 'fused_recurrent'})", f"{dtype} kernel={kernels}", errors)


def main():
    assert torch.cuda.is_available(), "this check needs CUDA"
    checks = [(check_conv, (dt, vl)) for dt in (torch.float32, torch.bfloat16) for vl in (False, True)]
    checks += [(check_norm, (dt, gated, rms)) for dt in (torch.float32, torch.bfloat16)
               for gated in (True, False) for rms in (True, False)]
    checks += [(check_layer, (fam, dt, train)) for fam in ("gdn", "kda") for dt in (torch.float32, torch.bfloat16)
               for train in (True, False)]
    for fn, args in checks:
        try:
            fn(*args)
        except Exception as e:  # reported, never hidden
            record(fn.__name__, " ".join(map(str, args)), error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            traceback.print_exc()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fla_frontend_gpu.json").write_text(json.dumps({
        "torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": ROWS}, indent=1))
    print(f"wrote {out / 'fla_frontend_gpu.json'}")


if __name__ == "__main__":
    main()
