"""The measurement records (examples/benchmarks/results/*.jsonl), the page rendered from them (docs/performance.md),
the converter from a GPU run's JSON to records, and the GPU suites' commands (examples/benchmarks/run_gpu.sh)."""
import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "examples" / "benchmarks" / "results"
sys.path.insert(0, str(RESULTS))
import record  # noqa: E402
import render  # noqa: E402


# history words and machine paths that no record may hold (spelled in pieces, so that this file holds neither)
FORBIDDEN = re.compile("|".join(["ses" + "sion", "work peri" + "od",
                                  *("/" + d + "/" for d in ("tmp", "home", "root", "work"))]), re.IGNORECASE)


def unmeasured():
    return json.loads((RESULTS / "unmeasured.json").read_text())


def test_the_page_is_what_the_records_render():
    assert (REPO / "docs" / "performance.md").read_text() == render.render(render.load(), unmeasured()), \
        "docs/performance.md is out of date: run python examples/benchmarks/results/render.py"


def test_every_record_is_complete_and_names_no_place_outside_the_repository():
    records = render.load()
    assert len(records) > 500
    for r in records:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-\d{2}", r["run"]) and r["figures"], r
        assert r["command"].strip()
        for script in re.findall(r"(?:examples|tests)/[\w/]+\.(?:py|sh)", r["command"]):
            assert (REPO / script).exists(), (script, r["run"])
        text = json.dumps(r)
        assert not FORBIDDEN.search(text), text[:300]
        if r["benchmark"] == "chunk":
            assert r["kind"] in ("gdn", "kda") and len(r["shape"]) == 4 and r["row"]


def write(folder, name, records):
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))


HEAD = {"machine": "GPU X", "versions": {"torch": "9"}, "commit": "abc", "command": "python3 x.py"}


def chunk(run, fb, row="laqat exact"):
    return {"benchmark": "chunk", "run": run, "date": run[:10], **HEAD, "kind": "gdn", "shape": [8, 4096, 16, 128],
            "dtype": "bfloat16", "row": row, "figures": {"fb_ms": fb, "fb_x_fla": fb / 4.0}}


def test_the_latest_run_of_a_row_is_shown_and_a_broken_record_is_named(tmp_path):
    write(tmp_path, "chunk.jsonl", [chunk("2026-12-02-01", 4.25), chunk("2026-12-01-07", 9.75),
                                     chunk("2026-12-01-07", 3.5, "FLA exact")])
    page = render.render(render.load(tmp_path), [{"what": "a thing", "command": "run it"}])
    assert "| laqat exact | - | - | 4.25 | 1.06 | - | 2026-12-02-01 |" in page
    assert "9.75" not in page and "| FLA exact | - | - | 3.50 | 0.88 |" in page
    assert "- a thing (`run it`)" in page
    broken = chunk("2026-12-03-01", 1.0)
    del broken["command"]
    write(tmp_path, "chunk.jsonl", [chunk("2026-12-02-01", 4.25), broken])
    with pytest.raises(render.RecordError, match=r"chunk.jsonl:2: missing command"):
        render.load(tmp_path)
    write(tmp_path, "chunk.jsonl", [{**chunk("2026-12-02-01", 4.25), "date": "2026-12-01"}])
    with pytest.raises(render.RecordError, match="does not start with its date"):
        render.load(tmp_path)


