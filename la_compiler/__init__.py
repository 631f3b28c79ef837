"""laqat: a torch.compile backend for quantization-aware training of linear-attention models.

    model = torch.compile(model, backend="laqat")
    print(la_compiler.explain(model, batch))

The public names are imported lazily, so that ``la_compiler.kernels`` and
``la_compiler.passes`` can import the floor modules (ir.spec, ir.delta_rule) without a circle.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "explain": "la_compiler.explainer",
    "ExplainReport": "la_compiler.explainer",
    "Policy": "la_compiler.policy.resolution",
    "attach_policy": "la_compiler.policy.attach",
    "policy_of": "la_compiler.policy.attach",
    "load_state_dict": "la_compiler.policy.attach",
    "phase": "la_compiler.phase",
    "PolicyError": "la_compiler.policy.file_format",
    "load_policy": "la_compiler.policy.resolution",
    "NumericsOptions": "la_compiler.options",
    "OptionsError": "la_compiler.options",
    "TuningOptions": "la_compiler.options",
    "RecurrenceSpec": "la_compiler.ir.spec",
    "RecurrenceSplitError": "la_compiler.hand_off.ddp_buckets",
    "laqat_backend": "la_compiler.backend",
    "SlowKernelWarning": "la_compiler.errors",
    "LaqatError": "la_compiler.error_base",
    "PolicyWarning": "la_compiler.policy.file_format",
    "UnmatchedPolicyRuleWarning": "la_compiler.policy.file_format",
    "NothingQuantizedWarning": "la_compiler.policy.file_format",
    "NoFastKernelError": "la_compiler.kernels.selection",
    "KernelSelectionError": "la_compiler.kernels.selection",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'la_compiler' has no attribute {name!r}")
