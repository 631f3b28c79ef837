"""FLA frontend: FLA's GDN/KDA op calls become laqat IR nodes while Dynamo traces.

Imported (once) by ``install_trace_frontends()`` where ``fla`` imports. It registers
``torch._dynamo.substitute_in_graph`` replacements, so that wherever a traced program calls
one of these FLA functions (under any alias: the replacement is keyed on the function
object), Dynamo traces the replacement instead:

    fla.ops.gated_delta_rule.chunk_gated_delta_rule (= chunk_gdn)          -> laqat::delta_rule (gdn)
    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule (= ..._gdn)  -> laqat::delta_rule (gdn, or kda with gk)
    fla.ops.kda.chunk_kda, fla.ops.kda.fused_recurrent_kda                  -> laqat::delta_rule (kda)
    fla.modules.causal_conv1d.causal_conv1d (= fla.modules.convolution.*)  -> laqat::causal_conv1d
    fla.modules.norm.fused_norm_gate.rms_norm_gated / layer_norm_gated     -> laqat::layer_norm_gated
    fla.modules.norm.layernorm.rms_norm / layer_norm                       -> laqat::layer_norm
    fla.modules.activations.swiglu_linear (GatedMLP's fused SwiGLU)        -> torch ops

Each recurrence replacement validates its arguments, emits the pre-processing FLA fuses
into its kernels (l2norm, gate, beta activation: ``fla_preprocess``) as torch ops, calls the
IR op once and returns what FLA returns: ``(o, final_state or None)``, o in q's dtype (chunk)
or v's dtype (fused_recurrent), the final state in fp32. chunk and fused_recurrent compute
the same recurrence, so both become the same node.

An argument the IR cannot express is refused at compile time with an
``UnsupportedArgumentError`` naming it, never dropped: Dynamo would otherwise fall back to
running FLA's original function, i.e. silently different numerics. The error is raised from
an ``assume_constant_result`` helper, which Dynamo runs while tracing, so it aborts the
compilation (Dynamo reports it as ``InternalTorchDynamoError: UnsupportedArgumentError: ...``)
with and without ``fullgraph``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from la_compiler.passes.frontends import fla_conv_op, fla_norm_op  # noqa: F401  (registers the laqat ops)
from la_compiler.passes.frontends.fla_preprocess import beta_activation, gdn_gate, kda_gate, l2norm

GDN_CHUNK_SIZES = (16, 32, 64)  # what FLA's chunk_gated_delta_rule accepts
KDA_CHUNK_SIZES = (32, 64)  # what FLA's chunk_kda accepts


class UnsupportedArgumentError(ValueError):
    """An FLA call argument (or value) that the laqat IR cannot express, or that FLA itself rejects."""


@torch._dynamo.assume_constant_result
def _refuse(function: str, message: str) -> bool:
    raise UnsupportedArgumentError(f"laqat FLA frontend, {function}(): {message}")


def _require(ok: bool, function: str, message: str) -> None:
    if not ok:
        _refuse(function, message)


@torch._dynamo.assume_constant_result
def _spec_string(kind: str, state: str, chunk: int) -> str:
    from la_compiler.spec import RecurrenceSpec

    return RecurrenceSpec(kind=kind, src="fla", state=state, chunk=chunk).to_string()


def _pop_state_v_first(function: str, state_v_first: bool, kwargs: dict) -> bool:
    """FLA's deprecated alias ``transpose_state_layout`` of ``state_v_first``."""
    if "transpose_state_layout" in kwargs:
        _require(not state_v_first, function, "pass `state_v_first` or the deprecated `transpose_state_layout`, "
                                              "not both")
        return bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def _refuse_unknown(function: str, kwargs: dict) -> None:
    for name in kwargs:
        _refuse(function, f"argument `{name}` is not supported by laqat (FLA would ignore or reject it)")


def _refuse_set(function: str, **arguments) -> None:
    """Arguments that must keep their default (None / False) for the IR to express the call."""
    for name, value in arguments.items():
        _require(value is None or value is False, function, f"argument `{name}` is not supported by laqat "
                                                            f"(got a non-default value)")


