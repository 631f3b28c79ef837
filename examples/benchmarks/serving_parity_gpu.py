"""Serving profiles on CUDA: laqat's decode phase against vLLM 0.33.0's own Triton kernels, element by element.

    python -m tests.serving.vllm_oracle --prepare out/vllm-oracle     # where the package index is reachable
    OUT=./out python examples/benchmarks/serving_parity_gpu.py --vllm-src out/vllm-oracle/src-<tag> [--layers-only]

Per case of PARITY (GDN with a bf16 / fp16 / fp32 cache, KDA with bf16 / fp32; 16 heads of 128, bf16 inputs):

1. the packed decode step: 64 sequences, each from its own random cached state, one token from raw projections,
   vLLM's packed decode kernel against laqat's serving ops and the profile's decode step (``forward: laqat`` and
   ``server``); the decode kernels against vLLM's recurrent kernel fed the computed inputs (one step from 64 states,
   256 steps from one); a whole sequence at [1, --tokens, 16, 128], half of it prefix, against ``serve``
   (tests/serving/vllm_serving.py: vLLM's chunk kernel, then its recurrent kernel per step, on canonical operands),
   with ``forward: server``'s outputs and gradients;
2. one layer from the raw projections (--layer-tokens, half of it prefix) against vLLM's layer's kernel calls
   (tests/serving's ``_vllm_layer``: the prefill's pre-processing and chunk kernel, the cache write, one packed
   decode launch per later token), compiled with the profile under ``forward: laqat`` and ``server``: differing
   prefix and decode outputs, with diagnostics (GDN: the prefill inputs, the decode alone from vLLM's handoff; KDA:
   laqat's cumsum of vLLM's gate of the raw gate against vLLM's fused gate cumsum).

Prints the rows and writes $OUT/serving_parity_gpu.json. The profiles' fwd+bwd time against FLA's is
decode_bench.py's (``--sections compare``, the "vllm serving recipe" rows, interleaved). The oracle needs no vLLM
install: the extracted kernel files (``--prepare``) and the stub package around them.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_common import REPO, ensure_la_compiler, rel_l2, start_cuda_run  # noqa: E402

ensure_la_compiler()
sys.path.insert(0, str(REPO))  # tests/serving: the oracle and vLLM's serving loop

import la_compiler.ir.delta_rule_phased  # noqa: E402,F401  (registers laqat::delta_rule_phased)
import la_compiler.kernels  # noqa: E402,F401
from la_compiler.kernels.decode import serving_inputs, serving_kda_inputs  # noqa: E402,F401  (the serving ops)
from la_compiler.ir.spec import RecurrenceSpec  # noqa: E402
from la_compiler.kernels.decode import suffix as decode_suffix  # noqa: E402
from la_compiler.kernels.registry import get_variant  # noqa: E402
from la_compiler.policy.resolution import Policy, load_policy  # noqa: E402
from tests.serving import vllm_oracle  # noqa: E402
from tests.serving.vllm_serving import serve  # noqa: E402

PARITY = [  # (kind, laqat policy cfg, vLLM cache dtype)
    ("gdn", {"serving": {"state_dtype": "bfloat16"}}, torch.bfloat16),
    ("gdn", {"serving": {"state_dtype": "float16"}}, torch.float16),
    ("gdn", {"serving": {"state_dtype": "float32"}}, torch.float32),
    ("kda", {"serving": {"state_dtype": "bfloat16", "model": "kimi_k3"}}, torch.bfloat16),
    ("kda", {"serving": {"state_dtype": "float32", "model": "kimi_k3"}}, torch.float32),
]


def _inputs(kind, B, T, H, D, device="cuda"):
    q = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    v = torch.randn(B, T, H, D, device=device).bfloat16()
    g = 0.1 * F.logsigmoid(torch.randn((B, T, H) if kind == "gdn" else (B, T, H, D), device=device))
    beta = torch.rand(B, T, H, device=device).sigmoid()
    return q, k, v, g, beta


def _spec(kind, policy, forward="laqat") -> RecurrenceSpec:
    """The profile's spec with ``serving.forward`` set (``auto`` would pick vLLM's kernels once the oracle is
    loaded)."""
    policy = load_policy(policy).to_dict()
    for rule in policy["linear_attention"]:
        rule["cfg"]["serving"]["forward"] = forward
    res = Policy.from_dict(policy).resolve("model.layers.0.attn", kind)
    return RecurrenceSpec(kind, state="vk", phase=res.phase, quant=res.quant, extra=res.extra,
                          kernel="decode_serving")


def _units(a, b, mantissa, per_row):
    """max |a - b| in units of the last place (``mantissa`` bits) of |b| (per_row: of the row's largest |b|)."""
    a, b = a.float(), b.float()
    ref = b.abs().amax(-1, keepdim=True) if per_row else b.abs()
    ulp = torch.exp2(torch.floor(torch.log2(ref.clamp_min(torch.finfo(torch.float32).tiny))) - mantissa)
    return ((a - b).abs() / ulp).max().item()


def parity(vllm, kind, cfg, cache, T=4096, H=16, D=128, prefix=2048, device="cuda") -> dict:
    q, k, v, g, beta = _inputs(kind, 1, T, H, D, device)
    o_ref, h_ref = serve(vllm, kind, q, k, v, g, beta, prefill_lengths=[prefix], valid_lengths=[T], cache_dtype=cache)
    policy = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": cfg}]})
    spec = _spec(kind, policy)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[cache]
    row = {"kind": kind, "cache": str(cache).removeprefix("torch."), "spec": spec.to_string()}
    for label, warps in (("vllm_warps", None), ("4_warps", 4)):
        decode_suffix.NUM_WARPS = warps
        try:
            o, ht = get_variant("decode_serving").forward(spec, q, k, v, g, beta, None, None, D ** -0.5,
                                                          prefill_lengths=torch.tensor([prefix], device=device),
                                                          valid_lengths=torch.tensor([T], device=device))
        finally:
            decode_suffix.NUM_WARPS = None
        ht = ht.transpose(-1, -2)
        pre, suf = o[0, :prefix], o[0, prefix:]
        pre_ref, suf_ref = o_ref[0, :prefix], o_ref[0, prefix:]
        row[label] = {
            "suffix_equal": bool(torch.equal(suf, suf_ref)), "suffix_differ": int((suf != suf_ref).sum()),
            "suffix_row_ulps": _units(suf, suf_ref, 7, True), "suffix_rel_l2": rel_l2(suf, suf_ref),
            "state_equal": bool(torch.equal(ht, h_ref)), "state_differ": int((ht != h_ref).sum()),
            "state_ulps": _units(ht, h_ref, mantissa, False), "state_rel_l2": rel_l2(ht, h_ref),
            "prefix_equal": bool(torch.equal(pre, pre_ref)), "prefix_row_ulps": _units(pre, pre_ref, 7, True),
            "prefix_rel_l2": rel_l2(pre, pre_ref)}
    row["server_forward"] = server_forward_check(kind, policy, q, k, v, g, beta, o_ref, h_ref, prefix, device)
    try:
        row["packed_step"] = packed_step(vllm, kind, cfg, cache, H=H, D=D, device=device)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        traceback.print_exc()
        row["packed_step"] = {"error": repr(e)}
    try:
        row["one_step"] = one_step(vllm, kind, spec, cache, H=H, D=D, device=device)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        traceback.print_exc()
        row["one_step"] = {"error": repr(e)}
    try:
        row["decode_only"] = decode_only(vllm, kind, spec, cache, H=H, D=D, device=device)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        traceback.print_exc()
        row["decode_only"] = {"error": repr(e)}
    return row


def decode_only(vllm, kind, spec, cache, T=256, H=16, D=128, device="cuda") -> dict:
    """The decode kernels alone: no prefix, the same initial state (stored in the cache dtype by both), T decode
    steps; whether laqat's suffix equals vLLM's step by step without a prefix's difference carried in."""
    q, k, v, g, beta = _inputs(kind, 1, T, H, D, device)
    h0 = 0.1 * torch.randn(1, H, D, D, device=device)
    o_ref, h_ref = serve(vllm, kind, q, k, v, g, beta, prefill_lengths=[0], valid_lengths=[T], cache_dtype=cache,
                         initial_state=h0)
    o, ht = get_variant("decode_serving").forward(spec, q, k, v, g, beta, h0.transpose(-1, -2).contiguous(), None,
                                                  D ** -0.5, prefill_lengths=torch.tensor([0], device=device),
                                                  valid_lengths=torch.tensor([T], device=device))
    ht = ht.transpose(-1, -2)
    return {"steps": T, "outputs_equal": bool(torch.equal(o, o_ref)), "outputs_differ": int((o != o_ref).sum()),
            "state_equal": bool(torch.equal(ht, h_ref)), "state_differ": int((ht != h_ref).sum()),
            "outputs_rel_l2": rel_l2(o, o_ref)}


def one_step(vllm, kind, spec, cache, N=64, H=16, D=128, device="cuda") -> dict:
    """One decode step of N sequences, each from its own random state (stored in the cache dtype by both): whether
    a single step of laqat's decode kernel equals one launch of vLLM's, before any difference can accumulate."""
    q, k, v, g, beta = _inputs(kind, N, 1, H, D, device)
    h0 = 0.1 * torch.randn(N, H, D, D, device=device)
    lengths = dict(prefill_lengths=[0] * N, valid_lengths=[1] * N)
    o_ref, h_ref = serve(vllm, kind, q, k, v, g, beta, cache_dtype=cache, initial_state=h0, **lengths)
    o, ht = get_variant("decode_serving").forward(
        spec, q, k, v, g, beta, h0.transpose(-1, -2).contiguous(), None, D ** -0.5,
        prefill_lengths=torch.zeros(N, dtype=torch.int32, device=device),
        valid_lengths=torch.ones(N, dtype=torch.int32, device=device))
    ht = ht.transpose(-1, -2).to(cache).float()  # vLLM's cache holds the stored state
    return {"sequences": N, "outputs_differ": int((o != o_ref).sum()), "outputs": o.numel(),
            "state_differ": int((ht != h_ref).sum()), "states": ht.numel()}


def _raw_decode_inputs(kind, N, H, D, device):
    """Raw projections of N decode tokens as vLLM's layers hand them to the packed decode: q|k|v packed, the raw gate
    (GDN: a [N, H]; KDA: [N, H, D]), raw beta [N, H], A_log, dt_bias."""
    gen = torch.Generator().manual_seed(3)
    mixed = (torch.randn(N, 3 * H * D, generator=gen) * 2).bfloat16()
    raw_g = (torch.randn((N, H) if kind == "gdn" else (N, H, D), generator=gen) * 4).bfloat16()
    raw_b = (torch.randn(N, H, generator=gen) * 2).bfloat16()
    A_log = torch.rand(H, generator=gen).mul(3).log()
    dt_bias = torch.rand(H if kind == "gdn" else H * D, generator=gen)
    return (x.to(device) for x in (mixed, raw_g, raw_b, A_log, dt_bias))


def packed_step(vllm, kind, cfg, cache, N=64, H=16, D=128, device="cuda") -> dict:
    """One decode step of N sequences from their own random cached states, as the server runs it: vLLM's packed
    decode kernel (``fused_recurrent_gated_delta_rule_packed_decode`` / ``fused_recurrent_kda_packed_decode``: the l2
    norm and the gate computed in the kernel from the raw projections) against laqat's serving pre-processing ops and
    the profile's decode step, under ``forward: laqat`` and ``forward: server``."""
    mixed, raw_g, raw_b, A_log, dt_bias = _raw_decode_inputs(kind, N, H, D, device)
    cache_state = torch.zeros(N + 1, H, D, D, dtype=cache, device=device)
    cache_state[1:] = (0.1 * torch.randn(N, H, D, D, device=device)).to(cache)
    h0 = cache_state[1:].float()  # [N, H, V, K]: the spec's "vk" layout
    slots = torch.arange(1, N + 1, dtype=torch.int32, device=device)
    served = cache_state.clone()
    if kind == "gdn":
        o_ref = torch.empty(N, 1, H, D, dtype=torch.bfloat16, device=device)
        vllm.gdn_recurrent.fused_recurrent_gated_delta_rule_packed_decode(
            mixed, raw_g, raw_b, A_log, dt_bias, D ** -0.5, served, o_ref, slots, use_qk_l2norm_in_kernel=True)
    else:
        o_ref, _ = vllm.kda_recurrent.fused_recurrent_kda_packed_decode(
            mixed_qkv=mixed, raw_g=raw_g[None], raw_beta=raw_b[None], A_log=A_log, dt_bias=dt_bias, lower_bound=None,
            initial_state=served, state_indices=slots)
    o_ref = o_ref.reshape(N, 1, H, D)
    decode = torch.zeros(N, 1, dtype=torch.int8, device=device)
    norm = torch.ops.laqat.serving_l2norm if kind == "gdn" else torch.ops.laqat.serving_kda_l2norm
    q, k = (norm(mixed[:, i * H * D:(i + 1) * H * D].reshape(N, 1, H, D), decode) for i in (0, 1))
    v = mixed[:, 2 * H * D:].reshape(N, 1, H, D)
    if kind == "gdn":
        g = torch.ops.laqat.serving_gdn_gate(raw_g[:, None], A_log, dt_bias, decode)
    else:
        g = torch.ops.laqat.serving_kda_gate(raw_g[:, None], A_log, dt_bias)
    beta = torch.ops.laqat.serving_sigmoid(raw_b[:, None])
    policy = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": cfg}]})
    row = {"sequences": N, "outputs": o_ref.numel(), "states": h0.numel()}
    for forward in ("laqat", "server"):
        spec = _spec(kind, policy, forward)
        o, ht = get_variant("decode_serving").forward(
            spec, q, k, v, g, beta, h0, None, D ** -0.5, prefill_lengths=torch.zeros(N, dtype=torch.int32,
                                                                                      device=device),
            valid_lengths=torch.ones(N, dtype=torch.int32, device=device))
        row[forward] = {"outputs_differ": int((o.to(o_ref.dtype) != o_ref).sum()),
                        "state_differ": int((ht.to(cache) != served[1:]).sum())}
    return row


def _kda_layer_core(mixed, raw_g, raw_b, A_log, dt_bias, H, K):  # -> (o, final state)
    """FLA's KDA layer from the convolution's output to the recurrence's output (the gate, beta's sigmoid and the
    l2 norm in FLA's kernels), as tests/serving/test_serving_kda_inputs.py's, without transformers' forget gate."""
    from fla.ops.kda import chunk_kda

    B, T = mixed.shape[:2]
    q, k, v = (x.reshape(B, T, H, K) for x in torch.split(mixed, [H * K] * 3, dim=-1))
    return chunk_kda(q, k, v, g=raw_g, beta=raw_b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)


def layer_parity(vllm, kind, forward, cache=torch.bfloat16, T=4096, prefixes=(2048,), H=16, D=128,
                 dtype=torch.bfloat16) -> dict:
    """One layer from the raw projections (tests/serving's layer cases at a model's head size), a batch of one
    sequence per prefix length: laqat compiles it with the profile (``cache`` its cache dtype, ``forward`` set) in a
    decode phase; vLLM's layer runs its own kernels on each sequence's projections (the prefill's pre-processing and
    chunk kernel, the cache write, one packed decode launch per later token). Differing outputs of the prefixes and
    of the decode tokens; KDA: laqat's cumsum of vLLM's gate of the raw gate against vLLM's fused gate cumsum.
    ``dtype``: the model's, of the projections (the tests' bf16 values, widened for fp32)."""
    import la_compiler
    from tests.serving import test_serving_inputs as gdn_case
    from tests.serving import test_serving_kda_inputs as kda_case

    cache_name = str(cache).removeprefix("torch.")
    serving = {"state_dtype": cache_name, "forward": forward, **({"model": "kimi_k3"} if kind == "kda" else {})}
    options = {"policy": {"linear_attention": [{"module_name": "*", "cfg": {"serving": serving}}]},
               "compiler": "eager"}
    row = {"kind": kind, "forward": forward, "cache": cache_name, "T": T, "prefixes": list(prefixes), "H": H, "D": D,
           "dtype": str(dtype).removeprefix("torch.")}
    if kind == "gdn":
        seqs = [list(gdn_case._raw(T, H, H, D, D, seed=1 + i)) for i in range(len(prefixes))]
        A_log, dt_bias = seqs[0][3:]
        mixed, a, b = (torch.stack([x[j] for x in seqs]).to(dtype) for j in range(3))
        core = torch.compile(gdn_case._layer_core, backend="laqat", fullgraph=True, options=options)
        with la_compiler.phase(prefill_lengths=list(prefixes)), torch.no_grad():
            out, state = core(mixed, a, b, A_log, dt_bias, H, H, D, D, gdn_case._chunk_function("fla"), True)
        expected = [gdn_case._vllm_layer(vllm, mixed[i], a[i], b[i], A_log, dt_bias, H, H, D, D, p, cache, True)
                    for i, p in enumerate(prefixes)]
    else:
        seqs = [list(kda_case._raw(T, H, D, seed=1 + i)) for i in range(len(prefixes))]
        A_log, dt_bias = seqs[0][3:]
        mixed, raw_g, raw_b = (torch.stack([x[j] for x in seqs]).to(dtype) for j in range(3))
        core = torch.compile(_kda_layer_core, backend="laqat", fullgraph=True, options=options)
        with la_compiler.phase(prefill_lengths=list(prefixes)), torch.no_grad():
            out, state = core(mixed, raw_g, raw_b, A_log, dt_bias, H, D)
        expected = [kda_case._vllm_layer(vllm, mixed[i], raw_g[i], raw_b[i], A_log, dt_bias, H, D, p, cache, True)
                    for i, p in enumerate(prefixes)]
        p = prefixes[0]
        g_cum, _ = vllm.kda_chunk.fused_kda_gate_chunk_cumsum(raw_g[:1, :p], raw_beta=raw_b[:1, :p], A_log=A_log,
                                                              g_bias=dt_bias)
        row["gate_cumsum_differ"] = int((kda_case.laqat_server_cumsum(raw_g[:1, :p], A_log, dt_bias) != g_cum).sum())
        row["gate_cumsum_values"] = g_cum.numel()
    # the final states: laqat's fp32 [N, HV, K, V] (FLA's layout) against vLLM's cache slot [HV, V, K], widened
    theirs_state = torch.stack([cached.transpose(-1, -2).float() for _, cached in expected])
    row.update(final_state_differ=int((state.float() != theirs_state).sum()), final_state_values=theirs_state.numel())
    expected = [o for o, _ in expected]
    counts = {"prefix_differ": 0, "decode_differ": 0, "prefix_outputs": 0, "decode_outputs": 0}
    first = []
    for i, p in enumerate(prefixes):
        ours, theirs = out[i], expected[i]
        counts["prefix_differ"] += int((ours[:p] != theirs[:p]).sum())
        counts["decode_differ"] += int((ours[p:] != theirs[p:]).sum())
        counts["prefix_outputs"] += theirs[:p].numel()
        counts["decode_outputs"] += theirs[p:].numel()
        differ = (ours[p:] != theirs[p:]).flatten(1).any(1).nonzero()
        first.append(int(differ[0]) if differ.numel() else None)
    row.update(counts, first_differing_decode_token=first,
               max_abs_diff=max((out[i].float() - e.float()).abs().max().item() for i, e in enumerate(expected)))
    return row


def dump_asm(directory: Path, *kernels) -> list[str]:
    """Every compiled specialization of ``kernels`` (JIT functions, or heuristics/autotuners around them): TTGIR,
    LLVM IR, PTX and SASS where Triton can disassemble, one file each, to compare the GPU's code of two kernels."""
    import triton

    written = []
    directory.mkdir(parents=True, exist_ok=True)
    for kernel in kernels:
        fn = kernel
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn
        for caches in fn.device_caches.values():
            for i, compiled in enumerate(caches[0].values()):
                for ext in ("ttgir", "llir", "ptx", "sass"):
                    try:
                        text = compiled.asm[ext]
                    except Exception as e:  # noqa: BLE001 (no disassembler on this machine)
                        text = f"unavailable: {e!r}"
                    path = directory / f"{fn.__name__}.{i}.{ext}"
                    path.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
                    written.append(path.name)
    return written


def server_forward_check(kind, policy, q, k, v, g, beta, o_ref, h_ref, prefix, device) -> dict:
    """serving.forward: server (vLLM's kernels forward, laqat's backward) against serve's outputs and state, and its
    gradients against serving.forward: laqat's, one training forward + backward each."""
    T, D = q.shape[1], q.shape[-1]
    lengths = dict(prefill_lengths=torch.tensor([prefix], device=device), valid_lengths=torch.tensor([T], device=device))
    variant = get_variant("decode_serving")
    gen = torch.Generator(device=device).manual_seed(0)
    do = torch.randn(o_ref.shape, device=device, generator=gen).to(o_ref.dtype)
    dht = torch.randn(h_ref.transpose(-1, -2).shape, device=device, generator=gen)
    runs = {}
    for forward in ("server", "laqat"):
        spec = _spec(kind, policy, forward)
        saved = torch.empty(variant.residual_numel(spec, q, v, None), dtype=torch.float32, device=device)
        o, ht = variant.forward(spec, q, k, v, g, beta, None, None, D ** -0.5, save_to=saved, **lengths)
        grads = variant.backward(spec, q, k, v, g, beta, None, None, D ** -0.5, do, dht, saved=saved, **lengths)
        runs[forward] = (spec, o, ht.transpose(-1, -2), grads[:5])
    spec, o, ht, grads = runs["server"]
    laqat_grads = runs["laqat"][3]
    return {"spec": spec.to_string(), "outputs_equal": bool(torch.equal(o, o_ref)),
            "state_equal": bool(torch.equal(ht, h_ref)),
            "grads_equal": {n: bool(torch.equal(a, b)) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                             grads, laqat_grads)},
            "grads_max_diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, laqat_grads))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", type=Path, default=None,
                        help="the oracle's extracted files (python -m tests.serving.vllm_oracle --prepare DIR); "
                             "default: fetch the wheel (needs the package index)")
    parser.add_argument("--no-timing", action="store_true",
                        help="no effect: kept for older command lines (the profiles' timing is decode_bench.py's)")
    parser.add_argument("--tokens", type=int, default=4096, help="T of the parity cases (the prefix is half)")
    parser.add_argument("--cases", default="", help="comma-separated kind:cache cases of PARITY (default: all)")
    parser.add_argument("--layers-only", action="store_true", help="the layer rows only (no PARITY cases)")
    parser.add_argument("--layer-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the model dtype of the layer rows (vLLM's GDN prefill refuses float32)")
    parser.add_argument("--layer-tokens", type=int, default=4096,
                        help="T of the layer rows (the prefix is half, the rest decode tokens)")
    parser.add_argument("--asm", type=Path, default=None,
                        help="write the compiled decode kernels (laqat's and vLLM's: TTGIR, LLVM IR, PTX, SASS) here")
    args = parser.parse_args()
    out, result = start_cuda_run("serving_parity_gpu.py", "parity")
    torch.backends.cuda.matmul.allow_tf32 = False

    vllm = vllm_oracle.load(args.vllm_src)
    T = args.tokens
    print(f"parity with vLLM 0.33.0, [1, {T}, 16, 128] bf16, prefix {T // 2} (suffix: {T - T // 2} decode steps)")
    wanted = {c for c in args.cases.split(",") if c}
    for kind, cfg, cache in PARITY:
        if args.layers_only:
            break
        if wanted and f"{kind}:{str(cache).removeprefix('torch.')}" not in wanted:
            continue
        try:
            row = parity(vllm, kind, cfg, cache, T=T, prefix=T // 2)
        except Exception as e:
            traceback.print_exc()
            row = {"kind": kind, "cache": str(cache), "error": repr(e)}
        result["parity"].append(row)
        for label in ("vllm_warps", "4_warps"):
            r = row.get(label)
            if r is None:
                print(f"  {kind} {row['cache']}: ERROR {row.get('error')}")
                break
            print(f"  {kind} cache {row['cache']:<8} {label:<10} suffix {'==' if r['suffix_equal'] else '!='} "
                  f"({r['suffix_differ']} differ, {r['suffix_row_ulps']:.1f} row-ulps), state "
                  f"{'==' if r['state_equal'] else '!='} ({r['state_differ']} differ, {r['state_ulps']:.1f} ulps), "
                  f"prefix {r['prefix_row_ulps']:.1f} row-ulps rel {r['prefix_rel_l2']:.1e}", flush=True)
        d = row.get("packed_step", {})
        print(f"  {kind} cache {row['cache']:<8} packed decode step from raw projections ({d.get('sequences')} "
              "states): " + ("; ".join(f"forward {f}: outputs {d[f]['outputs_differ']} of {d['outputs']} differ, "
                                       f"states {d[f]['state_differ']} of {d['states']}"
                                       for f in ("laqat", "server"))
                             if "error" not in d else d["error"]), flush=True)
        d = row.get("one_step", {})
        print(f"  {kind} cache {row['cache']:<8} one step ({d.get('sequences')} states): "
              + (f"outputs {d['outputs_differ']} of {d['outputs']} differ, stored states {d['state_differ']} of "
                 f"{d['states']}" if "error" not in d else d["error"]), flush=True)
        d = row.get("decode_only", {})
        print(f"  {kind} cache {row['cache']:<8} decode only ({d.get('steps')} steps from one state): "
              + (f"outputs {'==' if d['outputs_equal'] else '!='} ({d['outputs_differ']} differ), state "
                 f"{'==' if d['state_equal'] else '!='} ({d['state_differ']} differ)" if "error" not in d
                 else d["error"]), flush=True)
        s = row.get("server_forward")
        if s is not None:
            print(f"  {kind} cache {row['cache']:<8} forward: server  outputs "
                  f"{'==' if s['outputs_equal'] else '!='} vLLM, state {'==' if s['state_equal'] else '!='} vLLM, "
                  f"gradients {'==' if all(s['grads_equal'].values()) else '!='} forward: laqat's "
                  f"(max |diff| {s['grads_max_diff']:.1e})", flush=True)

    LT = args.layer_tokens
    batches = ([LT // 2], [LT // 2, LT // 4])  # one sequence; two with prefixes of different lengths
    print(f"one layer from the raw projections ({LT} tokens per sequence, prefixes {batches}, 16 heads of 128) "
          "against vLLM's layer's kernel calls")
    result["layer"] = []
    for kind, _, cache in PARITY:
        if wanted and f"{kind}:{str(cache).removeprefix('torch.')}" not in wanted:
            continue
        for prefixes in batches[:1] if cache != torch.bfloat16 else batches:
            for forward in ("laqat", "server"):
                try:
                    row = layer_parity(vllm, kind, forward, cache, T=LT, prefixes=prefixes,
                                       dtype=getattr(torch, args.layer_dtype))
                except Exception as e:  # noqa: BLE001 (reported in the table)
                    traceback.print_exc()
                    row = {"kind": kind, "forward": forward, "cache": str(cache), "error": repr(e)}
                result["layer"].append(row)
                print(f"  {kind} cache {str(cache).removeprefix('torch.'):<8} prefixes {prefixes} forward {forward:<7} "
                      + (f"prefix outputs {row['prefix_differ']} of {row['prefix_outputs']} differ, decode outputs "
                         f"{row['decode_differ']} of {row['decode_outputs']} (max |diff| {row['max_abs_diff']:.2e})"
                         + (f"; gate cumsum {row['gate_cumsum_differ']} of {row['gate_cumsum_values']} differ"
                            if "gate_cumsum_differ" in row else "")
                         + f"; final states {row['final_state_differ']} of {row['final_state_values']} differ"
                         + f"; first differing decode token {row['first_differing_decode_token']}"
                         if "error" not in row else row["error"]), flush=True)
    if args.asm is not None:
        from la_compiler.kernels.decode import kernels as decode_kernels

        result["asm"] = dump_asm(args.asm, decode_kernels.decode_fwd_kernel,
                                 vllm.gdn_recurrent.fused_recurrent_gated_delta_rule_fwd_kernel,
                                 vllm.gdn_recurrent.fused_recurrent_gated_delta_rule_packed_decode_kernel,
                                 vllm.kda_recurrent.fused_recurrent_kda_fwd_kernel,
                                 vllm.kda_recurrent.fused_recurrent_kda_packed_decode_kernel)
        print(f"compiled kernels: {len(result['asm'])} files in {args.asm}")

    path = out / "serving_parity_gpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
