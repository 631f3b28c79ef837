"""laqat's chunked (WY) kernels against FLA's chunk kernels on CUDA: exactness, time, memory.

    OUT=./out python examples/benchmarks/chunk_bench.py [--quick] [--kinds gdn,kda] [--shapes 1x1024x4x64,...]
        [--policies "laqat exact,laqat FP8 state"] [--skip-exactness] [--no-emulation-above TOKENS]

First use of every spec compiles its Triton kernels (seconds each); split long runs by --kinds /
--shapes / --policies to stay inside a 10-minute command limit.

1. exactness on the GPU (fp32, small varlen / grouped-head cases): the chunk kernels' forward and
   every gradient against fp64 autograd of the chunk reference, exact (relative L2 <= 1e-5) and
   with state / W QDQ (<= 1e-3);
2. at [B, T, H, D] in (1,1024,4,64), (1,4096,16,128), (8,4096,16,128), bf16 inputs as in
   triton.testing.do_bench medians of forward and forward+backward (backward of
   o.float().sum()) and peak extra MiB above the pre-run allocation, for
     FLA exact (chunk_kda fwd / fwd+bwd; chunk_gated_delta_rule fwd, its backward where FLA allows it, or
       with --lift-fla-gdn-guard past FLA's Hopper guard, timing only),
     laqat exact / FP8 state / INT8 state / FP8 state + W  (torch.ops.laqat.delta_rule, kernel=chunk),
     laqat FP8 all sites (+ state + W) / NVFP4 operands (all eight sites + W),
     laqat FP16 accumulators (block 16) at every GEMM site (the seeds' accumulator study),
     fp32 torch chunk emulation with FP8 state (kernels/reference/chunk.py in fp32),
   with ratios to FLA's time for the same pass. By default the issue's rows (TABLE_POLICIES: exact, FP8 / INT8
   state, FP8 all sites, NVFP4 operands, with FLA and the emulation); --policies all adds every setting row
   (accumulators, key blocks, GEMM precision, residual modes, ...), --policies "a,b" picks rows by name.
--numerics / --tuning (key=value,... as the spec spells them: docs/options.md) apply options to every laqat
spec of the run, the exactness cases included.
Prints a table and writes $OUT/chunk_bench.json. Every measurement that fails (FLA's guard,
out of memory) is caught and reported in the table and the JSON, never hidden.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback

import torch

from bench_common import ensure_la_compiler, kernel_times, make_inputs, peak_extra_mib, rel_l2, start_cuda_run  # noqa: E402

ensure_la_compiler()

from triton.testing import do_bench  # noqa: E402

import la_compiler.ir.delta_rule  # noqa: E402,F401  (registers torch.ops.laqat.delta_rule)
from la_compiler.ir.spec import GEMM_SITES, RecurrenceSpec  # noqa: E402
from la_compiler.kernels.chunk.bwd import chunk_bwd  # noqa: E402
from la_compiler.kernels.chunk.fwd import chunk_fwd  # noqa: E402
from la_compiler.kernels.chunk.params import ChunkParams, unsupported  # noqa: E402
from la_compiler.kernels.chunk.residual import residual_size  # noqa: E402
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference  # noqa: E402
from la_compiler.options import NumericsOptions, TuningOptions  # noqa: E402

SHAPES = [(1, 1024, 4, 64), (1, 4096, 16, 128), (8, 4096, 16, 128)]
OPERANDS = [f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if (s, side) != ("state_read", "lhs")]
FP8_ALL = {site: "fp8_e4m3/row" for site in OPERANDS}
NVFP4_ALL = {site: "nvfp4/block16" for site in OPERANDS}
POLICIES = {  # name -> quant sites of the spec
    "laqat exact": {},
    "laqat FP8 state": {"state": "fp8_e4m3/tile64"},
    "laqat INT8 state": {"state": "int8/tile64"},
    "laqat FP8 state + W": {"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"},
    "laqat FP8 all sites": {**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"},
    "laqat NVFP4 operands": {**NVFP4_ALL, "w": "nvfp4/block16"},
    "laqat FP16 accumulators (block 16)": {},  # acc.<every GEMM site>=fp16:16, see ACCUMULATORS
    "laqat exact (2-stage serial loops)": {},  # t.serial_stages=2, see SETTINGS
    "laqat exact (autotuned)": {},  # t.autotune=true (the first call times the candidates)
    "laqat exact (intra key block 32)": {},  # n.key_block=32
    "laqat exact (intra whole key rows)": {},  # n.key_block=128: the forward intra stage before key blocks
    "laqat exact (intra key block 16)": {},  # n.key_block=16
    "laqat exact (bwd key block 32)": {},  # n.bwd_key_block=32: KDA's backward intra and pairs stages
    "laqat exact (key blocks 32 / bwd 32)": {},
    "laqat FP8 all sites (autotuned)": {**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"},
    "laqat exact (intra key block 64)": {},  # n.key_block=64
    "laqat exact (bwd key block 64)": {},  # n.bwd_key_block=64
    "laqat exact (TF32 GEMMs)": {},  # n.gemm=tf32: fp32 operands and intermediates
    "laqat FP8 state (TF32 GEMMs)": {"state": "fp8_e4m3/tile64"},
    # t.keep_residual=none: the backward recomputes the whole forward intra stage
    "laqat exact (no residual)": {},
    "laqat FP8 state (no residual)": {"state": "fp8_e4m3/tile64"},
    "laqat FP8 all sites (no residual)": {**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"},
    # t.keep_residual=all: the forward keeps W, U, h, V_new too; the backward runs no forward kernel
    "laqat exact (keep all)": {},
    "laqat FP8 state (keep all)": {"state": "fp8_e4m3/tile64"},
    "laqat FP8 all sites (keep all)": {**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"},
}
# the benchmark table issue 5 asks for (FLA exact and the fp32 torch emulation are always timed)
TABLE_POLICIES = ("laqat exact", "laqat FP8 state", "laqat INT8 state", "laqat FP8 all sites", "laqat NVFP4 operands")
SETTINGS = {  # rows that time a spec with numerics (n.) or tuning (t.) options: docs/options.md
    "laqat exact (2-stage serial loops)": {"tuning": {"serial_stages": 2}},
    "laqat exact (autotuned)": {"tuning": {"autotune": True}},
    "laqat exact (intra key block 32)": {"numerics": {"key_block": 32}},
    "laqat exact (intra whole key rows)": {"numerics": {"key_block": 128}},
    "laqat exact (intra key block 16)": {"numerics": {"key_block": 16}},
    "laqat exact (bwd key block 32)": {"numerics": {"bwd_key_block": 32}},
    "laqat exact (key blocks 32 / bwd 32)": {"numerics": {"key_block": 32, "bwd_key_block": 32}},
    "laqat FP8 all sites (autotuned)": {"tuning": {"autotune": True}},
    "laqat exact (intra key block 64)": {"numerics": {"key_block": 64}},
    "laqat exact (bwd key block 64)": {"numerics": {"bwd_key_block": 64}},
    "laqat exact (TF32 GEMMs)": {"numerics": {"gemm": "tf32"}},
    "laqat FP8 state (TF32 GEMMs)": {"numerics": {"gemm": "tf32"}},
    "laqat exact (no residual)": {"tuning": {"keep_residual": "none"}},
    "laqat FP8 state (no residual)": {"tuning": {"keep_residual": "none"}},
    "laqat FP8 all sites (no residual)": {"tuning": {"keep_residual": "none"}},
    "laqat exact (keep all)": {"tuning": {"keep_residual": "all"}},
    "laqat FP8 state (keep all)": {"tuning": {"keep_residual": "all"}},
    "laqat FP8 all sites (keep all)": {"tuning": {"keep_residual": "all"}},
}
# --numerics / --tuning: options of every laqat spec of the run (the exactness cases too), over a row's own
RUN_OPTIONS = {"numerics": NumericsOptions(), "tuning": TuningOptions()}


def with_options(spec: RecurrenceSpec, row: dict | None = None) -> RecurrenceSpec:
    """``spec`` with the run's options and then a SETTINGS row's."""
    row = row or {}
    return spec.replace(**{name: {**RUN_OPTIONS[name].to_dict(), **row.get(name, {})} for name in RUN_OPTIONS})
ACCUMULATORS = {"laqat FP16 accumulators (block 16)": {site: "fp16:16" for site in GEMM_SITES}}


# ---- 1. exactness ------------------------------------------------------------------------------
PAIR_SITES = [f"{s}.{side}" for s in ("key_interaction", "output_score") for side in ("lhs", "rhs")]
PAIR_SITES_FP8 = {site: "fp8_e4m3/row" for site in PAIR_SITES}  # KDA: the rounded pair-product kernels
PAIR_SITES_NVFP4 = {site: "nvfp4/block16" for site in PAIR_SITES}
EXACT_CASES = [
    dict(kind="gdn", state="kv", B=2, T=200, H=2, HV=2, K=64, V=64, cu=None, quant={}),
    dict(kind="gdn", state="vk", B=1, T=300, H=2, HV=4, K=128, V=128, cu=(0, 37, 101, 300), quant={}),
    dict(kind="kda", state="kv", B=1, T=130, H=1, HV=2, K=128, V=96, cu=None, quant={}),
    dict(kind="kda", state="vk", B=1, T=190, H=2, HV=4, K=64, V=128, cu=(0, 1, 70, 190), quant={}),
    dict(kind="gdn", state="kv", B=1, T=300, H=2, HV=4, K=128, V=128, cu=(0, 100, 300),
         quant={"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}),
    dict(kind="kda", state="kv", B=2, T=150, H=2, HV=2, K=128, V=128, cu=None, quant={"state": "int8/tile64"}),
    dict(kind="kda", state="vk", B=1, T=200, H=1, HV=2, K=256, V=128, cu=(0, 70, 200), quant={}),
    dict(kind="kda", state="kv", B=2, T=150, H=2, HV=2, K=256, V=64, cu=None,
         quant={"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}),
    dict(kind="gdn", state="vk", B=1, T=200, H=1, HV=2, K=256, V=128, cu=(0, 70, 200), quant={}),
    dict(kind="kda", state="kv", B=1, T=200, H=1, HV=2, K=128, V=64, cu=(0, 70, 200), quant=PAIR_SITES_FP8),
    dict(kind="kda", state="vk", B=2, T=150, H=2, HV=2, K=64, V=64, cu=None, quant=PAIR_SITES_NVFP4),
    # all sixteen operand sites + state + W: one fp32-vs-fp64 flip of an operand element moves a whole row or
    # column of its product, hence the interpreter tests' ALL_SITES_TOL
    dict(kind="gdn", state="kv", B=1, T=300, H=2, HV=4, K=128, V=128, cu=(0, 100, 300),
         quant={**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}, tol=2e-2),
    dict(kind="kda", state="kv", B=2, T=150, H=2, HV=2, K=128, V=128, cu=None,
         quant={**FP8_ALL, "state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}, tol=2e-2),
]


def exactness(c, device="cuda") -> dict:
    """Forward (o, final state) and every gradient of the chunk kernels against fp64 autograd of the chunk reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32, device=device)
    (q, k, v, g, beta), _ = make_inputs(c["kind"], c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"],
                                        torch.float32, device=device)
    N = c["B"] if cu is None else len(c["cu"]) - 1
    h0 = torch.randn((N, c["HV"], c["K"], c["V"]) if c["state"] == "kv" else (N, c["HV"], c["V"], c["K"]),
                     device=device)
    spec = with_options(RecurrenceSpec(kind=c["kind"], chunk=64, state=c["state"], kernel="chunk").replace(
        quant=c["quant"]))
    params = ChunkParams.from_spec(spec)
    # unwritten elements show up as NaN errors (timing runs use empty buffers)
    tuning = dataclasses.replace(spec.tuning_options, nan_fill=True)
    scale = c["K"] ** -0.5
    # the training path: what the forward keeps for the backward (GDN's T, A_qk, G), NaN-filled before it runs
    size = residual_size(params, q, v, cu, tuning.keep_residual)
    kept = torch.full((size,), float("nan"), device=device) if size else None
    o, ht = chunk_fwd(params, q, k, v, g, beta, scale, h0, cu, save_to=kept, tuning=tuning)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = chunk_bwd(params, q, k, v, g, beta, scale, do, dht, h0, cu, saved=kept, tuning=tuning)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    ro, rht = chunk_delta_rule_reference(*leaves[:5], spec=spec, scale=scale, initial_state=leaves[5], cu_seqlens=cu)
    ref = torch.autograd.grad([ro, rht], leaves, [do.double(), dht.double()])
    errors = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
    errors.update({n: rel_l2(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, ref)})
    tol = c.get("tol") or (1e-5 if not c["quant"] else 1e-3)
    return {"case": {**c, "cu": c["cu"]}, "spec": str(spec), "rel_l2": errors, "tol": tol,
            "ok": max(errors.values()) <= tol}


