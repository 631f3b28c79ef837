"""A graph compiled with an attached policy runs only for a module with that policy.

Dynamo reuses a compiled graph for as long as its guards hold, and they do not look at the policy: not when
another policy is attached after compiling, and not for another instance of the same class (parameters are
graph inputs, so one graph serves every instance; a fresh instance compiled with the same options reuses it).
Without a check, such a module would silently run with the policy the graph was compiled with.

``PolicyGuardedGraph`` is what the backend returns for a graph whose policy came from the compiled module
(attached, or exact because none was). On each call it finds the module being run (the compile wrapper on the
call stack, as at compile time) and the object holding its policy; for a module or object not seen before it
reads the policy (a device sync where the buffer is on the GPU) and compares: an equal policy (a checkpoint of this run loaded, a fresh instance of it) runs
on, another raises ``PolicyError``. An explicit ``options={"policy": ...}`` needs no check.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from la_compiler.passes.module_names import compiled_root_module
from la_compiler.policy.attach import attached_policy_source, stored_object
from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy


class PolicyGuardedGraph:
    def __init__(self, compiled: Callable, root: torch.nn.Module, policy: Policy):
        self._compiled, self._policy = compiled, policy
        self._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo's calling convention, unchanged
        # id(module) -> (the module, the object holding its policy) last found to hold this graph's policy
        self._checked: dict[int, tuple[weakref.ref, object]] = {id(root): (weakref.ref(root), stored_object(root))}

    def __call__(self, *args):
        root = compiled_root_module()
        if root is not None:
            stored = stored_object(root)
            seen_root, seen_stored = self._checked.get(id(root), (None, None))
            if seen_root is None or seen_root() is not root or seen_stored is not stored:
                self._check(root)
                self._checked[id(root)] = (weakref.ref(root), stored)
        return self._compiled(*args)

    def _check(self, root: torch.nn.Module) -> None:
        found = attached_policy_source(root)
        now = found[0] if found is not None else Policy.exact()
        if now != self._policy:
            raise PolicyError(
                f"this graph was compiled with the policy {self._policy.name!r} and now runs for a "
                f"{type(root).__name__} whose policy is {now.name!r} (attached after compiling, or another instance "
                f"reusing the graph Dynamo compiled for the first): compiled graphs keep their policy; give each "
                f"compile its policy as options={{'policy': ...}}, or call torch._dynamo.reset() and compile again")
