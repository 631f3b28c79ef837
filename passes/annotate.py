"""The annotate pass: the policy table -> a quant spec for every site of every laqat node.

For each node the policy is resolved for its module (``node.meta["laqat"].module``, from
Dynamo's ``nn_module_stack``) and kind; the result is written into the node's spec argument
(so ``gm.print_readable()`` shows it) and into ``node.meta["laqat"]`` (spec, the rules that
applied, the backend the policy asked for), with the compile's tuning options (``t.<name>``: they change no
numerics, so they count as no change). A backend the policy names explicitly must be
able to apply the annotated spec on this node's device, dtype and head dims: if not, that is
a ``PolicyError`` naming the key now, at compile time. Rules that matched no site become
notes (and a warning): a pipeline stage may legitimately hold none of a rule's modules. The warnings
(``la_compiler.UnmatchedPolicyRuleWarning``, ``la_compiler.NothingQuantizedWarning``) point at the user's line.
"""
from __future__ import annotations

import logging

import torch

from la_compiler.errors import warn_at_caller
from la_compiler.ir.delta_rule import is_delta_rule
from la_compiler.kernels.selection import KernelSelectionError, select_kernel
from la_compiler.options import DEFAULT_TUNING, TuningOptions
from la_compiler.policy.file_format import NothingQuantizedWarning, PolicyError, UnmatchedPolicyRuleWarning
from la_compiler.policy.resolution import Policy
from la_compiler.record import GraphRecord

__all__ = ["annotate", "NothingQuantizedWarning", "UnmatchedPolicyRuleWarning"]

logger = logging.getLogger(__name__)


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
            chunk, kept = _chunk(meta, res, where)
            spec = meta.spec.replace(quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                                     chunk=chunk, chunk_passed=False, phase=res.phase, extra=res.extra,
                                     numerics=res.numerics)
        except PolicyError as e:
            raise PolicyError(f"{where}: {e}") from None
        if res.backend is not None or res.implementation is not None:
            _check_requested_kernel(node, spec, res, where)
        if spec != meta.spec.replace(tuning=(), chunk_passed=False):
            changed += 1
        spec = spec.replace(tuning=tuning)
        meta.spec = spec
        meta.policy_rules = list(res.rules) + kept
        logger.debug("policy %r at %s (%s): %s", policy.name, meta.module or "<top>", meta.kind, "; ".join(res.rules))
        meta.requested_backend = res.backend
        meta.requested_family = res.implementation
        _set_spec_arg(node, spec.to_string())
    _check_recompile(len(seen), policy, record)
    if seen:  # a graph without recurrences (a graph-break fragment) says nothing about the rules
        unmatched = policy.unmatched_rules(seen)
        record.notes.extend(unmatched)
        # a rule whose glob reaches no laqat quantizer of any model was warned about when the policy was loaded
        warned = policy.unmatched_rules(seen, reachable_only=True)
        if warned and not part_of_model:  # one warning per compiled graph, naming every rule and the sites it could have matched
            sites = ", ".join(f"{kind} at {module or '<top>'}" for module, kind in seen)
            warn_at_caller("; ".join(warned) + f" (this graph's sites: {sites})", UnmatchedPolicyRuleWarning)
    elif policy.changes_numerics and record.near_misses:
        misses = "; ".join(f"{n.frontend} at {n.module or '<top>'}: {n.reason}" for n in record.near_misses)
        note = (f"policy {policy.name!r} changes numerics, but laqat rewrote no recurrence in this graph, so none "
                f"of it applies here; candidate regions left untouched: {misses}")
        record.notes.append(note)
        warn_at_caller(note, NothingQuantizedWarning)
    return changed


# Dynamo frame id -> {frame compile id: recurrences rewritten}: what each compile of one frame rewrote
_REWRITES_BY_FRAME: dict[int, dict[int, int]] = {}


def _check_recompile(count: int, policy: Policy, record: GraphRecord) -> None:
    """A recompile of a frame (another sequence length under automatic dynamic shapes, a guard that failed) that
    rewrites fewer recurrences than an earlier compile of the same frame did, under a policy that changes
    numerics, would train part of the run without the policy: never silently (a note and a warning)."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return
    if compile_id.frame_compile_id == 0:  # a frame's first compile (torch._dynamo.reset() reuses frame ids)
        _REWRITES_BY_FRAME[compile_id.frame_id] = {}
    seen = _REWRITES_BY_FRAME.setdefault(compile_id.frame_id, {})
    earlier = max((n for c, n in seen.items() if c != compile_id.frame_compile_id), default=0)
    seen[compile_id.frame_compile_id] = max(count, seen.get(compile_id.frame_compile_id, 0))
    if policy.changes_numerics and count < earlier:
        misses = "; ".join(f"{n.frontend} at {n.module or '<top>'}: {n.reason}" for n in record.near_misses)
        note = (f"policy {policy.name!r} changes numerics, but this recompile of a function (Dynamo compile "
                f"{compile_id}) rewrote {count} recurrence(s) where an earlier compile of it rewrote {earlier}: the "
                f"calls that run this version run without the policy where it is missing (a symbolic sequence "
                f"length under automatic dynamic shapes? compile with dynamic=False, or mark the length static); "
                + (f"candidate regions left untouched: {misses}" if misses else "no candidate region was found"))
        record.notes.append(note)
        warn_at_caller(note, NothingQuantizedWarning)


DEFAULT_CHUNK = 64  # a policy's chunk_size default


def _chunk(meta, res, where: str) -> tuple[int, list[str]]:
    """The chunk size a node runs with: what the program passed is never replaced. A chunk size the call passed
    (the spec's ``chunk=N:passed``: an FLA call's ``chunk_size=N``, 64 included) is kept where the policy leaves
    chunk_size at its default; a policy that sets another one is an error naming both (under a quantizing policy
    the state rounds at every chunk boundary: other chunks are other numerics). Else the policy's chunk size."""
    call = meta.spec.chunk
    if not meta.spec.chunk_passed or call == res.chunk:
        return res.chunk, []
    if res.chunk == DEFAULT_CHUNK:
        return call, [f"chunk_size={call} from the FLA call kept (the policy leaves chunk_size at {DEFAULT_CHUNK})"]
    rule = next((r.split(" sets ")[0] for r in res.rules if r.startswith("linear_attention[")), "the policy")
    raise PolicyError(f"the FLA call passes chunk_size={call} but {rule} sets chunk_size={res.chunk}: laqat does not "
                      f"replace a chunk size the program passed (the state would round at other chunk boundaries "
                      f"than the program asks for); make them agree: chunk_size: {call} in the policy rule, or "
                      f"chunk_size={res.chunk} (or none) in the call")


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
