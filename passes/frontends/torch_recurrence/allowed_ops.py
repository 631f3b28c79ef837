"""Every op accounted for: the ops a region may contain, as data, each with why it preserves the
delta-rule algebra.

The semantic check (``semantics.py``) is a randomized identity test: it can tell a wrong sign
or a wrong index from the delta rule, but an op that acts only on some values (a clamp that
bites at |S| > 1e3, ``nan_to_num``, a bf16 round-trip, a ``detach`` that changes no forward
value) passes it at generic small inputs. So before any probe runs, every live node of the
region must be one of the ops below; anything else is a near miss whose reason names the op
and its source line.

Ops are named as ``op_name`` spells them: a method name, or a function's ``__name__``
(``operator.mul`` -> ``mul``, ``torch._C._nn.pad`` -> ``pad``). *Data-independent* nodes (no
region input among their ancestors: masks, ``eye``, ``zeros``) may use the ``CONSTANT_ONLY`` ops
too: their value is a fixed tensor, which the identity test checks like any other part of the
region. Casts must widen (to fp32 or wider) except on an input's entry chain (``entry.py``:
replayed exactly in front of the IR node) and in the write of a step's output into a narrower
output buffer (one rounding of the output, which the IR's output cast performs identically).
"""
from __future__ import annotations

import re

import torch

from la_compiler.error_base import LaqatError
from la_compiler.passes.frontends.torch_recurrence.dataflow import is_inplace_write, tensor_value, written_base
from la_compiler.passes.frontends.torch_recurrence.entry import _is_template_use

