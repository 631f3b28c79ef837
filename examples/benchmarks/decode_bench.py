"""Decode-phase training (prefix + recurrent suffix with state rounding) on CUDA: accuracy and timing.

    OUT=./out python examples/benchmarks/decode_bench.py [--sections accuracy timing compare] [--num-warps 4 8 16]
        [--policies token ...] [--timing-shapes 1x257x4x128:64,2x4096x8x128:2048] [--rounds 30]
    python examples/benchmarks/decode_bench.py --list       # the comparison's rows, specs and kernels; no GPU needed
    python examples/benchmarks/decode_bench.py --smoke      # tiny shapes on the CPU (Triton's interpreter)

1. ``accuracy``: the fused decode kernels (fp32 inputs) against the fp64 decode reference, forward and every
   gradient, token / decay-grid / replay / Hadamard cases;
2. ``timing``: KDA at each of ``--timing-shapes`` ([B, T, H, D]:prefix; default [1, 257, 4, 128] prefix 64,
   the decode-phase anchor shape, and [2, 4096, 8, 128] prefix 2048, the model benchmark's layer; bf16
   q/k/v, bench_common.make_inputs): fwd+bwd (forward, then backward of o.float().sum()) of laqat's decode_fused
   through ``laqat::delta_rule_phased`` per policy and warp count (do_bench medians), against the fp32 torch
   reference of the same policy (up to ``--reference-max-tokens`` tokens) and FLA's exact chunk_kda.
   Target: laqat <= 2x FLA exact.
3. ``compare``: at ``--compare-shape`` (default [1, 4096, 16, 128], prefix 2048), GDN and KDA, bf16: every decode
   mode through ``laqat::delta_rule_phased`` (token FP8 tile64, token INT8 block32, replay FP8 tile64, replay
   INT8 Hadamard-32, the kind's vLLM serving recipe; the kernel the selection table picks) and laqat's exact chunk
   kernels against FLA's exact ``chunk_gated_delta_rule`` / ``chunk_kda`` fwd+bwd (GDN's backward past FLA's
   Hopper guard where it refuses: timing only) and FLA's ``fused_recurrent_*`` forward over the suffix alone (the
   latency floor of a serial scan over the decode tokens). All rows timed interleaved: ``--rounds`` rounds of one
   call of every row, in a rotating order (round r starts at row r mod n), each call alone on the device, CUDA
   events after the forward and after the backward; medians of forward, backward and both, and their ratios.
Prints tables and writes $OUT/decode_bench.json. Works on triton 3.6 / torch 2.11 and without
``pip install -e .`` (it maps the repo's folders onto ``la_compiler`` itself).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

from bench_common import (Marks, ensure_la_compiler, fla_gdn_blocker, fla_gdn_guard_lifted, kernel_times,  # noqa: E402
                          make_inputs, peak_extra_mib, rel_l2, start_cuda_run, sync)

ensure_la_compiler()

from triton.testing import do_bench  # noqa: E402

import la_compiler.ir.delta_rule  # noqa: E402,F401  (registers laqat::delta_rule)
import la_compiler.ir.delta_rule_phased  # noqa: E402,F401  (registers laqat::delta_rule_phased)
import la_compiler.kernels  # noqa: E402,F401  (registers the kernel variants)
from la_compiler.ir.spec import RecurrenceSpec  # noqa: E402
from la_compiler.kernels.decode import fused as decode_fused  # noqa: E402
from la_compiler.kernels.reference.decode import delta_rule_decode_reference  # noqa: E402
from la_compiler.kernels.selection import select_kernel  # noqa: E402
from la_compiler.options import decode_options  # noqa: E402
from la_compiler.policy.resolution import load_policy  # noqa: E402

POLICIES = {
    # name: spec (state FP8 E4M3 per [K x 64] tile, as the seeds' decode study)
    "token": dict(phase="token", quant=(("state", "fp8_e4m3/tile64"),), extra=(("readout", "working"),)),
    "decay-grid": dict(phase="token", quant=(("state", "fp8_e4m3/tile64"),),
                       extra=(("decay_log_step", "0.00390625"), ("readout", "working"))),
    "replay": dict(phase="replay", quant=(("state", "fp8_e4m3/tile64"),),
                   extra=(("readout", "working"), ("replay_factor_qdq", "1"), ("replay_window", "8"))),
    "replay-h32": dict(phase="replay", quant=(("state", "int8_h32/tile64"),),
                       extra=(("readout", "working"), ("replay_factor_qdq", "1"), ("replay_window", "8"))),
    # state INT8, one scale per key row and 32 values (the state_int8_block32 recipe's state quantizer)
    "token-int8-block32": dict(phase="token", quant=(("state", "int8/block32"),), extra=(("readout", "working"),)),
}


def spec_of(kind: str, policy: str, state: str = "kv") -> RecurrenceSpec:
    return RecurrenceSpec(kind, state=state, kernel="decode_fused", **POLICIES[policy])


def set_decode_warps(warps) -> None:
    """The decode kernels' warp count (None: their default), wherever this checkout keeps the knob."""
    import importlib

    for name in ("la_compiler.kernels.decode.suffix", "la_compiler.kernels.decode.fused"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "NUM_WARPS"):
            module.NUM_WARPS = warps
            return
    raise RuntimeError("no NUM_WARPS knob in kernels/decode (suffix.py, fused.py)")


