"""Bit fingerprints of the kernel variants: a before/after check that a change moved no output bit.

    python examples/benchmarks/kernel_fingerprints.py --out before.json [--device cpu|cuda] [--shapes tiny|gpu]
        [--only SUBSTRING,...]
    python examples/benchmarks/kernel_fingerprints.py --compare before.json after.json   # exit 1 on any difference
    python examples/benchmarks/kernel_fingerprints.py --list

For a fixed list of cases (the specs of chunk_bench.py's EXACT_CASES through the ``chunk`` variant, GDN and
KDA, varlen, grouped value heads, initial states, state / W / GEMM-operand QDQ; the ``fused_recurrent`` variant,
exact; the ``decode_fused`` variant, token and replay phases with an FP8 state), each in fp32 and bf16, it
builds fresh random inputs from a seed of the case (on the CPU, then moved to the device), runs the
variant's forward (into a NaN-filled residual buffer where the variant keeps one) and its backward (random
do, dht) and records the sha256 of every output's bytes (o, ht, the residual, dq, dk, dv, dg, dbeta, dh0) with
its max |x| (a human sees it is not all zeros) and any non-finite count. The chunk variant's backward runs
twice, with the forward's residual and without it (``*_recomputed``: the path that recomputes the forward).
A case the variant refuses is recorded with its error (two cases are refusals on purpose: the refusal is
part of what is compared).

Only the stable entry points are used (``la_compiler.kernels.registry.get_variant``, ``la_compiler.ir.spec``),
never a kernels submodule, so the same script fingerprints a tree before and after its kernels move.

The JSON: ``{case: {tensor: sha256, ..., "_max_abs": {tensor: float}, "_nonfinite": {tensor: count},
"_spec": str, "_refused": str (only then no tensors)}, "_meta": {...}}``; ``--compare`` compares the tensor
hashes and refusals of every case (keys starting with "_" are information only).

Before / after a change: copy this script out of the tree, run it on the old tree (``--out before.json``),
then on the new one (``--out after.json``), then ``--compare before.json after.json``. The seed of a case
is its variant, spec and shape, so the cases can be reordered or extended without moving the others' inputs.

On the CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set here when absent) on one
thread; the tiny shapes keep the whole run to about 8 CPU minutes. ``--shapes gpu`` runs the cases at
chunk_bench's EXACT_CASES shapes (CUDA). A GPU run's bits may differ from a CPU run's (different dot
implementations): compare files of the same device and shapes only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib
from pathlib import Path

# ---- the cases -----------------------------------------------------------------------------------
# chunk_bench.py's quant policies, copied (not imported: the script must not depend on where the kernels live)
GEMM_SITES = ("key_interaction", "wy_value", "wy_key", "state_read", "state_update", "output_state",
              "output_score", "output_value")
OPERANDS = [f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if (s, side) != ("state_read", "lhs")]
FP8_ALL = {site: "fp8_e4m3/row" for site in OPERANDS}
PAIR_SITES = [f"{s}.{side}" for s in ("key_interaction", "output_score") for side in ("lhs", "rhs")]
PAIR_SITES_FP8 = {site: "fp8_e4m3/row" for site in PAIR_SITES}
PAIR_SITES_NVFP4 = {site: "nvfp4/block16" for site in PAIR_SITES}
STATE_FP8_W = {"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}
ALL_FP8 = {**FP8_ALL, **STATE_FP8_W}

# chunk_bench.py's EXACT_CASES: (name, kind, state layout, quant, gpu shape (B, T, H, HV, K, V, cu_seqlens),
# tiny shape). Tiny: T not a multiple of the chunk (64) and past one chunk where it is cheap, K/V 16..64 (V=64
# where a tile64 state codec needs a full tile), the same varlen / grouped-head structure.
CHUNK_CASES = [
    ("gdn-kv", "gdn", "kv", {}, (2, 200, 2, 2, 64, 64, None), (2, 37, 2, 2, 32, 32, None)),
    ("gdn-vk-varlen-gqa", "gdn", "vk", {}, (1, 300, 2, 4, 128, 128, (0, 37, 101, 300)),
     (1, 83, 2, 4, 32, 32, (0, 9, 20, 83))),
    ("kda-kv-gqa", "kda", "kv", {}, (1, 130, 1, 2, 128, 96, None), (1, 70, 1, 2, 32, 24, None)),
    ("kda-vk-varlen-gqa", "kda", "vk", {}, (1, 190, 2, 4, 64, 128, (0, 1, 70, 190)),
     (1, 40, 2, 4, 16, 32, (0, 1, 19, 40))),
    ("gdn-kv-varlen-state-fp8-w-fp8", "gdn", "kv", STATE_FP8_W, (1, 300, 2, 4, 128, 128, (0, 100, 300)),
     (1, 83, 2, 4, 32, 64, (0, 30, 83))),
    ("kda-kv-state-int8", "kda", "kv", {"state": "int8/tile64"}, (2, 150, 2, 2, 128, 128, None),
     (2, 29, 2, 2, 32, 64, None)),
    ("kda-vk-varlen-k256", "kda", "vk", {}, (1, 200, 1, 2, 256, 128, (0, 70, 200)), (1, 40, 1, 2, 256, 16, (0, 13, 40))),
    ("kda-kv-k256-state-fp8-w-fp8", "kda", "kv", STATE_FP8_W, (2, 150, 2, 2, 256, 64, None),
     (1, 23, 1, 1, 256, 64, None)),
    ("gdn-vk-varlen-k256", "gdn", "vk", {}, (1, 200, 1, 2, 256, 128, (0, 70, 200)), (1, 40, 1, 2, 256, 16, (0, 13, 40))),
    ("kda-kv-varlen-pairs-fp8", "kda", "kv", PAIR_SITES_FP8, (1, 200, 1, 2, 128, 64, (0, 70, 200)),
     (1, 40, 1, 2, 16, 16, (0, 13, 40))),
    ("kda-vk-pairs-nvfp4", "kda", "vk", PAIR_SITES_NVFP4, (2, 150, 2, 2, 64, 64, None), (2, 21, 1, 1, 16, 16, None)),
    ("gdn-kv-varlen-all-fp8", "gdn", "kv", ALL_FP8, (1, 300, 2, 4, 128, 128, (0, 100, 300)),
     (1, 40, 2, 4, 32, 64, (0, 13, 40))),
    ("kda-kv-all-fp8", "kda", "kv", ALL_FP8, (2, 150, 2, 2, 128, 128, None), (1, 27, 1, 1, 32, 64, None)),
    # refused (head dim above the chunk kernels' limit): the refusal is recorded and compared
    ("gdn-kv-k512-refused", "gdn", "kv", {}, (1, 70, 1, 1, 512, 32, None), (1, 19, 1, 1, 512, 16, None)),
]

# further chunk paths (not chunk_bench cases): the Neumann solve, accumulator emulation, NVFP4 / INT8 W, NVFP4
# GEMM operands (an h stage over all of V), the int8_h32 state codec, GDN's rounded pair products, chunks of 16
# (the row-by-row solve) and 32. (name, kind, layout, quant, spec fields, gpu shape, tiny shape)
NVFP4_ALL = {site: "nvfp4/block16" for site in OPERANDS}
ACC_SOME = {"key_interaction": "fp16:16", "state_update": "bf16:16", "output_value": "fp16:8", "wy_key": "bf16:8"}
CHUNK_PATH_CASES = [
    ("gdn-kv-neumann3", "gdn", "kv", {}, {"solve": "neumann", "degree": 3},
     (1, 200, 2, 2, 64, 64, None), (1, 37, 1, 2, 16, 16, None)),
    ("kda-vk-varlen-neumann2-pairs-fp8", "kda", "vk", PAIR_SITES_FP8, {"solve": "neumann", "degree": 2},
     (1, 200, 1, 2, 64, 64, (0, 70, 200)), (1, 40, 1, 2, 16, 16, (0, 13, 40))),
    ("gdn-kv-acc", "gdn", "kv", {}, {"acc": ACC_SOME}, (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 32, 16, None)),
    ("kda-vk-acc-chunk32", "kda", "vk", {}, {"acc": ACC_SOME, "chunk": 32},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 1, 32, 16, None)),
    ("gdn-vk-w-nvfp4-state-int8h32", "gdn", "vk", {"w": "nvfp4/block16", "state": "int8_h32/tile32"}, {},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 32, 32, None)),
    ("kda-kv-w-int8-block16-chunk16", "kda", "kv", {"w": "int8/block16"}, {"chunk": 16},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 32, 16, None)),
    ("gdn-kv-varlen-pairs-nvfp4", "gdn", "kv", PAIR_SITES_NVFP4, {},
     (1, 200, 1, 2, 64, 64, (0, 70, 200)), (1, 40, 1, 2, 16, 16, (0, 13, 40))),
    ("gdn-vk-pairs-fp8-chunk32", "gdn", "vk", PAIR_SITES_FP8, {"chunk": 32},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 32, 16, None)),
    ("kda-kv-all-nvfp4", "kda", "kv", NVFP4_ALL, {}, (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 1, 16, 16, None)),
    ("gdn-kv-all-nvfp4-state-fp8", "gdn", "kv", {**NVFP4_ALL, "state": "fp8_e4m3/tile16"}, {},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 16, 16, None)),
    ("gdn-kv-all-int8", "gdn", "kv", {site: "int8/row" for site in OPERANDS}, {"chunk": 32},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 2, 32, 16, None)),
    ("kda-vk-all-fp8-acc", "kda", "vk", FP8_ALL, {"acc": {"output_state": "bf16:16", "state_read": "fp16:8"}},
     (1, 130, 1, 2, 64, 64, None), (1, 37, 1, 1, 16, 16, None)),
]

# the fused recurrent variant, exact: (name, kind, layout, gpu shape, tiny shape)
RECURRENT_CASES = [
    ("gdn-kv-gqa", "gdn", "kv", (2, 256, 2, 4, 128, 128, None), (2, 19, 2, 4, 16, 16, None)),
    ("gdn-vk-varlen", "gdn", "vk", (1, 300, 2, 2, 64, 128, (0, 37, 101, 300)), (1, 40, 2, 2, 32, 16, (0, 7, 19, 40))),
    ("kda-kv-varlen-gqa", "kda", "kv", (1, 300, 2, 4, 128, 64, (0, 100, 300)), (1, 33, 2, 4, 16, 32, (0, 1, 33))),
    ("kda-vk", "kda", "vk", (2, 200, 2, 2, 128, 128, None), (2, 21, 2, 2, 32, 32, None)),
]

# the fused decode variant (tests/kernels/test_decode_fused.py's specs, FP8 state): (name, kind, phase, state
# format, extras, layout, gpu shape, tiny shape, prefill lengths, valid lengths per sequence of the tiny shape,
# of the gpu shape)
DECODE_CASES = [
    ("gdn-token-fp8-gqa", "gdn", "token", "fp8_e4m3/tile16", {}, "kv",
     (2, 19, 1, 2, 16, 32, None), ([3, 0], [19, 14]),
     (2, 256, 2, 4, 128, 128, None), ([100, 0], [256, 200])),
    ("kda-token-fp8-stored-grid-vk-empty-suffix", "kda", "token", "fp8_e4m3/tile16",
     {"readout": "stored", "decay_log_step": "0.03125"}, "vk",
     (2, 17, 2, 2, 16, 32, None), ([17, 2], [17, 17]),
     (2, 256, 2, 2, 128, 128, None), ([256, 50], [256, 256])),
    ("kda-replay-fp8-factors-grid", "kda", "replay", "fp8_e4m3/tile16",
     {"replay_window": "3", "replay_factor_qdq": "1", "decay_log_step": "0.015625"}, "kv",
     (2, 23, 1, 1, 16, 16, None), ([2, 5], [23, 20]),
     (2, 256, 2, 2, 128, 128, None), ([64, 5], [256, 250])),
    ("gdn-replay-fp8-vk-stored", "gdn", "replay", "fp8_e4m3/tile16", {"replay_window": "4", "readout": "stored"},
     "vk", (1, 21, 1, 2, 16, 32, None), ([3], [21]),
     (1, 256, 2, 4, 128, 128, None), ([30], [256])),
    ("kda-token-fp8-packed", "kda", "token", "fp8_e4m3/tile16", {"readout": "stored"}, "kv",
     (1, 24, 1, 2, 16, 16, (0, 11, 11, 24)), ([2, 0, 0], [11, 0, 13]),
     (1, 300, 2, 2, 128, 128, (0, 100, 100, 300)), ([20, 0, 0], [100, 0, 200])),
    ("gdn-token-fp8-grid-packed", "gdn", "token", "fp8_e4m3/tile16", {"decay_log_step": "0.0625"}, "vk",
     (1, 26, 1, 2, 16, 16, (0, 9, 9, 26)), ([1, 0, 3], [9, 0, 17]),
     (1, 300, 2, 2, 128, 128, (0, 100, 100, 300)), ([1, 0, 30], [100, 0, 200])),
    # refused (the int8_h32 codec needs V % 32 == 0)
    ("gdn-token-int8h32-v16-refused", "gdn", "token", "int8_h32/tile32", {}, "kv",
     (1, 8, 1, 1, 16, 16, None), ([2], [8]), (1, 64, 1, 1, 128, 16, None), ([2], [64])),
]

DTYPES = ("fp32", "bf16")
OUTPUT_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def build_cases(shapes: str) -> dict[str, dict]:
    """case name -> what to run (variant, spec string, kind, layout, shape, dtype, decode lengths)."""
    from la_compiler.ir.spec import RecurrenceSpec

    gpu = shapes == "gpu"
    cases = {}

    def add(variant, name, spec, kind, layout, shape, lengths=None):
        for dtype in DTYPES:
            cases[f"{variant}/{name}/{dtype}"] = dict(variant=variant, spec=str(spec), kind=kind, layout=layout,
                                                       shape=shape, dtype=dtype, lengths=lengths)

    for name, kind, layout, quant, big, tiny in CHUNK_CASES:
        spec = RecurrenceSpec(kind=kind, chunk=64, state=layout, kernel="chunk").replace(quant=quant)
        add("chunk", name, spec, kind, layout, big if gpu else tiny)
    for name, kind, layout, quant, fields, big, tiny in CHUNK_PATH_CASES:
        spec = RecurrenceSpec(kind=kind, chunk=64, state=layout, kernel="chunk").replace(quant=quant, **fields)
        add("chunk", name, spec, kind, layout, big if gpu else tiny)
    for name, kind, layout, big, tiny in RECURRENT_CASES:
        add("fused_recurrent", name, RecurrenceSpec(kind=kind, state=layout, kernel="fused_recurrent"), kind, layout,
            big if gpu else tiny)
    for name, kind, phase, fmt, extras, layout, tiny, tiny_lengths, big, big_lengths in DECODE_CASES:
        spec = RecurrenceSpec(kind=kind, phase=phase, state=layout, kernel="decode_fused").replace(
            quant={"state": fmt}, extra=extras)
        add("decode_fused", name, spec, kind, layout, big if gpu else tiny, big_lengths if gpu else tiny_lengths)
    return cases


# ---- running one case ----------------------------------------------------------------------------
def make_inputs(case, device):
    """Fresh random inputs (chunk_bench's: q, v randn; k l2-normalised; g = 0.1 * logsigmoid(randn), per channel
    for KDA; beta = sigmoid(rand); h0, do, dht randn), from a seed of the case name, built on the CPU."""
    import torch
    import torch.nn.functional as F

    B, T, H, HV, K, V, cu = case["shape"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    gen = torch.Generator().manual_seed(zlib.crc32(case_seed_name(case).encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(B, T, H, K)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    g = 0.1 * F.logsigmoid(randn(*((B, T, HV) if case["kind"] == "gdn" else (B, T, HV, K))))
    beta = torch.rand(B, T, HV, generator=gen).sigmoid()
    N = B if cu is None else len(cu) - 1
    state_shape = (N, HV, K, V) if case["layout"] == "kv" else (N, HV, V, K)
    h0 = randn(*state_shape)
    do = randn(B, T, HV, V).to(dtype)
    dht = randn(*state_shape)
    xs = [x.to(dtype).to(device) for x in (q, k, v, g, beta)]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    return xs, h0.to(device), cu_t, do.to(device), dht.to(device)


def case_seed_name(case) -> str:
    """The seed does not depend on the dtype: the bf16 case rounds the fp32 case's inputs."""
    return f"{case['variant']}|{case['spec']}|{case['shape']}"


