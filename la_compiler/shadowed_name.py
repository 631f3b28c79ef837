"""A directory of this repository imported under a top-level name that an installed distribution owns.

``kernels/`` is ``la_compiler.kernels`` (pyproject's package-dir). Where the repository root is on ``sys.path`` (a
test run, a script started there) ``import kernels`` finds that directory first, and so shadows the installed
package of that name: Hugging Face's ``kernels``, which transformers (>= 5.25) imports when it is installed. The
directory's ``__init__`` hands the name over to the installed package (a module may replace itself in
``sys.modules`` while it is imported); without one installed, nothing changes.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, package_dir: str) -> None:
    """Replace the module ``name`` (being imported from ``package_dir``) by the installed package of that name, found
    on ``sys.path`` without the directory that holds ``package_dir``."""
    shadowing_root = os.path.realpath(os.path.dirname(package_dir))
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != shadowing_root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
