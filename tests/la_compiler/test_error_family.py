"""One exception family: every exception class the package defines is a ``la_compiler.LaqatError`` (keeping its
standard base, ``ValueError`` or ``RuntimeError``), except the warnings, which docs/architecture.md ("Errors")
lists. The base lives in ``la_compiler.error_base``, which imports nothing, so that the floor modules (spec,
options, the policy schema, the kernels) can derive from it."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import la_compiler
from la_compiler.error_base import LaqatError
from tests.la_compiler.test_import_layers import ROOT, project_modules

WARNINGS = {  # the documented warnings (docs/architecture.md, "Errors"): not errors, so not LaqatErrors
    "SlowKernelWarning", "PolicyWarning", "UnmatchedPolicyRuleWarning", "NothingQuantizedWarning",
    "NothingMatchedWarning", "ServingInputsWarning",
}


def _defined_exceptions():
    found = []
    for name in sorted(project_modules()):
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                found.append(obj)
    return found


def test_every_exception_class_is_a_laqat_error():
    classes = _defined_exceptions()
    names = {cls.__name__ for cls in classes}
    # the walk sees the classes that motivated the rule (kernels, policy, spec, options, decode)
    assert {"PolicyError", "KernelSelectionError", "NoFastKernelError", "KernelParamsError", "DecodeOptionsError",
            "PhaseLengthsMissing", "ChunkQuantError", "SpecError", "OptionsError", "QuantConfigError",
            "PhaseError", "IRInputError", "UnsupportedArgumentError"} <= names, sorted(names)
    outside = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in classes
                     if not issubclass(cls, (LaqatError, Warning)))
    assert not outside, f"exception classes outside the LaqatError family: {outside}"
    warns = {cls.__name__ for cls in classes if issubclass(cls, Warning)}
    assert warns == WARNINGS, warns
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name in WARNINGS:
        assert name in architecture, f"{name} is not documented in docs/architecture.md"


def test_standard_bases_are_kept():
    from la_compiler.kernels.common.decode_phase import PhaseLengthsMissing
    from la_compiler.kernels.selection import KernelSelectionError, NoFastKernelError
    from la_compiler.options import DecodeOptionsError, OptionsError
    from la_compiler.policy.file_format import PolicyError
    from la_compiler.ir.spec import SpecError

    for cls in (PolicyError, DecodeOptionsError, OptionsError, SpecError):
        assert issubclass(cls, ValueError) and issubclass(cls, LaqatError), cls
    for cls in (KernelSelectionError, NoFastKernelError, PhaseLengthsMissing):
        assert issubclass(cls, RuntimeError) and issubclass(cls, LaqatError), cls


def test_one_base_re_exported():
    import la_compiler.errors

    assert la_compiler.LaqatError is LaqatError is la_compiler.errors.LaqatError


def test_the_base_module_imports_nothing():
    """The bottom of the import layers: no import at all (``from __future__`` aside)."""
    tree = ast.parse(Path(la_compiler.error_base.__file__).read_text())
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    assert imports == []
