"""What a spec runs, for people reading it: the generated modules of its kernel variant.

A variant that generates Triton source per spec names its modules by role (``KernelVariant.source_modules``):
the chunk family its "forward" and "backward" stages, the recurrent and decode families one "forward and
backward" module. ``laqat source SPEC`` prints them.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from la_compiler.kernels.common.codegen import CodegenError
from la_compiler.kernels.registry import get_variant, spec_of, variant_names
from la_compiler.spec import RecurrenceSpec


def generated_modules_for_spec(spec: RecurrenceSpec | str) -> dict[str, ModuleType]:
    """Every generated module that runs ``spec`` (its ``kernel=`` names the variant), by what it holds."""
    spec = spec_of(spec)
    variant = get_variant(spec.kernel) if spec.kernel in variant_names() else None
    if variant is None or variant.source_modules is None:
        generated = [name for name in variant_names() if get_variant(name).source_modules is not None]
        raise CodegenError(f"spec kernel={spec.kernel!r} is not a generated kernel family; "
                           f"generated families: {generated}")
    return variant.source_modules(spec)


def generated_module_for_spec(spec: RecurrenceSpec | str) -> ModuleType:
    """The first generated module of ``spec`` (the chunk family's forward stages; every module:
    ``generated_modules_for_spec``)."""
    return next(iter(generated_modules_for_spec(spec).values()))


def _module_of(obj) -> ModuleType:
    return obj if isinstance(obj, ModuleType) else generated_module_for_spec(obj)


def path_of(obj) -> Path:
    """The cached file of a generated module, or of the first module a spec (string or RecurrenceSpec) runs."""
    return Path(_module_of(obj).__file__)


def source_of(obj) -> str:
    """The generated Triton source of a module, or of the first module a spec runs."""
    return path_of(obj).read_text()


def paths_of_spec(spec) -> dict[str, Path]:
    """The cached file of every generated module a spec runs, by role: what ``laqat source`` prints."""
    return {role: Path(module.__file__) for role, module in generated_modules_for_spec(spec).items()}
