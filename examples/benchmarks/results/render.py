"""Renders docs/performance.md from the measurement records in this folder (standard library only).

    python examples/benchmarks/results/render.py            # rewrite docs/performance.md
    python examples/benchmarks/results/render.py --check    # exit 1 if docs/performance.md is out of date

Every ``*.jsonl`` file here holds one JSON record per line: one measured row of one run (README.md in this
folder lists the fields). Each table of the page shows the latest record of each row, by run id
(``YYYY-MM-DD-NN``, chronological), with the run it comes from; ratios to FLA are the record's own, from
the same run. ``unmeasured.json`` lists what no record covers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[2] / "docs" / "performance.md"
REQUIRED = ("benchmark", "run", "date", "machine", "versions", "command", "figures")
CHUNK_ROWS = ("FLA exact", "laqat exact", "laqat FP8 state", "laqat INT8 state", "laqat FP8 state + W",
              "laqat FP8 all sites", "laqat NVFP4 operands", "fp32 torch chunk emulation (FP8 state)")
SHAPES = ((8, 4096, 16, 128), (1, 4096, 16, 128), (1, 1024, 4, 64), (1, 4096, 16, 256))
COMPARE_ORDER = ("FLA chunk exact", "FLA fused_recurrent fwd (suffix)", "laqat chunk exact", "token",
                 "token-int8-block32", "replay", "replay-h32", "vllm_gdn_state_bf16", "vllm_kda_state_bf16")


class RecordError(ValueError):
    """A record that the page cannot be rendered from (named by file and line)."""


def load(folder: Path = HERE) -> list[dict]:
    """Every record of every *.jsonl file in ``folder``, checked for the fields every record carries."""
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{where}: not JSON ({e})") from None
            missing = [k for k in REQUIRED if k not in record]
            if missing:
                raise RecordError(f"{where}: missing {', '.join(missing)}")
            if not record["run"].startswith(record["date"]):
                raise RecordError(f"{where}: run {record['run']!r} does not start with its date {record['date']!r}")
            records.append(record)
    return records


def latest(records, key, usable=lambda r: True) -> dict:
    """key(record) -> the record of the latest run (a later line wins a tie), preferring usable records."""
    best = {}
    for r in records:
        k = key(r)
        old = best.get(k)
        if old is None or (usable(r), r["run"]) >= (usable(old), old["run"]):
            best[k] = r
    return best


def fmt(value, spec="{:.2f}") -> str:
    """A time, size or count: fixed decimals (spec); '-' for a missing figure."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return spec.format(value)
    return str(value)