# ---- 2. equality with FLA's exact kernels at real shapes ---------------------------------------
# FLA's tests/ops/test_kda.py tolerances (relative RMS error, its assert_close) for its bf16 chunk
# kernel against an fp32 reference; here both sides are bf16 kernels of the same algorithm.
FLA_TOLERANCES = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02}


def fla_equality(kind, B, T, H, D) -> dict:
    """laqat exact (chunk kernels through the IR op) vs FLA's chunk kernel, bf16 inputs, quantizers off:
    o, final state and (KDA; FLA's GDN backward refuses this Triton) every input gradient; both, and laqat
    with an FP8 state, against fp64 autograd of the chunk reference (laqat's gradients always)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    from la_compiler.kernels.fla.chunk_variant import gdn_backward_blocker

    xs, _ = make_inputs(kind, B, T, H, H, D, D, torch.bfloat16)
    scale = D ** -0.5
    fla_grads = kind == "kda" or gdn_backward_blocker() is None  # laqat's gradients are checked either way
    fla = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    spec = str(with_options(RecurrenceSpec(kind=kind, chunk=64, kernel="chunk")))
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(B, H, D, D, device="cuda")

    def run(fn, with_grads=True):
        leaves = leaves_of(xs) if with_grads else [x.detach() for x in xs]
        o, ht = fn(leaves)
        out = {"o": o.detach(), "ht": ht.detach()}
        if with_grads:
            grads = torch.autograd.grad([o, ht], leaves, [do, dht])
            out.update(zip(["dq", "dk", "dv", "dg", "dbeta"], grads))
        return out

    ours = run(lambda L: torch.ops.laqat.delta_rule(*L, None, None, scale, spec))
    theirs = run(lambda L: fla(*L, scale=scale, output_final_state=True), fla_grads)
    errors = {n: rel_l2(ours[n], theirs[n]) for n in theirs}  # o, ht only where FLA's backward refuses
    ok = all(e <= FLA_TOLERANCES[n] for n, e in errors.items())
    # both bf16 kernels against fp64 autograd of the chunk reference on the same inputs, and laqat with an FP8
    # state against the reference that rounds its state (FLA has no such kernel)
    want = reference_run(kind, xs, scale, {}, do, dht, True)
    vs_ref = {"laqat": {n: rel_l2(ours[n], want[n]) for n in ours}, "FLA": {n: rel_l2(theirs[n], want[n]) for n in theirs}}
    fp8 = {"state": "fp8_e4m3/tile64"}
    fp8_spec = str(with_options(RecurrenceSpec(kind=kind, chunk=64, kernel="chunk").replace(quant=fp8)))
    ours_fp8 = run(lambda L: torch.ops.laqat.delta_rule(*L, None, None, scale, fp8_spec))
    want_fp8 = reference_run(kind, xs, scale, fp8, do, dht, True)
    vs_ref["laqat FP8 state"] = {n: rel_l2(ours_fp8[n], want_fp8[n]) for n in ours_fp8}
    return {"kind": kind, "shape": [B, T, H, D], "rel_l2": errors, "tolerances": FLA_TOLERANCES, "ok": ok,
            "gradients_vs_fla": fla_grads, "rel_l2_vs_fp64_reference": vs_ref}


def reference_run(kind, xs, scale, quant, do, dht, with_grads) -> dict:
    """o, ht and (with_grads) the input gradients of fp64 autograd of the chunk reference on ``xs``."""
    leaves = [x.detach().double().requires_grad_(with_grads) for x in xs]
    spec = RecurrenceSpec(kind=kind, chunk=64).replace(quant=quant)
    o, ht = chunk_delta_rule_reference(*leaves, spec=spec, scale=scale)
    out = {"o": o.detach(), "ht": ht.detach()}
    if with_grads:
        grads = torch.autograd.grad([o, ht], leaves, [do.double(), dht.double()])
        out.update(zip(["dq", "dk", "dv", "dg", "dbeta"], grads))
    return out


# ---- 3. timing ---------------------------------------------------------------------------------

def measure(fwd, fwd_bwd) -> dict:
    """ms (median) and extra MiB of the forward and of forward+backward; errors are recorded, not raised."""
    row = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        if fn is None:
            continue
        try:
            fn()  # compile / warm up outside the timing
            row[f"ms_{name}"] = do_bench(fn, return_mode="median")
            row[f"mib_{name}"] = peak_extra_mib(fn)
        except Exception as e:  # noqa: BLE001 -- reported, never hidden
            row[f"error_{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            torch.cuda.empty_cache()
    return row


def leaves_of(xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def bench_shape(kind, B, T, H, D, *, with_emulation=True, policies=tuple(POLICIES), profile=(), fla=True,
                lift_gdn_guard=False) -> dict:
    from la_compiler.kernels.fla.chunk_variant import gdn_backward_blocker

    xs, _ = make_inputs(kind, B, T, H, H, D, D, torch.bfloat16)
    scale = D ** -0.5
    rows = {}

    # FLA exact
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    fla_op = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    kw = dict(scale=scale, output_final_state=True)
    fla_leaves = leaves_of(xs)

    def fla_fwd():
        return fla_op(*xs, **kw)

    def fla_fwd_bwd():
        for x in fla_leaves:
            x.grad = None
        o, _ = fla_op(*fla_leaves, **kw)
        o.float().sum().backward()

    blocked = gdn_backward_blocker() if kind == "gdn" else None
    lifted = None
    if blocked and lift_gdn_guard:  # the guard lifted (timing only): wrong gradients, real time
        import fla.ops.common.chunk_o as fla_chunk_o

        guarded_fwd_bwd, lifted = fla_fwd_bwd, blocked
        blocked = None

        def fla_fwd_bwd():
            saved, fla_chunk_o.TRITON_ABOVE_3_7_1 = fla_chunk_o.TRITON_ABOVE_3_7_1, True
            try:
                guarded_fwd_bwd()
            finally:
                fla_chunk_o.TRITON_ABOVE_3_7_1 = saved
    if not fla:  # FLA's chunk_kda compiles for minutes on a fresh machine
        fla_fwd = fla_fwd_bwd = None
        blocked = "skipped (--no-fla)"
    rows["FLA exact"] = measure(fla_fwd, None if blocked else fla_fwd_bwd)
    if "FLA exact" in profile and fla:
        rows["FLA exact"]["kernels_ms"] = kernel_times(fla_fwd if blocked else fla_fwd_bwd)
    if blocked:
        rows["FLA exact"]["error_fwd_bwd"] = f"not run: {blocked}"
    if lifted and fla:
        rows["FLA exact"]["note"] = f"fwd+bwd timed with FLA's guard lifted, timing only: {lifted}"
    fla_o = fla_fwd()[0] if fla_fwd else None

    # laqat, through the IR op (its registered autograd runs the variant's backward)
    outputs = {}  # o of each row without a SETTINGS row: what a setting's row is compared with
    for name, quant in POLICIES.items():
        if name not in policies:
            continue
        setting = SETTINGS.get(name)
        spec = with_options(RecurrenceSpec(kind=kind, chunk=64, kernel="chunk").replace(
            quant=quant, acc=ACCUMULATORS.get(name, {})), setting)
        why = unsupported(spec)
        if why:
            rows[name] = {"error_fwd": f"not implemented: {why}"}
            continue
        text = str(spec)
        leaves = leaves_of(xs)

        def ours_fwd(text=text):
            return torch.ops.laqat.delta_rule(*xs, None, None, scale, text)

        def ours_fwd_bwd(text=text, leaves=leaves):
            for x in leaves:
                x.grad = None
            o, _ = torch.ops.laqat.delta_rule(*leaves, None, None, scale, text)
            o.float().sum().backward()

        rows[name] = measure(ours_fwd, ours_fwd_bwd)
        rows[name]["spec"] = text
        default_row = name.split(" (")[0]  # "laqat FP8 all sites (keep all)" -> "laqat FP8 all sites"
        try:
            if setting is None:
                outputs[name] = ours_fwd()[0]
            elif default_row in outputs:  # the same quantization under other options: how far its o moved
                rows[name][f"rel_l2_o_vs_{default_row}"] = rel_l2(ours_fwd()[0], outputs[default_row])
        except Exception as e:  # noqa: BLE001
            rows[name][f"rel_l2_o_vs_{default_row}"] = f"{type(e).__name__}: {e}"
        if name in profile:
            try:
                rows[name]["kernels_ms"] = kernel_times(ours_fwd_bwd)
            except Exception as e:  # noqa: BLE001
                rows[name]["kernels_ms"] = {"error": f"{type(e).__name__}: {e}"}
        if not quant and name not in ACCUMULATORS and name not in SETTINGS and fla_o is not None:
            try:
                rows[name]["rel_l2_o_vs_fla"] = rel_l2(ours_fwd()[0], fla_o)
            except Exception as e:  # noqa: BLE001
                rows[name]["rel_l2_o_vs_fla"] = f"{type(e).__name__}: {e}"

    # fp32 torch chunk emulation, FP8 state (the slow path a torch-level QAT emulation takes)
    if with_emulation:
        spec = RecurrenceSpec(kind=kind, chunk=64).replace(quant={"state": "fp8_e4m3/tile64"})
        emu_leaves = leaves_of([x.float() for x in xs])

        def emu_fwd():
            with torch.no_grad():
                return chunk_delta_rule_reference(*[x.detach() for x in emu_leaves], spec=spec, scale=scale,
                                                  dtype=torch.float32)

        def emu_fwd_bwd():
            for x in emu_leaves:
                x.grad = None
            o, _ = chunk_delta_rule_reference(*emu_leaves, spec=spec, scale=scale, dtype=torch.float32)
            o.float().sum().backward()

        rows["fp32 torch chunk emulation (FP8 state)"] = measure(emu_fwd, emu_fwd_bwd)
    else:
        rows["fp32 torch chunk emulation (FP8 state)"] = {"error_fwd": "skipped (--no-emulation-above)"}

    ref = rows["FLA exact"]
    for row in rows.values():
        for p in ("fwd", "fwd_bwd"):
            if f"ms_{p}" in row and f"ms_{p}" in ref:
                row[f"x_fla_{p}"] = row[f"ms_{p}"] / ref[f"ms_{p}"]
    return rows


def fmt(row, key, spec="{:.2f}"):
    return spec.format(row[key]) if key in row and not isinstance(row[key], str) else "-"


def print_table(kind, shape, rows):
    print(f"\n{kind.upper()} [B,T,H,D]={list(shape)}  (bf16; ms = do_bench median; xFLA = ratio to FLA exact)")
    print(f"  {'what':40} {'fwd ms':>8} {'xFLA':>6} {'MiB':>7} {'f+b ms':>9} {'xFLA':>6} {'MiB':>7}")
    for name, row in rows.items():
        print(f"  {name:40} {fmt(row, 'ms_fwd'):>8} {fmt(row, 'x_fla_fwd'):>6} {fmt(row, 'mib_fwd', '{:.0f}'):>7}"
              f" {fmt(row, 'ms_fwd_bwd'):>9} {fmt(row, 'x_fla_fwd_bwd'):>6} {fmt(row, 'mib_fwd_bwd', '{:.0f}'):>7}")
        for key in ("error_fwd", "error_fwd_bwd"):
            if key in row:
                print(f"      {key[6:]}: {row[key]}")
        if "note" in row:
            print(f"      {row['note']}")
        if "rel_l2_o_vs_fla" in row:
            print(f"      o vs FLA (bf16) relative L2: {row['rel_l2_o_vs_fla']}")
        for key in [k for k in row if k.startswith("rel_l2_o_vs_laqat")]:
            value = f"{row[key]:.2e}" if isinstance(row[key], float) else row[key]
            print(f"      o vs the row '{key[len('rel_l2_o_vs_'):]}' relative L2: {value}")
        if "kernels_ms" in row:
            print("      kernels (ms per call): " + ", ".join(
                f"{k.split('(')[0][:48]} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row["kernels_ms"].items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the smallest shape")
    parser.add_argument("--kinds", default="gdn,kda")
    parser.add_argument("--shapes", default=None, help="e.g. 1x1024x4x64,8x4096x16x128")
    parser.add_argument("--no-emulation-above", type=int, default=1 << 62,
                        help="skip the fp32 torch emulation above this many B*T*H tokens")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--exactness-only", action="store_true")
    parser.add_argument("--exact-cases", default=None, help="comma-separated indices into EXACT_CASES (default: all)")
    parser.add_argument("--fla-equality", default="",
                        help="kind:BxTxHxD,... e.g. kda:1x4096x16x128: laqat exact vs FLA's kernels (bf16), then exit")
    parser.add_argument("--no-fla", action="store_true", help="skip FLA's kernels (no ratios)")
    parser.add_argument("--lift-fla-gdn-guard", action="store_true",
                        help="time FLA's GDN fwd+bwd past its Hopper/Triton guard (its gradients are wrong there: "
                             "timing only)")
    parser.add_argument("--profile", default="",
                        help="comma-separated rows (e.g. 'FLA exact,laqat exact') whose fwd+bwd kernels are timed one by one")
    parser.add_argument("--policies", default=None,
                        help="'all', or a comma-separated subset of: " + ", ".join(POLICIES)
                             + " (default: " + ", ".join(TABLE_POLICIES) + ")")
    parser.add_argument("--numerics", default="", help="numerics options of every laqat spec, e.g. fp32_dot=tf32x3")
    parser.add_argument("--tuning", default="", help="tuning options of every laqat spec, e.g. keep_residual=all")
    args = parser.parse_args()
    for name, options in (("numerics", NumericsOptions), ("tuning", TuningOptions)):
        items = [item.split("=", 1) for item in getattr(args, name).split(",") if item]
        if any(len(item) != 2 for item in items):
            sys.exit(f"--{name}: give key=value pairs separated by commas, got {getattr(args, name)!r}")
        try:
            RUN_OPTIONS[name] = options.from_spec_items(items)
        except ValueError as e:
            sys.exit(f"--{name}: {e}")
    out, result = start_cuda_run("chunk_bench.py", "exactness", "fla_equality", "timing")
    if args.fla_equality:
        print("laqat exact vs FLA exact, bf16 (relative L2; FLA's test tolerances)")
        for item in args.fla_equality.split(","):
            kind, shape = item.split(":")
            try:
                r = fla_equality(kind, *(int(x) for x in shape.split("x")))
            except Exception as e:  # noqa: BLE001
                r = {"kind": kind, "shape": shape, "error": traceback.format_exc(), "ok": False}
                print(f"  {kind} {shape}: ERROR {type(e).__name__}: {e}")
            else:
                print(f"  {kind} {shape}: " + ", ".join(f"{n} {e:.1e}" for n, e in r["rel_l2"].items())
                      + f"  {'ok' if r['ok'] else 'FAIL'}")
                for who, errs in r["rel_l2_vs_fp64_reference"].items():
                    print(f"    {who} vs the fp64 reference: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
            result["fla_equality"].append(r)
        (out / "chunk_bench.json").write_text(json.dumps(result, indent=2, default=str))
        return
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    if not args.skip_exactness:
        print("exactness (fp32, chunk kernels vs the fp64 chunk reference; tol 1e-5 exact, 1e-3 with QDQ)")
        picked = range(len(EXACT_CASES)) if args.exact_cases is None else [int(i) for i in args.exact_cases.split(",")]
        for index in picked:
            case = EXACT_CASES[index]
            try:
                r = {"index": index, **exactness(case)}
            except Exception as e:  # noqa: BLE001
                r = {"index": index, "case": case, "error": traceback.format_exc(), "ok": False}
                print(f"  {case['kind']} {case['quant']}: ERROR {type(e).__name__}: {e}")
            else:
                worst = max(r["rel_l2"], key=r["rel_l2"].get)
                print(f"  {case['kind']} {case['state']} T={case['T']} HV={case['HV']} K={case['K']} V={case['V']} "
                      f"varlen={case['cu'] is not None} quant={case['quant']}: o {r['rel_l2']['o']:.2e} "
                      f"ht {r['rel_l2']['ht']:.2e}, max over all {r['rel_l2'][worst]:.2e} ({worst}) "
                      f"{'ok' if r['ok'] else 'FAIL'}")
            result["exactness"].append(r)
        (out / "chunk_bench.json").write_text(json.dumps(result, indent=2, default=str))

    for kind in [] if args.exactness_only else args.kinds.split(","):
        for shape in shapes:
            B, T, H, D = shape
            policies = (TABLE_POLICIES if args.policies is None else tuple(POLICIES) if args.policies == "all"
                        else tuple(x.strip() for x in args.policies.split(",")))
            unknown = [x for x in policies if x not in POLICIES]
            if unknown:
                sys.exit(f"--policies: unknown {unknown}; known: {list(POLICIES)}")
            profile = tuple(x.strip() for x in args.profile.split(",") if x)
            rows = bench_shape(kind, B, T, H, D, with_emulation=B * T * H <= args.no_emulation_above,
                               policies=policies, fla=not args.no_fla, lift_gdn_guard=args.lift_fla_gdn_guard,
                               profile=profile)
            print_table(kind, shape, rows)
            result["timing"].append({"kind": kind, "shape": list(shape), "rows": rows})
            (out / "chunk_bench.json").write_text(json.dumps(result, indent=2, default=str))
            torch.cuda.empty_cache()
    print(f"\nwrote {out / 'chunk_bench.json'}")


if __name__ == "__main__":
    main()
