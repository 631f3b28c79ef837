"""Run a piece of an FX graph on probe tensors, in float64.

The graph's own casts to fp32 (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float``)
are lifted to float64 so that the comparison with the fp64 reference measures the algebra,
not the rounding; factories (``zeros(..., dtype=torch.bfloat16)``: an output buffer) are
lifted from any floating dtype, and factory calls without a dtype get float64 through the
default dtype. A cast *to* bf16 or fp16 (``.bfloat16()``, ``.half()``, ``.to(torch.float16)``)
is not lifted: it rounds on the probe as it does in the model, so that the comparison sees it
(an input's entry chain rounds its reference input identically, ``entry.py``).
"""
from __future__ import annotations

import contextlib
import operator

import torch

from la_compiler.error_base import LaqatError

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_WIDE = (torch.float32, torch.float64)
_TO_DOUBLE_METHODS = {"float": "double"}
CASTS = {"to", "type", torch.Tensor.to, torch.Tensor.type}


class ProbeError(LaqatError, RuntimeError):
    """The graph piece could not be run on probe inputs (internal: the frontend reports it as a near miss)."""


def _lift(x, floats=_FLOATS):
    if isinstance(x, torch.dtype) and x in floats:
        return torch.float64
    if isinstance(x, (tuple, list)):
        return type(x)(_lift(y, floats) for y in x)
    if isinstance(x, dict):
        return {k: _lift(v, floats) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def run_nodes(nodes, env: dict, grad: bool = False, lift: bool = True) -> dict:
    """Evaluates ``nodes`` (in graph order) with ``env`` holding the values of their external
    inputs; returns ``env`` extended with every evaluated node (in-place writes included).
    ``grad=True`` records autograd (for the vector-Jacobian product of the region); ``lift=False``
    runs the graph in its own dtypes (no cast or factory lifted to float64)."""
    env = dict(env)

    def load(a):
        if isinstance(a, torch.fx.Node):
            if a not in env:
                raise ProbeError(f"probe has no value for {a.name}")
            return env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(load(x) for x in a)
        if isinstance(a, dict):
            return {k: load(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(load(a.start), load(a.stop), load(a.step))
        return a

    with (_float64_default() if lift else contextlib.nullcontext()), torch.set_grad_enabled(grad):
        for n in nodes:
            if n in env:
                continue
            floats = () if not lift else _WIDE if n.target in CASTS else _FLOATS  # casts to bf16 / fp16 round
            args, kwargs = _lift(load(n.args), floats), _lift(load(n.kwargs), floats)
            try:
                if n.op == "call_function":
                    env[n] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    name = _TO_DOUBLE_METHODS.get(n.target, n.target) if lift else n.target
                    env[n] = getattr(args[0], name)(*args[1:], **kwargs)
                else:
                    raise ProbeError(f"cannot probe {n.op} node {n.name}")
            except ProbeError:
                raise
            except Exception as e:  # a region that does not run on probe inputs is not rewritten
                raise ProbeError(f"{n.name} ({n.target}) failed on probe inputs: {type(e).__name__}: {e}") from None
            if n.op == "call_function" and n.target is operator.setitem:
                env[n] = None
    return env
