"""Fully qualified module names from Dynamo's ``nn_module_stack`` node metadata."""
from __future__ import annotations

import re

import torch

_GETATTR = re.compile(r"getattr\((?P<inner>.+), ['\"](?P<attr>[^'\"]+)['\"]\)")
# the root object, with the subscripts that reach it from a wrapper's arguments ("L['args'][0]":
# FLA's *ForCausalLM.forward is wrapped, so Dynamo's frame sees the module as args[0])
_ROOT = re.compile(r"^(?:L|G)\[['\"][^'\"]+['\"]\](?:\[[^\]]+\])*\.?")


def normalize_module_path(path: str) -> str:
    """Dynamo's source path of a module -> its fully qualified name.

    "L['self'].layers[0].attn" -> "layers.0.attn";
    "getattr(L['self'].layers, '0').attn" -> "layers.0.attn";
    "L['self']._modules['layers']['0']" -> "layers.0";
    "L['args'][0].model.layers[1].attn" -> "model.layers.1.attn".
    """
    while True:
        m = _GETATTR.search(path)
        if not m:
            break
        path = path[: m.start()] + f"{m.group('inner')}.{m.group('attr')}" + path[m.end():]
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = _ROOT.sub("", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.strip(".").replace("..", ".")


def module_name(node: torch.fx.Node) -> str:
    """The innermost module a node was traced in ("" at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)
