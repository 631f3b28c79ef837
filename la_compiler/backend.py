"""The ``laqat`` torch.compile backend.

    torch.compile(model, backend="laqat", options={"policy": ..., "compiler": "inductor" | "eager",
                                                   "verify": False, "tuning": {...}})

Without a ``policy`` option (or with None) a graph gets the policy attached to the compiled module
(``la_compiler.attach_policy``; also when a bound method such as ``model.loss`` is compiled), else exact
numerics. ``tuning`` (``la_compiler.options.TuningOptions`` fields: how the chunk kernels launch and what they
keep for the backward) goes into every node's spec (docs/options.md). ``compiler`` is what runs the rewritten graph
(the hand-off): as given, else Inductor for a graph with tensors on a GPU and eager for a CPU-only graph
(``la_compiler.hand_off.compiler_choice``; docs/options.md, "Hand-off").

Registered through the ``torch_dynamo_backends`` entry point, so a fresh process that never
imported ``la_compiler`` finds it; importing this module installs the trace-time frontends
(FLA substitutions), registers einops' torch backend (``_register_einops_torch_backend``) before Dynamo traces
anything, and starts computing the once-per-process keys of Inductor's and Triton's caches in a daemon thread
(``la_compiler.hand_off.process_keys_ahead``).

Logging (``logging.getLogger(__name__)``, under ``la_compiler``; torch's ``TORCH_LOGS="+la_compiler"`` turns it on):
each rewritten graph logs one DEBUG line per rewrite (module, kind, spec, kernel), per near miss and per policy
note, and one INFO line with the graph's summary, the hand-off and why included (``TORCH_LOGS="la_compiler"``).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from la_compiler.backend_mark import mark_laqat_backend
from la_compiler.hand_off.cache_key import compile_fingerprint
from la_compiler.hand_off.ddp_buckets import check_pieces
from la_compiler.hand_off import process_keys_ahead
import la_compiler.ir.log_decay  # noqa: F401  (laqat::log_decay: the torch frontend puts it in graphs)
from la_compiler.errors import LaqatError, laqat_error_in, through_dynamo
from la_compiler.hand_off.compiler_choice import choose_hand_off, compile_rewritten
from la_compiler.hand_off.module_specialized_graph import ModuleSpecializedGraph
from la_compiler.options import DEFAULT_TUNING, HAND_OFFS, OptionsError, TuningOptions
from la_compiler.passes.frontends import install_trace_frontends
from la_compiler.passes.inline_regions import inline_block_regions
from la_compiler.passes.module_names import compiled_root_module, root_prefixes
from la_compiler.passes.pipeline import run_pipeline
from la_compiler.policy.resolution import Policy, load_policy
from la_compiler.policy.attach import attached_policy_source
from la_compiler.policy.guard import PolicyGuardedGraph
from la_compiler.record import CompileRecord

COMPILERS = tuple(HAND_OFFS)

logger = logging.getLogger(__name__)


class BackendOptionsError(LaqatError, ValueError):
    """An ``options={...}`` key or value the laqat backend does not accept."""


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    policy: Policy | None  # None: not given (the attached policy, else exact numerics)
    compiler: str | None = None  # what runs the rewritten graph; None: chosen by device (la_compiler.hand_off.compiler_choice)
    verify: bool = False  # the thorough rewrite check (the whole region); a bounded one runs on every compile
    tuning: TuningOptions = DEFAULT_TUNING  # the chunk kernels' launches (docs/options.md)
    regional: bool | int = True  # Inductor: repeated layers compile once; an int: layers per piece (hand_off.regions)

    @staticmethod
    def from_user(options: dict[str, Any] | None) -> "BackendOptions":
        if options is not None and not isinstance(options, dict):
            hint = f" (did you mean options={{'policy': {options!r}}}?)" if isinstance(options, str) else ""
            raise BackendOptionsError(f"torch.compile(..., options=...) must be a dict of laqat options, got "
                                      f"{type(options).__name__} {options!r}{hint}")
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(BackendOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise BackendOptionsError(f"unknown laqat option(s) {unknown}; allowed: {sorted(known)}")
        compiler = options.get("compiler")
        if compiler is not None and compiler not in COMPILERS:
            raise BackendOptionsError(f"options['compiler'] must be one of {COMPILERS} (or None: chosen by device), "
                                      f"got {compiler!r}")
        verify = options.get("verify", False)
        if not isinstance(verify, bool):
            raise BackendOptionsError(f"options['verify'] must be a bool, got {verify!r}")
        regional = options.get("regional", True)
        if not isinstance(regional, (bool, int)) or (not isinstance(regional, bool) and regional < 1):
            raise BackendOptionsError(f"options['regional'] must be a bool or a number of layers per piece (>= 1), "
                                      f"got {regional!r}")
        try:
            tuning = TuningOptions.from_dict(options.get("tuning"), key="options['tuning'].")
        except OptionsError as e:
            raise BackendOptionsError(str(e)) from None
        policy = options.get("policy")
        return BackendOptions(policy=None if policy is None else load_policy(policy), compiler=compiler, verify=verify,
                              tuning=tuning, regional=regional)


def policy_for(option: Policy | None, root: torch.nn.Module | None) -> tuple[Policy, str]:
    """The policy a graph compiles with and where it came from: the option wins over the policy attached to the
    compiled module; neither gives exact numerics."""
    if option is not None:
        return option, "option"
    attached = attached_policy_source(root)
    return attached if attached is not None else (Policy.exact(), "default exact")


install_trace_frontends()


def _register_einops_torch_backend() -> None:
    """einops registers its torch backend at its first call on a tensor. A model traced before that (FLA's KDA layers
    call einops) leaves a guard on einops' backend table that the first run itself breaks: one more full Dynamo
    trace and compile at the second call. Registered here, before Dynamo traces anything, where einops is installed."""
    try:
        from einops._backends import get_backend
    except ImportError:
        return
    get_backend(torch.empty(0))
    get_backend(torch.nn.Parameter(torch.empty(0)))  # a type of its own in einops' table (FLA passes parameters)


_register_einops_torch_backend()
process_keys_ahead.start()

# Every compilation's record, newest last; ``explain`` installs its own recorder instead.
_ACTIVE_RECORD: list[CompileRecord] = [CompileRecord()]


def last_record() -> CompileRecord:
    return _ACTIVE_RECORD[-1]


def graph_break_of(gm: torch.fx.GraphModule) -> str:
    """Why Dynamo ended this graph at a graph break, with the user line it broke at ("" if it did not)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return ""
    where = [f"{f.filename}:{f.lineno} in {f.name}" for f in reason.user_stack[-1:]]
    text = " ".join(reason.reason.split()).split(" Hint:")[0]  # Dynamo's hints and debug context follow
    return f"{text} (at {where[0]})" if where else text


