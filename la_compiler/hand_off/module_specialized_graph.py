"""One compiled graph per module a Dynamo graph serves.

Dynamo compiles a frame once per set of guards, not once per module object: when a block's
``forward`` graph-breaks, the graph that resumes it is traced once (for ``layers.0``) and then
reused for ``layers.1``, ``layers.2`` ... with their parameters as inputs. Its laqat nodes carry the
first block's module names, and so the first block's policy: a per-layer policy would silently give
every block the numerics of the first.

``ModuleSpecializedGraph`` is what the backend returns for such a graph. On each call it reads the
full names of the modules behind the graph's parameter inputs (by tensor identity, in the compiled
model's ``named_parameters()``) and runs the laqat passes once for each new set of names, on a copy
of the graph as Dynamo traced it. Versions whose rewritten code is the same (the policy does not
tell the modules apart) share one compiled callable.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from la_compiler.passes.module_names import normalize_module_path, root_prefixes

Rewrite = Callable[[torch.fx.GraphModule, dict], torch.fx.GraphModule]  # the laqat passes, given the root prefixes
HandOff = Callable[[torch.fx.GraphModule, list], Callable]  # Inductor or eager


def _pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of the graph as Dynamo traced it; placeholders keep their ``grapharg`` (it holds the real
    parameter, which must not be copied)."""
    kept = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        if "grapharg" in node.meta:
            kept[node.name] = node.meta.pop("grapharg")
    try:
        clone = copy.deepcopy(gm)
    finally:
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name in kept:
                node.meta["grapharg"] = kept[node.name]
    for node in clone.graph.find_nodes(op="placeholder"):
        if node.name in kept:
            node.meta["grapharg"] = kept[node.name]
    return clone


def _probes(gm: torch.fx.GraphModule, prefixes: dict[str, str]) -> list[tuple[int, str, str]]:
    """(input position, source root, the tensor's name below that root) for one parameter input per
    source root with a resolved prefix."""
    probes, seen = [], set()
    for position, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        if source is None:
            continue
        path = source.name() if callable(source.name) else source.name
        root = next((r for r in prefixes if path.startswith(r)), None)
        if root is None or root in seen or not prefixes[root]:
            continue
        seen.add(root)
        probes.append((position, root, normalize_module_path(path)))
    return probes


class ModuleSpecializedGraph:
    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, root: torch.nn.Module,
                 prefixes: dict[str, str], rewrite: Rewrite, hand_off: HandOff):
        self._pristine = _pristine_copy(gm)
        self._root = root
        self._rewrite, self._hand_off = rewrite, hand_off
        self._probes = _probes(gm, prefixes)
        self._names: dict[int, str] = {}
        rewritten = rewrite(gm, prefixes)
        fn = hand_off(rewritten, example_inputs)
        self._versions: dict[tuple, Callable] = {self._key_of(prefixes): fn}  # Dynamo's guards hold at any shape
        self._by_code: dict[tuple, Callable] = {}  # (rewritten code, input shapes) -> compiled

    @staticmethod
    def _key_of(prefixes: dict[str, str]) -> tuple:
        return tuple(sorted(prefixes.items()))

    def _full_name(self, tensor) -> str | None:
        name = self._names.get(id(tensor))
        if name is None:
            self._names = {id(t): n for n, t in (*self._root.named_parameters(remove_duplicate=False),
                                                  *self._root.named_buffers(remove_duplicate=False))}
            name = self._names.get(id(tensor))
        return name

    def _prefixes_of(self, args) -> dict[str, str] | None:
        prefixes = {}
        for position, root, local in self._probes:
            full = self._full_name(args[position])
            if full is None or not full.endswith(local):
                return None  # not a parameter of the compiled model: keep the first version's names
            prefixes[root] = full[: len(full) - len(local)]
        return prefixes

    def __call__(self, *args):
        prefixes = self._prefixes_of(args)
        if prefixes is None:
            return next(iter(self._versions.values()))(*args)
        key = self._key_of(prefixes)
        fn = self._versions.get(key)
        if fn is None:
            # a new version is compiled from concrete inputs: static shapes, so its key holds them
            shape_key = key + tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            fn = self._versions.get(shape_key)
            if fn is None:
                rewritten = self._rewrite(_pristine_copy(self._pristine), prefixes)
                code_key = (rewritten.code, shape_key[len(key):])
                fn = self._by_code.get(code_key)
                if fn is None:
                    fn = self._by_code[code_key] = self._hand_off(rewritten, list(args))
                self._versions[shape_key] = fn
        return fn(*args)
