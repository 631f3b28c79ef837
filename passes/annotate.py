"""The annotate pass: the policy table -> a quant spec for every site of every laqat node.

For each node the policy is resolved for its module (``node.meta["laqat"].module``, from
Dynamo's ``nn_module_stack``) and kind; the result is written into the node's spec argument
(so ``gm.print_readable()`` shows it) and into ``node.meta["laqat"]`` (spec, the rules that
applied, the backend the policy asked for), with the compile's tuning options (``t.<name>``: they change no
numerics, so they count as no change). A backend the policy names explicitly must be
able to apply the annotated spec on this node's device, dtype and head dims: if not, that is
a ``PolicyError`` naming the key now, at compile time. Rules that matched no site become
notes (and a warning): a pipeline stage may legitimately hold none of a rule's modules.
"""
from __future__ import annotations

import warnings

import torch

from la_compiler.ir import is_delta_rule
from la_compiler.kernels.selection import KernelSelectionError, select_kernel
from la_compiler.options import DEFAULT_TUNING, TuningOptions
from la_compiler.policy import Policy, PolicyError
from la_compiler.record import GraphRecord


class UnmatchedPolicyRuleWarning(UserWarning):
    """A policy rule matched no recurrence of a compiled graph."""


class NothingQuantizedWarning(UserWarning):
    """A policy that changes numerics met a graph with candidate recurrences and rewrote none of them."""


def annotate(gm: torch.fx.GraphModule, policy: Policy, record: GraphRecord, *, part_of_model: bool = False,
             tuning: TuningOptions = DEFAULT_TUNING) -> int:
    """Rewrites each node's spec argument to what the policy resolves for its module, with ``tuning``. Returns
    how many nodes changed numerics. ``part_of_model``: the graph was traced inside a submodule (it resumed
    after a graph break), so a rule that matches none of its sites may match a sibling's: a note, no warning."""
    changed = 0
    seen = []
    for node in gm.graph.nodes:
        if not is_delta_rule(node):
            continue
        meta = node.meta["laqat"]
        seen.append((meta.module, meta.kind))
        where = f"laqat node {node.name} (module {meta.module or '<top>'!r}, {meta.kind})"
        try:
            res = policy.resolve(meta.module, meta.kind)
            spec = meta.spec.replace(quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                                     chunk=res.chunk, phase=res.phase, extra=res.extra, numerics=res.numerics)
        except PolicyError as e:
            raise PolicyError(f"{where}: {e}") from None
        if res.backend is not None or res.implementation is not None:
            _check_requested_kernel(node, spec, res, where)
        if spec != meta.spec.replace(tuning=()):
            changed += 1
        spec = spec.replace(tuning=tuning)
        meta.spec = spec
        meta.policy_rules = list(res.rules)
        meta.requested_backend = res.backend
        meta.requested_family = res.implementation
        _set_spec_arg(node, spec.to_string())
    if seen:  # a graph without recurrences (a graph-break fragment) says nothing about the rules
        unmatched = policy.unmatched_rules(seen)
        record.notes.extend(unmatched)
        if unmatched and not part_of_model:  # one warning per compiled graph, naming every rule and the sites it could have matched
            sites = ", ".join(f"{kind} at {module or '<top>'}" for module, kind in seen)
            warnings.warn("; ".join(unmatched) + f" (this graph's sites: {sites})", UnmatchedPolicyRuleWarning,
                          stacklevel=2)
    elif policy.changes_numerics and record.near_misses:
        misses = "; ".join(f"{n.frontend} at {n.module or '<top>'}: {n.reason}" for n in record.near_misses)
        note = (f"policy {policy.name!r} changes numerics, but laqat rewrote no recurrence in this graph, so none "
                f"of it applies here; candidate regions left untouched: {misses}")
        record.notes.append(note)
        warnings.warn(note, NothingQuantizedWarning, stacklevel=2)
    return changed


def _check_requested_kernel(node: torch.fx.Node, spec, res, where: str) -> None:
    """A policy's ``backend`` / ``implementation`` must be able to apply the annotated spec."""
    q, v = (_example(a) for a in node.args[:3:2])
    if q is None or v is None:
        return  # a graph built by hand, without shapes: the lower pass decides
    auto = spec.replace(kernel="auto")
    try:
        select_kernel(auto, device=q.device.type, dtype=q.dtype, head_k=q.shape[-1], head_v=v.shape[-1],
                      requested=res.backend, family=res.implementation)
    except KernelSelectionError as e:
        keys = [f"{key}={value!r}" for key, value in ((res.backend_key, res.backend),
                                                     (res.implementation_key, res.implementation)) if value]
        raise PolicyError(f"{where}: {' with '.join(keys)} cannot apply {auto}: {e}") from None


def _example(arg):
    value = arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _set_spec_arg(node: torch.fx.Node, spec: str) -> None:
    if len(node.args) > 8:
        node.args = (*node.args[:8], spec, *node.args[9:])
    else:
        node.kwargs = {**node.kwargs, "spec": spec}