def parse_shape(text: str):
    """'BxTxHxD:prefix' -> (B, T, H, D, prefix)."""
    dims, _, prefix = text.partition(":")
    B, T, H, D = (int(x) for x in dims.split("x"))
    return B, T, H, D, int(prefix)


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
    # either side of a rounding boundary, docs/numerics.md); everything else within 1e-3 relative L2
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


def _add(rows, row, where=None):
    """Keep a timing row and print it at once (a run cut short still shows what it measured)."""
    rows.append({**row, **(where or {})})
    print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                           if not k.startswith("rel_l2")), flush=True)


def timing(B: int, T: int, H: int, D: int, prefix: int, policies, num_warps, fla_reference_ms=None,
           profile=False, reference_max_tokens=1024) -> list[dict]:
    from fla.ops.kda import chunk_kda

    (q, k, v, g, beta), _ = make_inputs("kda", B, T, H, H, D, D, torch.bfloat16)
    scale = D ** -0.5
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    pre = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    val = torch.full((B,), T, dtype=torch.int32, device="cuda")
    rows = []
    where = {"kind": "kda", "shape": [B, T, H, D], "prefix": prefix}

    def fla_fwd_bwd():
        for x in leaves:
            x.grad = None
        o, _ = chunk_kda(*leaves, scale=scale, output_final_state=True)
        o.float().sum().backward()

    if fla_reference_ms is None:
        fla_ms = do_bench(fla_fwd_bwd, return_mode="median")
        _add(rows, {"impl": "FLA chunk_kda (exact)", "policy": "exact", "ms": fla_ms,
                    "extra_mib": peak_extra_mib(fla_fwd_bwd), "x_fla": 1.0}, where)
        fla_fwd_bwd()
        fla_grads = [x.grad.clone() for x in leaves]
    else:  # FLA's chunk_kda compiles for minutes on a fresh machine: its figure from an earlier run
        fla_ms, fla_grads = fla_reference_ms, None
        _add(rows, {"impl": "FLA chunk_kda (exact), given (--fla-ms), not this run", "policy": "exact",
                    "ms": fla_ms, "extra_mib": float("nan"), "x_fla": 1.0}, where)

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
            set_decode_warps(warps)

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
            _add(rows, row, where)
        set_decode_warps(None)

        if B * T > reference_max_tokens:  # the fp32 token loop: seconds per call at 4096 tokens
            print(f"  torch reference (fp32, token loop), {policy}: not timed ({B * T} tokens > "
                  f"--reference-max-tokens {reference_max_tokens})")
            continue
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
                    "extra_mib": peak_extra_mib(torch_fwd_bwd), "x_fla": ms / fla_ms}, where)
        torch_fwd_bwd()
        rows[-1].update({f"rel_l2_d{n}_laqat_vs_torch": rel_l2(x.grad, r.grad)
                         for n, x, r in zip(("q", "k", "v", "g", "beta"), leaves, ref_leaves)})
    return rows


# ---- 3. kernel-level comparison, interleaved -------------------------------------------------------