def run_case(case, device) -> dict[str, "torch.Tensor | None"]:
    import torch

    from la_compiler.kernels.registry import get_variant

    variant = get_variant(case["variant"])
    (q, k, v, g, beta), h0, cu, do, dht = make_inputs(case, device)
    scale = q.shape[-1] ** -0.5
    spec = case["spec"]
    kwargs = {}
    if case["lengths"] is not None:
        prefill, valid = case["lengths"]
        kwargs = dict(prefill_lengths=torch.tensor(prefill, dtype=torch.int32, device=device),
                      valid_lengths=torch.tensor(valid, dtype=torch.int32, device=device))
    size = variant.residual_numel(spec, q, v, cu)
    outputs = {}
    if size:
        kept = torch.full((size,), float("nan"), dtype=torch.float32, device=device)
        o, ht = variant.forward(spec, q, k, v, g, beta, h0, cu, scale, save_to=kept, **kwargs)
        outputs.update(o=o, ht=ht, residual=kept)
        outputs.update(zip(OUTPUT_NAMES, variant.backward(spec, q, k, v, g, beta, h0, cu, scale, do, dht, saved=kept,
                                                          **kwargs)))
        # the backward without the residual (recomputes the forward): bits of its own code path
        outputs.update(zip((f"{n}_recomputed" for n in OUTPUT_NAMES),
                           variant.backward(spec, q, k, v, g, beta, h0, cu, scale, do, dht, **kwargs)))
    else:
        o, ht = variant.forward(spec, q, k, v, g, beta, h0, cu, scale, **kwargs)
        outputs.update(o=o, ht=ht)
        outputs.update(zip(OUTPUT_NAMES, variant.backward(spec, q, k, v, g, beta, h0, cu, scale, do, dht, **kwargs)))
    return outputs


