""""Did you mean ...?" for a misspelt key, value or name: the closest allowed spellings.

    did_you_mean("chunksize", ["chunk_size", "backend"])   # -> " (did you mean 'chunk_size'?)"
    did_you_mean("e4m4", ["e4m3", "e2m1", "int8"])         # -> " (did you mean 'e4m3'?)"

This module imports nothing of the project (only ``difflib``), so every layer may use it.
"""
from __future__ import annotations

import difflib
from typing import Iterable


def close_matches(value, allowed: Iterable, *, n: int = 2, cutoff: float = 0.6) -> list:
    """The allowed values whose spelling is closest to ``value``'s (case-insensitive): the best one, and up to
    ``n - 1`` others about as close (a tie)."""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        return []
    spelled = {}
    for a in allowed:
        if a is not None and not isinstance(a, bool):
            spelled.setdefault(str(a).lower(), a)
    text = str(value).lower()
    if not text or text in spelled and spelled[text] == value:
        return []
    return [spelled[m] for m in best_of(text, list(spelled), n=n, cutoff=cutoff)]


def best_of(text: str, candidates: list[str], *, n: int = 2, cutoff: float = 0.6, tie: float = 0.03) -> list[str]:
    """The candidates closest to ``text`` (difflib's ratio at least ``cutoff``): the best, and those within ``tie``
    of it, at most ``n``."""
    scored = sorted(((difflib.SequenceMatcher(None, text, c).ratio(), c) for c in candidates), key=lambda x: -x[0])
    scored = [(r, c) for r, c in scored if r >= cutoff]
    return [c for r, c in scored if r >= scored[0][0] - tie][:n] if scored else []


def did_you_mean(value, allowed: Iterable, **kwargs) -> str:
    """`` (did you mean 'x'?)`` or `` (did you mean 'x' or 'y'?)`` for the closest allowed values, "" if none is
    close."""
    found = close_matches(value, allowed, **kwargs)
    if not found:
        return ""
    return " (did you mean " + " or ".join(repr(m) for m in found) + "?)"
