"""laqat's part of the keys of Inductor's FX graph cache and AOTAutograd's cache (``TORCHINDUCTOR_CACHE_DIR``).

Both caches key a graph by its code, its inputs, torch's configs and versions, not by the Python code behind the
custom ops in it. A compiled laqat graph bakes in more of laqat than its ops' names and spec strings: what
``laqat::delta_rule`` resolves to, what each op's autograd formula saves and calls in the backward, the shapes,
dtypes and residual sizes of the fake implementations. An entry written before laqat's sources changed would
otherwise still be hit, and run the old backward (a gradient off without an error).

``cache_key_patches`` gives the Inductor compile of a rewritten graph a ``post_grad_custom_post_pass`` that
changes nothing in the graph and whose ``uuid()``, which both keys include, is the hash of every laqat source
file, the policy, the tuning options and the Triton interpreter switch. A pass the user set there still runs, and
its uuid joins laqat's; one without a uuid makes Inductor bypass its cache, as it would without laqat.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from la_compiler.options import interpreter

# la_compiler's packages whose directories hold its sources: passes/ and kernels/ are mapped beneath it
SOURCE_PACKAGES = ("la_compiler", "la_compiler.passes", "la_compiler.kernels")


def source_files() -> list[tuple[str, Path]]:
    """(name within the package, path) of every Python source of laqat, sorted by name."""
    files = {}
    for package in SOURCE_PACKAGES:
        for directory in importlib.import_module(package).__path__:
            root = Path(directory)
            for path in root.rglob("*.py"):
                files[f"{package}/{path.relative_to(root).as_posix()}"] = path
    return sorted(files.items())


def hash_files(files: list[tuple[str, Path]]) -> str:
    """sha256 over the names and contents of ``files`` ((name, path) pairs)."""
    hasher = hashlib.sha256()
    for name, path in files:
        content = path.read_bytes()
        hasher.update(f"{name}\0{len(content)}\0".encode())
        hasher.update(content)
    return hasher.hexdigest()


@functools.cache
def source_hash() -> str:
    """The hash of laqat's Python sources, read once per process."""
    return hash_files(source_files())


def _string_keys(x):
    """x with every dict key a string, so that the keys sort (a policy may key by integers)."""
    if isinstance(x, dict):
        return {str(k): _string_keys(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_string_keys(v) for v in x]
    return x


def compile_fingerprint(policy, tuning) -> str:
    """What a compiled laqat graph depends on beyond its own code: laqat's sources, the policy (``Policy``), the
    tuning options (``TuningOptions``) and whether Triton kernels run in the interpreter."""
    settings = json.dumps(_string_keys({"policy": policy.to_dict(), "tuning": dataclasses.asdict(tuning),
                                        "interpreter": interpreter()}), sort_keys=True, default=str)
    return hashlib.sha256(f"{source_hash()}\0{settings}".encode()).hexdigest()


class LaqatCacheKey(CustomGraphPass):
    """Runs the user's post-grad post pass, if any, and nothing else; its uuid carries laqat's fingerprint."""

    def __init__(self, fingerprint: str, inner: Any = None):
        self.fingerprint = fingerprint
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        if self.inner is None:
            return ("laqat", self.fingerprint)
        # torch 2.11 has no CustomPassBase: any pass with a uuid() keys the cache
        inner = self.inner.uuid() if callable(getattr(self.inner, "uuid", None)) else None
        return None if inner is None else ("laqat", self.fingerprint, inner)


def cache_key_patches(fingerprint: str) -> dict[str, Any]:
    """Inductor config patches for ``compile_fx``: they apply to the forward's compile and to the backward's,
    which AOTAutograd compiles later, at the first backward."""
    user_pass = torch._inductor.config.post_grad_custom_post_pass
    return {"post_grad_custom_post_pass": LaqatCacheKey(fingerprint, user_pass)}
