"""On CUDA: laqat's FLA ops compile their backward's kernels ahead (kernels/fla/backward_ahead.py), and the
backward then compiles none of FLA's kernels; every output and gradient against the op's fp32 torch reference (its
CPU path).

    OUT=./out python examples/benchmarks/fla_backward_ahead_gpu_check.py    (one fresh process: the kernels' first
                                                                             launches are this process's)

Per op, at the model benchmark's widths (bf16, B=2, T=512): the first forward, the background thread waited for,
then the backward with every Triton compile outside the background thread recorded (``JITFunction._do_compile``;
autograd runs a CUDA backward on its own device thread). A row passes when the background requested compiles, the
backward compiled none of FLA's kernels, and the output and every gradient are within 1e-2 (relative L2) of the
reference; a last row, with ``LAQAT_FLA_COMPILE_AHEAD=off``, passes when the backward did compile FLA's kernels.
Prints a table and writes $OUT/fla_backward_ahead_gpu.json; exits 1 if a row fails.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

import la_compiler.backend  # noqa: F401  (registers laqat's ops)
from la_compiler.kernels.common.background_compiles import finish_background_compiles
from la_compiler.kernels.fla.backward_ahead import BACKGROUND_THREAD

B, T = 2, 512
BF16 = torch.bfloat16


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ops():
    """(name, call(*tensors) -> outputs, inputs as fp32 CPU tensors, the dtype each is given on the GPU)."""
    op = torch.ops.laqat
    H, D, HID, INTER = 8, 128, 1024, 2816
    return [
        ("layer_norm_gated", lambda x, g, w: op.layer_norm_gated(x, g, w, None, "swish", 1e-5, True),
         [torch.randn(B, T, H, D), torch.randn(B, T, H, D), 1 + 0.1 * torch.randn(D)], [BF16, BF16, torch.float32]),
        ("layer_norm", lambda x, w: op.layer_norm(x, w, None, 1e-6, True),
         [torch.randn(B, T, HID), 1 + 0.1 * torch.randn(HID)], [BF16, torch.float32]),
        ("layer_norm_residual", lambda x, r, w: sum(t.float() for t in op.layer_norm_residual(x, r, w, None, 1e-6,
                                                                                             True)),
         [torch.randn(B, T, HID), torch.randn(B, T, HID), 1 + 0.1 * torch.randn(HID)],
         [BF16, torch.float32, torch.float32]),  # an fp32 residual: another kind than layer_norm's
        ("l2_norm", lambda x: op.l2_norm(x, 1e-6, None)[0],
         [torch.randn(B, T, H, D)], [BF16]),
        ("causal_conv1d", lambda x, w: op.causal_conv1d(x, w, None, None, None, None, "silu", False)[0],
         [torch.randn(B, T, H * D), 0.3 * torch.randn(H * D, 4)], [BF16, BF16]),
        ("glu_linear", lambda x, y, w: op.glu_linear(x, y, w, None, "swiglu", 1.0),
         [torch.randn(B, T, INTER), torch.randn(B, T, INTER), 0.02 * torch.randn(HID, INTER)], [BF16, BF16, BF16]),
    ]


class Compiles:
    """The Triton compiles requested in the background thread (a count), and those requested in any other thread
    while recording (kernel name, module)."""

    def __init__(self):
        from triton.runtime import jit

        self.recording, self.seen, self.background = False, [], 0
        do_compile = jit.JITFunction._do_compile
        log = self

        def recorded(fn, *args, **kwargs):
            if threading.current_thread().name == BACKGROUND_THREAD:
                log.background += 1
            elif log.recording:
                log.seen.append((fn.__name__, fn.module or ""))
            return do_compile(fn, *args, **kwargs)
        jit.JITFunction._do_compile = recorded


def check(name, call, inputs, dtypes, compiles) -> dict:
    gpu = [t.to("cuda", d).requires_grad_(True) for t, d in zip(inputs, dtypes)]
    cpu = [t.to(d).float().requires_grad_(True) for t, d in zip(inputs, dtypes)]
    before = compiles.background
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out = call(*gpu)
        finish_background_compiles()
    requested = compiles.background - before
    grad = torch.randn(out.shape)
    compiles.recording, compiles.seen = True, []
    got = torch.autograd.grad(out, gpu, grad.to("cuda", out.dtype))
    torch.cuda.synchronize()
    compiles.recording = False
    fla_compiles = [k for k, module in compiles.seen if module.startswith("fla")]
    want_out = call(*cpu)
    want = torch.autograd.grad(want_out, cpu, grad.to(out.dtype).float())
    errors = {"out": rel_l2(out.float().cpu(), want_out)}
    errors.update({f"d{i}": rel_l2(g.float().cpu(), w) for i, (g, w) in enumerate(zip(got, want))})
    ok = requested > 0 and not fla_compiles and max(errors.values()) <= 1e-2 and not warned
    return {"op": name, "background_requests": requested, "backward_fla_compiles": fla_compiles,
            "rel_l2": {k: float(f"{v:.3g}") for k, v in errors.items()}, "warnings": [str(w.message) for w in warned],
            "ok": ok}


def control(compiles) -> dict:
    """The check's own sensitivity: with LAQAT_FLA_COMPILE_AHEAD=off (a width no row above used) the backward
    compiles FLA's kernels."""
    os.environ["LAQAT_FLA_COMPILE_AHEAD"] = "off"
    try:
        row = check("layer_norm (off: control)", lambda x, w: torch.ops.laqat.layer_norm(x, w, None, 1e-6, True),
                    [torch.randn(B, T, 1536), 1 + 0.1 * torch.randn(1536)], [BF16, torch.float32], compiles)
    finally:
        del os.environ["LAQAT_FLA_COMPILE_AHEAD"]
    row["ok"] = (row["background_requests"] == 0 and bool(row["backward_fla_compiles"])
                 and max(row["rel_l2"].values()) <= 1e-2)
    return row


def main() -> int:
    torch.manual_seed(0)
    compiles = Compiles()
    rows = [check(*op, compiles) for op in ops()] + [control(compiles)]
    print(f"{'op':26s} {'bg requests':>11s} {'backward FLA compiles':>21s} {'max rel L2':>10s}  ok")
    for r in rows:
        print(f"{r['op']:26s} {r['background_requests']:>11d} {len(r['backward_fla_compiles']):>21d} "
              f"{max(r['rel_l2'].values()):>10.2e}  {r['ok']}")
    out = Path(os.environ.get("OUT", ".")) / "fla_backward_ahead_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                               "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
