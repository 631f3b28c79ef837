"""Turns the JSON a GPU run wrote under $OUT into measurement records (standard library only).

    python examples/benchmarks/results/record.py OUT --run 2026-12-05-01 [--commit abc1234] [--write]

Walks OUT for the files the benchmark scripts write (chunk_bench.json, decode_bench.json, recurrent_vs_fla.json,
model_bench.json, train_fp8_state_gpu.json, compile_account.json, pytest's junit.xml of the QDQ tests), converts
each to records (one per measured row: README.md in this folder lists the fields) and prints how many of each it found; with --write it
appends them to the *.jsonl files of this folder (a run id already there is refused). The command of a part is
read from the command.txt that examples/benchmarks/run_gpu.sh writes beside its JSON; machine, versions and commit
from $OUT/machine.json (examples/benchmarks/gpu_chores.sh setup) or the JSON itself. Then render.py regenerates
docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_ID = re.compile(r"\d{4}-\d{2}-\d{2}-\d{2}")


def describe_quant(quant: dict) -> str:
    """'exact', or the state / w formats and the operand sites grouped by format."""
    if not quant:
        return "exact"
    parts = [f"{site} {quant[site]}" for site in ("state", "w") if site in quant]
    by_format = {}
    for site, fmt in quant.items():
        if site not in ("state", "w"):
            by_format.setdefault(fmt, []).append(site)
    for fmt, sites in sorted(by_format.items()):
        parts.append(f"{len(sites)} operand site{'s' if len(sites) > 1 else ''} {fmt}")
    return ", ".join(parts)


def describe_shape(c: dict) -> str:
    cu = c.get("cu")
    text = f"{c['state']} state, B={c['B']} T={c['T']} H={c['H']} HV={c['HV']} K={c['K']} V={c['V']}"
    return text + (f", varlen {list(cu)}" if cu else "")


def describe_chunk_case(c: dict) -> str:
    return f"{c['kind']}, {describe_shape(c)}; {describe_quant(c.get('quant') or {})}"


def describe_decode_case(c: dict) -> str:
    return f"{c['kind']} {c['policy']}, {describe_shape(c)}, prefill {list(c['prefill'])}"


def describe_recurrent_case(c: dict) -> str:
    return f"{c['kind']}, {describe_shape(c)}"


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _mib(x):
    return None if x is None or x != x else round(x)


# ---- one converter per file name: (path, header fields of every record) -> records -------------------------

def chunk_bench(data: dict, head: dict) -> list[dict]:
    out = []
    for t in data.get("timing", []):
        for name, row in t["rows"].items():
            base = {**head, "kind": t["kind"], "shape": t["shape"], "dtype": "bfloat16", "row": name}
            figures = _drop_none({
                "fwd_ms": row.get("ms_fwd"), "fwd_x_fla": row.get("x_fla_fwd"), "fb_ms": row.get("ms_fwd_bwd"),
                "fb_x_fla": row.get("x_fla_fwd_bwd"), "fb_mib": _mib(row.get("mib_fwd_bwd")),
                "fwd_error": row.get("error_fwd"), "fb_error": row.get("error_fwd_bwd"),
                "o_rel_l2_vs_fla": row.get("rel_l2_o_vs_fla")})
            if any(k in figures for k in ("fwd_ms", "fb_ms", "fwd_error", "fb_error")):
                out.append({"benchmark": "chunk", **base, "figures": figures, **_drop_none({"note": row.get("note")})})
            if isinstance(row.get("kernels_ms"), dict) and "error" not in row["kernels_ms"]:
                out.append({"benchmark": "chunk-kernels", **base, "unit": "ms per fwd+bwd step",
                            "figures": {"kernels_ms": row["kernels_ms"]}})
    for r in data.get("exactness", []):
        case = r["case"]
        figures = ({"max_rel_l2": max(r["rel_l2"].values()), "worst": max(r["rel_l2"], key=r["rel_l2"].get),
                    "tol": r["tol"]} if "rel_l2" in r else {"error": str(r.get("error", ""))[-300:]})
        out.append({"benchmark": "chunk-exactness", **head, "case": r.get("index", describe_chunk_case(case)),
                    "case_description": describe_chunk_case(case), "dtype": "float32", "figures": figures})
    for r in data.get("fla_equality", []):
        base = {**head, "kind": r["kind"], "shape": r["shape"], "dtype": "bfloat16"}
        if "rel_l2" not in r:
            out.append({"benchmark": "fla-equality", **base, "row": "laqat exact", "against": "FLA",
                        "figures": {"error": str(r.get("error", ""))[-300:]}})
            continue
        out.append({"benchmark": "fla-equality", **base, "row": "laqat exact", "against": "FLA", "figures": r["rel_l2"]})
        refs = r.get("rel_l2_vs_fp64_reference", {})
        for who, row, against in (("laqat", "laqat exact", "fp64 reference"), ("FLA", "FLA exact", "fp64 reference"),
                                  ("laqat FP8 state", "laqat FP8 state", "fp64 reference that rounds the state")):
            if who in refs:
                out.append({"benchmark": "fla-equality", **base, "row": row, "against": against, "figures": refs[who]})
    return out


def model_bench(data: dict, head: dict) -> list[dict]:
    """One record per row. Interleaved runs (``timing``: every row's step once per round) have ``rounds`` in the
    config, ``x_eager`` / ``x_laqat_exact`` (ratios within the run) and ``peak_extra_mib`` (the step's peak above
    what was allocated before it); earlier runs ``steps`` and ``peak_mib`` (the peak allocation, weights included)."""
    args = data.get("shape", {})
    keys = ["layers", "hidden", "heads", "head_dim", "batch", "seq", "vocab", "warmup"]
    keys += ["rounds"] if data.get("timing") == "interleaved" else ["steps"]
    config = {k: args[k] for k in keys if k in args}
    if data.get("timing") == "interleaved":
        config["timing"] = "interleaved"
    keys = ("step_ms", "x_eager", "x_laqat_exact", "peak_mib", "peak_extra_mib", "first_step_peak_extra_mib",
            "first_step_s", "loss", "nodes", "kernels", "graphs", "grad_rel_max", "rounds", "compiles_in_rounds",
            "decode_phase", "error")
    ahead_off = {"fla_compile_ahead": False} if data.get("fla_compile_ahead") is False else {}
    return [{"benchmark": "model", **head, "model": r["model"], "config": config, "dtype": "bfloat16", "row": r["row"],
             **ahead_off, "figures": {k: r[k] for k in keys if k in r}, **_drop_none({"note": r.get("note")})}
            for r in data.get("rows", [])]


def compile_account(data: dict, head: dict) -> list[dict]:
    """One record per step of ``compile_account.py``: the step's wall seconds, torch's graph compiles (Dynamo's
    ``_compile.compile_inner`` and Inductor's backward compile; of the first, Dynamo's bytecode tracing and the
    backend's call where measured), its forward, backward and optimizer step where measured, laqat's compile-ahead,
    the Triton compiles and autotuning searches by origin, the kernels readied for their first launch on the step's
    thread."""
    caches = data.get("caches") or next((w for w in ("cold", "warm") if w in data.get("tag", "").split("-")), None)
    config = {k: data[k] for k in ("layers", "hidden", "heads", "head_dim") if k in data}
    out = []
    for step in data.get("steps", []):
        phases, triton = step.get("phases_s", {}), step.get("triton", {})
        figures = {"wall_s": step["wall_s"],
                   "graph_compile_s": round(phases.get("_compile.compile_inner", 0)
                                            + phases.get("compile_fx.<locals>.bw_compiler", 0), 2),
                   "laqat_compile_ahead_s": triton.get("laqat_compile_ahead_s", 0)}
        for who in ("laqat", "fla"):
            part = triton.get(who, {})
            figures[f"{who}_compile_s"] = part.get("compile_s", 0)
            figures[f"{who}_search_s"] = part.get("search_s", 0)
            figures[f"{who}_searches"] = part.get("searches", 0)
        if "bytecode_tracing" in phases:  # Dynamo's capture and laqat's backend with its hand-off
            figures["dynamo_tracing_s"] = phases["bytecode_tracing"]
            figures["hand_off_s"] = phases.get("OutputGraph.call_user_compiler", 0)
        for part, s in step.get("parts_s", {}).items():  # forward (its compile included), backward, optimizer
            figures[f"{part}_s"] = s
        if "ready_step_thread" in triton:  # kernels readied for their first launch on the step's thread
            figures["ready_step_thread_s"] = triton["ready_step_thread"]["s"]
            figures["ready_step_thread_kernels"] = triton["ready_step_thread"]["kernels"]
        out.append({"benchmark": "compile", **head, "model": data["family"], "config": config, "row": data["row"],
                    "caches": caches, "step": step["step"], "tuning": data.get("tuning") or {},
                    "full_searches": bool(data.get("full_searches")),
                    **({"ready_on_first_launch": True} if data.get("ready_on_first_launch") else {}),
                    **({"fla_compile_ahead": False} if data.get("fla_compile_ahead") is False else {}),
                    **({"process_keys_ahead": False} if data.get("process_keys_ahead") is False else {}),
                    "figures": figures})
    return out


def decode_bench(data: dict, head: dict) -> list[dict]:
    out = []
    for r in data.get("accuracy", []):
        if "rel_l2" not in r:
            continue
        grads = {n: e for n, e in r["rel_l2"].items() if n != "ht"}
        worst = max(grads, key=grads.get)
        out.append({"benchmark": "decode-accuracy", **head, "case_description": describe_decode_case(r["case"]),
                    "dtype": "float32", "figures": {"max_grad_rel_l2": grads[worst], "worst": worst,
                                                    "final_state_flips": r["ht_flips"],
                                                    "final_state_elements": r["ht_elements"], "tol": 1e-3}})
    for r in data.get("timing", []):
        if "ms" not in r:
            continue
        warps = re.search(r"num_warps=(\d+)", r["impl"])
        if r["impl"].startswith("FLA"):
            row = "FLA chunk_kda exact"
        elif r["impl"].startswith("torch"):
            row = f"torch reference (fp32), {r['policy']}"
        else:
            row = r["policy"]
        figures = _drop_none({"fb_ms": r["ms"], "fb_x_fla": r.get("x_fla"), "fb_mib": r.get("extra_mib")})
        figures = {k: v for k, v in figures.items() if v == v}  # NaN: not measured
        out.append({"benchmark": "decode", **head, "kind": r.get("kind", "kda"),  # runs before 2 shapes: 1 shape
                    "shape": r.get("shape", [1, 257, 4, 128]), "prefix": r.get("prefix", 64), "dtype": "bfloat16",
                    "row": row,
                    **({"num_warps": int(warps.group(1))} if warps else {}),
                    "figures": figures, **({"note": r["impl"]} if "given" in r["impl"] else {})})
    compare = data.get("compare") or {}
    keys = ("fwd_ms", "bwd_ms", "fb_ms", "fb_x_fla", "fwd_x_fla", "bwd_x_fla", "fwd_x_fla_recurrent", "extra_mib",
            "o_rel_l2_vs_fla_chunk", "rounds", "error")
    for r in compare.get("rows", []):
        figures = {k: r[k] for k in keys if k in r}
        if not figures:
            continue
        out.append({"benchmark": "decode-compare", **head, "kind": r["kind"], "shape": compare["shape"],
                    "prefix": compare["prefix"], "dtype": compare.get("dtype", "bfloat16"), "row": r["row"],
                    **_drop_none({"kernel": r.get("kernel"), "spec": r.get("spec")}), "figures": figures,
                    **_drop_none({"note": r.get("note")})})
    return out


def recurrent_vs_fla(data: dict, head: dict) -> list[dict]:
    out = []
    for r in data.get("exactness", []):
        if "rel_l2" in r:
            worst = max(r["rel_l2"], key=r["rel_l2"].get)
            out.append({"benchmark": "recurrent-exactness", **head, "case": describe_recurrent_case(r["case"]),
                        "case_description": describe_recurrent_case(r["case"]), "dtype": "float32",
                        "figures": {"max_rel_l2": r["rel_l2"][worst], "worst": worst, "tol": 1e-5}})
    for r in data.get("versus_fla", []):
        if "ms_fwd_laqat" not in r:
            continue
        out.append({"benchmark": "recurrent", **head, "kind": r["kind"], "shape": r["shape"], "dtype": "bfloat16",
                    "figures": _drop_none({
                        "laqat_fwd_ms": r["ms_fwd_laqat"], "fla_fused_recurrent_fwd_ms": r["ms_fwd_fla_recurrent"],
                        "fla_chunk_fwd_ms": r["ms_fwd_fla_chunk"], "laqat_fb_ms": r.get("ms_fwd_bwd_laqat"),
                        "o_rel_l2_vs_fla_recurrent": r["rel_l2_o_vs_fla_recurrent"],
                        "ht_rel_l2_vs_fla_recurrent": r.get("rel_l2_ht_vs_fla_recurrent"),
                        "o_rel_l2_vs_fla_chunk": r["rel_l2_o_vs_fla_chunk"]})})
    return out


def train_fp8_state_gpu(data: dict, head: dict) -> list[dict]:
    first, losses = data.get("first_step", {}), data.get("losses", [])
    kernels = sorted({m["kernel"] for m in data.get("matches", [])})
    figures = _drop_none({
        "kernels": ", ".join(kernels) or None,
        "first_step_loss_equal_to_reference": (first["loss_fp8_chunk"] == first["loss_fp8_torch_reference"]
                                               if "loss_fp8_chunk" in first else None),
        "max_grad_rel_l2": first.get("grad_rel_max_vs_torch_reference"),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "s_per_step": data.get("seconds_per_step")})
    return [{"benchmark": "train", **head, "model": f"GDN + KDA FLA layers, {data.get('dtype', '')}, {data.get('shape', '')}",
             "steps": len(losses), "policy": data.get("recipe", "state_fp8"), "figures": figures}]


def junit(xml_text: str, head: dict, setting: str) -> list[dict]:
    suite = ElementTree.fromstring(xml_text)
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return [{"benchmark": "qdq", **head, "setting": setting,
             "figures": {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}}]


CONVERTERS = {"chunk_bench.json": chunk_bench, "model_bench.json": model_bench, "decode_bench.json": decode_bench,
              "recurrent_vs_fla.json": recurrent_vs_fla, "train_fp8_state_gpu.json": train_fp8_state_gpu,
              "compile_account.json": compile_account}
FILES = {"chunk": "chunk.jsonl", "chunk-kernels": "chunk_kernels.jsonl", "chunk-exactness": "chunk_exactness.jsonl",
         "fla-equality": "fla_equality.jsonl", "model": "model.jsonl", "decode": "decode.jsonl",
         "decode-accuracy": "decode.jsonl", "decode-compare": "decode.jsonl", "recurrent": "recurrent.jsonl", "recurrent-exactness": "recurrent.jsonl",
         "train": "train.jsonl", "compiled-step": "train.jsonl", "qdq": "qdq.jsonl", "comparison": "comparisons.jsonl",
         "compile": "compile.jsonl"}


def _nearest(path: Path, root: Path, name: str):
    for folder in [path.parent, *path.parent.parents]:
        if (folder / name).exists():
            return folder / name
        if folder == root:
            return None
    return None


# run_gpu.sh's compile parts point each cache at a folder under a fresh temporary COLD_ROOT
COLD_CACHE = re.compile(r"\b([A-Z_]+_DIR)=/\S*?/([\w.-]+/(?:triton|laqat|inductor))(?=\s|$)")


def portable(command: str) -> str:
    """The command with each cache folder under a temporary root written as ``$COLD_ROOT/<row>/<cache>``."""
    return COLD_CACHE.sub(r"\1=$COLD_ROOT/\2", command)


def collect(out: Path, run: str, commit: str | None = None) -> list[dict]:
    """Every record the files under ``out`` hold, headed by run, date, machine, versions, commit and command."""
    if not RUN_ID.fullmatch(run):
        raise ValueError(f"--run: {run!r} is not YYYY-MM-DD-NN")
    records = []
    for path in sorted(out.rglob("*")):
        if path.name not in CONVERTERS and path.name != "junit.xml":
            continue
        machine_file = _nearest(path, out, "machine.json")
        machine = json.loads(machine_file.read_text()) if machine_file else {}
        command_file = _nearest(path, out, "command.txt")
        command = portable(command_file.read_text().strip()) if command_file else f"(a file {path.name}; no command.txt)"
        if path.name == "junit.xml":
            data = {}
        else:
            data = json.loads(path.read_text())
        device = machine.get("device") or data.get("device", "unknown device")
        gpus = machine.get("gpus")
        head = {"run": run, "date": run[:10],
                "machine": f"{device} ({'one GPU' if gpus == 1 else f'{gpus} GPUs'})" if gpus else device,
                "versions": _drop_none({"torch": machine.get("torch") or data.get("torch"),
                                        "triton": machine.get("triton") or data.get("triton"),
                                        "fla": machine.get("fla")}),
                "commit": commit or machine.get("commit") or "unknown", "command": command}
        if path.name == "junit.xml":
            setting = " ".join(w for w in command.split() if re.fullmatch(r"LAQAT_[A-Z0-9_]+=\S+", w)) or "defaults"
            records += junit(path.read_text(), head, setting)
        else:
            records += CONVERTERS[path.name](data, head)
    return records


def append(records: list[dict], folder: Path = HERE) -> dict:
    """Appends each record to its file in ``folder``; refuses a run id that a file there holds already."""
    runs = {r["run"] for r in records}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip() and json.loads(line)["run"] in runs:
                raise ValueError(f"run {json.loads(line)['run']} is in {path.name} already")
    counts = {}
    for r in records:
        name = FILES[r["benchmark"]]
        with open(folder / name, "a") as f:
            f.write(json.dumps(r) + "\n")
        counts[name] = counts.get(name, 0) + 1
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the $OUT folder of a GPU run")
    parser.add_argument("--run", required=True, help="the run id, YYYY-MM-DD-NN (NN: the day's next number)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: machine.json's)")
    parser.add_argument("--write", action="store_true", help="append the records to this folder's *.jsonl")
    args = parser.parse_args(argv)
    try:
        records = collect(args.out, args.run, args.commit)
        counts = {}
        for r in records:
            counts[r["benchmark"]] = counts.get(r["benchmark"], 0) + 1
        print(f"{len(records)} records: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        if args.write:
            print("appended: " + ", ".join(f"{k} {v}" for k, v in sorted(append(records).items())))
    except ValueError as e:
        print(f"record.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
