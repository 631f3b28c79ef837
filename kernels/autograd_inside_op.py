"""Run torch autograd inside a custom op's implementation.

A custom op's kernel runs below the Autograd dispatch key (``_AutoDispatchBelowAutograd``),
so ops inside it record no graph. Backward implementations that recompute a reference and
differentiate it with ``torch.autograd.grad`` lift that exclusion for their own scope.
"""
from __future__ import annotations

import contextlib

import torch

_C = torch._C


@contextlib.contextmanager
def autograd_enabled():
    exclude = _C._dispatch_tls_local_exclude_set().remove(_C.DispatchKey.AutogradFunctionality)
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