def fingerprint(t) -> str:
    """sha256 of dtype, shape and the raw bytes (CPU, contiguous)."""
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def record(outputs) -> dict:
    import torch

    entry, max_abs, nonfinite = {}, {}, {}
    for name, t in outputs.items():
        if t is None:
            entry[name] = None
            continue
        entry[name] = fingerprint(t)
        finite = torch.isfinite(t)
        max_abs[name] = t.detach().float().abs().where(finite, 0).max().item() if t.numel() else 0.0
        if not finite.all():
            nonfinite[name] = int((~finite).sum().item())
    entry["_max_abs"] = max_abs
    if nonfinite:
        entry["_nonfinite"] = nonfinite
    return entry


# ---- comparing two files -------------------------------------------------------------------------
def compare(path_a: str, path_b: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    names = [n for n in dict.fromkeys([*a, *b]) if not n.startswith("_")]
    for key in ("device", "shapes"):
        if a.get("_meta", {}).get(key) != b.get("_meta", {}).get(key):
            print(f"note: {key} differs: {a.get('_meta', {}).get(key)} vs {b.get('_meta', {}).get(key)}")
    width = max(len(n) for n in names) if names else 4
    differing = 0
    print(f"{'case':{width}}  result")
    for name in names:
        if name not in a or name not in b:
            verdict = f"only in {path_a if name in a else path_b}"
        elif a[name].get("_refused") or b[name].get("_refused"):
            ra, rb = a[name].get("_refused"), b[name].get("_refused")
            verdict = (f"refused in both (same reason)" if ra == rb
                       else f"refusal differs: A: {ra or 'ran'} | B: {rb or 'ran'}")
            if ra == rb:
                print(f"{name:{width}}  {verdict}")
                continue
        else:
            tensors = [t for t in dict.fromkeys([*a[name], *b[name]]) if not t.startswith("_")]
            changed = [t for t in tensors if a[name].get(t, "missing") != b[name].get(t, "missing")]
            if not changed:
                print(f"{name:{width}}  identical ({len(tensors)} tensors)")
                continue
            verdict = "DIFFERS: " + ", ".join(changed)
        differing += 1
        print(f"{name:{width}}  {verdict}")
    print(f"\n{len(names) - differing} of {len(names)} cases identical; {differing} differ")
    return 1 if differing else 0


# ---- main ----------------------------------------------------------------------------------------
def set_up_environment(device: str) -> None:
    """Before torch / triton are imported: one thread (reproducible CPU reductions, one core), the interpreter
    on the CPU (under which the chunk kernels NaN-fill their scratch buffers: an element a kernel does not write
    shows up)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if device == "cpu":
        if os.environ.setdefault("TRITON_INTERPRET", "1") != "1":
            sys.exit("--device cpu runs the Triton kernels in the interpreter: TRITON_INTERPRET must be 1")


def import_la_compiler() -> None:
    """la_compiler as installed (or on PYTHONPATH); else this checkout's, mapped by bench_common (when here)."""
    try:
        import la_compiler.kernels.registry  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import ensure_la_compiler

    ensure_la_compiler()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print which cases / tensors differ; exit 1 on any difference")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", choices=("tiny", "gpu"), default="tiny",
                        help="tiny (default; CPU interpreter) or chunk_bench's EXACT_CASES shapes (CUDA)")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only the cases naming one")
    parser.add_argument("--list", action="store_true", help="print the cases (name, spec, shape) and exit")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    set_up_environment(args.device)
    import_la_compiler()
    import torch

    cases = build_cases(args.shapes)
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        cases = {n: c for n, c in cases.items() if any(w in n for w in wanted)}
    if args.list:
        for name, c in cases.items():
            B, T, H, HV, K, V, cu = c["shape"]
            print(f"{name}\n    {c['spec']}\n    B={B} T={T} H={H} HV={HV} K={K} V={V} cu_seqlens={cu}"
                  + (f" prefill={c['lengths'][0]} valid={c['lengths'][1]}" if c["lengths"] else ""))
        return 0
    if not args.out:
        parser.error("--out FILE.json (or --compare / --list) is required")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    import la_compiler.kernels.registry as registry
    import triton

    result = {"_meta": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                        "shapes": args.shapes, "torch": torch.__version__, "triton": triton.__version__,
                        "registry": registry.__file__}}
    start_all = time.process_time()
    for name, case in cases.items():
        start = time.process_time()
        try:
            outputs = run_case(case, args.device)
        except Exception as e:  # noqa: BLE001 -- a refusal (or failure) is recorded, the other cases still run
            entry = {"_refused": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            line = entry["_refused"]
        else:
            entry = record(outputs)
            line = "max|x| " + " ".join(f"{n} {v:.3g}" for n, v in entry["_max_abs"].items())
            if "_nonfinite" in entry:
                line += f"  NON-FINITE {entry['_nonfinite']}"
        entry["_spec"] = case["spec"]
        entry["_cpu_s"] = round(time.process_time() - start, 2)
        result[name] = entry
        print(f"{name} ({entry['_cpu_s']:.1f} CPU s): {line}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    result["_meta"]["cpu_s"] = round(time.process_time() - start_all, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    refused = [n for n in cases if "_refused" in result[n]]
    print(f"\n{len(cases)} cases ({len(refused)} refused) in {result['_meta']['cpu_s']} CPU s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
