"""Every step reads its own token: what the steps of a token loop read that depends on the step.

``loops.py`` proves that the steps are one program up to their time slices: the same ops, shapes and
loop invariants, every literal equal except the time index of a per-step slice or output write. What
a step then reads that changes from step to step is its time slices ``x[:, t]``. The algebra check
(``semantics.py``) runs a token loop's first two steps only, so each slice must be the step's own
token of a sequence input for those two steps to stand for all of them:

- a slice of an input of the IR node (a frontier tensor: q, k, v, g, beta after their entry chains)
  is checked by the algebra, whatever computed it outside the region;
- a slice of a tensor the region computes before the loop is accepted when every op on its way
  from the inputs maps token t to token t (elementwise arithmetic, casts, layout ops: index maps
  that the two probed steps pin down), and every constant on that way is one value everywhere;
- a slice of a constant (``keep = (torch.arange(T) < T // 2).float()``; ``keep[t]``) is evaluated:
  it must be the same at every step.

Anything else is a near miss naming the step, the value it reads and the source line. Loops over
chunks need none of this: their algebra check runs the whole region on every token.
"""
from __future__ import annotations

import torch

from la_compiler.passes.frontends.torch_recurrence.allowed_ops import op_name, where_from
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, is_inplace_write, tensor_value
from la_compiler.passes.frontends.torch_recurrence.entry import _is_template_use
from la_compiler.passes.frontends.torch_recurrence.loops import NotARecurrence
from la_compiler.passes.frontends.torch_recurrence.probe import ProbeError, run_nodes
from la_compiler.passes.frontends.torch_recurrence.slices import time_slices

# ops that map token t of their inputs to token t of their output: elementwise arithmetic and casts, and
# index maps without data (a layout op reads one fixed position per output position; the two probed steps
# pin down which)
TOKEN_WISE = {
    "add", "sub", "mul", "div", "truediv", "neg", "rsub", "exp", "log", "iadd", "isub", "imul",
    "to", "float", "double", "type", "half", "bfloat16",
    "reshape", "view", "permute", "transpose", "t", "unsqueeze", "squeeze", "contiguous", "clone", "flatten",
    "unflatten", "expand", "expand_as", "repeat_interleave", "getitem", "select", "narrow", "unbind", "pad",
}


def _op(n: torch.fx.Node) -> str:
    return op_name(n)


def _data_independent(flow: Dataflow, region) -> dict:
    """Region nodes none of whose ancestors is an input of the region (a tensor lending only its shape or
    dtype does not count): fixed tensors."""

    constant: dict = {}
    for n in region.ordered(flow):
        constant[n] = all(a in region.nodes and constant.get(a, False) for a in flow.graph.predecessors(n)
                          if not _is_template_use(n, a))
    return constant


def _evaluate(flow: Dataflow, region, node: torch.fx.Node, reader: torch.fx.Node, constant: dict,
              unit_inputs: bool = False):
    """The value of a fixed tensor of the region as ``reader`` reads it (after the in-place writes before it:
    ``w = torch.ones(T); w[2:] = 0.5``); None where it cannot be computed at compile time. ``unit_inputs``: any
    region node, computed with every input of the region set to ones."""

    def wanted(a):
        return a in region.nodes and a not in flow.dead if unit_inputs else constant.get(a, False)

    needed, stack = {node}, [node] + [a for a in flow.graph.predecessors(reader) if wanted(a)]
    needed.update(stack)
    while stack:
        n = stack.pop()
        for a in flow.graph.predecessors(n):
            if a not in needed and wanted(a):
                needed.add(a)
                stack.append(a)
    env = {}
    for n in needed:
        for a in n.all_input_nodes:
            if a not in needed:  # an input (ones) or a template (only its dtype, device and shape are read)
                v = tensor_value(a)
                if v is None or not all(isinstance(s, int) for s in v.shape):
                    return None
                env[a] = torch.ones(tuple(v.shape), dtype=v.dtype, device=v.device)
    try:
        out = run_nodes(sorted(needed, key=flow.pos.__getitem__), env)
    except ProbeError:
        return None
    value = out.get(node)
    return value if isinstance(value, torch.Tensor) else None


def _first_difference(value: torch.Tensor, s, first: int, last: int):
    """(t, slice at t, slice at first) of the first step whose slice differs from the first step's, or None."""
    v0 = _slice_at(value, s, first)
    for t in range(first + 1, last + 1):
        vt = _slice_at(value, s, t)
        if not torch.equal(vt, v0):
            return t, vt, v0
    return None


def _show(x: torch.Tensor) -> str:
    if x.numel() == 1:
        return f"{x.item() + 0.0:g}"
    return f"a {tuple(x.shape)} slice (first entries {[round(float(v), 6) for v in x.flatten()[:3]]})"