# op -> why it preserves the algebra (the delta rule is polynomial in q, k, v, beta, S, exp(g))
ALLOWED = {
    # arithmetic: the delta rule itself
    "add": "sum of terms of the update (S + k u^T, v - S^T k, inter + intra)",
    "sub": "the delta v - S^T k, log-decay differences",
    "mul": "products of the recurrence (decay * S, beta * delta, scales)",
    "truediv": "division by a constant or a normalizer of the algebra",
    "div": "division by a constant or a normalizer of the algebra",
    "neg": "sign of a term (-A of the WY system)",
    "iadd": "S += x, functional in the graph (its result is read)",
    "isub": "S -= x, functional in the graph",
    "imul": "S *= x, functional in the graph",
    "rsub": "c - x",
    # contractions
    "matmul": "S^T k, k u^T, q S as matrix products",
    "bmm": "the same over flattened batch and heads",
    "einsum": "the same contractions by subscript (strings checked by the probes)",
    "sum": "contraction by broadcast multiply + sum",
    "linalg_solve_triangular": "the unit-triangular WY system (I + A)^-1 of the chunked form",
    "mm": "a matrix product (one head, or heads flattened)", "mv": "a matrix-vector product (S^T k)",
    "outer": "k u^T for one head", "tensordot": "a contraction by dims",
    "baddbmm": "S + k u^T as one fused batched product", "addmm": "S + k u^T as one fused product",
    "addcmul": "S + c * k * u as one fused op",
    # the gate
    "exp": "exp of the log-decay g (or of its cumulative sums)",
    "log": "log of a pre-exponentiated decay",
    "cumsum": "cumulative log-decay within a chunk",
    # layout: values unchanged, re-indexed
    **{op: "re-indexes values, no arithmetic (heads, chunks, D last)"
       for op in ("reshape", "view", "permute", "transpose", "t", "unsqueeze", "squeeze", "contiguous",
                  "flatten", "unflatten")},
    "clone": "copies values unchanged",
    "expand": "broadcasts a value over heads or positions", "expand_as": "broadcasts a value over heads or positions",
    "repeat_interleave": "grouped heads: head j of HV reads head j // G",
    "repeat": "tiles values (a head mapping the head-locality probe checks)",
    "getitem": "per-step and per-chunk slices", "select": "per-step slices", "unbind": "per-step slices",
    "stack": "collects the per-step outputs", "cat": "collects the per-step outputs",
    "setitem": "writes a step's output (or a row of the WY inverse) into a buffer",
    "pad": "zero padding of T to a chunk multiple",
    "roll": "re-indexing (the head-locality probe checks which head a step reads)",
    # masks and structure with a data-independent mask (checked below)
    "tril": "causal mask of the intra-chunk terms", "triu": "causal mask of the intra-chunk terms",
    "masked_fill": "causal mask (the mask must be data-independent)",
    "masked_fill_": "causal mask, in place on an intermediate (the mask must be data-independent)",
    "where": "causal mask (the condition must be data-independent)",
    # factories: constants of the algebra
    "zeros": "the zero initial state or output buffer", "zeros_like": "a zero buffer",
    "new_zeros": "a zero state", "ones": "mask construction", "ones_like": "mask construction",
    "eye": "the identity of the WY system", "arange": "mask construction",
    # casts that widen (narrowing ones are checked below)
    "to": "a cast to fp32 or wider (the probe runs in fp64)", "float": "a cast to fp32",
    "double": "a cast to fp64", "type": "a cast to fp32 or wider",
}
# ops that build masks: allowed on data-independent values only (named in the refusal)
CONSTANT_ONLY = {
    "gt", "ge", "lt", "le", "eq", "ne", "logical_not", "invert", "and_", "or_", "bitwise_not", "bool",
    "full", "full_like", "new_ones", "new_full", "diag", "diag_embed", "tril_", "triu_", "fill_",
}
# ops refused with a specific explanation (anything else unlisted: "not an op of the algebra")
REFUSED = {
    **{op: "saturates: it changes values only beyond a threshold, which small random probes never reach"
       for op in ("clamp", "clamp_min", "clamp_max", "clip", "hardtanh", "relu", "relu6", "minimum", "maximum",
                  "max", "min", "amax", "amin", "abs", "sign", "sgn", "heaviside")},
    **{op: "rounds values (not the exact recurrence)" for op in ("round", "floor", "ceil", "trunc", "frac")},
    **{op: "replaces or tests non-finite values (the delta rule propagates them)"
       for op in ("nan_to_num", "nan_to_num_", "isnan", "isinf", "isfinite", "isposinf", "isneginf")},
    **{op: "cuts the gradient: the region's backward is not the delta rule's"
       for op in ("detach", "detach_", "requires_grad_", "_set_grad_enabled", "stop_gradient")},
    **{op: "draws random numbers" for op in ("rand", "randn", "rand_like", "randn_like", "randint", "bernoulli",
                                             "dropout", "normal", "normal_", "uniform_", "multinomial",
                                             "native_dropout", "feature_dropout")},
    **{op: "is data-dependent control or indexing" for op in ("item", "nonzero", "any", "all", "tolist", "cond",
                                                              "while_loop", "argmax", "argmin", "sort", "topk",
                                                              "masked_select", "index_select", "gather",
                                                              "scatter", "scatter_add", "index_put")},
    **{op: "rounds to a narrower dtype" for op in ("bfloat16", "half")},
    **{op: "a nonlinearity the delta rule does not contain"
       for op in ("tanh", "sigmoid", "softplus", "silu", "gelu", "softmax", "log_softmax", "sqrt", "rsqrt",
                  "pow", "reciprocal", "square", "sin", "cos", "expm1", "log1p", "logsigmoid", "elu")},
}
GRAD_MODE = {torch._C._set_grad_enabled}
_NARROW = {torch.bfloat16, torch.float16}


def op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return "div" if name in ("truediv", "div") else name
    return node.op