def err(value) -> str:
    """An error figure (relative L2 and the like): two significant digits, '3.7e-3'; 0 stays 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return fmt(value)
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def figure(key, value) -> str:
    """A figure of a free-form record, formatted by what its key says it is."""
    if any(word in key for word in ("rel", "l2", "tol")):
        return err(value)
    return fmt(value, "{:g}")


def table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return out + [""]


class Notes:
    """Footnotes of one table: the same text gets the same number."""

    def __init__(self):
        self.texts = []

    def mark(self, record) -> str:
        text = record.get("note")
        if not text:
            return ""
        if text not in self.texts:
            self.texts.append(text)
        return f" [{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        if not self.texts:
            return []
        return [f"[{i}] {t}" + ("  " if i < len(self.texts) else "") for i, t in enumerate(self.texts, 1)] + [""]


def shape_text(shape) -> str:
    return "[" + ",".join(str(x) for x in shape) + "]"


def of(records, benchmark):
    return [r for r in records if r["benchmark"] == benchmark]


# ---- sections --------------------------------------------------------------------------------------------

def chunk_section(records) -> list[str]:
    rows = of(records, "chunk")
    timed = lambda r: "fwd_ms" in r["figures"] or "fb_ms" in r["figures"]  # noqa: E731
    best = latest(rows, lambda r: (r["kind"], tuple(r["shape"]), r["dtype"], r["row"]), timed)
    out = ["## Chunk kernels: time and memory (`chunk_bench.py`)", "",
           "do_bench medians; f+b is the forward and the backward of `o.float().sum()`; MiB the peak extra memory "
           "of the f+b step; x FLA the ratio to FLA exact in the same run. Rows after the policy rows time the "
           "same spec under a code-generation or launch setting (`chunk_bench.py`'s `ENVIRONMENTS`).", ""]
    for kind in ("gdn", "kda"):
        for shape in SHAPES:
            picked = [r for (k, s, _, _), r in best.items() if k == kind and s == shape]
            if not picked:
                continue
            picked.sort(key=lambda r: (CHUNK_ROWS.index(r["row"]) if r["row"] in CHUNK_ROWS else len(CHUNK_ROWS),
                                       r["row"]))
            notes = Notes()
            lines = []
            for r in picked:
                f = r["figures"]
                fb = fmt(f.get("fb_ms")) if "fb_ms" in f else f.get("fb_error", "-")
                lines.append([r["row"], fmt(f.get("fwd_ms")), fmt(f.get("fwd_x_fla")), fb, fmt(f.get("fb_x_fla")),
                              fmt(f.get("fb_mib"), "{:.0f}"), r["run"] + notes.mark(r)])
            out += [f"### {kind.upper()} {shape_text(shape)}, {picked[0]['dtype']}", ""]
            out += table(["row", "fwd ms", "x FLA", "f+b ms", "x FLA", "f+b MiB", "run"], lines) + notes.lines()
    return out


def kernels_section(records) -> list[str]:
    best = latest(of(records, "chunk-kernels"),
                  lambda r: (r["kind"], tuple(r["shape"]), r["row"], r.get("unit", "")))
    out = ["## Chunk kernels: where the time goes (`chunk_bench.py --profile`)", "",
           "The torch profiler's device time per kernel, largest first.", ""]
    notes = Notes()
    lines = []
    for (kind, shape, row, unit), r in sorted(best.items(), key=lambda kv: (kv[0][0], SHAPES.index(kv[0][1])
                                                                            if kv[0][1] in SHAPES else 9, kv[0][2:])):
        times = sorted(r["figures"]["kernels_ms"].items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{name} {fmt(ms)}" for name, ms in times)
        if "fb_ms" in r["figures"]:
            text += f" (step {fmt(r['figures']['fb_ms'])})"
        lines.append([f"{kind.upper()} {shape_text(shape)}", row, unit, text, r["run"] + notes.mark(r)])
    return out + table(["kind, shape", "row", "unit", "kernels (ms)", "run"], lines) + notes.lines()


def exactness_section(records) -> list[str]:
    valued = lambda r: isinstance(r["figures"].get("max_rel_l2"), float)  # noqa: E731
    best = latest(of(records, "chunk-exactness"), lambda r: (r["case"], r.get("setting") or ""), valued)
    out = ["## Chunk kernels: exactness on the GPU (`chunk_bench.py --exactness-only`)", "",
           "fp32 inputs, IEEE dots: forward and every gradient against fp64 autograd of the chunk reference that "
           "rounds at the same sites; the largest relative L2 distance over o, the final state and every gradient. "
           "Cases are `chunk_bench.py`'s `EXACT_CASES`.", ""]
    notes = Notes()
    lines = []
    for (case, setting), r in sorted(best.items()):
        f = r["figures"]
        lines.append([str(case), r.get("case_description", ""), setting or "defaults", err(f.get("max_rel_l2")),
                      f.get("worst", ""), err(f.get("tol")), r["run"] + notes.mark(r)])
    return out + table(["case", "what", "setting", "max rel L2", "worst", "tol", "run"], lines) + notes.lines()


def equality_section(records) -> list[str]:
    best = latest(of(records, "fla-equality"), lambda r: (r["kind"], tuple(r["shape"]), r["row"], r["against"]))
    out = ["## Chunk kernels against FLA (`chunk_bench.py --fla-equality`)", "",
           "bf16 inputs; relative L2 of each output and gradient against FLA's chunk kernel (FLA's own test "
           "tolerances: 5e-3 for o / ht, 8e-3 for dq / dk / dv, 2e-2 for dg / dbeta) or against fp64 autograd of the "
           "chunk reference on the same inputs.", ""]
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
    notes = Notes()
    lines = []
    for key, r in sorted(best.items()):
        f = r["figures"]
        other = ", ".join(f"{k.replace('_', ' ')} {err(v)}" for k, v in f.items() if k not in names)
        lines.append([f"{r['kind'].upper()} {shape_text(r['shape'])}", r["row"], r["against"]]
                     + [err(f.get(n)) for n in names] + [other, r["run"] + notes.mark(r)])
    return out + table(["kind, shape", "row", "against", *names, "other", "run"], lines) + notes.lines()


def recurrent_section(records) -> list[str]:
    out = ["## Fused recurrent kernel (`recurrent_vs_fla.py`)", ""]
    notes = Notes()
    lines = [[r["case_description"], err(r["figures"]["max_rel_l2"]), r["figures"].get("worst", ""),
              r["run"] + notes.mark(r)]
             for _, r in sorted(latest(of(records, "recurrent-exactness"), lambda r: r["case"]).items())]
    out += ["fp32 exactness against the fp64 reference (o, final state, every gradient):", ""]
    out += table(["case", "max rel L2", "worst", "run"], lines)
    lines = []
    for (kind, shape), r in sorted(latest(of(records, "recurrent"), lambda r: (r["kind"], tuple(r["shape"]))).items()):
        f = r["figures"]
        lines.append([f"{kind.upper()} {shape_text(shape)}", fmt(f["laqat_fwd_ms"], "{:.3f}"),
                      fmt(f["fla_fused_recurrent_fwd_ms"], "{:.3f}"), fmt(f["fla_chunk_fwd_ms"], "{:.3f}"),
                      fmt(f.get("laqat_fb_ms"), "{:.3f}"), err(f["o_rel_l2_vs_fla_recurrent"]),
                      err(f["o_rel_l2_vs_fla_chunk"]), r["run"] + notes.mark(r)])
    out += ["bf16, ms; o against FLA's fused recurrent kernel (0: bit for bit) and its chunk kernel:", ""]
    out += table(["kind, shape", "laqat fwd", "FLA recurrent fwd", "FLA chunk fwd", "laqat f+b", "o vs FLA recurrent",
                  "o vs FLA chunk", "run"], lines)
    return out + notes.lines()


def decode_section(records) -> list[str]:
    out = ["## Decode-phase training (`decode_bench.py`)", ""]
    notes = Notes()
    acc = latest(of(records, "decode-accuracy"), lambda r: r["case_description"])
    lines = [[k, err(r["figures"]["max_grad_rel_l2"]), r["figures"].get("worst", ""),
              f"{r['figures']['final_state_flips']} / {r['figures']['final_state_elements']}", r["run"] + notes.mark(r)]
             for k, r in acc.items()]
    out += ["fp32 against the fp64 decode reference (every gradient within 1e-3), the stored final state element by "
            "element:", ""]
    out += table(["case", "worst gradient", "which", "final-state flips", "run"], lines)
    timing = latest(of(records, "decode"), lambda r: (r["kind"], tuple(r["shape"]), r["prefix"], r["row"],
                                                      r.get("num_warps") or 0))
    groups = {}
    for (kind, shape, prefix, row, warps), r in timing.items():
        groups.setdefault((kind, shape, prefix), []).append(((row, warps), r))
    for _, group in sorted(groups.items()):
        lines = []
        for (row, warps), r in sorted(group, key=lambda kv: (kv[0][0].startswith("torch"), kv[0])):
            f = r["figures"]
            lines.append([row, str(warps or "-"), fmt(f["fb_ms"]), fmt(f.get("fb_x_fla")),
                          fmt(f.get("fb_mib"), "{:.1f}"), r["run"] + notes.mark(r)])
        shape = group[0][1]
        out += [f"{shape['kind'].upper()} {shape_text(shape['shape'])} {shape['dtype']}, prefix {shape['prefix']}, "
                "fwd+bwd ms of `laqat::delta_rule_phased` (decode_fused) per policy, FLA's chunk_kda exact and the "
                "fp32 torch reference:", ""]
        out += table(["row", "warps", "f+b ms", "x FLA", "extra MiB", "run"], lines)
    compare = latest(of(records, "decode-compare"), lambda r: (r["kind"], tuple(r["shape"]), r["prefix"], r["row"]),
                     lambda r: "fb_ms" in r["figures"] or "fwd_ms" in r["figures"])
    groups = {}
    for (kind, shape, prefix, _), r in compare.items():
        groups.setdefault((shape, prefix), []).append(r)
    for (shape, prefix), group in sorted(groups.items()):
        out += [f"{shape_text(shape)} {group[0]['dtype']}, prefix {prefix}: the decode modes through "
                "`laqat::delta_rule_phased` and laqat's exact chunk kernels against FLA's exact chunk kernel (fwd+bwd) "
                "and FLA's fused recurrent forward over the suffix (`--sections compare`); medians over interleaved "
                "rounds in one run, x FLA per part, x rec the forward over FLA's fused recurrent forward:", ""]
        lines = []
        for r in sorted(group, key=lambda r: (r["kind"], COMPARE_ORDER.index(r["row"]) if r["row"] in COMPARE_ORDER
                                               else len(COMPARE_ORDER), r["row"])):
            f = r["figures"]
            lines.append([r["kind"].upper(), r["row"], r.get("kernel", "-"), fmt(f.get("fwd_ms"), "{:.3f}"),
                          fmt(f.get("bwd_ms"), "{:.3f}"), fmt(f.get("fb_ms"), "{:.3f}"), fmt(f.get("fb_x_fla")),
                          fmt(f.get("fwd_x_fla")), fmt(f.get("bwd_x_fla")), fmt(f.get("fwd_x_fla_recurrent")),
                          fmt(f.get("extra_mib"), "{:.1f}"), err(f.get("o_rel_l2_vs_fla_chunk")),
                          (str(f.get("error", ""))[:80]), r["run"] + notes.mark(r)])
        out += table(["kind", "row", "kernel", "fwd ms", "bwd ms", "f+b ms", "x FLA f+b", "x FLA fwd", "x FLA bwd",
                      "x rec fwd", "extra MiB", "o rel L2 vs FLA", "error", "run"], lines)
    return out + notes.lines()


def training_section(records) -> list[str]:
    out = ["## Training checks (`train_fp8_state_gpu.py`, `compiled_step_vs_eager.py`)", ""]
    notes = Notes()
    lines = []
    for bench in ("train", "compiled-step"):
        for (_, steps), r in sorted(latest(of(records, bench), lambda r: (bench, r.get("steps") or 0),
                                           lambda r: len(r["figures"]) > 1).items()):
            figures = ", ".join(f"{k.replace('_', ' ')} {figure(k, v)}" for k, v in r["figures"].items())
            lines.append([bench, r.get("model", ""), r.get("policy", ""), str(steps or "-"), figures,
                          r["run"] + notes.mark(r)])
    return out + table(["check", "model", "policy", "steps", "figures", "run"], lines) + notes.lines()


MODEL_SHAPE = ("layers", "hidden", "heads", "head_dim", "batch", "seq", "vocab")


def model_section(records) -> list[str]:
    rows = of(records, "model")
    shapes = sorted({tuple(r["config"].get(k) for k in MODEL_SHAPE) for r in rows}, key=lambda s: tuple(
        -1 if v is None else v for v in s))
    out = ["## The model benchmark (`model_bench.py`, docs/model-bench.md)", "",
           "FLA's causal LMs, one training step (forward with labels, backward, AdamW), bf16, one table per model "
           "shape.", ""]
    for shape in shapes:
        out += model_shape_section([r for r in rows if tuple(r["config"].get(k) for k in MODEL_SHAPE) == shape])
    return out


def model_shape_section(rows) -> list[str]:
    best = latest(rows, lambda r: (r["model"], r["row"]),
                  lambda r: "step_ms" in r["figures"] and r.get("fla_compile_ahead", True))
    config = rows[-1]["config"]
    if config.get("timing") == "interleaved":
        timing = (f"the median over {config['rounds']} rounds of one step of every row (rotating order, each step "
                  f"alone on the device) after a first step and {config['warmup']} warm-up steps per row; x eager and "
                  "x exact are ratios to the eager FLA and laqat exact rows of the same run; extra MiB the step's peak "
                  "allocation above what was allocated before it, peak MiB (earlier runs) the peak allocation. Rows of "
                  "runs before the interleaved timing moved by up to 30 % between runs: their ratios hold within "
                  "their run only.")
    else:
        timing = (f"the median of {config['steps']} steps after {config['warmup']} warm-up steps. Step times of one "
                  "row moved by up to 30 % between runs: ratios hold within one run.")
    out = [f"### {config['layers']} layers, hidden {config['hidden']}, {config['heads']} heads of "
           f"{config['head_dim']}", "",
           f"Vocabulary {config['vocab']}, B={config['batch']}, T={config['seq']}; {timing}", ""]
    optional = [(key, title, spec) for key, title, spec in (("x_eager", "x eager", "{:.2f}"),
                                                            ("x_laqat_exact", "x exact", "{:.2f}"),
                                                            ("peak_extra_mib", "extra MiB", "{:.0f}"))
                if any(key in r["figures"] for r in best.values())]
    notes = Notes()
    lines = []
    for (model, row), r in sorted(best.items()):
        f = r["figures"]
        lines.append([model.upper(), row, fmt(f.get("step_ms"))] + [fmt(f.get(k), spec) for k, _, spec in optional]
                     + [fmt(f.get("peak_mib"), "{:.0f}"), fmt(f.get("first_step_s"), "{:.1f}"),
                        fmt(f.get("loss"), "{:.4f}"), f.get("kernels", "-"), (f.get("error", "")[:80] or ""),
                        r["run"] + notes.mark(r)])
    return out + table(["model", "row", "step ms", *(title for _, title, _ in optional), "peak MiB", "first step s",
                        "loss", "kernels", "error", "run"], lines) + notes.lines()


def compile_section(records) -> list[str]:
    rows = [r for r in of(records, "compile") if r["step"] == 0]
    best = latest(rows, lambda r: (r["model"], tuple(sorted(r["config"].items())), r["caches"],
                                   json.dumps(r["tuning"], sort_keys=True), r["full_searches"],
                                   r.get("ready_on_first_launch", False), r.get("fla_compile_ahead", True),
                                   r.get("process_keys_ahead", True), r["row"]))
    out = ["## The first training step (`compile_account.py`, docs/model-bench.md)", "",
           "The model benchmark's `laqat exact` row (B=2, T=4096, bf16), its first step in a fresh process: cold, every "
           "cache empty (Triton's, laqat's, Inductor's); warm, the caches of a cold process before it. graph compiles: "
           "Dynamo's capture with AOTAutograd and Inductor's forward compile, and Inductor's backward compile; "
           "compile-ahead: laqat's chunk kernels compiled before their first launch (the seconds the step waits for it; "
           "from commit 6f8fb4b on, the backward's kernels compile in a background thread and the step waits for the "
           "forward's only); searches: the autotuning "
           "searches of FLA's kernels under laqat's ops, compiles included; readied on the step: compiled kernels "
           "loaded and their launchers built on the step's own threads (the main thread, and from commit 1691d54 on "
           "autograd's device thread, where the backward runs; a dash where a run did not record it). "
           "`full searches`: FLA's searches as Triton runs them; `readied at first launch`: laqat's compile threads "
           "compile only (`--ready-on-first-launch`); `LAQAT_FLA_COMPILE_AHEAD=off`: FLA's backward kernels compile at "
           "their first launches, not ahead in a background thread (kernels/fla/backward_ahead.py, from commit "
           "648cc3d on); `LAQAT_PROCESS_KEYS_AHEAD=off`: the once-per-process keys of Inductor's and Triton's caches "
           "computed by the first compile, not ahead from the backend's import (la_compiler/hand_off/"
           "process_keys_ahead.py, from commit dce5970 on); `one graph`: the row `laqat exact (whole graph)`, "
           "`options={\"regional\": False}` (every layer compiled, as before laqat's regional hand-off; "
           "docs/options.md, \"Hand-off\"); `a piece per layer`: the row `laqat exact (1 layer per piece)`, "
           "`options={\"regional\": 1}`; `defaults` are the options' defaults at the row's commit: under Inductor a "
           "piece per layer at commits b95d7b8 to 283d824 (runs 2026-12-04-03 to -06), runs of four layers from "
           "9624feb on (a 4-layer LM compiled whole).", ""]
    notes = Notes()
    lines = []
    ordered = sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[1]["run"]))
    for (model, _, caches, tuning, full, on_launch, fla_ahead, keys_ahead, row), r in ordered:
        f, c = r["figures"], r["config"]
        setting = ", ".join([f"t.{k}={json.dumps(v)}" for k, v in json.loads(tuning).items()]
                            + (["full searches"] if full else []) + (["readied at first launch"] if on_launch else [])
                            + ([] if fla_ahead else ["LAQAT_FLA_COMPILE_AHEAD=off"])
                            + ([] if keys_ahead else ["LAQAT_PROCESS_KEYS_AHEAD=off"])
                            + (["one graph"] if row == "laqat exact (whole graph)" else [])
                            + (["a piece per layer"] if row == "laqat exact (1 layer per piece)" else []))
        lines.append([model.upper(), f"{c.get('layers')} x {c.get('hidden')}", caches or "-", setting or "defaults",
                      fmt(f["wall_s"], "{:.1f}"), fmt(f["graph_compile_s"], "{:.1f}"),
                      fmt(f["laqat_compile_ahead_s"], "{:.1f}"), fmt(f["laqat_compile_s"], "{:.1f}"),
                      fmt(f["fla_search_s"], "{:.1f}"), fmt(f["fla_compile_s"], "{:.1f}"),
                      fmt(f.get("ready_step_thread_s"), "{:.1f}"), r["commit"],
                      r["run"] + notes.mark(r)])
    return out + table(["model", "layers x hidden", "caches", "setting", "first step s", "graph compiles s",
                        "compile-ahead s", "laqat compiles s", "FLA searches s", "FLA compiles s",
                        "readied on the step s", "commit", "run"],
                       lines) + notes.lines()


def qdq_section(records) -> list[str]:
    best = latest(of(records, "qdq"), lambda r: (r["command"].split("pytest")[-1], r["setting"]))
    out = ["## QDQ device functions on the GPU (`tests/kernels/test_qdq_triton.py`)", ""]
    notes = Notes()
    lines = [[r["setting"], ", ".join(f"{k} {figure(k, v)}" for k, v in r["figures"].items()), r["run"] + notes.mark(r)]
             for _, r in sorted(best.items(), key=lambda kv: kv[1]["run"])]
    return out + table(["setting", "result", "run"], lines) + notes.lines()


def comparisons_section(records) -> list[str]:
    rows = of(records, "comparison")
    topics = {}
    for r in rows:
        topics.setdefault(r["topic"], []).append(r)
    out = ["## Comparisons behind the code's choices (`comparisons.jsonl`)", "",
           "Launch settings and code forms timed against each other (the reference docs cite them by topic); each "
           "record lists its variants and figures.", ""]
    lines = [[topic, rs[0]["metric"], ", ".join(sorted({r["kind"] for r in rs if r.get("kind")})) or "-",
              ", ".join(sorted({r["run"] for r in rs}))] for topic, rs in sorted(topics.items())]
    return out + table(["topic", "metric", "kinds", "runs"], lines)


def unmeasured_section(items) -> list[str]:
    out = ["## Not measured", ""]
    return out + [f"- {item['what']}" + (f" (`{item['command']}`)" if item.get("command") else "") for item in items] + [""]


SECTIONS = ((("chunk",), chunk_section), (("chunk-kernels",), kernels_section),
            (("chunk-exactness",), exactness_section), (("fla-equality",), equality_section),
            (("recurrent", "recurrent-exactness"), recurrent_section), (("decode", "decode-accuracy", "decode-compare"), decode_section),
            (("train", "compiled-step"), training_section), (("model",), model_section),
            (("compile",), compile_section), (("qdq",), qdq_section),
            (("comparison",), comparisons_section))


def render(records, unmeasured) -> str:
    machines = {}
    for r in records:
        key = (r["machine"], tuple(sorted(r["versions"].items())))
        machines.setdefault(key, []).append(r["run"])
    out = ["# Performance", "",
           "Generated by `python examples/benchmarks/results/render.py` from the records in "
           "`examples/benchmarks/results/*.jsonl` (one line per measured row of a run: machine, versions, commit, "
           "command, shape, dtype, figures); do not edit by hand. Each table shows the latest record of each row and "
           "the run it comes from: run ids are `date-NN`, chronological. A row's figures are as good as its run: "
           "rows last measured before later kernel changes keep their date. `examples/benchmarks/results/README.md` "
           "says how to add a run.", ""]
    for (machine, versions), runs in sorted(machines.items()):
        v = ", ".join(f"{k} {x}" for k, x in versions) or "versions not recorded"
        span = runs[0] if min(runs) == max(runs) else f"{min(runs)} to {max(runs)}"
        out.append(f"Machine: {machine}; {v}; runs {span}.  ")
    out.append("")
    for benchmarks, section in SECTIONS:
        if any(r["benchmark"] in benchmarks for r in records):
            out += section(records)
    if unmeasured:
        out += unmeasured_section(unmeasured)
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the records render")
    args = parser.parse_args(argv)
    text = render(load(), json.loads((HERE / "unmeasured.json").read_text()))
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python examples/benchmarks/results/render.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
