"""Which ``torch.compile`` backends are laqat's: trace-time substitutions that only laqat's backend undoes
(passes/frontends/fla/block_regions.py) ask ``compiling_for_laqat()`` while Dynamo traces.

A backend is laqat's where the chain Dynamo holds (its debug wrapper, ``torch.compile``'s options wrapper,
``functools.partial``) reaches a function marked by ``mark_laqat_backend``: ``la_compiler.backend.laqat_backend`` and
``la_compiler.explain``'s. A user's function that calls ``laqat_backend`` is not, nor is a backend under DDP's graph
splitting (Dynamo's ``DDPOptimizer`` holds the backend behind a bound method).
"""
from __future__ import annotations

import functools

MARK = "__laqat_backend__"


def mark_laqat_backend(fn):
    setattr(fn, MARK, True)
    return fn


def _chain(fn, limit: int = 8):
    for _ in range(limit):
        yield fn
        if isinstance(fn, functools.partial):
            following = fn.func
        else:
            following = (getattr(fn, "compiler_fn", None) or getattr(fn, "_torchdynamo_orig_backend", None)
                         or getattr(fn, "__wrapped__", None))
        if following is None or following is fn:
            return
        fn = following


def compiling_for_laqat() -> bool:
    """While Dynamo traces: whether the backend it compiles for is laqat's (False where this torch's Dynamo does not
    expose it)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        compiler_fn = InstructionTranslator.current_tx().output.compiler_fn
    except (ImportError, AttributeError, AssertionError, IndexError):
        return False
    return any(getattr(fn, MARK, False) for fn in _chain(compiler_fn))