def _check_heads(function: str, q, k, v) -> None:
    _require(q.dim() == 4 and k.shape == q.shape, function,
             f"q and k must both be [B, T, H, K], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    _require(v.dim() == 4 and v.shape[:2] == q.shape[:2], function, f"v must be [B, T, HV, V], got {tuple(v.shape)}")
    _require(v.shape[2] % q.shape[2] == 0, function,
             f"num_v_heads (HV={v.shape[2]}) must be divisible by num_heads (H={q.shape[2]})")


def _check_varlen(function: str, q, initial_state, cu_seqlens) -> None:
    if cu_seqlens is None:
        return
    _require(q.shape[0] == 1, function, f"with `cu_seqlens` the batch size must be 1, got {q.shape[0]}")
    _require(initial_state is None or initial_state.shape[0] == cu_seqlens.shape[0] - 1, function,
             "`initial_state` must hold one state per sequence of `cu_seqlens`")


def _check_beta(function: str, beta, v, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    _require(not allow_neg_eigval or use_beta_sigmoid_in_kernel, function,
             "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    _require(beta.dim() == 3, function, f"argument `beta` must be [B, T, HV] (one beta per head); got shape "
                                        f"{tuple(beta.shape)} (per-value beta is not supported by laqat)")


def _delta_rule(kind, q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                chunk_size):
    if scale is None:
        scale = k.shape[-1] ** -0.5
    spec = _spec_string(kind, "vk" if state_v_first else "kv", chunk_size)
    o, final_state = torch.ops.laqat.delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), spec)
    return o, (final_state if output_final_state else None)


# ---- GDN ------------------------------------------------------------------------------------
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    fn = "chunk_gated_delta_rule"
    kwargs = dict(kwargs)
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context)
    _require(chunk_size in GDN_CHUNK_SIZES, fn, f"`chunk_size` must be one of {GDN_CHUNK_SIZES}, got {chunk_size}")
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    _require(not use_gate_in_kernel or A_log is not None, fn, "`A_log` must be given with `use_gate_in_kernel=True`")
    _require(g.dim() == 3, fn, f"argument `g` must be [B, T, HV], got {tuple(g.shape)}")

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return _delta_rule("gdn", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                       cu_seqlens, chunk_size)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    fn = "fused_recurrent_gated_delta_rule"
    kwargs = dict(kwargs)
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, gv=gv)
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    B, T, HV = v.shape[:3]
    if beta is None:  # FLA: beta = 1 (before its optional sigmoid)
        beta = torch.ones(B, T, HV, dtype=torch.float32, device=v.device)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        _require(A_log is not None, fn, "`A_log` must be given with `use_gate_in_kernel=True`")
        _require(g is not None, fn, "`g` (the raw gate) must be given with `use_gate_in_kernel=True`")

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, keep_fp32=True), l2norm(k, keep_fp32=True)
    if g is not None and use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if gk is not None:  # per-key-channel decay: a KDA recurrence; a scalar g on top multiplies in
        kind, g = "kda", (gk if g is None else gk.float() + g.float().unsqueeze(-1))
    else:
        kind = "gdn"
        g = g if g is not None else torch.zeros(B, T, HV, dtype=torch.float32, device=v.device)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    o, final_state = _delta_rule(kind, q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                                 cu_seqlens, 64)
    return o.to(v.dtype), final_state


# ---- KDA ------------------------------------------------------------------------------------
def _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    if not use_gate_in_kernel:
        return g
    _require(A_log is not None or lower_bound is not None, fn,
             "`A_log` must be given with `use_gate_in_kernel=True` unless `lower_bound` is set")
    return kda_gate(g, A_log, dt_bias, lower_bound)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    fn = "chunk_kda"
    kwargs = dict(kwargs)
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context, return_intermediate_states=return_intermediate_states,
                use_graph=use_graph, max_num_seqs=max_num_seqs)
    _require(chunk_size in KDA_CHUNK_SIZES, fn, f"`chunk_size` must be one of {KDA_CHUNK_SIZES}, got {chunk_size}")
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    _require(initial_state is None or initial_state.dtype == torch.float32, fn,
             "`initial_state` must be float32 (as FLA requires)")
    _require(tuple(g.shape) == tuple(v.shape[:3]) + (q.shape[-1],), fn,
             f"argument `g` must be [B, T, HV, K], got {tuple(g.shape)}")
    if safe_gate and use_gate_in_kernel:
        _require(lower_bound is not None and -5 <= lower_bound < 0, fn,
                 f"`safe_gate=True` with `use_gate_in_kernel=True` needs `lower_bound` in [-5, 0), got {lower_bound}")

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return _delta_rule("kda", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                       cu_seqlens, chunk_size)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    fn = "fused_recurrent_kda"
    kwargs = dict(kwargs)
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    _refuse_unknown(fn, kwargs)
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    _require(tuple(g.shape) == tuple(v.shape[:3]) + (q.shape[-1],), fn,
             f"argument `g` must be [B, T, HV, K], got {tuple(g.shape)}")

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, keep_fp32=True), l2norm(k, keep_fp32=True)
    g = _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    o, final_state = _delta_rule("kda", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                                 cu_seqlens, 64)
    return o.to(v.dtype), final_state


