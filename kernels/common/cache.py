"""The on-disk code cache of generated Triton source (after torch/_inductor/codecache.py).

Generated source is written once under a hash of (source, generation parameters, versions
of torch, triton and laqat), atomically (a temporary file, then ``os.replace``), and loaded
as a real module whose ``__file__`` is that file: Triton's ``@jit`` reads its kernels'
source from there and tracebacks point at real lines. Each module loads once per process.

The cache lives under ``la_compiler.options.cache_dir()`` (``LAQAT_CACHE_DIR``, default
``$XDG_CACHE_HOME/laqat`` or ``~/.cache/laqat``: docs/options.md).

Users read what a spec runs through ``la_compiler.kernels.sources`` (and ``laqat source SPEC``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Mapping

import torch
import triton

import la_compiler
from la_compiler.options import CACHE_DIR_ENV, cache_dir  # noqa: F401  (the cache's root is read there)

MODULE_PREFIX = "laqat_generated"

_LOADED: dict[str, ModuleType] = {}  # cache key -> module, in this process
_LOCK = threading.Lock()


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "triton": triton.__version__, "laqat": la_compiler.__version__}


def cache_key(source: str, params: Mapping[str, object]) -> str:
    """sha256 over the generated source, its generation parameters and the tool versions."""
    payload = json.dumps({"source": source, "params": dict(params), "versions": versions()}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either no file or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_source(name: str, source: str, params: Mapping[str, object]) -> ModuleType:
    """The module of generated ``source`` (written to the cache first if it is not there).

    ``name`` is a readable prefix of the file name; ``params`` (JSON-able) are what the
    generator specialized on. The module carries ``__laqat_key__`` and ``__laqat_params__``.
    """
    key = cache_key(source, params)
    with _LOCK:
        module = _LOADED.get(key)
        if module is not None:
            return module
        path = cache_dir() / "kernels" / key[:2] / f"{name}_{key[:24]}.py"
        if not path.exists() or path.read_text() != source:
            write_atomic(path, source)
        module_name = f"{MODULE_PREFIX}.{name}_{key[:24]}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        module.__laqat_key__ = key
        module.__laqat_params__ = dict(params)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        _LOADED[key] = module
        return module


def path_of(module: ModuleType) -> Path:
    """The cached file of a generated module (of a spec: ``la_compiler.kernels.sources.path_of``)."""
    return Path(module.__file__)


def source_of(module: ModuleType) -> str:
    """The generated Triton source of a module (of a spec: ``la_compiler.kernels.sources.source_of``)."""
    return path_of(module).read_text()


def loaded_modules() -> dict[str, ModuleType]:
    """Every generated module loaded in this process, by cache key."""
    return dict(_LOADED)
