"""Where a decode-phase training step spends its time on CUDA, and how the suffix kernels' launch settings move it.

    OUT=./out python examples/benchmarks/decode_profile.py [--kinds gdn kda] [--shape 1x4096x16x128] [--prefix 2048]
        [--rows token,token-int8-block32,vllm serving recipe] [--sections split forward dstate backward]
        [--state kv|vk]

1. ``split``: device time per kernel (torch.profiler, ms per call) of one forward and backward of
   ``laqat::delta_rule_phased`` per row (decode_bench.py's comparison rows, the kernel the selection table picks);
2. ``forward``: the suffix forward kernel alone (do_bench median) at each warp count and tile orientation
   (``VFIRST``: the state tile [BV, BK] in registers), with and without storing checkpoints, against FLA's
   ``fused_recurrent`` forward over the same suffix;
3. ``dstate``: the state-gradient walk alone at each value-tile width, warp count and orientation;
4. ``backward``: the block kernel (decode_bwd_kernel) at each checkpoint interval, programs per multiprocessor and
   warp count.

The sweeps launch the kernels directly with the settings they vary (a setting that changes the order of sums,
the orientation, changes bits within the decode contract). Writes $OUT/decode_profile.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from bench_common import ensure_la_compiler, kernel_times, make_inputs  # noqa: E402

ensure_la_compiler()

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import la_compiler.ir.delta_rule_phased  # noqa: E402,F401  (registers laqat::delta_rule_phased)
import la_compiler.kernels  # noqa: E402,F401  (registers the kernel variants)
from decode_bench import compare_spec, parse_shape  # noqa: E402
from la_compiler.kernels.decode import kernels, suffix  # noqa: E402

ROWS = ("token", "token-int8-block32", "vllm serving recipe")


@dataclasses.dataclass
class Case:
    kind: str
    row: str
    spec: object
    leaves: list
    packed: list  # the suffix's q, k, v, g, beta: [1, B * (T - prefix), ...]
    cu: torch.Tensor
    h0: torch.Tensor
    pre: torch.Tensor
    val: torch.Tensor
    scale: float


def build(kind, row, B, T, H, D, prefix, state="kv") -> Case:
    spec = compare_spec(kind, row, T, D, "cuda").replace(state=state)
    (q, k, v, g, beta), _ = make_inputs(kind, B, T, H, H, D, D, torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    packed = [x[:, prefix:].reshape(1, -1, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    cu = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * (T - prefix)
    h0 = torch.randn(B, H, D, D, device="cuda") * 0.1
    pre = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    val = torch.full((B,), T, dtype=torch.int32, device="cuda")
    return Case(kind, row, spec, leaves, packed, cu, h0, pre, val, D ** -0.5)


def split(case: Case) -> dict:
    text = case.spec.to_string()

    def step():
        for x in case.leaves:
            x.grad = None
        o = torch.ops.laqat.delta_rule_phased(*case.leaves, None, None, case.pre, case.val, case.scale, text)[0]
        o.float().sum().backward()

    return {"spec": text, "kernels_ms": {k: round(t, 4) for k, t in kernel_times(step).items()}}


def _forward_launch(case: Case, *, vfirst: bool, num_warps: int, save: bool):
    q, k, v, g, beta = case.packed
    opts = suffix.options_of(case.spec)
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    BK, BV = suffix.tiles(K, V, opts)
    params = dataclasses.replace(suffix.DecodeParams.from_spec(case.spec, v.dtype), vfirst=vfirst)
    n = case.cu.numel() - 1
    blocks = suffix.blocks_of([int(x) for x in case.cu.diff().tolist()], q.device)
    ckpt = torch.empty(suffix.checkpoint_numel(case.spec, q, v, case.cu), device=q.device)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ht = torch.empty(case.h0.shape, device=q.device)

    def launch():
        kernels.decode_fwd_kernel[(triton.cdiv(V, BV), n * HV)](
            q, k, v, g, beta, case.h0, o, ht, ckpt, case.cu, blocks.offsets, case.scale, opts.window,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CK=suffix.CHECKPOINT_EVERY, SAVE_CKPT=save,
            **params.constants(*suffix.KERNEL_CONSTEXPRS["decode_fwd_kernel"]), num_warps=num_warps)
    return launch


def forward_sweep(case: Case) -> list[dict]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import fused_recurrent_kda

    out = []
    default_warps = suffix._forward_warps(suffix.DecodeParams.from_spec(case.spec, case.packed[2].dtype))
    settings = [(vfirst, warps, True) for vfirst in (False, True) for warps in (1, 2, 4, 8)]
    settings.append((suffix.DecodeParams.from_spec(case.spec).vfirst, default_warps, False))
    for vfirst, warps, save in settings:
        if vfirst and suffix.options_of(case.spec).codec == "int8_h32":
            continue
        try:
            ms = do_bench(_forward_launch(case, vfirst=vfirst, num_warps=warps, save=save), warmup=20, rep=100)
            out.append({"vfirst": vfirst, "num_warps": warps, "save_ckpt": save, "ms": round(ms, 4)})
        except Exception as e:  # a setting Triton cannot compile (registers)
            out.append({"vfirst": vfirst, "num_warps": warps, "save_ckpt": save, "error": str(e)[:200]})
        print(f"  forward {case.kind} {case.row}: {out[-1]}", flush=True)
    fla = fused_recurrent_gated_delta_rule if case.kind == "gdn" else fused_recurrent_kda
    q, k, v, g, beta = case.packed
    ms = do_bench(lambda: fla(q=q, k=k, v=v, g=g, beta=beta, scale=case.scale, initial_state=case.h0,
                              output_final_state=True, cu_seqlens=case.cu.long()), warmup=20, rep=100)
    out.append({"fla_fused_recurrent_ms": round(ms, 4)})
    print(f"  forward {case.kind} FLA fused_recurrent: {ms:.4f}", flush=True)
    return out


def dstate_sweep(case: Case) -> list[dict]:
    q, k, v, g, beta = case.packed
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(K)
    n = case.cu.numel() - 1
    blocks = suffix.blocks_of([int(x) for x in case.cu.diff().tolist()], q.device)
    do = torch.randn(v.shape, dtype=v.dtype, device=v.device)
    dh_end = torch.empty(blocks.count * HV * K * V, device=v.device)
    dh0 = torch.empty(case.h0.shape, device=v.device)
    base = suffix.DecodeParams.from_spec(case.spec, v.dtype)
    out = []
    settings = [(False, bv, warps) for bv in (8, 16, 32) for warps in (1, 2, 4)] + [(True, 8, 1), (True, 32, 1)]
    for vfirst, bv, warps in settings:
        params = dataclasses.replace(base, vfirst=vfirst)

        def launch():
            kernels.decode_dstate_kernel[(triton.cdiv(V, bv), n * HV)](
                q, k, v, g, beta, do, case.h0, dh_end, dh0, case.cu, blocks.offsets, case.scale,
                H=H, HV=HV, K=K, V=V, BK=BK, BV=bv, CK=suffix.CHECKPOINT_EVERY,
                **params.constants(*suffix.KERNEL_CONSTEXPRS["decode_dstate_kernel"]), num_warps=warps)
        out.append({"vfirst": vfirst, "block_v": bv, "num_warps": warps,
                    "ms": round(do_bench(launch, warmup=20, rep=100), 4)})
        print(f"  dstate {case.kind} {case.row}: {out[-1]}", flush=True)
    return out


def backward_sweep(case: Case) -> list[dict]:
    q, k, v, g, beta = case.packed
    do = torch.randn(v.shape, dtype=v.dtype, device=v.device)
    dht = torch.randn(case.h0.shape, device=v.device)
    defaults = (suffix.CHECKPOINT_EVERY, suffix.PROGRAMS_PER_SM, suffix.NUM_WARPS)
    out = []
    try:
        settings = [(ck, per_sm, None) for ck in (16, 32, 64) for per_sm in (2, 4, 8)] + [(32, 4, 4), (32, 4, 8)]
        for ck, per_sm, warps in settings:
            suffix.CHECKPOINT_EVERY, suffix.PROGRAMS_PER_SM, suffix.NUM_WARPS = ck, per_sm, warps
            ckpt = torch.empty(suffix.checkpoint_numel(case.spec, q, v, case.cu), device=q.device)
            suffix.suffix_forward(case.spec, q, k, v, g, beta, case.h0, case.cu, case.scale, checkpoints=ckpt)
            times = kernel_times(lambda: suffix.suffix_backward(case.spec, q, k, v, g, beta, case.cu, case.scale,
                                                                do, dht, ckpt))
            bwd = sum(t for name, t in times.items() if "decode_bwd_kernel" in name)
            walk = sum(t for name, t in times.items() if "decode_dstate_kernel" in name)
            out.append({"checkpoint_every": ck, "programs_per_sm": per_sm, "num_warps": warps,
                        "bwd_kernel_ms": round(bwd, 4), "dstate_ms": round(walk, 4),
                        "all_ms": round(sum(times.values()), 4)})
            print(f"  backward {case.kind} {case.row}: {out[-1]}", flush=True)
    finally:
        suffix.CHECKPOINT_EVERY, suffix.PROGRAMS_PER_SM, suffix.NUM_WARPS = defaults
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["gdn", "kda"])
    parser.add_argument("--shape", default="1x4096x16x128")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--state", choices=["kv", "vk"], default="kv",
                        help="the state's memory layout (FLA's GDN layers hand the IR a V-first state: vk)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--sections", nargs="+", default=["split", "forward", "dstate", "backward"])
    args = parser.parse_args()
    B, T, H, D, _ = parse_shape(f"{args.shape}:{args.prefix}")
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    result = {"shape": [B, T, H, D], "prefix": args.prefix, "state": args.state, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "cases": []}
    sweeps = {"split": split, "forward": forward_sweep, "dstate": dstate_sweep, "backward": backward_sweep}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for kind in args.kinds:
        for row in rows:
            case = build(kind, row, B, T, H, D, args.prefix, args.state)
            record = {"kind": kind, "row": row, "state": args.state}
            for section in args.sections:
                if section == "dstate" and row != rows[0]:  # it rounds nothing: the same for every row of a kind
                    continue
                try:
                    record[section] = sweeps[section](case)
                except Exception as e:
                    record[section] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{kind} {row} {section}: {json.dumps(record[section])[:2000]}", flush=True)
                with open(os.path.join(out_dir, "decode_profile.json"), "w") as f:
                    json.dump(result | {"cases": result["cases"] + [record]}, f, indent=1)
            result["cases"].append(record)


if __name__ == "__main__":
    main()