# ---- the graph-breaking helpers of FLA's layers ------------------------------------------------
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    fn = "causal_conv1d"
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context)
    _require(weight is not None, fn, "argument `weight` is required by laqat")
    _require(activation in fla_conv_op.ACTIVATIONS, fn,
             f"argument `activation` must be one of {fla_conv_op.ACTIVATIONS}, got {activation!r}")
    _require(backend in ("triton", "cuda", "mix"), fn, f"unsupported `backend` {backend!r}")
    _check_varlen(fn, x, None, cu_seqlens)
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(x.shape[0], x.shape[1], -1)
    if residual is not None:
        residual = residual.reshape(x.shape)
    y, final_state = torch.ops.laqat.causal_conv1d(x, weight, bias, residual, initial_state, cu_seqlens, activation,
                                                   bool(output_final_state))
    return y.view(shape), (final_state if output_final_state else None)


def _add_residual(x, residual, residual_in_fp32):
    """FLA's fused pre-norm residual add: the norm reads the fp32 sum; ``prenorm`` also returns the
    sum, stored in the residual's dtype (fp32 with residual_in_fp32, else x's dtype without one)."""
    if residual is None and not residual_in_fp32:
        return x, x
    total = x.float() + residual.float() if residual is not None else x.float()
    residual_dtype = residual.dtype if residual is not None else torch.float32
    return total, total.to(residual_dtype)


def _norm_gated(fn, is_rms_norm, x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps):
    _require(activation in fla_norm_op.ACTIVATIONS, fn,
             f"argument `activation` must be one of {fla_norm_op.ACTIVATIONS}, got {activation!r}")
    _require(g.shape == x.shape, fn, f"argument `g` must have x's shape {tuple(x.shape)}, got {tuple(g.shape)}")
    _require(residual is None or residual.shape == x.shape, fn, "argument `residual` must have x's shape")
    total, residual_out = _add_residual(x, residual, residual_in_fp32)
    y = torch.ops.laqat.layer_norm_gated(total, g, weight, bias, activation, float(eps), is_rms_norm).to(x.dtype)
    return (y, residual_out) if prenorm else y


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    return _norm_gated("rms_norm_gated", True, x, g, weight, bias, activation, residual, prenorm, residual_in_fp32,
                       eps)


def layer_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                     eps=1e-6):
    return _norm_gated("layer_norm_gated", False, x, g, weight, bias, activation, residual, prenorm,
                       residual_in_fp32, eps)


def _norm(fn, is_rms_norm, x, weight, bias, residual, prenorm, residual_in_fp32, eps):
    _require(residual is None or residual.shape == x.shape, fn, "argument `residual` must have x's shape")
    total, residual_out = _add_residual(x, residual, residual_in_fp32)
    y = torch.ops.laqat.layer_norm(total, weight, bias, float(eps), is_rms_norm).to(x.dtype)
    return (y, residual_out) if prenorm else y


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return _norm("rms_norm", True, x, weight, bias, residual, prenorm, residual_in_fp32, eps)


def layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    return _norm("layer_norm", is_rms_norm, x, weight, bias, residual, prenorm, residual_in_fp32, eps)


def swiglu_linear(x, y, weight, bias):
    """FLA's fused SwiGLU + linear (GatedMLP's default): ``silu(x) * y`` in fp32, stored in x's dtype,
    then the linear layer; elementwise, so plain torch ops that Inductor fuses, no opaque op."""
    return F.linear((F.silu(x.float()) * y.float()).to(x.dtype), weight, bias)


# ---- registration ---------------------------------------------------------------------------
def _substitutions():
    """(FLA's function object, its traceable replacement); aliases share one object."""
    import fla.modules.activations.ops as activation_ops
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.modules.norm.fused_norm_gate as norm_ops
    import fla.modules.norm.layernorm as plain_norm_ops
    import fla.ops.gated_delta_rule as gdn_ops
    import fla.ops.kda as kda_ops

    return (
        (gdn_ops.chunk_gated_delta_rule, chunk_gated_delta_rule),
        (gdn_ops.fused_recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule),
        (kda_ops.chunk_kda, chunk_kda),
        (kda_ops.fused_recurrent_kda, fused_recurrent_kda),
        (conv_ops.causal_conv1d, causal_conv1d),
        (norm_ops.rms_norm_gated, rms_norm_gated),
        (norm_ops.layer_norm_gated, layer_norm_gated),
        (plain_norm_ops.rms_norm, rms_norm),
        (plain_norm_ops.layer_norm, layer_norm),
        (activation_ops.swiglu_linear, swiglu_linear),
    )


SUBSTITUTED: dict = {}  # FLA function object -> the replacement Dynamo traces instead


def _install() -> None:
    for original, replacement in _substitutions():
        if original in SUBSTITUTED:
            continue
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(replacement)
        SUBSTITUTED[original] = replacement


_install()
