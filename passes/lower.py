"""The lower pass: the kernel-selection table picks one kernel variant per laqat node."""
from __future__ import annotations

import torch

from la_compiler.ir import is_delta_rule
from la_compiler.kernels.selection import KernelSelectionError, select_kernel
from la_compiler.passes.annotate import _set_spec_arg


def static_int(size) -> int | None:
    """A size known at compile time; None for a symbolic one (never specialized here)."""
    return size if isinstance(size, int) else None


def lower(gm: torch.fx.GraphModule) -> int:
    """Writes ``kernel=<variant>`` into every node's spec. Returns how many nodes were lowered."""
    count = 0
    for node in gm.graph.nodes:
        if not is_delta_rule(node):
            continue
        meta = node.meta["laqat"]
        q, v = (a.meta.get("example_value", a.meta.get("val")) for a in node.args[:3:2])
        try:
            choice = select_kernel(meta.spec.replace(kernel="auto"), device=q.device.type, dtype=q.dtype,
                                   head_k=q.shape[-1], head_v=v.shape[-1], requested=meta.requested_backend,
                                   family=meta.requested_family, seq_len=static_int(q.shape[1]))
        except KernelSelectionError as e:
            raise KernelSelectionError(f"laqat node for module {meta.module or '<top>'!r}: {e}") from None
        meta.spec = meta.spec.replace(kernel=choice.variant)
        meta.kernel_reason = choice.explain()
        _set_spec_arg(node, meta.spec.to_string())
        count += 1
    return count
