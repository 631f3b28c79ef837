"""The fused recurrent kernels against FLA's, on CUDA: equality and timing.

    OUT=./out python examples/benchmarks/recurrent_vs_fla.py [--quick]

1. exactness on the GPU: fp32 forward and every gradient of small cases (varlen, grouped heads,
   initial state, both state layouts) against the fp64 reference (relative L2 <= 1e-5);
2. at [B, T, H, D] = [1, 1024, 4, 64] and [1, 4096, 16, 128] (bf16, bench_common.make_inputs):
   the fused recurrent kernel vs FLA's fused_recurrent_gated_delta_rule / fused_recurrent_kda forward
   (and vs FLA's chunk kernels), relative L2 of o and the final state, and
   triton.testing.do_bench medians of forward and forward+backward.
Prints a table and writes $OUT/recurrent_vs_fla.json. Works without ``pip install -e .``
(it maps the repo's folders onto ``la_compiler`` itself).
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from bench_common import ensure_la_compiler, make_inputs, peak_extra_mib, rel_l2, start_cuda_run  # noqa: E402

ensure_la_compiler()

from triton.testing import do_bench  # noqa: E402

from la_compiler.kernels.recurrent import fused_recurrent  # noqa: E402
from la_compiler.kernels.recurrent.params import FusedRecurrentParams  # noqa: E402
from la_compiler.kernels.recurrent.fused_recurrent import fused_recurrent_bwd, fused_recurrent_fwd  # noqa: E402
from la_compiler.kernels.reference.recurrent import delta_rule_reference  # noqa: E402


# ---- 1. exactness against the fp64 reference ------------------------------------------------
EXACT_CASES = [
    dict(kind="gdn", state="kv", B=2, T=100, H=2, HV=2, K=64, V=64, h0=True, cu=None),
    dict(kind="gdn", state="vk", B=1, T=150, H=2, HV=4, K=128, V=128, h0=True, cu=(0, 37, 101, 150)),
    dict(kind="kda", state="kv", B=1, T=130, H=1, HV=2, K=128, V=96, h0=False, cu=None),
    dict(kind="kda", state="vk", B=1, T=90, H=2, HV=4, K=100, V=256, h0=True, cu=(0, 1, 70, 90)),
]


def exactness(case, device="cuda") -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    c = dict(case)
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32, device=device)
    (q, k, v, g, beta), h0 = make_inputs(c["kind"], c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"], torch.float32,
                                         h0=c["h0"], n_seqs=None if cu is None else len(c["cu"]) - 1,
                                         state=c["state"], device=device)
    params = FusedRecurrentParams(c["kind"], c["state"])
    scale = c["K"] ** -0.5
    o, ht = fused_recurrent_fwd(params, q, k, v, g, beta, scale, h0, cu)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = fused_recurrent_bwd(params, q, k, v, g, beta, scale, do, dht, h0, cu)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0_ref = None if h0 is None else h0.double().requires_grad_(True)
    ro, rht = delta_rule_reference(*leaves, kind=c["kind"], scale=scale, initial_state=h0_ref, cu_seqlens=cu,
                                   state_layout=c["state"])
    wrt = leaves + ([h0_ref] if h0_ref is not None else [])
    ref = torch.autograd.grad([ro, rht], wrt, [do.double(), dht.double()])
    errors = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
    errors.update({n: rel_l2(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, ref)})
    return {"case": {k: v for k, v in c.items()}, "rel_l2": errors, "ok": max(errors.values()) <= 1e-5}


# ---- 2. against FLA ----------------------------------------------------------------------------

def versus_fla(kind: str, B: int, T: int, H: int, D: int) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    from la_compiler.kernels.fla.chunk_variant import gdn_backward_blocker

    (q, k, v, g, beta), _ = make_inputs(kind, B, T, H, H, D, D, torch.bfloat16)
    params = FusedRecurrentParams(kind, "kv")
    scale = D ** -0.5
    fla_recurrent = fused_recurrent_gated_delta_rule if kind == "gdn" else fused_recurrent_kda
    fla_chunk = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    fla_kw = dict(scale=scale, output_final_state=True)

    ours = lambda: fused_recurrent_fwd(params, q, k, v, g, beta, scale)  # noqa: E731
    theirs = lambda: fla_recurrent(q=q, k=k, v=v, g=g, beta=beta, **fla_kw)  # noqa: E731
    chunk = lambda: fla_chunk(q, k, v, g, beta, **fla_kw)  # noqa: E731
    o, ht = ours()
    fo, fht = theirs()
    co, cht = chunk()
    row = {
        "kind": kind, "shape": [B, T, H, D],
        "rel_l2_o_vs_fla_recurrent": rel_l2(o, fo), "rel_l2_ht_vs_fla_recurrent": rel_l2(ht, fht),
        "rel_l2_o_vs_fla_chunk": rel_l2(o, co), "rel_l2_ht_vs_fla_chunk": rel_l2(ht, cht),
        "ms_fwd_laqat": do_bench(ours, return_mode="median"),
        "ms_fwd_fla_recurrent": do_bench(theirs, return_mode="median"),
        "ms_fwd_fla_chunk": do_bench(chunk, return_mode="median"),
    }

    do = torch.ones_like(o)  # backward of o.float().sum()

    def ours_fwd_bwd():
        o, _ = fused_recurrent_fwd(params, q, k, v, g, beta, scale)
        return fused_recurrent_bwd(params, q, k, v, g, beta, scale, do)

    row["ms_fwd_bwd_laqat"] = do_bench(ours_fwd_bwd, return_mode="median")
    row["extra_mib_fwd_bwd_laqat"] = peak_extra_mib(ours_fwd_bwd)
    blocked = gdn_backward_blocker() if kind == "gdn" else None
    if blocked is None:
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

        def chunk_fwd_bwd():
            for x in leaves:
                x.grad = None
            o, _ = fla_chunk(*leaves, **fla_kw)
            o.float().sum().backward()

        row["ms_fwd_bwd_fla_chunk"] = do_bench(chunk_fwd_bwd, return_mode="median")
        row["extra_mib_fwd_bwd_fla_chunk"] = peak_extra_mib(chunk_fwd_bwd)
        chunk_fwd_bwd()
        ours_grads = ours_fwd_bwd()
        for name, a, x in zip(["dq", "dk", "dv", "dg", "dbeta"], ours_grads, leaves):
            row[f"rel_l2_{name}_vs_fla_chunk"] = rel_l2(a, x.grad)
    else:
        row["fla_chunk_backward"] = f"not run: {blocked}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the smaller comparison shape")
    parser.add_argument("--kinds", default="gdn,kda", help="comma-separated: gdn, kda")
    parser.add_argument("--skip-exactness", action="store_true")
    args = parser.parse_args()
    out, result = start_cuda_run("recurrent_vs_fla.py", "exactness", "versus_fla")

    print("exactness (fp32, laqat's kernel vs fp64 reference, max relative L2 over o, ht and every gradient)")
    for case in [] if args.skip_exactness else EXACT_CASES:
        try:
            r = exactness(case)
        except Exception as e:  # keep going: one run should report every case
            traceback.print_exc()
            result["exactness"].append({"case": case, "error": repr(e)})
            print(f"  {case['kind']} {case['state']} T={case['T']}: ERROR {e!r}")
            continue
        result["exactness"].append(r)
        worst = max(r["rel_l2"], key=r["rel_l2"].get)
        print(f"  {case['kind']} {case['state']} T={case['T']} HV={case['HV']} K={case['K']} V={case['V']}"
              f" varlen={case['cu'] is not None}: max {r['rel_l2'][worst]:.2e} ({worst})"
              f" {'ok' if r['ok'] else 'FAIL'}")

    shapes = [(1, 1024, 4, 64)] + ([] if args.quick else [(1, 4096, 16, 128)])
    header = (f"{'kind':4} {'[B,T,H,D]':>16} {'laqat fwd':>10} {'FLA rec fwd':>11} {'FLA chunk fwd':>13}"
              f" {'laqat f+b':>10} {'FLA chunk f+b':>13} {'o vs FLA rec':>12} {'o vs chunk':>10}")
    print("\nbf16, do_bench median ms\n" + header)
    for kind in args.kinds.split(","):
        for shape in shapes:
            try:
                row = versus_fla(kind, *shape)
            except Exception as e:
                traceback.print_exc()
                result["versus_fla"].append({"kind": kind, "shape": list(shape), "error": repr(e)})
                print(f"{kind:4} {str(list(shape)):>16} ERROR {e!r}")
                continue
            result["versus_fla"].append(row)
            chunk_fb = row.get("ms_fwd_bwd_fla_chunk")
            print(f"{kind:4} {str(list(shape)):>16} {row['ms_fwd_laqat']:10.3f} {row['ms_fwd_fla_recurrent']:11.3f}"
                  f" {row['ms_fwd_fla_chunk']:13.3f} {row['ms_fwd_bwd_laqat']:10.3f}"
                  f" {('%.3f' % chunk_fb) if chunk_fb else 'blocked':>13}"
                  f" {row['rel_l2_o_vs_fla_recurrent']:12.2e} {row['rel_l2_o_vs_fla_chunk']:10.2e}")
    result["kernel_file"] = fused_recurrent.__file__
    path = out / "recurrent_vs_fla.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
