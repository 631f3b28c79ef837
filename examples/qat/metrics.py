"""Where a training run reports: metrics as JSONL (one record a line) and a progress display.

    log = MetricsLog("out/metrics.jsonl", run="state_fp8/qat/seed0", resume_step=100)
    log.write(kind="train", step=101, loss=2.31, lr=3e-4, seconds=0.031)

A resumed run first drops its own records past the step it resumes from (a run killed after its last
checkpoint logged steps it will now repeat), so the file reads as one uninterrupted run. Records of other runs
in the same file are kept: several runs can share one file, each record names its run.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: str | Path | None, run: str, resume_step: int | None = None):
        self.path = None if path is None else Path(path)
        self.run = run
        self.records: list[dict] = []
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line)
                mine = record.get("run") == run
                if not mine or (resume_step is not None and record.get("step", 0) <= resume_step):
                    kept.append(line)
                    if mine:
                        self.records.append(record)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, **record) -> dict:
        record = {"run": self.run, **{k: _plain(v) for k, v in record.items()}}
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def _plain(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN / Inf
    return value


def read_records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def number(value: float) -> str:
    """Four decimals, or three significant digits for a small value (a learning rate of 1.5e-05)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-2 else f"{value:.3g}"


class Progress:
    """A tqdm bar on a terminal (where tqdm is installed), else one plain line every ``every`` steps."""

    def __init__(self, total: int, initial: int = 0, label: str = "", every: int = 10):
        self.total, self.step, self.label, self.every = total, initial, label, max(1, every)
        self.bar = None
        self.started = time.perf_counter()
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc=label, dynamic_ncols=True, leave=False)

    def update(self, step: int, **fields) -> None:
        text = " ".join(f"{k} {number(v)}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.update(step - self.step)
            self.bar.set_postfix_str(text, refresh=False)
        elif step % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.started
            print(f"{self.label} step {step}/{self.total} {text} ({elapsed:.1f} s)", flush=True)
        self.step = step

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"{self.label} {text}")
        else:
            print(f"{self.label} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
