"""The serving pass: a serving profile's recurrence receives what the server's kernels receive.

vLLM computes q and k's l2 norm, the gate and beta itself, from the raw projections, in fp32 and with its own
formulas, differently in the prefill and in each decode step (docs/serving.md, "The server's pre-processing"). A
model computes them in its own code (transformers' torch fallbacks: the l2 norm in fp32 after a cast, beta's sigmoid
in the model's dtype; FLA: ``laqat::l2_norm``, ``laqat::softplus_gate``), so for every ``laqat::delta_rule_phased``
node whose spec has ``x.serving`` (GDN or KDA), this pass traces each input back to the model's formula and its raw
operand, and feeds the node the server's formula of that operand instead (kernels/decode/serving_inputs.py, GDN;
serving_kda_inputs.py, KDA):

    q, k    l2 norm of x (``laqat::l2_norm``, ``x * rsqrt(sum(x * x, -1) + eps)`` or ``x / sqrt(...)``)
            -> GDN laqat::serving_l2norm(x), KDA laqat::serving_kda_l2norm(x)
    g       ``-exp(A_log) * softplus(a + dt_bias)`` (``laqat::softplus_gate``, or torch with ``F.softplus`` or
            ``where(u > 20, u, log(1 + exp(u)))``), per value head (GDN) or per key channel (KDA)
            -> GDN laqat::serving_gdn_gate; KDA the node's raw gate: a, A_log, dt_bias as its operands (vLLM's
               prefill sums the gate's products inside its chunk cumsum, so the node computes the gate itself)
    beta    ``sigmoid(b)``                                                  -> laqat::serving_sigmoid(b)
    v       a widening cast of the model's v                                -> that v, in its dtype

Between the raw operand and the node only layout operations (permute, transpose, reshape, view, contiguous,
repeat_interleave over heads) and widening casts may stand; the layout operations are replayed on the raw operand,
the casts dropped (the server's kernels widen their loads themselves). An input that does not trace back to the
formula keeps the model's own pre-processing, with a compile-time warning naming it; the node's policy rules
(``la_compiler.explain``) say what was replaced.
"""
from __future__ import annotations

import operator
import warnings

import torch

from la_compiler.ir.delta_rule import LaqatMeta
from la_compiler.ir.delta_rule_phased import is_delta_rule_phased
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.decode import serving_inputs, serving_kda_inputs  # noqa: F401  (register the serving ops)

LAYOUT_METHODS = {"permute", "transpose", "reshape", "view", "contiguous", "repeat_interleave"}
LAYOUT_FUNCTIONS = {torch.permute, torch.transpose, torch.reshape, torch.repeat_interleave}
RESHAPES = {"view", "reshape", "contiguous", torch.reshape}  # layout operations that keep the element order
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
ARG = {"q": 0, "k": 1, "v": 2, "g": 3, "beta": 4}
SPEC_ARG = 10
RAW_GATE_ARGS = 11  # A_log, dt_bias: the node's raw gate


class ServingInputsWarning(UserWarning):
    """A serving profile's recurrence input keeps the model's own pre-processing (the server computes another)."""


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _dtype(node):
    v = _value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _cast_target(node: torch.fx.Node):
    """The dtype a ``to`` / ``float`` cast node converts to, or None if the node is no plain dtype cast."""
    if node.op == "call_method" and node.target == "float" and len(node.args) == 1:
        return torch.float32
    if node.op == "call_method" and node.target == "to":
        dtypes = [a for a in list(node.args[1:]) + [node.kwargs.get("dtype")] if isinstance(a, torch.dtype)]
        others = [a for a in node.args[1:] if not isinstance(a, torch.dtype)]
        if len(dtypes) == 1 and not others and set(node.kwargs) <= {"dtype", "memory_format"}:
            return dtypes[0]
    return None


def _is_widening(node: torch.fx.Node) -> bool:
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    target, source = _cast_target(node), _dtype(node.args[0])
    return target is not None and source is not None and (
        target == source or (target == torch.float32 and source in SIXTEEN_BIT))


def _is_layout(node: torch.fx.Node) -> bool:
    if not node.args:
        return False
    if node.op == "call_method" and node.target in LAYOUT_METHODS:
        return True
    return node.op == "call_function" and node.target in LAYOUT_FUNCTIONS


