"""What a spec runs, for people reading it: the modules of its kernel variant and how the spec specializes them.

A variant names the modules its kernels live in by role (``KernelVariant.source_modules``): the chunk family's
stage modules (``chunk/fwd_*.py``, ``chunk/bwd_*.py``, those a spec launches), the recurrent family's
``recurrent/fused_recurrent.py``, the decode family's ``decode/kernels.py``. Every kernel is the package's own
source, specialized by ``tl.constexpr`` values that the spec fixes (``KernelVariant.constexprs``); ``laqat source
SPEC`` prints the files and those values.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.errors import KernelParamsError
from la_compiler.kernels.registry import get_variant, spec_of, variant_names


def kernel_modules_for_spec(spec: RecurrenceSpec | str) -> dict[str, ModuleType]:
    """Every module whose kernels run ``spec`` (its ``kernel=`` names the variant), by what it holds."""
    spec = spec_of(spec)
    variant = get_variant(spec.kernel) if spec.kernel in variant_names() else None
    if variant is None or variant.source_modules is None:
        with_source = [name for name in variant_names() if get_variant(name).source_modules is not None]
        raise KernelParamsError(f"spec kernel={spec.kernel!r} names no Triton kernel family; "
                           f"families with kernel source: {with_source}")
    return variant.source_modules(spec)


def kernel_module_for_spec(spec: RecurrenceSpec | str) -> ModuleType:
    """The first module of ``spec`` (every module: ``kernel_modules_for_spec``)."""
    return next(iter(kernel_modules_for_spec(spec).values()))


def constexprs_of_spec(spec: RecurrenceSpec | str) -> dict[str, object]:
    """The ``tl.constexpr`` values ``spec`` fixes in the kernels it runs."""
    spec = spec_of(spec)
    kernel_modules_for_spec(spec)  # the same refusal for a spec without kernel source
    variant = get_variant(spec.kernel)
    return {} if variant.constexprs is None else variant.constexprs(spec)


def _module_of(obj) -> ModuleType:
    return obj if isinstance(obj, ModuleType) else kernel_module_for_spec(obj)


def path_of(obj) -> Path:
    """The file of a kernel module, or of the first module a spec (string or RecurrenceSpec) runs."""
    return Path(_module_of(obj).__file__)


def source_of(obj) -> str:
    """The Triton source of a kernel module, or of the first module a spec runs."""
    return path_of(obj).read_text()


def paths_of_spec(spec) -> dict[str, Path]:
    """The file of every module a spec runs, by role: what ``laqat source`` prints."""
    return {role: Path(module.__file__) for role, module in kernel_modules_for_spec(spec).items()}
