"""What a spec runs, for people reading it: the modules of its kernel variant and how the spec specializes them.

A variant names the modules its kernels live in by role (``KernelVariant.source_modules``). The chunk family
generates its "forward" and "backward" stages per spec: the spec's choices are written into the generated
source, which the code cache keeps. The recurrent and decode families' "forward and backward" kernels are the
package's own ``recurrent/fused_recurrent.py`` and ``decode/kernels.py``, specialized by ``tl.constexpr``
values that the spec fixes (``KernelVariant.constexprs``). ``laqat source SPEC`` prints the files and those
values.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from la_compiler.kernels.common.codegen import CodegenError
from la_compiler.kernels.registry import get_variant, spec_of, variant_names
from la_compiler.spec import RecurrenceSpec


def kernel_modules_for_spec(spec: RecurrenceSpec | str) -> dict[str, ModuleType]:
    """Every module whose kernels run ``spec`` (its ``kernel=`` names the variant), by what it holds."""
    spec = spec_of(spec)
    variant = get_variant(spec.kernel) if spec.kernel in variant_names() else None
    if variant is None or variant.source_modules is None:
        with_source = [name for name in variant_names() if get_variant(name).source_modules is not None]
        raise CodegenError(f"spec kernel={spec.kernel!r} names no Triton kernel family; "
                           f"families with kernel source: {with_source}")
    return variant.source_modules(spec)


def kernel_module_for_spec(spec: RecurrenceSpec | str) -> ModuleType:
    """The first module of ``spec`` (the chunk family's forward stages; every module: ``kernel_modules_for_spec``)."""
    return next(iter(kernel_modules_for_spec(spec).values()))


def constexprs_of_spec(spec: RecurrenceSpec | str) -> dict[str, object]:
    """The ``tl.constexpr`` values ``spec`` fixes of kernels that are not generated per spec; empty for a
    generated family (its module's source holds them)."""
    spec = spec_of(spec)
    kernel_modules_for_spec(spec)  # the same refusal for a spec without kernel source
    variant = get_variant(spec.kernel)
    return {} if variant.constexprs is None else variant.constexprs(spec)


def is_generated(module: ModuleType) -> bool:
    """Whether ``module`` was generated for a spec and loaded from the code cache (``common/cache.py``)."""
    return hasattr(module, "__laqat_key__")


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
