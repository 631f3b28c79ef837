"""Decode-phase training (prefix + recurrent suffix with state rounding) on CUDA: accuracy and timing.

    OUT=./out python examples/benchmarks/decode_bench.py [--quick] [--num-warps 4 8 16] [--policies token ...]

1. accuracy on the GPU: the fused decode kernels (fp32 inputs) against the fp64 decode
   reference, forward and every gradient, token / decay-grid / replay / Hadamard cases;
2. KDA at [B, T, H, D] = [1, 257, 4, 128], prefix 64 (BASELINES.md's decode-phase anchor
   shape; bf16 q/k/v, BASELINES.md's inputs): fwd+bwd (forward, then backward of
   o.float().sum()) of laqat's decode_fused through ``laqat::delta_rule_phased`` for the token,
   decay-grid and replay policies, against the fp32 torch reference of the same policy and
   FLA's exact chunk_kda. Target: laqat <= 2x FLA exact.
Prints a table and writes $OUT/decode_bench.json. Works on triton 3.6 / torch 2.11 and without
``pip install -e .`` (it maps the repo's folders onto ``la_compiler`` itself).
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from bench_common import ensure_la_compiler, kernel_times, make_inputs, peak_extra_mib, rel_l2, start_cuda_run  # noqa: E402

ensure_la_compiler()

from triton.testing import do_bench  # noqa: E402

import la_compiler.ir_phase  # noqa: E402,F401  (registers laqat::delta_rule_phased)
from la_compiler.kernels.decode import fused as decode_fused  # noqa: E402
from la_compiler.kernels.decode.options import decode_options  # noqa: E402
from la_compiler.kernels.reference.decode import delta_rule_decode_reference  # noqa: E402
from la_compiler.spec import RecurrenceSpec  # noqa: E402

POLICIES = {
    # name: spec (state FP8 E4M3 per [K x 64] tile, as the seeds' decode study)
    "token": dict(phase="token", quant=(("state", "fp8_e4m3/tile64"),), extra=(("readout", "working"),)),
    "decay-grid": dict(phase="token", quant=(("state", "fp8_e4m3/tile64"),),
                       extra=(("decay_log_step", "0.00390625"), ("readout", "working"))),
    "replay": dict(phase="replay", quant=(("state", "fp8_e4m3/tile64"),),
                   extra=(("readout", "working"), ("replay_factor_qdq", "1"), ("replay_window", "8"))),
    "replay-h32": dict(phase="replay", quant=(("state", "int8_h32/tile64"),),
                       extra=(("readout", "working"), ("replay_factor_qdq", "1"), ("replay_window", "8"))),
}


def spec_of(kind: str, policy: str, state: str = "kv") -> RecurrenceSpec:
    return RecurrenceSpec(kind, state=state, kernel="decode_fused", **POLICIES[policy])


# ---- 1. accuracy against the fp64 reference ---------------------------------------------------
ACCURACY_CASES = [
    dict(kind="kda", policy="token", state="kv", B=2, T=80, H=2, HV=2, K=128, V=128, h0=True, cu=None,
         prefill=[64, 0], valid=[80, 71]),
    dict(kind="gdn", policy="decay-grid", state="vk", B=1, T=90, H=1, HV=2, K=64, V=96, h0=True,
         cu=(0, 30, 30, 90), prefill=[10, 0, 50], valid=[30, 0, 55]),
    dict(kind="kda", policy="replay", state="kv", B=1, T=70, H=2, HV=2, K=100, V=128, h0=False, cu=None,
         prefill=[20], valid=[70]),
    dict(kind="kda", policy="replay-h32", state="vk", B=2, T=40, H=1, HV=1, K=128, V=64, h0=True, cu=None,
         prefill=[5, 40], valid=[40, 40]),
]


def accuracy(case, device="cuda") -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    c = dict(case)
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32, device=device)
    (q, k, v, g, beta), h0 = make_inputs(c["kind"], c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"], torch.float32,
                                         h0=c["h0"], n_seqs=None if cu is None else len(c["cu"]) - 1,
                                         state=c["state"], device=device)
    spec = spec_of(c["kind"], c["policy"], c["state"])
    pre = torch.tensor(c["prefill"], dtype=torch.int32, device=device)
    val = torch.tensor(c["valid"], dtype=torch.int32, device=device)
    scale = c["K"] ** -0.5
    o, ht = decode_fused.decode_fused_forward(spec, q, k, v, g, beta, h0, cu, scale, prefill_lengths=pre,
                                              valid_lengths=val)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = decode_fused.decode_fused_backward(spec, q, k, v, g, beta, h0, cu, scale, do, dht,
                                               prefill_lengths=pre, valid_lengths=val)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0_ref = None if h0 is None else h0.double().requires_grad_(True)
    ro, rht = delta_rule_decode_reference(*leaves, kind=c["kind"], options=decode_options(spec),
                                          prefill_lengths=c["prefill"], valid_lengths=c["valid"], scale=scale,
                                          initial_state=h0_ref, cu_seqlens=cu, state_layout=c["state"])
    wrt = leaves + ([h0_ref] if h0_ref is not None else [])
    ref = torch.autograd.grad([ro, rht], wrt, [do.double(), dht.double()])
    errors = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
    errors.update({n: rel_l2(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, ref)})
    # ht is stored rounded: compare it element for element, counting rounding flips (fp32 and fp64 values on
    # either side of a rounding boundary, NUMERICS.md); everything else within 1e-3 relative L2
    tile_amax = rht.abs().amax((-2, -1), keepdim=True)
    flips = int(((ht.double() - rht).abs() > 1e-4 * rht.abs() + 1e-6 * tile_amax).sum())
    ok = all(e <= 1e-3 for n, e in errors.items() if n != "ht") and flips <= 0.02 * ht.numel()
    return {"case": c, "rel_l2": errors, "ht_flips": flips, "ht_elements": ht.numel(), "ok": ok}


# ---- 2. timing ------------------------------------------------------------------------------------

class _DirectDecode(torch.autograd.Function):
    """decode_fused without the custom-op dispatch (used only if the op path fails to import/run)."""

    @staticmethod
    def forward(ctx, spec, scale, pre, val, q, k, v, g, beta):
        ctx.save_for_backward(q, k, v, g, beta, pre, val)
        ctx.spec, ctx.scale = spec, scale
        return decode_fused.decode_fused_forward(spec, q, k, v, g, beta, None, None, scale, prefill_lengths=pre,
                                                 valid_lengths=val)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, pre, val = ctx.saved_tensors
        if dht is None:
            dht = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3], device=q.device)
        grads = decode_fused.decode_fused_backward(ctx.spec, q, k, v, g, beta, None, None, ctx.scale, do, dht,
                                                   prefill_lengths=pre, valid_lengths=val)
        return (None, None, None, None, *grads[:5])


def _phased(leaves, pre, val, scale, spec, path):
    if path == "op":
        return torch.ops.laqat.delta_rule_phased(*leaves, None, None, pre, val, scale, spec)
    return _DirectDecode.apply(RecurrenceSpec.parse(spec), scale, pre, val, *leaves)


def _add(rows, row):
    """Keep a timing row and print it at once (a run cut short still shows what it measured)."""
    rows.append(row)
    print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                           if not k.startswith("rel_l2")), flush=True)


def timing(B: int, T: int, H: int, D: int, prefix: int, policies, num_warps, fla_reference_ms=None,
           profile=False) -> list[dict]:
    from fla.ops.kda import chunk_kda

    (q, k, v, g, beta), _ = make_inputs("kda", B, T, H, H, D, D, torch.bfloat16)
    scale = D ** -0.5
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    pre = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    val = torch.full((B,), T, dtype=torch.int32, device="cuda")
    rows = []

    def fla_fwd_bwd():
        for x in leaves:
            x.grad = None
        o, _ = chunk_kda(*leaves, scale=scale, output_final_state=True)
        o.float().sum().backward()

    if fla_reference_ms is None:
        fla_ms = do_bench(fla_fwd_bwd, return_mode="median")
        _add(rows, {"impl": "FLA chunk_kda (exact)", "policy": "exact", "ms": fla_ms,
                     "extra_mib": peak_extra_mib(fla_fwd_bwd), "x_fla": 1.0})
        fla_fwd_bwd()
        fla_grads = [x.grad.clone() for x in leaves]
    else:  # FLA's chunk_kda compiles for minutes on a fresh machine: its figure from an earlier run
        fla_ms, fla_grads = fla_reference_ms, None
        _add(rows, {"impl": "FLA chunk_kda (exact), given (--fla-ms), not this run", "policy": "exact",
                     "ms": fla_ms, "extra_mib": float("nan"), "x_fla": 1.0})

    path = "op"
    try:
        _phased(leaves, pre, val, scale, spec_of("kda", policies[0]).to_string(), "op")[0].float().sum().backward()
    except Exception:  # e.g. another variant module failing to import on this triton: time the kernels directly
        traceback.print_exc()
        print("laqat::delta_rule_phased failed (above): timing decode_fused through a local autograd.Function")
        path = "direct"
    for policy in policies:
        spec = spec_of("kda", policy).to_string()
        for warps in num_warps:
            decode_fused.NUM_WARPS = warps

            def ours_fwd_bwd():
                for x in leaves:
                    x.grad = None
                o, _ = _phased(leaves, pre, val, scale, spec, path)
                o.float().sum().backward()

            try:
                ms = do_bench(ours_fwd_bwd, return_mode="median")
                row = {"impl": f"laqat decode_fused (num_warps={warps})", "policy": policy, "ms": ms, "path": path,
                       "extra_mib": peak_extra_mib(ours_fwd_bwd), "x_fla": ms / fla_ms}
                if profile:
                    row["kernels_ms"] = kernel_times(ours_fwd_bwd)
                    print("    kernels (ms per call): " + ", ".join(f"{n.split('(')[0][:40]} {t:.3f}"
                                                                   for n, t in row["kernels_ms"].items()))
                ours_fwd_bwd()
                # how far the rounded training phase is from exact FLA (not an error: a sanity scale)
                if fla_grads is not None:
                    row.update({f"rel_l2_d{n}_vs_fla_exact": rel_l2(x.grad, r)
                                for n, x, r in zip(("q", "k", "v", "g", "beta"), leaves, fla_grads)})
            except Exception as e:  # keep going: one run should report every row
                traceback.print_exc()
                row = {"impl": f"laqat decode_fused (num_warps={warps})", "policy": policy, "error": repr(e)}
            _add(rows, row)
        decode_fused.NUM_WARPS = None

        opts = decode_options(RecurrenceSpec.parse(spec))
        ref_leaves = [x.detach().float().requires_grad_(True) for x in leaves]

        def torch_fwd_bwd():
            for x in ref_leaves:
                x.grad = None
            o, _ = delta_rule_decode_reference(*ref_leaves, kind="kda", options=opts, prefill_lengths=[prefix] * B,
                                               valid_lengths=[T] * B, scale=scale, dtype=torch.float32)
            o.float().sum().backward()

        ms = do_bench(torch_fwd_bwd, warmup=1, rep=1, return_mode="median")
        _add(rows, {"impl": "torch reference (fp32, token loop)", "policy": policy, "ms": ms,
                     "extra_mib": peak_extra_mib(torch_fwd_bwd), "x_fla": ms / fla_ms})
        torch_fwd_bwd()
        rows[-1].update({f"rel_l2_d{n}_laqat_vs_torch": rel_l2(x.grad, r.grad)
                         for n, x, r in zip(("q", "k", "v", "g", "beta"), leaves, ref_leaves)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the accuracy cases")
    parser.add_argument("--fla-ms", type=float, default=None,
                        help="skip timing FLA's chunk_kda (minutes of compilation on a fresh machine) and use this "
                             "fwd+bwd figure, e.g. BASELINES.md's 3.50 ms; the table says it is not from this run")
    parser.add_argument("--profile", action="store_true", help="also time each laqat row's kernels one by one")
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=["token", "decay-grid", "replay", "replay-h32"],
                        choices=list(POLICIES))
    args = parser.parse_args()
    out, result = start_cuda_run("decode_bench.py", "accuracy", "timing")

    if not args.quick:
        print("accuracy (fp32 inputs, decode_fused vs fp64 decode reference, relative L2, max over o/ht/grads)")
        for case in ACCURACY_CASES:
            try:
                r = accuracy(case)
            except Exception as e:
                traceback.print_exc()
                result["accuracy"].append({"case": case, "error": repr(e)})
                print(f"  {case['kind']} {case['policy']}: ERROR {e!r}")
                continue
            result["accuracy"].append(r)
            worst = max((n for n in r["rel_l2"] if n != "ht"), key=r["rel_l2"].get)
            print(f"  {case['kind']} {case['policy']:<10} {case['state']} T={case['T']} K={case['K']} V={case['V']}: "
                  f"worst {worst} {r['rel_l2'][worst]:.2e}, ht flips {r['ht_flips']}/{r['ht_elements']} "
                  f"(ht rel L2 {r['rel_l2']['ht']:.1e}) {'ok' if r['ok'] else 'FAIL'}")

    print("\nKDA decode-phase training fwd+bwd, [1, 257, 4, 128] bf16, prefix 64 (median ms)")
    try:
        result["timing"] = timing(1, 257, 4, 128, 64, args.policies, args.num_warps, args.fla_ms, args.profile)
    except Exception as e:
        traceback.print_exc()
        result["timing_error"] = repr(e)
    print(f"| {'implementation':<40} | {'policy':<10} | {'ms':>8} | {'x FLA':>6} | {'extra MiB':>9} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 11}|")
    for r in result["timing"]:
        if "error" in r:
            print(f"| {r['impl']:<40} | {r['policy']:<10} | ERROR {r['error'][:60]}")
            continue
        print(f"| {r['impl']:<40} | {r['policy']:<10} | {r['ms']:8.3f} | {r['x_fla']:6.2f} | {r['extra_mib']:9.1f} |")
    (out / "decode_bench.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out / 'decode_bench.json'}")


if __name__ == "__main__":
    main()
