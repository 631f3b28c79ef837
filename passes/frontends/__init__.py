"""Frontends turn a recurrence, however it is written, into one laqat IR node.

Two kinds:
- trace-time frontends substitute a library's functions while Dynamo traces
  (``fla.py``: FLA op calls, via ``torch._dynamo.substitute_in_graph``); installed once, when
  the backend module is imported;
- graph frontends rewrite the traced FX graph (``torch code`` matched on the dataflow).
  Each is ``rewrite(gm, record, verify=...) -> int`` and is listed in ``GRAPH_FRONTENDS``.
"""
from __future__ import annotations

import importlib.util

GRAPH_FRONTENDS: list = []  # callables (gm, record, *, verify: bool) -> int, run in order


def torch_recurrence(gm, record, *, verify: bool = False) -> int:
    """GDN/KDA recurrences written in plain PyTorch (imports networkx only when a graph comes)."""
    from la_compiler.passes.frontends.torch_recurrence import rewrite_torch_recurrences

    return rewrite_torch_recurrences(gm, record, verify=verify)


GRAPH_FRONTENDS.append(torch_recurrence)

_INSTALLED = False


def install_trace_frontends() -> None:
    """Register the trace-time substitutions whose library is importable (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if importlib.util.find_spec("fla") is not None:
        from la_compiler.passes.frontends import fla  # noqa: F401  (registers on import)
