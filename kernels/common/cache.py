"""laqat's on-disk cache: where the chunk kernels' autotuning choices (``chunk/autotune.py``) are kept, written
atomically (a temporary file, then ``os.replace``) so that concurrent processes never read half a file.

The cache lives under ``la_compiler.options.cache_dir()`` (``LAQAT_CACHE_DIR``, default ``$XDG_CACHE_HOME/laqat``
or ``~/.cache/laqat``: docs/options.md). Compiled kernels are Triton's own cache's.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from la_compiler.options import CACHE_DIR_ENV, cache_dir  # noqa: F401  (the cache's root is read there)


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