def where_from(node: torch.fx.Node) -> str:
    """``file.py:LINE (source)`` from the node's stack trace, innermost frame."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)', trace)
    if not frames:
        return f"node {node.name}"
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} ({code.strip()})"


CASTS = {"to", "type", "float", "double", "half", "bfloat16"}
# ops whose result is exact in any dtype (they move, select or zero values): allowed on bf16 / fp16 data
EXACT_IN_ANY_DTYPE = {
    "reshape", "view", "permute", "transpose", "t", "unsqueeze", "squeeze", "contiguous", "clone", "flatten",
    "unflatten", "expand", "expand_as", "repeat_interleave", "getitem", "select", "unbind", "stack", "cat",
    "setitem", "pad", "roll", "tril", "triu", "masked_fill", "masked_fill_", "where", "neg", "zeros_like",
    "new_zeros", "zeros", "ones", "eye", "arange", "ones_like",
} | CASTS
MASKING = {"masked_fill": 1, "masked_fill_": 1, "where": 0}  # op -> position of its condition


def _narrows(node: torch.fx.Node) -> bool:
    """A cast to fewer bits, to another 16-bit format, or to a non-floating dtype."""
    out = tensor_value(node)
    src = tensor_value(node.all_input_nodes[0]) if node.all_input_nodes else None
    if out is None or src is None or out.dtype == src.dtype or not src.dtype.is_floating_point:
        return False
    if not out.dtype.is_floating_point:
        return True
    return torch.finfo(out.dtype).bits <= torch.finfo(src.dtype).bits


class OpRefused(LaqatError):
    """A region node the algebra does not allow (internal: the frontend reports it as a near miss)."""

    def __init__(self, reason: str, node: torch.fx.Node):
        super().__init__(reason)
        self.reason, self.node = reason, node


def check_region_ops(flow, region, state_nodes: set, chain_nodes: set) -> None:
    """Raises ``OpRefused`` naming the first node (in graph order) that the algebra does not allow.
    ``state_nodes``: the loop-carried states; ``chain_nodes``: the inputs' entry chains (``entry.py``)."""

    inside = region.nodes
    constant: dict = {}
    for n in region.ordered(flow):
        constant[n] = all(a in inside and constant.get(a, False) for a in flow.graph.predecessors(n)
                          if not _is_template_use(n, a))
        why = _refusal(n, constant, state_nodes, chain_nodes, region)
        if why:
            raise OpRefused(_reason(n, why, region), n)
    _check_grad_islands(flow, region)


def _reason(n: torch.fx.Node, why: str, region) -> str:
    if op_name(n) in CONSTANT_ONLY:  # a data comparison: name the mask op that consumes it
        mask = next((u for u in n.users if u in region.nodes and op_name(u) in MASKING), None)
        if mask is not None:
            return (f"`{_display(mask)}` at {where_from(mask)} masks by a value-dependent condition "
                    f"(`{_display(n)}` of data values); the region is not the plain delta rule")
    if n.op == "call_function" and n.target in GRAD_MODE:
        under = next((u for u in _following(n) if u.meta.get("stack_trace")), n)
        mode = "torch.no_grad()" if not n.args[0] else "torch.enable_grad()"
        return f"`{mode}` at {where_from(under)} {why}; the region is not the plain delta rule"
    return f"`{_display(n)}` at {where_from(n)} {why}; the region is not the plain delta rule"


def _following(n: torch.fx.Node, limit: int = 8):
    cur = n.next
    for _ in range(limit):
        if cur.op == "root":
            return
        yield cur
        cur = cur.next


def _display(n: torch.fx.Node) -> str:
    name = n.meta.get("laqat_inplace", op_name(n))
    if name in ("to", "type"):
        v = tensor_value(n)
        return f"{name}({v.dtype})" if v is not None else name
    return name


