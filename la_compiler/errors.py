"""laqat's errors reach the user as themselves, also from inside ``torch.compile``.

Dynamo wraps whatever a backend raises in ``BackendCompilerFailed`` ("backend='laqat' raised: ..."),
so ``except la_compiler.PolicyError`` would not catch a policy error raised while compiling. Dynamo
lets one kind of exception through unwrapped: ``ShortenTraceback`` (it trims Dynamo's frames from
its traceback and re-raises it). ``through_dynamo`` gives a laqat error that base too: its class is a
subclass of the original (same name, same message), so ``except PolicyError`` catches it.

laqat's warnings point at the user's code: ``warn_at_caller`` attributes one to the innermost frame outside laqat
and torch.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
from torch._dynamo.exc import ShortenTraceback

from la_compiler.error_base import LaqatError

__all__ = ["LaqatError", "SlowKernelWarning", "is_laqat_error", "laqat_error_in", "through_dynamo", "warn_at_caller"]

_CLASSES: dict[type, type] = {}


def is_laqat_error(error: BaseException) -> bool:
    return isinstance(error, LaqatError) or type(error).__module__.split(".")[0] == "la_compiler"


def laqat_error_in(error: BaseException) -> BaseException | None:
    """The laqat error ``error`` is or wraps (its ``__cause__`` / ``__context__`` chain, Dynamo's
    ``inner_exception``), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if is_laqat_error(error):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or \
            (None if error.__suppress_context__ else error.__context__)
    return None


def through_dynamo(error: Exception) -> Exception:
    """``error`` as an instance of a subclass of its class that Dynamo re-raises unwrapped."""
    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    passing = _CLASSES.get(cls)
    if passing is None:
        bases = (cls, ShortenTraceback) if issubclass(cls, LaqatError) else (cls, LaqatError, ShortenTraceback)
        passing = _CLASSES[cls] = type(cls.__name__, bases,
                                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    copy = passing.__new__(passing, *error.args)
    copy.args = error.args
    copy.__dict__.update(error.__dict__)
    copy.first_useful_frame = None  # keep the whole traceback (laqat's frames say where the error is)
    return copy.with_traceback(error.__traceback__)


class SlowKernelWarning(UserWarning):
    """On CUDA the kernel-selection table sent a recurrence to a slow kernel that the policy did not pin: the fp64
    torch reference, or a token-by-token kernel on a long sequence (docs/policy.md, "Kernel selection"). One per
    compiled graph, naming every such layer, its kernel, why the faster ones were rejected and what it costs."""


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the innermost frame outside laqat and torch: the user's line that called the
    compiled model (or the model code a graph resumed in after a graph break), not a line inside the backend."""
    internal = _internal_dirs()
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def _internal_dirs() -> tuple[str, ...]:
    """laqat's directories (la_compiler/, passes/, kernels/: one package), torch's and contextlib (whose decorator
    frames sit between torch's)."""
    dirs = [os.path.dirname(torch.__file__) + os.sep, contextlib.__file__]
    for name in ("la_compiler", "la_compiler.passes", "la_compiler.kernels"):
        module = sys.modules.get(name)
        dirs += [os.path.join(path, "") for path in getattr(module, "__path__", ())]
    return tuple(dirs)