COMPARE_DECODE = ("token", "token-int8-block32", "replay", "replay-h32")  # POLICIES rows of the comparison
SERVING_RECIPES = {"gdn": "vllm_gdn_state_bf16", "kda": "vllm_kda_state_bf16"}
COMPARE_ROWS = ("FLA chunk exact", "FLA fused_recurrent fwd (suffix)", "laqat chunk exact", *COMPARE_DECODE,
                "vllm serving recipe")


def compare_spec(kind: str, row: str, T: int, D: int, device: str) -> RecurrenceSpec:
    """The spec of a laqat row, with the kernel the selection table picks for it (as the lower pass does)."""
    if row == "laqat chunk exact":
        return RecurrenceSpec(kind, kernel="chunk")
    if row in POLICIES:
        spec = RecurrenceSpec(kind, state="kv", **POLICIES[row])
        requested = family = None
    else:
        res = load_policy(SERVING_RECIPES[kind]).resolve("model.layers.0.attn", kind)
        spec = RecurrenceSpec(kind, state="kv", quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                              chunk=res.chunk, phase=res.phase, extra=res.extra, numerics=res.numerics)
        requested, family = res.backend, res.implementation
    choice = select_kernel(spec, device=device, dtype=torch.bfloat16, head_k=D, head_v=D, requested=requested,
                           family=family, seq_len=T)
    return spec.replace(kernel=choice.variant)


class CompareRow:
    """One row of the comparison: ``call(marks)`` runs it once, marking before the forward, after it, and (for a
    fwd+bwd row) after the backward."""

    def __init__(self, kind, name, record, call=None, output=None):
        self.kind, self.name, self.call, self.output = kind, name, call, output
        self.record = {"kind": kind, "row": name, **record}
        self.fwd, self.bwd = [], []

    @property
    def ok(self) -> bool:
        return self.call is not None and "error" not in self.record

    def fail(self, e: BaseException, stage: str) -> None:
        traceback.print_exc()
        self.record["error"] = f"{stage}: {type(e).__name__}: {str(e)[:300]}"
        self.call = None

    def timed(self) -> None:
        sync()
        marks = Marks()
        self.call(marks)
        ms = marks.ms()
        self.fwd.append(ms[0])
        if len(ms) > 1:
            self.bwd.append(ms[1])


def compare_rows(kind, B, T, H, D, prefix, names, device) -> list[CompareRow]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    (q, k, v, g, beta), _ = make_inputs(kind, B, T, H, H, D, D, torch.bfloat16, device=device)
    scale = D ** -0.5
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    suffix = [x[:, prefix:].contiguous() for x in (q, k, v, g, beta)]
    h0 = torch.zeros(B, H, D, D, dtype=torch.float32, device=device)  # the handed-off state (its values: no matter)
    pre = torch.full((B,), prefix, dtype=torch.int32, device=device)
    val = torch.full((B,), T, dtype=torch.int32, device=device)
    fla_chunk = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    fla_recurrent = fused_recurrent_gated_delta_rule if kind == "gdn" else fused_recurrent_kda
    blocked = fla_gdn_blocker() if kind == "gdn" else None

    def fwd_bwd(forward, lift=False):
        def call(marks):
            for x in leaves:
                x.grad = None
            with fla_gdn_guard_lifted(lift):
                marks.mark()
                o = forward()
                marks.mark()
                o.float().sum().backward()
                marks.mark()
        return call

    def recurrent(marks):
        sq, sk, sv, sg, sb = suffix
        with torch.no_grad():
            marks.mark()
            fla_recurrent(q=sq, k=sk, v=sv, g=sg, beta=sb, scale=scale, initial_state=h0, output_final_state=True)
            marks.mark()

    rows = []
    for name in names:
        if name == "FLA chunk exact":
            record = {"impl": f"FLA {fla_chunk.__name__}", "kernel": "FLA"}
            if blocked:
                record["note"] = f"backward past FLA's guard, timing only: {blocked}"
            forward = lambda: fla_chunk(*leaves, scale=scale, output_final_state=True)[0]  # noqa: E731
            rows.append(CompareRow(kind, name, record, fwd_bwd(forward, bool(blocked)), forward))
        elif name == "FLA fused_recurrent fwd (suffix)":
            record = {"impl": f"FLA {fla_recurrent.__name__}, tokens [{prefix}, {T}) from a state, forward only",
                      "kernel": "FLA"}
            rows.append(CompareRow(kind, name, record, recurrent))
        else:
            row_name = SERVING_RECIPES[kind] if name == "vllm serving recipe" else name
            try:
                spec = compare_spec(kind, name, T, D, device)
            except Exception as e:
                rows.append(CompareRow(kind, row_name, {"error": f"spec: {type(e).__name__}: {str(e)[:300]}"}))
                continue
            text = spec.to_string()
            if spec.phase == "none":
                forward = lambda text=text: torch.ops.laqat.delta_rule(  # noqa: E731
                    *leaves, None, None, scale, text)[0]
            else:
                forward = lambda text=text: torch.ops.laqat.delta_rule_phased(  # noqa: E731
                    *leaves, None, None, pre, val, scale, text)[0]
            rows.append(CompareRow(kind, row_name, {"kernel": spec.kernel, "spec": text}, fwd_bwd(forward), forward))
    return rows


