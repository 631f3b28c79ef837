"""The verifier of IR invariants: every laqat node is well formed before it is lowered."""
from __future__ import annotations

import operator

import torch

from la_compiler.errors import LaqatError
from la_compiler.ir.checks import check_tensors
from la_compiler.ir.delta_rule import LaqatMeta, is_delta_rule, node_spec


class IRVerificationError(LaqatError, RuntimeError):
    """A laqat IR node breaks an invariant of the IR contract (a bug in a frontend or pass)."""


def _value(arg):
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else arg


def _positive_scale(scale) -> bool:
    """A positive number; or a symbolic one (``K ** -0.5`` of a dynamic head dim, ``dynamic=True``) whose example
    value is positive: the value each call computes."""
    if isinstance(scale, torch.SymFloat):
        hint = scale.node.hint if scale.node.has_hint() else None
        return hint is None or hint > 0
    return isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0


def verify_node(node: torch.fx.Node) -> None:
    where = f"laqat node {node.name}"
    if len(node.args) + len(node.kwargs) != 9:
        raise IRVerificationError(f"{where}: expected 9 arguments, got {len(node.args) + len(node.kwargs)}")
    spec = node_spec(node)
    meta = node.meta.get("laqat")
    if not isinstance(meta, LaqatMeta):
        raise IRVerificationError(f"{where}: node.meta['laqat'] is missing")
    if meta.spec != spec:
        raise IRVerificationError(f"{where}: node.meta['laqat'].spec {meta.spec} != spec argument {spec}")
    q, k, v, g, beta, h0, cu, scale = (_value(a) for a in node.args[:8])
    if not _positive_scale(scale):
        raise IRVerificationError(f"{where}: scale must be a positive float, got {scale!r}")
    if q is None or not isinstance(q, torch.Tensor):
        return  # no shape information (graphs built by hand); nothing more to check
    check_tensors(where, q, k, v, g, beta, h0, cu)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    expect = {
        "k": (k.shape, q.shape),
        "v": (v.shape[:2], (B, T)),
        "g": (g.shape, (B, T, HV) if spec.kind == "gdn" else (B, T, HV, K)),
        "beta": (beta.shape, (B, T, HV)),
    }
    for name, (got, want) in expect.items():
        if tuple(got) != tuple(want):
            raise IRVerificationError(f"{where}: {name} has shape {tuple(got)}, the IR needs {tuple(want)}")
    if HV % H:
        raise IRVerificationError(f"{where}: value heads HV={HV} must be a multiple of q/k heads H={H}")
    for name, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
        if not t.dtype.is_floating_point:
            raise IRVerificationError(f"{where}: {name} must be floating point, got {t.dtype}")
    if cu is not None and B != 1:
        raise IRVerificationError(f"{where}: cu_seqlens needs batch size 1, got B={B}")
    if h0 is not None:
        n = B if cu is None else cu.shape[0] - 1
        want = (n, HV, V, K) if spec.state == "vk" else (n, HV, K, V)
        if tuple(h0.shape) != want:
            raise IRVerificationError(f"{where}: initial_state has shape {tuple(h0.shape)}, the IR needs {want}")
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1)):
            raise IRVerificationError(f"{where}: its outputs may only be read through [0] and [1], found {user.format_node()}")


def verify_ir(gm: torch.fx.GraphModule) -> int:
    """Checks every laqat node; returns how many were checked."""
    count = 0
    for node in gm.graph.nodes:
        if is_delta_rule(node):
            verify_node(node)
            count += 1
    return count
