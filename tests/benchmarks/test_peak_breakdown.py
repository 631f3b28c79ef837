"""examples/benchmarks/peak_breakdown.py's replay of an allocator trace: the peak is the highest running total of
the blocks allocated during the step (a block from before the trace lowers it when freed), and the blocks alive then
are grouped by the code that allocated them (an Inductor graph's buffer line, laqat, FLA, or the autograd engine
where no Python frame lies between the caller and the allocator)."""
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "examples" / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from peak_breakdown import format_breakdown, peak_of_trace  # noqa: E402

REPO = Path(__file__).parents[2]
GENERATED = "/tmp/inductor-cache/ab/cabcdefghijklmnopqrstuvwxyz0123.py"
CALLER = {"filename": str(BENCHMARKS / "memory_account.py"), "line": 10, "name": "forward_backward"}
TORCH = {"filename": "/site-packages/torch/autograd/__init__.py", "line": 1, "name": "backward"}


def frame(filename, name="f", line=1):
    return {"filename": filename, "line": line, "name": name}


def alloc(addr, mib, *frames):
    return {"action": "alloc", "addr": addr, "size": mib << 20, "frames": list(frames)}


def free(addr, mib):
    return {"action": "free_requested", "addr": addr, "size": mib << 20}


def test_the_peak_and_what_is_alive_then():
    laqat = frame(str(REPO / "kernels" / "chunk" / "fwd.py"), "scratch")
    fla = frame("/site-packages/fla/modules/fused_cross_entropy/ops.py", "cross_entropy_bwd")
    events = [
        free(999, 64),                                     # a block from before the trace: the total goes to -64
        alloc(1, 100, laqat, CALLER),
        alloc(2, 50, frame(GENERATED, "call", 3), TORCH, CALLER),
        free(1, 100),                                      # total -14
        alloc(3, 300, TORCH, CALLER),                      # 286: the peak; alive: 2 and 3
        alloc(4, 20, fla, TORCH, CALLER),                  # 306: higher still; alive: 2, 3, 4
        free(3, 300),
        alloc(5, 200, fla, CALLER),                        # 206: below the peak
    ]
    result = peak_of_trace(events)
    assert result["peak_bytes"] == (300 + 50 + 20 - 64) << 20
    labels = dict(result["live"])
    assert labels == {
        "outside any op (autograd engine): memory_account.py:forward_backward": 300 << 20,
        f"Inductor graph {Path(GENERATED).name[:8]}: ": 50 << 20,  # the generated file does not exist here
        "FLA modules/fused_cross_entropy/ops.py:cross_entropy_bwd": 20 << 20,
    }
    assert result["live_other_bytes"] == 0
    text = format_breakdown("row", result)
    assert text.splitlines()[1].strip().startswith("300.0 MiB  outside any op")


def test_laqat_frames_are_named_by_their_path_and_the_rest_is_summed():
    events = [alloc(i, i + 1, frame(str(REPO / "la_compiler" / "ir" / f"m{i}.py"), "op"), CALLER) for i in range(5)]
    result = peak_of_trace(events, top=2)
    assert result["live"] == [("laqat la_compiler/ir/m4.py:op", 5 << 20), ("laqat la_compiler/ir/m3.py:op", 4 << 20)]
    assert result["live_other_bytes"] == (1 + 2 + 3) << 20