def log_graph(record) -> None:
    """What one rewritten graph holds, for ``TORCH_LOGS="+la_compiler"`` (DEBUG: every rewrite, near miss and
    note) and ``TORCH_LOGS="la_compiler"`` (INFO: the summary)."""
    for m in record.matches:
        logger.debug("rewrote %s at %s (frontend %s): %s -> kernel %s", m.kind, m.module or "<top>", m.frontend,
                     m.spec, m.kernel)
    for n in record.near_misses:
        logger.debug("near miss (%s frontend) at %s: %s", n.frontend, n.module or "<top>", n.reason)
    for note in record.notes:
        logger.debug("note: %s", note)
    logger.info("graph %d: %d recurrence(s) rewritten (%s), %d near miss(es); policy %s (%s); hand-off %s (%s)%s",
                record.graph_id, len(record.matches),
                ", ".join(f"{m.kind} at {m.module or '<top>'}" for m in record.matches) or "none",
                len(record.near_misses), record.policy, record.policy_source, record.hand_off, record.hand_off_reason,
                f"; ended at a graph break: {record.graph_break}" if record.graph_break else "")


@mark_laqat_backend
def laqat_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None,
                  _record: CompileRecord | None = None) -> Callable:
    try:
        return _compile(gm, example_inputs, options, mode, _record)
    except Exception as e:
        inner = laqat_error_in(e)  # raised by laqat, or by a laqat op inside AOTAutograd's or Inductor's tracing
        if inner is not None:  # as itself, not wrapped in Dynamo's BackendCompilerFailed
            raise through_dynamo(inner) from inner.__cause__
        raise


def _compile(gm, example_inputs, options, mode, _record) -> Callable:
    if mode not in (None, "default"):
        raise BackendOptionsError(f"torch.compile(mode={mode!r}) is not supported by the laqat backend")
    opts = BackendOptions.from_user(options)
    inlined = inline_block_regions(gm)  # FLA's blocks traced once (passes/frontends/fla/block_regions.py), first
    sink = _record or _ACTIVE_RECORD[-1]
    root = compiled_root_module()
    check_pieces(root)  # under DDPOptimizer: no recurrence split across two graph pieces
    policy, policy_source = policy_for(opts.policy, root)
    chosen = choose_hand_off(opts.compiler, gm, example_inputs)

    def rewrite(graph: torch.fx.GraphModule, prefixes: dict[str, str]) -> torch.fx.GraphModule:
        record = sink.new_graph()
        record.graph_break = graph_break_of(gm)
        record.policy, record.policy_source = policy.name, policy_source
        record.hand_off, record.hand_off_reason = chosen.compiler, chosen.reason
        if inlined:
            record.notes.append(f"{inlined} FLA block calls traced as one region each, Dynamo reusing the first "
                                f"block's trace; inlined back, each under its own module path (LAQAT_FLA_BLOCK_REGIONS)")
        run_pipeline(graph, policy, record, verify=opts.verify, module_prefixes=prefixes, tuning=opts.tuning)
        log_graph(record)
        graph.meta["laqat_record"] = record  # the hand-off adds how the graph was compiled
        return graph

    hand_off = functools.partial(compile_rewritten, chosen, compile_fingerprint(policy, opts.tuning),
                                 regional=opts.regional)
    prefixes = root_prefixes(gm, root)
    if root is not None and any(prefixes.values()):  # a graph traced inside a submodule: reused for its siblings
        compiled = ModuleSpecializedGraph(gm, example_inputs, root, prefixes, rewrite, hand_off)
    else:
        compiled = hand_off(rewrite(gm, prefixes), example_inputs)
    if policy_source == "option" or root is None:
        return compiled
    return PolicyGuardedGraph(compiled, root, policy)  # runs only for a module with this policy
