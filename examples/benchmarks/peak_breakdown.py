"""What is allocated at the peak of one CUDA training step, by the code that allocated it.

    from peak_breakdown import live_at_peak
    rows = live_at_peak(step)      # step(): one forward and backward

Records the caching allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks) over one call
of ``step``, replays its allocations and frees, finds the moment the bytes allocated during the step peak, and
groups the blocks alive then by where they were allocated: the innermost frame of an Inductor-generated graph (its
source line: the buffer it allocates), of laqat (``la_compiler``), of FLA, or else of the caller (an allocation with
no Python frame between the caller and the allocator is the autograd engine's own: a gradient it accumulates or a
zero gradient it materializes for an output the loss does not use). Used by memory_account.py ``--peak-breakdown``.
"""
from __future__ import annotations

import linecache
import os
import re
from pathlib import Path
from typing import Callable

import torch

_GENERATED = re.compile(r"/[a-z0-9]{2}/c[a-z0-9]{20,}\.py$")  # Inductor's generated modules
_REPO = Path(__file__).resolve().parents[2]
_LAQAT = tuple(str(_REPO / d) + "/" for d in ("la_compiler", "kernels", "passes"))


def _label(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        name, line, fn = f.get("filename", ""), f.get("line", 0), f.get("name", "")
        if _GENERATED.search(name):
            source = linecache.getline(name, line).strip()
            return f"Inductor graph {os.path.basename(name)[:8]}: {source[:90]}"
        if name.startswith(_LAQAT):
            return f"laqat {os.path.relpath(name, _REPO)}:{fn}"
        if "/fla/" in name:
            return f"FLA {name.split('/fla/')[-1]}:{fn}"
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and "/triton/" not in name and name and not name.startswith("<"):
            return f"outside any op (autograd engine): {os.path.basename(name)}:{f.get('name', '')}"
    return "no Python frame"


def live_at_peak(step: Callable[[], None], top: int = 16) -> dict:
    """-> {"peak_bytes": the step's peak above its start, "live": [(label, bytes), ...] largest first,
    "live_other_bytes": the rest's}."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_of_trace(snapshot["device_traces"][torch.cuda.current_device()], top)


def peak_of_trace(events: list[dict], top: int = 16) -> dict:
    """The allocator trace's replay (``alloc`` adds a block, ``free_requested`` removes one; a block allocated
    before the trace began lowers the running total when freed), the blocks alive at its highest total, by label."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested":
            total -= e["size"]
            live.pop(e["addr"], None)
    by_label: dict[str, int] = {}
    for size, frames in at_peak.values():
        label = _label(frames)
        by_label[label] = by_label.get(label, 0) + size
    rows = sorted(by_label.items(), key=lambda kv: -kv[1])
    return {"peak_bytes": peak, "live": rows[:top], "live_other_bytes": sum(b for _, b in rows[top:])}


def format_breakdown(title: str, result: dict) -> str:
    lines = [f"{title}: peak {result['peak_bytes'] / 2**20:.1f} MiB above the step's start; alive then, by allocator"]
    lines += [f"  {b / 2**20:10.1f} MiB  {label}" for label, b in result["live"]]
    if result["live_other_bytes"]:
        lines.append(f"  {result['live_other_bytes'] / 2**20:10.1f} MiB  (the rest)")
    return "\n".join(lines)