def _strip(node):
    """(the node below the chain of layout operations and widening casts above it, that chain top-down)."""
    chain = []
    while isinstance(node, torch.fx.Node) and (_is_layout(node) or _is_widening(node)):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _uncast(node):
    """The node below the widening casts above it."""
    while isinstance(node, torch.fx.Node) and _is_widening(node):
        node = node.args[0]
    return node


def _replay(graph, chain, x):
    """The chain's layout operations (not its casts) applied to ``x``, bottom-up, placed before the node."""
    for op in reversed(chain):
        if _is_widening(op):
            continue
        x = graph.create_node(op.op, op.target, (x, *op.args[1:]), dict(op.kwargs))
    return x


def _arg_of(node, name, index):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _sum_of_squares_plus_eps(add, x) -> bool:
    """``add`` is ``sum(x * x, dim=-1, keepdim=True) + 1e-6``."""
    if not (_is_call(add, operator.add, torch.add) and add.args[1] == 1e-6):
        return False
    s = add.args[0]
    if not _is_call(s, "sum"):
        return False
    dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
    keepdim = s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim")
    sq = s.args[0]
    return dim in (-1, [-1], (-1,)) and bool(keepdim) and _is_call(sq, operator.mul, torch.mul) and (
        sq.args[0] is x and sq.args[1] is x)