def summarize(rows: list[CompareRow], kinds) -> None:
    """Medians of the rounds so far and their ratios into each row's record."""
    for row in rows:
        if row.fwd:
            row.record["fwd_ms"] = statistics.median(row.fwd)
            row.record["rounds"] = len(row.fwd)
            row.record["fwd_ms_rounds"] = [round(t, 4) for t in row.fwd]
        if row.bwd:
            row.record["bwd_ms"] = statistics.median(row.bwd)
            row.record["fb_ms"] = statistics.median([a + b for a, b in zip(row.fwd, row.bwd)])
            row.record["bwd_ms_rounds"] = [round(t, 4) for t in row.bwd]
    for kind in kinds:
        of_kind = {row.name: row.record for row in rows if row.kind == kind}
        fla = of_kind.get("FLA chunk exact", {})
        floor = of_kind.get("FLA fused_recurrent fwd (suffix)", {}).get("fwd_ms")
        for record in of_kind.values():
            for key in ("fb", "fwd", "bwd"):
                if f"{key}_ms" in record and fla.get(f"{key}_ms"):
                    record[f"{key}_x_fla"] = record[f"{key}_ms"] / fla[f"{key}_ms"]
            if "fwd_ms" in record and floor:
                record["fwd_x_fla_recurrent"] = record["fwd_ms"] / floor


