"""Fully qualified module names from Dynamo's ``nn_module_stack`` node metadata.

A graph's ``nn_module_stack`` paths are relative to the frame Dynamo traced. For the model's own
``forward`` that is the model (``L['self'].layers[0].attn``), but a graph that resumes after a graph
break inside a block starts at the block (``L['self'].attn``): the path alone loses ``layers.0.``.
``root_prefixes(gm, root)`` restores it from the graph's own inputs: Dynamo lifts every parameter and
buffer a graph reads into a placeholder whose source names it relative to the frame
(``L['self']._modules['attn']._parameters['weight']``) and whose example *is* that tensor. Looking the
tensor up in the compiled model's ``named_parameters()`` gives its full name, hence the prefix of the
frame's root (``layers.0.``). The compiled model is the ``torch.compile`` wrapper on the call stack.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import sys
from typing import Iterator

import torch

_GETATTR = re.compile(r"getattr\((?P<inner>.+), ['\"](?P<attr>[^'\"]+)['\"]\)")
# the root object, with the subscripts that reach it from a wrapper's arguments ("L['args'][0]":
# FLA's *ForCausalLM.forward is wrapped, so Dynamo's frame sees the module as args[0])
_ROOT = re.compile(r"^(?:L|G)\[['\"][^'\"]+['\"]\](?:\[[^\]]+\])*\.?")
_TENSOR_SLOT = re.compile(r"\._(?:parameters|buffers)\[['\"]([^'\"]+)['\"]\]")

# root of a source path (its _ROOT match, without the trailing dot) -> the full name of that root object
_PREFIXES: list[dict[str, str]] = [{}]


def normalize_module_path(path: str) -> str:
    """Dynamo's source path of a module -> its name relative to the traced frame.

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
    path = _TENSOR_SLOT.sub(r".\1", path)
    path = _ROOT.sub("", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.strip(".").replace("..", ".")


def _root_of(path: str) -> str:
    m = _ROOT.match(path)
    return m.group(0).rstrip(".") if m else ""


def compiled_root_module() -> torch.nn.Module | None:
    """The module the user compiled: that of the outermost compile wrapper on the call stack, whether it wraps
    the module (``torch.compile(model)``, ``model.compile()``) or a bound method of it
    (``torch.compile(model.loss)``); None when a function was compiled. DDP is looked through: under
    ``torch.compile(DistributedDataParallel(model))`` module names (and the policy attached to the model) are
    the model's own, ``layers.0.attn`` rather than DDP's ``module.layers.0.attn``."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        found = _compiled_module_of(frame) or found
        frame = frame.f_back
    while isinstance(found, torch.nn.parallel.DistributedDataParallel):  # Dynamo traces the model's own forward
        found = found.module
    return found


def _compiled_module_of(frame) -> torch.nn.Module | None:
    owner = frame.f_locals.get("self")
    if isinstance(owner, torch._dynamo.eval_frame.OptimizedModule):
        return owner._orig_mod
    if isinstance(owner, torch._dynamo.eval_frame._TorchDynamoContext):  # its wrapper, calling ``fn``
        target = getattr(frame.f_locals.get("fn"), "__self__", None)
        if isinstance(target, torch.nn.Module):
            return target
    return None


def root_prefixes(gm: torch.fx.GraphModule, root: torch.nn.Module | None) -> dict[str, str]:
    """{a source root such as "L['self']": the full name of that object in ``root``, with a trailing dot}
    for every frame root whose parameters or buffers this graph reads."""
    if root is None:
        return {}
    names: dict[int, str] = {}
    for name, tensor in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), name)  # a shared module keeps its first name
    prefixes: dict[str, str] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        example = getattr(arg, "example", None) if arg is not None else None
        if source is None or example is None or id(example) not in names:
            continue
        path = source.name() if callable(source.name) else source.name
        local, full = normalize_module_path(path), names[id(example)]
        if local and full.endswith(local):
            prefixes.setdefault(_root_of(path), full[: len(full) - len(local)])
    return prefixes


@contextlib.contextmanager
def graph_module_names(prefixes: dict[str, str]) -> Iterator[None]:
    """While active, ``module_name`` gives full names: ``prefixes`` from ``root_prefixes``."""
    _PREFIXES.append(dict(prefixes))
    try:
        yield
    finally:
        _PREFIXES.pop()


def is_function_module(module_type) -> bool:
    """Whether a module class only stands in for a function: Hugging Face kernels' ``Func`` (transformers >= 5.25 wraps
    its kernel functions in one, ``torch_chunk_gated_delta_rule`` among them, a global module outside the model)."""
    return getattr(module_type, "__qualname__", "").endswith("_create_func_module.<locals>.Func")


def function_behind(fn):
    """The plain function behind ``fn``: through a ``Func`` module (``is_function_module``) and ``functools.wraps``
    wrappers (transformers' torch fallbacks, e.g. ``modeling_qwen3_next.torch_chunk_gated_delta_rule``)."""
    if isinstance(fn, torch.nn.Module) and is_function_module(type(fn)):
        forward = type(fn).forward
        fn = forward.__closure__[forward.__code__.co_freevars.index("func")].cell_contents
    return inspect.unwrap(fn)


def module_name(node: torch.fx.Node) -> str:
    """The innermost module a node was traced in, by its full name in the compiled model ("" at top level); a module
    that stands in for a function (``is_function_module``) is not one."""
    stack = [entry for entry in (node.meta.get("nn_module_stack") or {}).values() if not is_function_module(entry[1])]
    if not stack:  # traced in the frame's own module: a resumed block's frame is that block
        return _PREFIXES[-1].get("L['self']", "").rstrip(".")
    path = stack[-1][0]
    local = normalize_module_path(path)
    prefix = _PREFIXES[-1].get(_root_of(path), "")
    return (prefix + local).strip(".") if local else prefix.rstrip(".")
