"""The "Hand-off" section of docs/options.md (``la_compiler.options_doc`` renders the page): what runs a rewritten
graph, how the default is chosen, the measurements behind the CPU default, and what Inductor's caches save."""
from __future__ import annotations

from la_compiler.options import CPU_HAND_OFF, DEVICE_HAND_OFF, HAND_OFFS, LOSS_TAIL, REGIONAL

INTRO = f"""`torch.compile(..., options={{"compiler": ...}})` picks what runs a graph after laqat's passes
(`la_compiler/hand_off/compiler_choice.py`). A value given is used as given, on any device. Unset (or `None`),
the graph's devices decide: `{DEVICE_HAND_OFF}` where a tensor of the graph (an input, or a value it computes) is on
an accelerator (CUDA, XPU, ...), `{CPU_HAND_OFF}` where every tensor is on the CPU. There Inductor's C++ build costs a minute or
more of the first step, and its later steps were no faster: with laqat's torch references slower (2.2 CPU s
against 1.5 to 1.7), with the Triton interpreter within the runs' spread (25 to 31 CPU s against 29 to 36); table
below. `la_compiler.explain(...)` runs the eager hand-off unless given `compiler=`; its report and the INFO line of
`TORCH_LOGS="la_compiler"` name the hand-off of each graph and why (`hand-off: eager (default: every tensor of the
graph is on the CPU)`, `hand-off: inductor (options['compiler'])`). docs/memory.md says what each hand-off saves
for the backward."""

# examples/benchmarks/first_step_time.py, one process per row, a fresh Inductor cache: (laqat's kernels,
# options["compiler"], what ran, laqat's default then, first forward s (CPU s), first step s (CPU s), later steps:
# median s (CPU s), how many)
MEASURED = (
    ("torch references", "unset", "inductor", "inductor", "99.5 (72.6)", "166.3 (118.6)", "3.24 (2.15)", 3),
    ("torch references", "`eager`", "eager", "inductor", "12.1 (8.1)", "14.1 (9.3)", "2.59 (1.72)", 3),
    ("torch references", "unset", "eager", "by device", "9.2 (5.9)", "10.6 (6.8)", "2.32 (1.54)", 3),
    ("torch references", "`inductor`", "inductor", "by device", "84.7 (54.5)", "149.3 (97.3)", "3.31 (2.18)", 3),
    ("Triton interpreter", "unset", "inductor", "inductor", "94.0 (58.5)", "190.6 (115.2)", "34.11 (26.54)", 3),
    ("Triton interpreter", "`eager`", "eager", "inductor", "12.6 (12.0)", "39.8 (35.3)", "36.58 (35.96)", 3),
    ("Triton interpreter", "unset", "eager", "by device", "22.7 (15.1)", "78.7 (45.3)", "46.26 (30.57)", 3),
    ("Triton interpreter", "`inductor`", "inductor", "by device", "76.3 (50.0)", "170.5 (101.6)", "75.07 (24.91)", 3),
    ("Triton interpreter", "unset", "eager", "by device", "25.0 (13.4)", "69.0 (35.5)", "57.08 (29.10)", 5),
    ("Triton interpreter", "`inductor`", "inductor", "by device", "92.9 (58.5)", "200.2 (131.0)", "41.41 (30.50)", 5),
    ("torch references", "unset", "eager", "by device", "4.2 (4.2)", "4.4 (4.5)", "0.28 (0.32)", 3),
    ("Triton interpreter", "unset", "eager", "by device", "7.8 (7.7)", "20.6 (20.5)", "16.21 (16.24)", 3),
)
MEASURED_SETUP = """examples/qat/hf_trainer.py's smoke model (a Qwen3.5 of two GDN layers, hidden 32; transformers'
torch fallbacks, FLA hidden), fp32, 2 x 72 tokens; a step is the forward with labels, the backward and an AdamW
step. `python examples/benchmarks/first_step_time.py [--kernel-family torch] [--compiler inductor|eager]
[--steps 5]`: "torch references" is `--kernel-family torch` (laqat's torch references, as examples/qat's CPU
recipes run them), "Triton interpreter" the selection table's kernels under `TRITON_INTERPRET=1`. x86_64, 2 cores
shared with other work (a load of 2 to 6: wall seconds vary by up to half between runs; CPU seconds count this
process and the compilers it waited for), torch 2.13.0+cpu, Triton 3.9.0, transformers 5.24.0, Python 3.11.7. The
last two rows ran alone on the machine (commit 4f208ed)."""

CACHES = """**Inductor's caches.** Under the Inductor hand-off, a second process with the same `TORCHINDUCTOR_CACHE_DIR`
finds the graphs the first compiled in Inductor's FX graph cache and in AOTAutograd's cache, and bypasses neither.
Both keys include laqat's sources, the policy and the tuning options (`la_compiler/hand_off/cache_key.py`), so
another laqat, policy or tuning compiles anew. Dynamo's capture and laqat's passes run in every process. Measured
as above, `first_step_time.py --compiler inductor --kernel-family torch` twice with one `TORCHINDUCTOR_CACHE_DIR`,
two such pairs (a load of 0.4 to 1.6, commit 7dd1e5a):"""

# (Inductor's cache, what the compiles found, first forward s (CPU s), first step s (CPU s), later steps: median s
# (CPU s)), each cell the two pairs' values
CACHE_MEASURED = (
    ("empty", "FX graph: 2 misses; AOTAutograd: 1 miss", "29.5 (35.3), 30.7 (36.7)", "48.1 (65.1), 49.9 (67.8)",
     "0.34 (0.38), 0.35 (0.39)"),
    ("the first run's", "FX graph: 2 hits; AOTAutograd: 1 hit", "8.3 (8.2), 8.2 (8.2)", "8.5 (8.5), 8.5 (8.5)",
     "0.35 (0.39), 0.42 (0.47)"),
)


def hand_off_section() -> list[str]:
    lines = ["## Hand-off (`torch.compile(..., options={\"compiler\": ...})`)", "", INTRO, "",
             "| value | what runs the rewritten graph |", "|---|---|"]
    lines += [f"| `{name}` | {doc} |" for name, doc in HAND_OFFS.items()]
    lines += ["| unset | by device, as above |", "", LOSS_TAIL + ".", "", REGIONAL + ".", "", "Measured: " + MEASURED_SETUP, "",
              "| laqat's kernels | `compiler` | ran | laqat's default | first forward s (CPU s) "
              "| first step s (CPU s) | later steps: median s (CPU s) | later steps |",
              "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in MEASURED]
    lines += ["", CACHES, "", "| Inductor's cache | the compiles found | first forward s (CPU s) | first step s (CPU s) "
              "| later steps: median s (CPU s) |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in CACHE_MEASURED]
    return lines + [""]