def test_a_gpu_runs_json_becomes_records_once(tmp_path):
    out = tmp_path / "out"
    (out / "chunk-gdn" / "table").mkdir(parents=True)
    (out / "machine.json").write_text(json.dumps({"device": "GPU X", "gpus": 1, "torch": "2.11", "triton": "3.6",
                                                  "fla": "0.6.0", "commit": "1234567"}))
    (out / "chunk-gdn" / "table" / "command.txt").write_text("python3 examples/benchmarks/chunk_bench.py --kinds gdn\n")
    bench = {"device": "GPU X", "torch": "2.11", "triton": "3.6", "exactness": [
        {"index": 4, "case": {"kind": "gdn", "state": "kv", "B": 1, "T": 300, "H": 2, "HV": 4, "K": 128, "V": 128,
                              "cu": [0, 100, 300], "quant": {"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}},
         "rel_l2": {"o": 1e-7, "dg": 3e-6}, "tol": 1e-3, "ok": True}],
        "fla_equality": [{"kind": "kda", "shape": [1, 4096, 16, 128], "rel_l2": {"o": 2.7e-3},
                          "rel_l2_vs_fp64_reference": {"laqat": {"o": 3.8e-3}, "FLA": {"o": 3.9e-3}}}],
        "timing": [{"kind": "gdn", "shape": [8, 4096, 16, 128], "rows": {
            "FLA exact": {"ms_fwd": 1.0, "ms_fwd_bwd": 4.0, "mib_fwd_bwd": 1621.4, "x_fla_fwd": 1.0,
                          "x_fla_fwd_bwd": 1.0, "note": "guard lifted"},
            "laqat exact": {"ms_fwd": 0.5, "ms_fwd_bwd": 4.4, "mib_fwd_bwd": 1554.2, "x_fla_fwd": 0.5,
                            "x_fla_fwd_bwd": 1.1, "kernels_ms": {"bwd intra": 2.1, "fwd h": 0.8}},
            "laqat NVFP4 operands": {"error_fwd": "OutOfMemoryError: CUDA out of memory"}}}]}
    (out / "chunk-gdn" / "table" / "chunk_bench.json").write_text(json.dumps(bench))
    qdq = out / "exactness" / "qdq-division-rn"
    qdq.mkdir(parents=True)
    (qdq / "command.txt").write_text("LAQAT_QDQ_DIVISION=rn python3 -m pytest -q tests/kernels/test_qdq_triton.py\n")
    (qdq / "junit.xml").write_text('<testsuites><testsuite name="pytest" tests="16" failures="1" errors="0" '
                                   'skipped="2"/></testsuites>')
    records = record.collect(out, "2026-12-05-01")
    by = {(r["benchmark"], r.get("row"), r.get("against")): r for r in records}
    ours = by[("chunk", "laqat exact", None)]
    assert ours["figures"] == {"fwd_ms": 0.5, "fwd_x_fla": 0.5, "fb_ms": 4.4, "fb_x_fla": 1.1, "fb_mib": 1554}
    assert ours["command"] == "python3 examples/benchmarks/chunk_bench.py --kinds gdn"
    assert ours["versions"] == {"torch": "2.11", "triton": "3.6", "fla": "0.6.0"} and ours["commit"] == "1234567"
    assert ours["machine"] == "GPU X (one GPU)"
    assert by[("chunk", "FLA exact", None)]["note"] == "guard lifted"
    assert by[("chunk", "laqat NVFP4 operands", None)]["figures"] == {"fwd_error": "OutOfMemoryError: CUDA out of memory"}
    assert by[("chunk-kernels", "laqat exact", None)]["figures"]["kernels_ms"] == {"bwd intra": 2.1, "fwd h": 0.8}
    exact = by[("chunk-exactness", None, None)]
    assert exact["case"] == 4 and exact["figures"] == {"max_rel_l2": 3e-6, "worst": "dg", "tol": 1e-3}
    assert by[("qdq", None, None)]["setting"] == "LAQAT_QDQ_DIVISION=rn"
    assert by[("qdq", None, None)]["figures"] == {"passed": 13, "failed": 1, "skipped": 2}
    assert {(r["row"], r["against"]) for r in records if r["benchmark"] == "fla-equality"} == {
        ("laqat exact", "FLA"), ("laqat exact", "fp64 reference"), ("FLA exact", "fp64 reference")}

    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(RESULTS / "chunk.jsonl", folder / "chunk.jsonl")
    counts = record.append(records, folder)
    assert counts == {"chunk.jsonl": 3, "chunk_kernels.jsonl": 1, "chunk_exactness.jsonl": 1, "fla_equality.jsonl": 3,
                      "qdq.jsonl": 1}
    page = render.render(render.load(folder), [])
    assert "| laqat exact | 0.50 | 0.50 | 4.40 | 1.10 | 1554 | 2026-12-05-01 |" in page
    with pytest.raises(ValueError, match="run 2026-12-05-01 is in"):
        record.append(records, folder)
    with pytest.raises(ValueError, match="--run"):
        record.collect(out, "2026-12-05")


def literal_keys(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
    raise AssertionError(name)


def test_the_gpu_suites_call_existing_scripts_with_rows_and_cases_they_know():
    script = REPO / "examples" / "benchmarks" / "run_gpu.sh"
    listing = subprocess.run(["bash", str(script), "--list"], capture_output=True, text=True, check=True).stdout
    suites = [line for line in listing.splitlines() if not line.startswith(" ")]
    assert suites == ["exactness", "chunk-gdn", "chunk-kda", "decode", "recurrent", "model", "compile", "serving",
                      "train"]
    dry = subprocess.run(["bash", str(script), "--dry-run", *suites], capture_output=True, text=True, check=True).stdout
    parts = [line.strip() for line in listing.splitlines() if line.startswith(" ")]
    commands = dry.strip().splitlines()
    assert [c.split(" ")[0] for c in commands] == parts
    tree = ast.parse((REPO / "examples" / "benchmarks" / "chunk_bench.py").read_text())
    policies = {k.value for k in literal_keys(tree, "POLICIES").keys} | {"FLA exact"}
    cases = len(literal_keys(tree, "EXACT_CASES").elts)
    for line in commands:
        words = shlex.split(line.split("): ", 1)[1])
        program = next(w for w in words if w.endswith(".py") or w == "pytest")
        assert program == "pytest" or (REPO / program).exists(), line
        if program.endswith("chunk_bench.py"):
            for option in ("--policies", "--profile"):
                if option in words:
                    named = set(words[words.index(option) + 1].split(","))
                    assert named <= policies, (line, named - policies)
            if "--exact-cases" in words:
                assert all(int(i) < cases for i in words[words.index("--exact-cases") + 1].split(","))
    covered = {int(i) for line in commands if "--exact-cases" in line
               for i in shlex.split(line)[shlex.split(line).index("--exact-cases") + 1].split(",")}
    assert covered == set(range(cases)), "every exactness case runs in the exactness suite"
    bad = subprocess.run(["bash", str(script), "--dry-run", "chunk-gdn:nothing"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no part 'nothing'" in bad.stderr
    bad = subprocess.run(["bash", str(script), "speed"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown suite 'speed'" in bad.stderr


def test_interleaved_model_rows_and_the_decode_comparison_become_records_and_tables(tmp_path):
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "decode").mkdir()
    (out / "machine.json").write_text(json.dumps({"device": "GPU X", "gpus": 1, "torch": "2.11", "commit": "1234567"}))
    (out / "model" / "command.txt").write_text("python3 examples/benchmarks/model_bench.py --family gdn\n")
    (out / "decode" / "command.txt").write_text("python3 examples/benchmarks/decode_bench.py --sections timing compare\n")
    shape = {"layers": 4, "hidden": 1024, "heads": 8, "head_dim": 128, "batch": 2, "seq": 4096, "vocab": 32000,
             "warmup": 2, "rounds": 10}
    model = {"device": "GPU X", "timing": "interleaved", "shape": shape, "skipped": [], "rows": [
        {"model": "gdn", "row": "eager FLA", "step_ms": 40.0, "x_eager": 1.0, "x_laqat_exact": 1.25,
         "peak_extra_mib": 2500, "first_step_s": 1.5, "loss": 10.5, "rounds": 10, "step_ms_rounds": [40.0] * 10,
         "note": "FLA's GDN chunk backward past its guard, timing only: refused"},
        {"model": "gdn", "row": "laqat exact", "step_ms": 32.0, "x_eager": 0.8, "x_laqat_exact": 1.0,
         "peak_extra_mib": 2400, "first_step_s": 4.0, "loss": 10.5, "nodes": 4, "kernels": "chunk", "rounds": 10},
        {"model": "gdn", "row": "laqat state_int8_block32", "error": "build: NoFastKernelError: reference only"}]}
    (out / "model" / "model_bench.json").write_text(json.dumps(model))
    decode = {"device": "GPU X", "accuracy": [], "timing": [
        {"impl": "FLA chunk_kda (exact)", "policy": "exact", "ms": 9.0, "extra_mib": 100.0, "x_fla": 1.0,
         "kind": "kda", "shape": [2, 4096, 8, 128], "prefix": 2048},
        {"impl": "laqat decode_fused (num_warps=8)", "policy": "token", "ms": 45.0, "extra_mib": 120.0, "x_fla": 5.0,
         "kind": "kda", "shape": [2, 4096, 8, 128], "prefix": 2048},
        {"impl": "laqat decode_fused (num_warps=8)", "policy": "token", "ms": 5.1, "extra_mib": 12.0, "x_fla": 1.6}],
        "compare": {"kinds": ["gdn"], "shape": [1, 4096, 16, 128], "prefix": 2048, "dtype": "bfloat16", "rounds": 30,
                    "rows": [
                        {"kind": "gdn", "row": "FLA chunk exact", "kernel": "FLA", "fwd_ms": 0.5, "bwd_ms": 1.5,
                         "fb_ms": 2.0, "fb_x_fla": 1.0, "note": "backward past FLA's guard, timing only"},
                        {"kind": "gdn", "row": "FLA fused_recurrent fwd (suffix)", "kernel": "FLA", "fwd_ms": 4.0},
                        {"kind": "gdn", "row": "token", "kernel": "decode_fused", "spec": "gdn[phase=token]",
                         "fwd_ms": 8.0, "bwd_ms": 12.0, "fb_ms": 20.0, "fb_x_fla": 10.0, "fwd_x_fla_recurrent": 2.0,
                         "o_rel_l2_vs_fla_chunk": 0.031},
                        {"kind": "gdn", "row": "replay", "error": "warm-up: RuntimeError: no"}]}}
    (out / "decode" / "decode_bench.json").write_text(json.dumps(decode))
    records = record.collect(out, "2027-01-02-01")
    models = {r["row"]: r for r in records if r["benchmark"] == "model"}
    assert models["laqat exact"]["config"] == {**shape, "timing": "interleaved"}
    assert models["laqat exact"]["figures"] == {"step_ms": 32.0, "x_eager": 0.8, "x_laqat_exact": 1.0,
                                                "peak_extra_mib": 2400, "first_step_s": 4.0, "loss": 10.5, "nodes": 4,
                                                "kernels": "chunk", "rounds": 10}
    assert models["eager FLA"]["note"].startswith("FLA's GDN chunk backward past its guard")
    assert models["laqat state_int8_block32"]["figures"] == {"error": "build: NoFastKernelError: reference only"}
    timing = {(tuple(r["shape"]), r["prefix"], r["row"]) for r in records if r["benchmark"] == "decode"}
    assert timing == {((2, 4096, 8, 128), 2048, "FLA chunk_kda exact"), ((2, 4096, 8, 128), 2048, "token"),
                      ((1, 257, 4, 128), 64, "token")}  # a row without a shape: a run before there were two
    compare = {r["row"]: r for r in records if r["benchmark"] == "decode-compare"}
    assert set(compare) == {"FLA chunk exact", "FLA fused_recurrent fwd (suffix)", "token", "replay"}
    assert compare["token"]["kernel"] == "decode_fused" and compare["token"]["shape"] == [1, 4096, 16, 128]
    assert compare["token"]["figures"]["fb_x_fla"] == 10.0 and compare["replay"]["figures"] == {
        "error": "warm-up: RuntimeError: no"}

    folder = tmp_path / "results"
    folder.mkdir()
    assert record.append(records, folder) == {"model.jsonl": 3, "decode.jsonl": 7}
    page = render.render(render.load(folder), [])
    assert "| GDN | laqat exact | 32.00 | 0.80 | 1.00 | 2400 | - | 4.0 | 10.5000 | chunk |  | 2027-01-02-01 |" in page
    assert "median over 10 rounds of one step of every row" in page
    assert "KDA [1,257,4,128] bfloat16, prefix 64" in page and "KDA [2,4096,8,128] bfloat16, prefix 2048" in page
    assert ("| GDN | token | decode_fused | 8.000 | 12.000 | 20.000 | 10.00 | - | - | 2.00 | - | 3.1e-2 |  | "
            "2027-01-02-01 |") in page
    assert page.index("| GDN | FLA chunk exact |") < page.index("| GDN | FLA fused_recurrent fwd (suffix) |") \
        < page.index("| GDN | token |") < page.index("| GDN | replay |")


def test_a_compile_account_becomes_one_record_per_step_and_a_first_step_row(tmp_path):
    out = tmp_path / "out" / "kda-cold"
    out.mkdir(parents=True)
    (out / "machine.json").write_text(json.dumps({"device": "GPU X", "gpus": 1, "torch": "2.11", "commit": "1234567"}))
    (out / "command.txt").write_text("TRITON_CACHE_DIR=/tmp/laqat-cold-Ab12/kda/triton python3 "
                                     "examples/benchmarks/compile_account.py --family kda --caches cold\n")
    account = {"family": "kda", "row": "laqat exact", "layers": 4, "hidden": 1024, "heads": 8, "head_dim": 128,
               "tag": "", "caches": "cold", "tuning": {"compile_ahead": False}, "full_searches": True, "steps": [
                   {"step": 0, "wall_s": 129.53, "phases_s": {"_compile.compile_inner": 6.32,
                                                             "compile_fx.<locals>.bw_compiler": 1.69},
                    "triton": {"laqat_compile_ahead_s": 0, "laqat": {"compiles": 10, "compile_s": 7.87, "searches": 0,
                                                                      "search_s": 0},
                               "fla": {"compiles": 2, "compile_s": 0.25, "searches": 11, "search_s": 108.87},
                               "ready_step_thread": {"kernels": 14, "s": 6.12},
                               "ready_other_threads": {"kernels": 0, "s": 0}}},
                   {"step": 1, "wall_s": 0.06, "phases_s": {}, "triton": {}},
                   {"step": 2, "wall_s": 6.12, "phases_s": {"_compile.compile_inner": 5.02, "bytecode_tracing": 3.34,
                                                            "OutputGraph.call_user_compiler": 1.2},
                    "parts_s": {"forward": 5.61, "optimizer": 0.12, "backward": 0.39}, "triton": {}}]}
    (out / "compile_account.json").write_text(json.dumps(account))
    records = record.collect(tmp_path / "out", "2027-01-02-01")
    assert {k: v for k, v in records[2]["figures"].items() if k.endswith(("tracing_s", "off_s", "ward_s", "zer_s"))} \
        == {"dynamo_tracing_s": 3.34, "hand_off_s": 1.2, "forward_s": 5.61, "backward_s": 0.39, "optimizer_s": 0.12}
    records = records[:2]
    assert [r["step"] for r in records] == [0, 1] and {r["benchmark"] for r in records} == {"compile"}
    assert records[0]["figures"] == {"wall_s": 129.53, "graph_compile_s": 8.01, "laqat_compile_ahead_s": 0,
                                     "laqat_compile_s": 7.87, "laqat_search_s": 0, "laqat_searches": 0,
                                     "fla_compile_s": 0.25, "fla_search_s": 108.87, "fla_searches": 11,
                                     "ready_step_thread_s": 6.12, "ready_step_thread_kernels": 14}
    assert records[0]["caches"] == "cold" and records[0]["config"] == {"layers": 4, "hidden": 1024, "heads": 8,
                                                                       "head_dim": 128}
    assert records[0]["command"] == ("TRITON_CACHE_DIR=$COLD_ROOT/kda/triton python3 "
                                     "examples/benchmarks/compile_account.py --family kda --caches cold")
    folder = tmp_path / "results"
    folder.mkdir()
    assert record.append(records, folder) == {"compile.jsonl": 2}
    page = render.render(render.load(folder), [])
    assert ("| KDA | 4 x 1024 | cold | t.compile_ahead=false, full searches | 129.5 | 8.0 | 0 | 7.9 | 108.9 | 0.2 | "
            "6.1 | 1234567 | 2027-01-02-01 |") in page


def test_model_rows_with_flas_backward_compile_ahead_off_are_labelled_and_left_out_of_the_table(tmp_path):
    shape = {"layers": 4, "hidden": 1024, "heads": 8, "head_dim": 128, "batch": 2, "seq": 4096, "vocab": 32000,
             "warmup": 1, "rounds": 3}
    folder = tmp_path / "results"
    folder.mkdir()
    for run, ahead, step_ms in (("2027-01-02-01", True, 30.0), ("2027-01-02-02", False, 31.0)):
        out = tmp_path / run
        (out / "model").mkdir(parents=True)
        (out / "machine.json").write_text(json.dumps({"device": "GPU X", "gpus": 1, "torch": "2.11",
                                                      "commit": "1234567"}))
        (out / "model" / "command.txt").write_text("python3 examples/benchmarks/model_bench.py --family kda\n")
        (out / "model" / "model_bench.json").write_text(json.dumps({
            "device": "GPU X", "timing": "interleaved", "shape": shape, "fla_compile_ahead": ahead, "rows": [
                {"model": "kda", "row": "laqat exact", "step_ms": step_ms, "peak_extra_mib": 1765,
                 "first_step_peak_extra_mib": 1827, "first_step_s": 3.3, "rounds": 3}]}))
        (record_of_run,) = record.collect(out, run)
        assert record_of_run["figures"]["first_step_peak_extra_mib"] == 1827
        assert record_of_run.get("fla_compile_ahead", True) is ahead
        record.append([record_of_run], folder)
    page = render.render(render.load(folder), [])
    assert "| KDA | laqat exact | 30.00 |" in page and "| KDA | laqat exact | 31.00 |" not in page