def compare(kinds, B, T, H, D, prefix, rounds, names, warmup=2, deadline=None, progress=None) -> dict:
    """The comparison's rows, warmed up, then timed in ``rounds`` interleaved rounds (fewer where the next round
    would end after ``deadline``, a perf_counter time). ``progress(result)`` after the warm-up and every round."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [row for kind in kinds for row in compare_rows(kind, B, T, H, D, prefix, names, device)]
    result = {"kinds": list(kinds), "shape": [B, T, H, D], "prefix": prefix, "dtype": "bfloat16", "rounds": 0,
              "timing": "interleaved", "rows": [row.record for row in rows]}
    reference = {}
    for row in rows:  # warm-up: compiles, autotuning; the peak extra memory of one call; o against FLA's chunk
        if not row.ok:
            continue
        try:
            for _ in range(warmup):
                row.call(Marks())
            sync()
            if torch.cuda.is_available():
                row.record["extra_mib"] = round(peak_extra_mib(lambda: row.call(Marks())), 1)
            if row.output is not None:
                with torch.no_grad():
                    o = row.output().float()
                if row.name == "FLA chunk exact":
                    reference[row.kind] = o
                elif row.kind in reference:
                    row.record["o_rel_l2_vs_fla_chunk"] = rel_l2(o, reference[row.kind])
        except Exception as e:
            row.fail(e, "warm-up")
        print(f"  warm: {row.kind} {row.name}: " + ("ok" if row.ok else row.record["error"]), flush=True)
    reference.clear()
    if progress:
        progress(result)
    timed = [row for row in rows if row.ok]
    round_s = 0.0
    for r in range(rounds if timed else 0):
        if deadline is not None and time.perf_counter() + round_s > deadline:
            result["rounds_cut"] = f"{r} of {rounds} rounds: --budget-s"
            print(f"  {result['rounds_cut']}", flush=True)
            break
        began = time.perf_counter()
        start = r % len(timed)
        for row in timed[start:] + timed[:start]:
            if row.ok:
                try:
                    row.timed()
                except Exception as e:
                    row.fail(e, f"round {r}")
        round_s = time.perf_counter() - began
        result["rounds"] = r + 1
        summarize(rows, kinds)
        if progress:
            progress(result)
    summarize(rows, kinds)
    return result


def print_compare(result: dict) -> None:
    B, T, H, D = result["shape"]
    print(f"\n[{B}, {T}, {H}, {D}] bf16, prefix {result['prefix']}: median ms over {result['rounds']} interleaved "
          "rounds; x FLA: / FLA's exact chunk kernel (same kind, same part); x rec: forward / FLA's fused_recurrent "
          "forward over the suffix")
    print(f"| {'kind':<4} | {'row':<34} | {'kernel':<14} | {'fwd':>8} | {'bwd':>8} | {'f+b':>8} | {'x FLA f+b':>9} | "
          f"{'x FLA fwd':>9} | {'x FLA bwd':>9} | {'x rec':>7} | {'MiB':>7} | {'o rel L2':>8} |")
    print("|" + "|".join("-" * (w + 2) for w in (4, 34, 14, 8, 8, 8, 9, 9, 9, 7, 7, 8)) + "|")
    cell = lambda r, key, width, spec: (spec.format(r[key]) if key in r else "-").rjust(width)  # noqa: E731
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['kind']:<4} | {r['row']:<34} | ERROR {r['error'][:150]}")
            continue
        print(f"| {r['kind']:<4} | {r['row']:<34} | {r.get('kernel', ''):<14} | {cell(r, 'fwd_ms', 8, '{:.3f}')} | "
              f"{cell(r, 'bwd_ms', 8, '{:.3f}')} | {cell(r, 'fb_ms', 8, '{:.3f}')} | "
              f"{cell(r, 'fb_x_fla', 9, '{:.2f}')} | "
              f"{cell(r, 'fwd_x_fla', 9, '{:.2f}')} | {cell(r, 'bwd_x_fla', 9, '{:.2f}')} | "
              f"{cell(r, 'fwd_x_fla_recurrent', 7, '{:.2f}')} | {cell(r, 'extra_mib', 7, '{:.1f}')} | "
              f"{cell(r, 'o_rel_l2_vs_fla_chunk', 8, '{:.1e}')} |" + (f" {r['note'][:60]}" if "note" in r else ""))


def list_compare(kinds, T, D, names) -> None:
    for kind in kinds:
        for name in names:
            if name.startswith("FLA"):
                print(f"{kind} {name}")
                continue
            try:
                spec = compare_spec(kind, name, T, D, "cuda")
                print(f"{kind} {name}: {spec.kernel}  {spec.to_string()}")
            except Exception as e:
                print(f"{kind} {name}: no kernel ({type(e).__name__}: {str(e)[:200]})")


SMALL = (1, 257, 4, 128, 64)  # the decode-phase anchor shape: --fla-ms is a figure of it


def print_timing(rows) -> None:
    groups = {}
    for r in rows:
        groups.setdefault((tuple(r.get("shape", SMALL[:4])), r.get("prefix", SMALL[4])), []).append(r)
    for (shape, prefix), group in groups.items():
        print(f"\nKDA decode-phase training fwd+bwd, {list(shape)} bf16, prefix {prefix} (median ms)")
        print(f"| {'implementation':<40} | {'policy':<18} | {'ms':>8} | {'x FLA':>6} | {'extra MiB':>9} |")
        print(f"|{'-' * 42}|{'-' * 20}|{'-' * 10}|{'-' * 8}|{'-' * 11}|")
        for r in group:
            if "error" in r:
                print(f"| {r['impl']:<40} | {r['policy']:<18} | ERROR {r['error'][:60]}")
                continue
            print(f"| {r['impl']:<40} | {r['policy']:<18} | {r['ms']:8.3f} | {r['x_fla']:6.2f} | "
                  f"{r['extra_mib']:9.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["accuracy", "timing", "compare"],
                        choices=["accuracy", "timing", "compare"], help="what to run (default: all three)")
    parser.add_argument("--quick", action="store_true", help="skip the accuracy cases")
    parser.add_argument("--fla-ms", type=float, default=None,
                        help="skip timing FLA's chunk_kda at [1, 257, 4, 128] (minutes of compilation on a fresh "
                             "machine) and use this fwd+bwd figure, e.g. 3.50 ms; the table says it "
                             "is not from this run")
    parser.add_argument("--profile", action="store_true", help="also time each laqat timing row's kernels one by one")
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=["token", "decay-grid", "replay", "replay-h32"],
                        choices=list(POLICIES))
    parser.add_argument("--timing-shapes", default="1x257x4x128:64,2x4096x8x128:2048",
                        help="the timing section's KDA shapes, BxTxHxD:prefix, comma-separated")
    parser.add_argument("--reference-max-tokens", type=int, default=1024,
                        help="time the fp32 torch reference only at shapes of at most B*T tokens")
    parser.add_argument("--compare-shape", default="1x4096x16x128:2048", help="the comparison's shape, BxTxHxD:prefix")
    parser.add_argument("--compare-kinds", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    parser.add_argument("--compare-rows", default=",".join(COMPARE_ROWS),
                        help="comma-separated rows of the comparison: " + ", ".join(COMPARE_ROWS))
    parser.add_argument("--rounds", type=int, default=30, help="the comparison's interleaved rounds")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds this call may take: the comparison's rounds stop where the next would end later")
    parser.add_argument("--list", action="store_true",
                        help="print the comparison's rows, specs and kernels; run nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="without CUDA: the comparison at [1, 64, 2, 32] prefix 32, 2 rounds, on the CPU "
                             "(Triton's interpreter; FLA's rows fail there); checks the script, times nothing "
                             "meaningful")
    args = parser.parse_args()
    names = [r.strip() for r in args.compare_rows.split(",") if r.strip()]
    unknown = [r for r in names if r not in COMPARE_ROWS]
    if unknown:
        parser.error(f"unknown --compare-rows {unknown}; known: {list(COMPARE_ROWS)}")
    try:
        shapes = [parse_shape(x) for x in args.timing_shapes.split(",") if x.strip()]
        compare_shape = parse_shape(args.compare_shape)
    except ValueError as e:
        parser.error(f"a shape is BxTxHxD:prefix, e.g. 1x4096x16x128:2048 ({e})")
    if args.list:
        list_compare(args.compare_kinds, compare_shape[1], compare_shape[3], names)
        return
    sections = set(args.sections) - ({"accuracy"} if args.quick else set())
    if args.smoke and not torch.cuda.is_available():
        sections, compare_shape, args.rounds = {"compare"}, (1, 64, 2, 32, 32), 2
    t_start = time.perf_counter()
    out, result = start_cuda_run("decode_bench.py", "accuracy", "timing", cpu_ok=args.smoke)
    path = out / "decode_bench.json"

    def save():
        path.write_text(json.dumps(result, indent=2, default=str))

    if "accuracy" in sections:
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
        save()

    if "timing" in sections:
        for B, T, H, D, prefix in shapes:
            print(f"\nKDA decode-phase training fwd+bwd, [{B}, {T}, {H}, {D}] bf16, prefix {prefix} (median ms)")
            try:
                fla_ms = args.fla_ms if (B, T, H, D, prefix) == SMALL else None
                result["timing"] += timing(B, T, H, D, prefix, args.policies, args.num_warps, fla_ms, args.profile,
                                           args.reference_max_tokens)
            except Exception as e:
                traceback.print_exc()
                result.setdefault("timing_errors", []).append({"shape": [B, T, H, D], "prefix": prefix,
                                                               "error": repr(e)})
            save()
        print_timing(result["timing"])

    if "compare" in sections:
        B, T, H, D, prefix = compare_shape
        print(f"\ncomparison at [{B}, {T}, {H}, {D}], prefix {prefix}: warm-up, then {args.rounds} interleaved rounds")
        try:
            deadline = t_start + args.budget_s if args.budget_s else None

            def progress(partial):
                result["compare"] = partial
                save()

            result["compare"] = compare(args.compare_kinds, B, T, H, D, prefix, args.rounds, names,
                                        deadline=deadline, progress=progress)
            print_compare(result["compare"])
        except Exception as e:
            traceback.print_exc()
            result["compare_error"] = repr(e)
        save()
    save()
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
