"""Run a piece of an FX graph on probe tensors, in float64.

The graph's own dtype casts (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float``)
are lifted to float64 so that the comparison with the fp64 reference measures the algebra,
not the rounding. Factory calls without a dtype get float64 through the default dtype.
"""
from __future__ import annotations

import contextlib
import operator

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TO_DOUBLE_METHODS = {"float": "double", "half": "double", "bfloat16": "double"}


class ProbeError(RuntimeError):
    """The graph piece could not be run on probe inputs."""


def _lift(x):
    if isinstance(x, torch.dtype) and x in _FLOATS:
        return torch.float64
    if isinstance(x, (tuple, list)):
        return type(x)(_lift(y) for y in x)
    if isinstance(x, dict):
        return {k: _lift(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def run_nodes(nodes, env: dict) -> dict:
    """Evaluates ``nodes`` (in graph order) with ``env`` holding the values of their external
    inputs; returns ``env`` extended with every evaluated node (in-place writes included)."""
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

    with _float64_default(), torch.no_grad():
        for n in nodes:
            if n in env:
                continue
            args, kwargs = _lift(load(n.args)), _lift(load(n.kwargs))
            try:
                if n.op == "call_function":
                    env[n] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    name = _TO_DOUBLE_METHODS.get(n.target, n.target)
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