def _refusal(n, constant, state_nodes, chain_nodes, region) -> str | None:
    if n in chain_nodes:
        return None  # an input's layout ops, casts and scalars: replayed exactly in front of the IR node
    name = op_name(n)
    if is_inplace_write(n) and written_base(n) in state_nodes:
        return "modifies the state in place (a partial or in-place update is not the delta rule)"
    if _mutates(n) and _aliases_input(n.args[0], region):
        return (f"modifies the region's input {_root(n.args[0], region).name} in place (the caller sees that "
                f"mutation; the IR node would not make it)")
    if name in REFUSED and not (constant[n] and name not in _ALWAYS_REFUSED):
        return REFUSED[name]
    if name in CASTS and _narrows(n):
        return "rounds to a narrower dtype (casts inside the recurrence must widen)"
    if name == "setitem":
        base, x = n.args[0], n.args[2] if len(n.args) > 2 else None
        vb, vx = tensor_value(base), tensor_value(x) if isinstance(x, torch.fx.Node) else None
        if vb is not None and vx is not None and vb.dtype != vx.dtype and vx.dtype.is_floating_point \
                and base is not region.body.o_buffer and (not vb.dtype.is_floating_point
                                                          or torch.finfo(vb.dtype).bits <= torch.finfo(vx.dtype).bits):
            return "rounds to a narrower dtype (a write into a narrower buffer)"
        return None
    if name in MASKING:
        cond = n.args[MASKING[name]] if len(n.args) > MASKING[name] else None
        if isinstance(cond, torch.fx.Node) and not constant.get(cond, False):
            return "masks by a value-dependent condition (a causal mask must not depend on the data)"
        return None
    if constant[n]:
        return None  # a constant is a fixed tensor, which the identity test sees like any other part
    if name in ALLOWED:
        out = tensor_value(n)
        if out is not None and out.dtype in _NARROW and name not in EXACT_IN_ANY_DTYPE:
            return f"computes in {str(out.dtype).replace('torch.', '')} (it rounds; the recurrence must run in fp32 or wider)"
        return None
    if name in CONSTANT_ONLY:
        return "compares or masks data values (a value-dependent mask)"
    return "is not an op of the delta-rule algebra (docs/torch_frontend.md lists the allowed ones)"


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "setitem"}
_ALIASING = {"view", "reshape", "transpose", "permute", "t", "getitem", "select", "narrow", "unsqueeze", "squeeze",
             "expand", "expand_as", "flatten", "unflatten", "view_as", "contiguous", "to", "type", "float",
             "detach", "as_strided", "diagonal", "movedim", "swapaxes"}


def _mutates(n: torch.fx.Node) -> bool:
    name = op_name(n)
    if n.op == "call_function":
        return name in _INPLACE_OPERATORS and bool(n.args) and isinstance(n.args[0], torch.fx.Node)
    return n.op == "call_method" and name.endswith("_") and not name.startswith("_") and \
        name not in ("requires_grad_",) and bool(n.args) and isinstance(n.args[0], torch.fx.Node)


def _root(x: torch.fx.Node, region):
    """Back through ops that may return a view, to the tensor whose storage ``x`` may share."""
    while x in region.nodes and x.op in ("call_method", "call_function") and op_name(x) in _ALIASING \
            and x.args and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x


def _aliases_input(x, region) -> bool:
    """Whether ``x`` may share storage with a tensor the caller passed in (an output buffer the caller passed is
    part of the region, and still the caller's)."""
    if not isinstance(x, torch.fx.Node):
        return False
    root = _root(x, region)
    return root not in region.nodes or root.op in ("placeholder", "get_attr")


# refused even on constants: they make the region non-deterministic or cut gradients
_ALWAYS_REFUSED = {op for op, why in REFUSED.items() if why.startswith(("draws", "cuts"))}


def _check_grad_islands(flow, region) -> None:
    """A region node computed under ``torch.no_grad()`` (Dynamo records the mode switches as
    ``torch._C._set_grad_enabled`` calls around it) has no gradient in the original program."""
    first = min(flow.pos[n] for n in region.nodes)
    last = max(flow.pos[n] for n in region.nodes)
    enabled, switch = True, None
    for n in flow.nodes[:last + 1]:
        if n.op == "call_function" and n.target in GRAD_MODE:
            enabled, switch = bool(n.args[0]), n
            continue
        if not enabled and flow.pos[n] >= first and n in region.nodes and n not in flow.dead:
            raise OpRefused(f"`torch.no_grad()` at {where_from(n)} {REFUSED['_set_grad_enabled']}; "
                            f"the region is not the plain delta rule", n)