def _l2norm_operand(node):
    """x where ``node`` is x's l2 norm over the last dim (eps 1e-6), else None."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        inner = node.args[0]
        if _is_call(inner, torch.ops.laqat.l2_norm.default, torch.ops.laqat.l2_norm):
            return inner.args[0] if _dtype(inner.args[0]) in (*SIXTEEN_BIT, torch.float32) and (
                _arg_of(inner, "eps", 1) == 1e-6) and (
                _arg_of(inner, "output_dtype", 2) in (None, _dtype(inner.args[0]))) else None
    # x / sqrt(sum(x * x, dim=-1, keepdim=True) + 1e-6)
    if _is_call(node, operator.truediv, torch.div) and _is_call(node.args[1], torch.sqrt):
        x = node.args[0]
        return x if _sum_of_squares_plus_eps(node.args[1].args[0], x) else None
    # x * rsqrt(sum(x * x, dim=-1, keepdim=True) + 1e-6), either factor order
    if not _is_call(node, operator.mul, torch.mul):
        return None
    for x, r in (node.args, node.args[::-1]):
        if _is_call(r, torch.rsqrt) and _sum_of_squares_plus_eps(r.args[0], x):
            return x
    return None


def _neg_exp_times(node):
    """(A_log, the other factor) where ``node`` is ``-exp(A_log) * other`` (either order), A_log below its casts."""
    if not _is_call(node, operator.mul, torch.mul):
        return None
    for neg, other in (node.args, node.args[::-1]):
        if _is_call(neg, operator.neg, torch.neg) and _is_call(neg.args[0], "exp", torch.exp):
            return _uncast(neg.args[0].args[0]), other
    return None


def _softplus_operand(node):
    """u where ``node`` is softplus(u): ``F.softplus(u)`` or ``where(u > 20, u, log(1 + exp(u)))``."""
    if _is_call(node, torch.nn.functional.softplus, torch._C._nn.softplus):
        return node.args[0] if len(node.args) == 1 and not node.kwargs else None
    if not (_is_call(node, torch.where) and len(node.args) == 3):
        return None
    cond, u, log = node.args
    if not (_is_call(cond, operator.gt, torch.gt) and cond.args[0] is u and cond.args[1] == 20.0):
        return None
    if not _is_call(log, "log", torch.log):
        return None
    one_plus = log.args[0]
    if not (_is_call(one_plus, operator.add, torch.add) and 1.0 in one_plus.args):
        return None
    exp = one_plus.args[1] if one_plus.args[0] == 1.0 else one_plus.args[0]
    return u if _is_call(exp, "exp", torch.exp) and exp.args[0] is u else None


def _softplus_gate_operands(node):
    """(a, A_log, dt_bias or None) where ``node`` is ``-exp(A_log) * softplus(a + dt_bias)`` per value head."""
    if _is_call(node, torch.ops.laqat.softplus_gate.default, torch.ops.laqat.softplus_gate):
        a, A_log, dt_bias = node.args[:3]
        return (a, A_log, dt_bias) if _value(a) is not None and _value(a).dim() == 3 else None
    found = _neg_exp_times(node)
    u = None if found is None else _softplus_operand(found[1])
    if u is None:
        return None
    if _is_call(u, operator.add, torch.add):
        a, dt_bias = sorted(u.args, key=lambda x: -_value(x).dim() if _value(x) is not None else 0)
        return _uncast(a), found[0], _uncast(dt_bias)
    return _uncast(u), found[0], None


def _param(node):
    """The tensor below reshapes and widening casts that keep its element order (a parameter's view), else None."""
    top, chain = _strip(node)
    return top if all(_is_widening(op) or op.target in RESHAPES for op in chain) else None


def _kda_gate_operands(node):
    """(a, A_log, dt_bias or None, the layout chain from a to the formula) where ``node`` [B, T, HV, K] is
    ``-exp(A_log) * softplus(a + dt_bias)`` per key channel: A_log one per value head, dt_bias one per channel."""
    if _is_call(node, torch.ops.laqat.softplus_gate.default, torch.ops.laqat.softplus_gate):
        a, A_log, dt_bias = node.args[:3]
        return (a, A_log, dt_bias, []) if _value(a) is not None and _value(a).dim() == 4 else None
    found = _neg_exp_times(node)
    u = None if found is None else _softplus_operand(found[1])
    if u is None or _value(node) is None or _value(node).dim() != 4:
        return None
    HV, K = _value(node).shape[-2:]
    top, chain = _strip(u)  # transformers' Kimi-Linear adds dt_bias [HV K] before viewing the gate [.., HV, K]
    a, dt_bias = top, None
    if _is_call(top, operator.add, torch.add):
        full = [x for x in top.args if _value(x) is not None and _value(x).shape == _value(top).shape]
        if not full:
            return None
        a, dt_bias = full[0], _param(top.args[1] if full[0] is top.args[0] else top.args[0])
        if dt_bias is None or _value(dt_bias).numel() != HV * K:
            return None
    A_log = _param(found[0])
    if A_log is None or _value(A_log).numel() != HV:
        return None
    return _uncast(a), A_log, dt_bias, chain


def _sigmoid_operand(node):
    if node.op == "call_method" and node.target == "sigmoid" or (
            node.op == "call_function" and node.target in (torch.sigmoid, torch.nn.functional.sigmoid)):
        return node.args[0]
    return None


def _raw(node, matcher):
    """(operands, chain above the formula) where the input traces back to the formula, else None."""
    top, chain = _strip(node)
    found = matcher(top)
    return None if found is None else (found, chain)


def rewrite_serving_inputs(gm: torch.fx.GraphModule) -> int:
    """Returns how many inputs were replaced by the server's pre-processing."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_delta_rule_phased(node):
            continue
        spec = RecurrenceSpec.parse(node.args[SPEC_ARG])
        if spec.kind not in ("gdn", "kda") or "serving" not in dict(spec.extra):
            continue
        count += _rewrite_node(gm.graph, node, spec)
    return count


def _rewrite_node(graph, node, spec) -> int:
    kda = spec.kind == "kda"
    args = list(node.args)
    replaced, kept = [], []
    cu, prefill, valid = args[6], args[7], args[8]
    lengths = prefill.args[0]  # laqat::phase_lengths, which the phase pass put before the node
    operands = {}
    with graph.inserting_before(lengths):  # the raw operands in the node's layout
        v, chain = _strip(args[ARG["v"]])
        if chain and any(_is_widening(op) and _cast_target(op) != _dtype(op.args[0]) for op in chain):
            args[ARG["v"]] = _replay(graph, chain, v)
            replaced.append(f"v: in the model's {_dtype(v)} (the model's widening cast dropped)")
        for name in ("q", "k"):
            found = _raw(args[ARG[name]], _l2norm_operand)
            if found is None:
                kept.append(f"{name} (not an l2 norm over its last dim with eps 1e-6)")
            else:
                x = _uncast(found[0])
                operands[name] = (_replay(graph, found[1], x), _dtype(x))
        found = _raw(args[ARG["g"]], _kda_gate_operands if kda else _softplus_gate_operands)
        if found is None:
            kept.append(f"g (not -exp(A_log) * softplus(a + dt_bias) per {'key channel' if kda else 'value head'})")
        elif kda:
            (a, A_log, dt_bias, inner), chain = found
            operands["g"] = (_replay(graph, chain + inner, a), A_log, dt_bias)
        else:
            (a, A_log, dt_bias), chain = found
            operands["g"] = (_replay(graph, chain, a), A_log, dt_bias, None)
        found = _raw(args[ARG["beta"]], _sigmoid_operand)
        if found is None:
            kept.append("beta (not sigmoid(b))")
        else:
            operands["beta"] = _replay(graph, found[1], _uncast(found[0]))
    with graph.inserting_before(node):
        # the phase's token layout read from v, so that the model's own q, k pre-processing can go
        prefix = graph.call_function(torch.ops.laqat.serving_prefix.default, (args[ARG["v"]], cu, prefill, valid))
        l2norm = torch.ops.laqat.serving_kda_l2norm if kda else torch.ops.laqat.serving_l2norm
        for name in ("q", "k"):
            if name in operands:
                x, dtype = operands[name]
                args[ARG[name]] = graph.call_function(l2norm.default, (x, prefix))
                replaced.append(f"{name}: vLLM's l2 norm (prefill: stored in {dtype or 'its dtype'}; decode: fp32)")
        if "g" in operands and kda:  # the node computes the gate (its raw form: ir/delta_rule_phased.py)
            args[ARG["g"]], A_log, dt_bias = operands["g"]
            args[RAW_GATE_ARGS:] = [A_log, dt_bias]
            replaced.append("g: vLLM's KDA gate, from the raw gate, A_log and dt_bias in the node (fp32 per key "
                            "channel; the prefill's fused gate-cumsum kernel sums it, the decode computes it per "
                            "step)")
        elif "g" in operands:
            args[ARG["g"]] = graph.call_function(torch.ops.laqat.serving_gdn_gate.default,
                                                 (*operands["g"][:3], prefix))
            replaced.append("g: vLLM's softplus gate in fp32 (the prefill's and the decode's formula)")
        if "beta" in operands:
            args[ARG["beta"]] = graph.call_function(torch.ops.laqat.serving_sigmoid.default, (operands["beta"],))
            replaced.append("beta: sigmoid(b) in fp32")
    old = [node.args[i] for i in ARG.values()]
    lengths.args = (args[ARG["v"]], *lengths.args[1:])
    _set_inputs(graph, node, args, q_replaced=args[ARG["q"]] is not node.args[ARG["q"]])
    _erase_dead(graph, old)
    meta: LaqatMeta = node.meta["laqat"]
    meta.policy_rules.append("serving pre-processing: " + ("; ".join(replaced) or "nothing replaced"))
    if kept:
        message = (f"serving profile at {meta.module}: {', '.join(kept)}: these inputs keep the model's own "
                   f"pre-processing, which vLLM's kernels do not compute (docs/serving.md)")
        meta.policy_rules.append(message)
        warnings.warn(message, ServingInputsWarning, stacklevel=2)
    return len(replaced)


def _erase_dead(graph, nodes):
    """The model's pre-processing that no node reads any more (pure operations only)."""
    todo, erased = [n for n in nodes if isinstance(n, torch.fx.Node)], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.target is operator.setitem or (
                isinstance(n.target, str) and n.target.endswith("_")):
            continue
        todo.extend(a for a in n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def _set_inputs(graph, node, args, q_replaced: bool):
    """The node's new inputs. Its output follows q's dtype, fp32 once q is the server's; where the graph read
    another dtype before, a cast back to it follows (round to nearest even, as the server's store)."""
    old_dtype = _output_dtype(node)
    node.args = tuple(args)
    if not q_replaced or old_dtype in (None, torch.float32):
        return
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
            with graph.inserting_after(user):
                cast = graph.call_method("to", (user, old_dtype))
            user.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)


def _output_dtype(node):
    """The dtype of the node's output as the graph reads it: its recorded value's, else its q's (the op's rule)."""
    value = _value(node)
    if isinstance(value, (tuple, list)) and isinstance(value[0], torch.Tensor):
        return value[0].dtype
    return _dtype(node.args[0])
