"""laqat's errors reach the user as themselves, also from inside ``torch.compile``.

Dynamo wraps whatever a backend raises in ``BackendCompilerFailed`` ("backend='laqat' raised: ..."),
so ``except la_compiler.PolicyError`` would not catch a policy error raised while compiling. Dynamo
lets one kind of exception through unwrapped: ``ShortenTraceback`` (it trims Dynamo's frames from
its traceback and re-raises it). ``through_dynamo`` gives a laqat error that base too: its class is a
subclass of the original (same name, same message), so ``except PolicyError`` catches it.
"""
from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback

_CLASSES: dict[type, type] = {}


def is_laqat_error(error: BaseException) -> bool:
    return type(error).__module__.split(".")[0] == "la_compiler"


def through_dynamo(error: Exception) -> Exception:
    """``error`` as an instance of a subclass of its class that Dynamo re-raises unwrapped."""
    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    passing = _CLASSES.get(cls)
    if passing is None:
        passing = _CLASSES[cls] = type(cls.__name__, (cls, ShortenTraceback),
                                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    copy = passing.__new__(passing, *error.args)
    copy.args = error.args
    copy.__dict__.update(error.__dict__)
    copy.first_useful_frame = None  # keep the whole traceback (laqat's frames say where the error is)
    return copy.with_traceback(error.__traceback__)
