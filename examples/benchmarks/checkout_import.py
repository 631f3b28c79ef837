"""Make ``la_compiler`` importable from this checkout when it is not pip-installed (e.g. on a
GPU machine with only torch, triton and FLA), mapping kernels/ and passes/ as pyproject's
package-dir does. Benchmarks call ``ensure_la_compiler()`` before importing laqat."""
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ensure_la_compiler() -> None:
    try:
        import la_compiler.kernels  # noqa: F401
        import la_compiler.passes  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(REPO))
    import la_compiler  # noqa: F401

    for folder in ("kernels", "passes"):
        name = f"la_compiler.{folder}"
        spec = importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
