"""Frontends turn a recurrence, however it is written, into one laqat IR node.

Two kinds:
- trace-time frontends substitute a library's functions while Dynamo traces
  (``fla/``: FLA op calls, via ``torch._dynamo.substitute_in_graph``; ``megatron.py``: what keeps
  Megatron-Core's GDN path in one graph); installed once, when the backend module is imported
  (Megatron's when ``megatron.core`` is imported, before or after that);
- graph frontends rewrite the traced FX graph (``torch code`` matched on the dataflow).
  Each is ``rewrite(gm, record, verify=...) -> int`` and is listed in ``GRAPH_FRONTENDS``.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

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
    if importlib.util.find_spec("einops") is not None and dynamo_traces_einops():
        from la_compiler.passes.frontends import einops_recipes  # noqa: F401  (registers on import)
    if importlib.util.find_spec("fla") is not None:
        from la_compiler.passes.frontends.fla import substitutions  # noqa: F401  (registers on import)
        from la_compiler.passes.frontends.fla import block_regions  # noqa: F401  (installs where Dynamo reuses)
    if importlib.util.find_spec("megatron") is not None:
        _when_imported("megatron.core", _install_megatron)


def dynamo_traces_einops() -> bool:
    """Whether Dynamo traces einops' own code, by torch's own check (``_einops_supports_dynamo_tracing``: einops >=
    0.8.2 on a torch that has the check). Elsewhere einops registers its functions with ``allow_in_graph``: each
    call is one op of the graph, cheaper to trace than ``einops_recipes``' substitution (docs/model-bench.md)."""
    import einops
    from torch._dynamo import decorators

    supports = getattr(decorators, "_einops_supports_dynamo_tracing", None)
    return supports is not None and bool(supports(einops))


def _install_megatron() -> None:
    from la_compiler.passes.frontends import megatron  # noqa: F401  (registers on import)


def _when_imported(name: str, install) -> None:
    """``install()`` now if module ``name`` is imported, else right after its first import completes
    (Megatron takes seconds to import: a process that never imports it must not pay for it)."""
    if name in sys.modules:
        install()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, install))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and runs ``install`` once its module has executed. It stays in
    ``sys.meta_path`` until then: ``importlib.util.find_spec(name)`` also asks it, without importing."""

    def __init__(self, name: str, install):
        self.name, self.install, self.finding = name, install, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.install()

        spec.loader.exec_module = exec_then_install  # this spec's own loader object
        return spec