def _slice_at(value: torch.Tensor, s, index: int) -> torch.Tensor:
    return value.narrow(s.dim, index, 1) if s.keepdim else value.select(s.dim, index)


def check_step_inputs(flow: Dataflow, region) -> None:
    """Raises ``NotARecurrence`` where a step of a token loop reads a slice that is not its own token of a
    sequence input (module docstring)."""

    if region.chunk != 1:
        return
    body = region.body
    in_windows = set(body.nodes())
    constant = _data_independent(flow, region)
    checked: dict = {}
    for w, win in enumerate(body.windows):
        step = body.loop.first + w
        for n in win:
            if n is None:
                continue
            for s in time_slices(n):
                src = s.source
                if src in in_windows or s.index != step or src not in region.nodes:
                    continue  # a loop-local value, a fixed index (the same every step), or an input of the IR node
                if constant.get(src, False):
                    why = _constant_slices(flow, region, body, s, src, n, constant)
                else:
                    if src not in checked:
                        checked[src] = _token_wise(flow, region, src, constant)
                    why, fixed = checked[src]
                    if fixed is not None:
                        why = _schedule_reason(flow, region, body, s, src, n, constant, fixed)
                    elif why:
                        why = (f"step {step} reads {src.name}[{step}] along dim {s.dim} at {where_from(n)}, which "
                               f"{why}")
                if why:
                    raise NotARecurrence(why, nodes=[n.name])


def _constant_slices(flow, region, body, s, src, node, constant) -> str | None:
    """A constant sliced per step: the same values at every step, else the first step that differs."""

    value = _evaluate(flow, region, src, node, constant)
    first = body.loop.first
    where = f"{src.name} ({where_from(src)})"
    if value is None:
        return (f"step {first} reads {src.name}[{first}] at {where_from(node)}: a constant {where} that laqat cannot "
                f"evaluate at compile time, so it cannot prove every step reads the same value")
    differs = _first_difference(value, s, first, body.loop.last)
    if differs is None:
        return None
    t, vt, v0 = differs
    return (f"step {t} reads {src.name}[{t}] = {_show(vt)} at {where_from(node)} where step {first} reads "
            f"{_show(v0)}: the constant {where} depends on the step (a per-position mask, cap or schedule), so the "
            f"steps are not one recurrence")


def _schedule_reason(flow, region, body, s, src, node, constant, fixed) -> str:
    """A per-token tensor the region computes with a constant that differs by position: the first step at which
    the slices differ with every input set to ones, where that shows it."""

    what = (f"is computed from the constant {fixed.name} ({where_from(fixed)}), whose values differ by position (a "
            f"per-position mask, cap or schedule): the steps are not one recurrence")
    value = _evaluate(flow, region, src, node, constant, unit_inputs=True)
    differs = _first_difference(value, s, body.loop.first, body.loop.last) if value is not None else None
    if differs is None:
        first = body.loop.first
        return f"step {first} reads {src.name}[{first}] along dim {s.dim} at {where_from(node)}, which {what}"
    t, vt, v0 = differs
    return (f"step {t} reads {src.name}[{t}] at {where_from(node)}, which {what}; with every input 1, step {t} reads "
            f"{_show(vt)} where step {body.loop.first} reads {_show(v0)}")


def _token_wise(flow, region, src, constant) -> tuple[str | None, torch.fx.Node | None]:
    """(None, None) when ``src`` is computed from the region's inputs by token-wise ops and uniform constants
    only; else why not (the text continues "step t reads src[t] at ..., which ..."), or a constant that differs
    by position."""

    seen, stack = {src}, [(src, None)]
    while stack:
        n, reader = stack.pop()
        if n not in region.nodes:
            continue  # an input of the IR node
        if constant.get(n, False):
            if is_inplace_write(n):
                continue  # its reader sees its effect on the written tensor
            value = _evaluate(flow, region, n, reader, constant) if reader is not None else None
            if value is None:
                return f"is computed from the constant {n.name} ({where_from(n)}), which laqat cannot evaluate", None
            if value.numel() > 1 and not bool((value == value.flatten()[0]).all()):
                return None, n
            continue
        name = _op(n)
        index = n.args[1] if name == "getitem" and len(n.args) > 1 else None
        if name not in TOKEN_WISE or (name == "getitem" and _indexes_by_tensor(index)):
            return (f"is computed before the loop by `{name}` at {where_from(n)}, which is not a per-token op: a "
                    f"step may read only its own token's slice of a sequence input"), None
        for a in flow.graph.predecessors(n):
            if a not in seen and not _is_template_use(n, a):
                seen.add(a)
                stack.append((a, n))
    return None, None


def _indexes_by_tensor(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(it, (torch.fx.Node, list, torch.Tensor)) for it in items)

