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
    fla.modules.norm.l2norm.l2norm (= l2_norm)                             -> laqat::l2_norm
    fla.modules.activations: swiglu_linear, powglu_linear (GatedMLP fused)  -> laqat::glu_linear
        swiglu_fwd / swiglu_fwdbwd, powglu_fwd / powglu_fwdbwd (the launchers
        inside FLA's SwiGLUFunction / PowGLUFunction)                      -> torch ops (glu_formulas)
    fla.modules.fused_cross_entropy.cross_entropy_loss                     -> laqat::cross_entropy
    fla.modules.fused_linear_cross_entropy.fused_linear_cross_entropy_loss -> laqat::fused_linear_cross_entropy

and, as methods (below), ``FusedCrossEntropyLoss.forward``, ``FusedLinearCrossEntropyLoss.forward`` and
``FLAPreTrainedModel._compute_logits_and_loss``.

Each recurrence replacement validates its arguments, emits the pre-processing FLA fuses
into its kernels (l2norm: ``laqat::l2_norm``; gate, beta activation: ``preprocess``, as torch ops), calls the
IR op once and returns what FLA returns: ``(o, final_state or None)``, o in q's dtype (chunk)
or v's dtype (fused_recurrent), the final state in fp32. chunk and fused_recurrent compute
the same recurrence, so both become the same node.

An argument the IR cannot express is refused at compile time with an
``UnsupportedArgumentError`` naming it, never dropped: Dynamo would otherwise fall back to
running FLA's original function, i.e. silently different numerics. The error is raised from
an ``assume_constant_result`` helper, which Dynamo runs while tracing, so it aborts the
compilation (Dynamo reports it as ``InternalTorchDynamoError: UnsupportedArgumentError: ...``)
with and without ``fullgraph``.

Dynamo calls an ``nn.Module``'s ``forward``, and any Python method, without consulting
``substitute_in_graph``'s table (torch 2.13, ``UnspecializedNNModuleVariable.call_function``), so
FLA's loss modules, whose ``forward`` is ``torch.compiler.disable``'d (FusedLinearCrossEntropyLoss)
or asserts a GPU device before calling a disable'd dispatcher (FusedCrossEntropyLoss), and the
causal LMs' ``_compute_logits_and_loss`` (a graph break at ``criterion.ignore_index`` of an
``nn.CrossEntropyLoss`` it builds) get a method substitution instead (``_method_substitutions``):
the class attribute becomes a function that runs the replacement while
``torch.compiler.is_compiling()`` and FLA's original otherwise, so eager calls are unchanged.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss
from fla.modules.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
from fla.modules.l2warp import l2_warp

from la_compiler.errors import LaqatError, through_dynamo
from la_compiler.ir.checks import tensor_problem
from la_compiler.kernels.fla import conv_op, norm_op  # noqa: F401  (register their laqat:: ops)
from la_compiler.kernels.fla import cross_entropy_op, linear_cross_entropy_op  # noqa: F401  (likewise)
from la_compiler.kernels.fla import glu_formulas, glu_linear_op, l2_norm_op
from la_compiler.passes.frontends.fla.preprocess import beta_activation, gdn_gate, kda_gate

GDN_CHUNK_SIZES = (16, 32, 64)  # what FLA's chunk_gated_delta_rule accepts
KDA_CHUNK_SIZES = (32, 64)  # what FLA's chunk_kda accepts
FLA_DEFAULT_CHUNK = 64  # both functions' chunk_size default


class UnsupportedArgumentError(LaqatError, ValueError):
    """An FLA call argument (or value) that the laqat IR cannot express, or that FLA itself rejects."""


@torch._dynamo.assume_constant_result
def _refuse(function: str, message: str) -> bool:
    # as itself through Dynamo (la_compiler/errors.py): ``except UnsupportedArgumentError`` catches it
    raise through_dynamo(UnsupportedArgumentError(f"laqat FLA frontend, {function}(): {message}"))


@torch._dynamo.assume_constant_result
def _spec_string(kind: str, state: str, chunk: int, chunk_passed: bool) -> str:
    from la_compiler.ir.spec import RecurrenceSpec

    return RecurrenceSpec(kind=kind, src="fla", state=state, chunk=chunk, chunk_passed=chunk_passed).to_string()


def _pop_state_v_first(function: str, state_v_first: bool, kwargs: dict) -> bool:
    """FLA's deprecated alias ``transpose_state_layout`` of ``state_v_first``."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            _refuse(function, "pass `state_v_first` or the deprecated `transpose_state_layout`, not both")
        return bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def _refuse_unknown(function: str, kwargs: dict) -> None:
    for name in kwargs:
        _refuse(function, f"argument `{name}` is not supported by laqat (FLA would ignore or reject it)")


def _refuse_set(function: str, **arguments) -> None:
    """Arguments that must keep their default (None / False) for the IR to express the call."""
    for name, value in arguments.items():
        if not (value is None or value is False):
            _refuse(function, f"argument `{name}` is not supported by laqat (got a non-default value)")


def _check_heads(function: str, q, k, v) -> None:
    if not (q.dim() == 4 and k.shape == q.shape):
        _refuse(function, f"q and k must both be [B, T, H, K], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if not (v.dim() == 4 and v.shape[:2] == q.shape[:2]):
        _refuse(function, f"v must be [B, T, HV, V], got {tuple(v.shape)}")
    if v.shape[2] % q.shape[2] != 0:
        _refuse(function, f"num_v_heads (HV={v.shape[2]}) must be divisible by num_heads (H={q.shape[2]})")


def _check_varlen(function: str, q, initial_state, cu_seqlens) -> None:
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        _refuse(function, f"with `cu_seqlens` the batch size must be 1, got {q.shape[0]}")
    if not (initial_state is None or initial_state.shape[0] == cu_seqlens.shape[0] - 1):
        _refuse(function, "`initial_state` must hold one state per sequence of `cu_seqlens`")


def _check_beta(function: str, beta, v, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _refuse(function, "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    if beta.dim() != 3:
        _refuse(function, f"argument `beta` must be [B, T, HV] (one beta per head); got shape {tuple(beta.shape)} "
                          f"(per-value beta is not supported by laqat)")


def _delta_rule(kind, q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                chunk_size, function):
    # what the node's fake implementation would refuse, refused here, as the call's error (an error inside fake
    # propagation reaches the user wrapped in Dynamo's TorchRuntimeError)
    problem = tensor_problem("laqat::delta_rule", q, k, v, g, beta, initial_state, cu_seqlens)
    if problem is not None:
        _refuse(function, f"{problem} (after laqat's pre-processing of the call's arguments)")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    chunk, passed = (FLA_DEFAULT_CHUNK, False) if chunk_size is None else (chunk_size, True)
    spec = _spec_string(kind, "vk" if state_v_first else "kv", chunk, passed)
    # contiguous, as FLA's input_guard makes them: the op saves its inputs, and a slice (GDN's v, of the fused q/k/v
    # convolution's output) would keep its whole base alive, the pre-norm q and k with it
    q, k, v, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    o, final_state = torch.ops.laqat.delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), spec)
    return o, (final_state if output_final_state else None)


# ---- GDN ------------------------------------------------------------------------------------
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    fn = "chunk_gated_delta_rule"
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", None)  # None: FLA's default
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context)
    if not (chunk_size is None or chunk_size in GDN_CHUNK_SIZES):
        _refuse(fn, f"`chunk_size` must be one of {GDN_CHUNK_SIZES}, got {chunk_size}")
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel and A_log is None:
        _refuse(fn, "`A_log` must be given with `use_gate_in_kernel=True`")
    if g.dim() != 3:
        _refuse(fn, f"argument `g` must be [B, T, HV], got {tuple(g.shape)}")

    if use_qk_l2norm_in_kernel:
        q, k = l2_norm_op.l2norm(q), l2_norm_op.l2norm(k)
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return _delta_rule("gdn", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                       cu_seqlens, chunk_size, fn)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    fn = "fused_recurrent_gated_delta_rule"
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
        if A_log is None:
            _refuse(fn, "`A_log` must be given with `use_gate_in_kernel=True`")
        if g is None:
            _refuse(fn, "`g` (the raw gate) must be given with `use_gate_in_kernel=True`")
    if not (g is None or g.dim() == 3):
        _refuse(fn, f"argument `g` must be [B, T, HV], got {tuple(g.shape) if g is not None else None}")
    if not (gk is None or tuple(gk.shape) == (B, T, HV, q.shape[-1])):
        _refuse(fn, f"argument `gk` must be [B, T, HV, K] = {(B, T, HV, q.shape[-1])}, got "
                    f"{tuple(gk.shape) if gk is not None else None}")

    if use_qk_l2norm_in_kernel:
        q, k = l2_norm_op.l2norm(q, output_dtype=torch.float32), l2_norm_op.l2norm(k, output_dtype=torch.float32)
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
                                 cu_seqlens, 64, fn)
    return o.to(v.dtype), final_state


# ---- KDA ------------------------------------------------------------------------------------
def _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    if not use_gate_in_kernel:
        return g
    if not (A_log is not None or lower_bound is not None):
        _refuse(fn, "`A_log` must be given with `use_gate_in_kernel=True` unless `lower_bound` is set")
    return kda_gate(g, A_log, dt_bias, lower_bound)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    fn = "chunk_kda"
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", None)  # None: FLA's default
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context, return_intermediate_states=return_intermediate_states,
                use_graph=use_graph, max_num_seqs=max_num_seqs)
    if not (chunk_size is None or chunk_size in KDA_CHUNK_SIZES):
        _refuse(fn, f"`chunk_size` must be one of {KDA_CHUNK_SIZES}, got {chunk_size}")
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if not (initial_state is None or initial_state.dtype == torch.float32):
        _refuse(fn, "`initial_state` must be float32 (as FLA requires)")
    if tuple(g.shape) != tuple(v.shape[:3]) + (q.shape[-1],):
        _refuse(fn, f"argument `g` must be [B, T, HV, K], got {tuple(g.shape)}")
    if safe_gate and use_gate_in_kernel:
        if not (lower_bound is not None and -5 <= lower_bound < 0):
            _refuse(fn, f"`safe_gate=True` with `use_gate_in_kernel=True` needs `lower_bound` in [-5, 0), got "
                        f"{lower_bound}")

    if use_qk_l2norm_in_kernel:
        q, k = l2_norm_op.l2norm(q), l2_norm_op.l2norm(k)
    g = _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return _delta_rule("kda", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                       cu_seqlens, chunk_size, fn)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    fn = "fused_recurrent_kda"
    state_v_first = _pop_state_v_first(fn, state_v_first, kwargs)
    _refuse_unknown(fn, kwargs)
    _check_heads(fn, q, k, v)
    _check_varlen(fn, q, initial_state, cu_seqlens)
    _check_beta(fn, beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if tuple(g.shape) != tuple(v.shape[:3]) + (q.shape[-1],):
        _refuse(fn, f"argument `g` must be [B, T, HV, K], got {tuple(g.shape)}")

    if use_qk_l2norm_in_kernel:
        q, k = l2_norm_op.l2norm(q, output_dtype=torch.float32), l2_norm_op.l2norm(k, output_dtype=torch.float32)
    g = _kda_gate(fn, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    o, final_state = _delta_rule("kda", q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                                 cu_seqlens, 64, fn)
    return o.to(v.dtype), final_state


# ---- the graph-breaking helpers of FLA's layers ------------------------------------------------
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    fn = "causal_conv1d"
    _refuse_unknown(fn, kwargs)
    _refuse_set(fn, cp_context=cp_context)
    if weight is None:
        _refuse(fn, "argument `weight` is required by laqat")
    if activation not in conv_op.ACTIVATIONS:
        _refuse(fn, f"argument `activation` must be one of {conv_op.ACTIVATIONS}, got {activation!r}")
    if backend not in ("triton", "cuda", "mix"):
        _refuse(fn, f"unsupported `backend` {backend!r}")
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
    if activation not in norm_op.ACTIVATIONS:
        _refuse(fn, f"argument `activation` must be one of {norm_op.ACTIVATIONS}, got {activation!r}")
    if g.shape != x.shape:
        _refuse(fn, f"argument `g` must have x's shape {tuple(x.shape)}, got {tuple(g.shape)}")
    if not (residual is None or residual.shape == x.shape):
        _refuse(fn, "argument `residual` must have x's shape")
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
    if not (residual is None or residual.shape == x.shape):
        _refuse(fn, "argument `residual` must have x's shape")
    if residual is not None:  # saves the sum in the residual's dtype, as FLA's LayerNormFunction (norm_op.py)
        y, residual_out = torch.ops.laqat.layer_norm_residual(x, residual, weight, bias, float(eps), is_rms_norm)
        return (y, residual_out) if prenorm else y
    total, residual_out = _add_residual(x, residual, residual_in_fp32)
    y = torch.ops.laqat.layer_norm(total, weight, bias, float(eps), is_rms_norm).to(x.dtype)
    return (y, residual_out) if prenorm else y


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return _norm("rms_norm", True, x, weight, bias, residual, prenorm, residual_in_fp32, eps)


def layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    return _norm("layer_norm", is_rms_norm, x, weight, bias, residual, prenorm, residual_in_fp32, eps)


def l2norm(x, eps=1e-6, output_dtype=None):
    """FLA's ``l2norm`` module function: ``x / sqrt(sum(x^2) + eps)`` in fp32, stored in ``output_dtype`` (x's dtype
    by default); ``laqat::l2_norm``."""
    return l2_norm_op.l2norm(x, eps=eps, output_dtype=output_dtype)


# ---- FLA's fused losses ------------------------------------------------------------------------
def _check_logits(fn, logits, target):
    if logits.dim() != 2:
        _refuse(fn, f"`logits` must be [N, V], got {tuple(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape[:1]):
        _refuse(fn, f"`target` must be [N] = {tuple(logits.shape[:1])}, got {tuple(target.shape)}")


def cross_entropy_loss(logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                       logit_softcapping=None, ignore_index=-100, inplace_backward=False, process_group=None):
    """-> (loss [N], z_loss [N]) in fp32, the loss including the z-loss; ``inplace_backward`` (FLA writes the
    logits' gradient into the logits' storage) goes to the op, for the hand-off (la_compiler/hand_off/loss_tails.py)."""
    fn = "cross_entropy_loss"
    _refuse_set(fn, process_group=process_group)
    _check_logits(fn, logits, target)
    loss, z_loss, _ = torch.ops.laqat.cross_entropy(
        logits, target, float(label_smoothing), float(logit_scale), float(lse_square_scale),
        None if logit_softcapping is None else float(logit_softcapping), int(ignore_index), bool(inplace_backward))
    return loss, z_loss


def fused_cross_entropy_forward(self, input, target):
    """``FusedCrossEntropyLoss.forward`` without its GPU-device assertion (the op runs FLA's kernels
    on CUDA and their torch transcription elsewhere): FLA's reductions over the per-token loss."""
    loss, z_loss = cross_entropy_loss(input, target, self.label_smoothing, self.logit_scale, self.lse_square_scale,
                                      self.logit_softcapping, self.ignore_index, self.inplace_backward,
                                      self.process_group)
    if self.reduction != "none":
        loss = loss.sum()
        if self.return_z_loss:
            z_loss = z_loss.sum()
        if self.reduction == "mean":
            total = (target != self.ignore_index).sum()
            loss = loss / total
            if self.return_z_loss:
                z_loss = z_loss / total
    return (loss, z_loss) if self.return_z_loss else loss


def fused_linear_cross_entropy_loss(x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0,
                                    logit_scale=1.0, logit_softcapping=None, num_chunks=8, reduction="mean",
                                    use_l2warp=False, l2_penalty_factor=1e-4, accumulate_grad_in_fp32=True,
                                    process_group=None):
    """-> the fp32 scalar loss of ``linear(x, weight, bias)`` against ``target``."""
    fn = "fused_linear_cross_entropy_loss"
    _refuse_set(fn, process_group=process_group)
    if reduction not in linear_cross_entropy_op.REDUCTIONS:
        _refuse(fn, f"argument `reduction` must be one of {linear_cross_entropy_op.REDUCTIONS}, got {reduction!r}")
    if x.dim() != 2:
        _refuse(fn, f"`x` must be [N, H], got {tuple(x.shape)}")
    if tuple(target.shape) != tuple(x.shape[:1]):
        _refuse(fn, f"`target` must be [N] = {tuple(x.shape[:1])}, got {tuple(target.shape)}")
    if not (weight.dim() == 2 and weight.shape[1] == x.shape[1]):
        _refuse(fn, f"`weight` must be [V, H={x.shape[1]}], got {tuple(weight.shape)}")
    if not (bias is None or tuple(bias.shape) == tuple(weight.shape[:1])):
        _refuse(fn, "`bias` must be [V]")
    if weight.dtype != x.dtype:
        _refuse(fn, f"`weight` ({weight.dtype}) must have x's dtype ({x.dtype}), as FLA's matmuls require")
    if int(num_chunks) < 1:
        _refuse(fn, f"`num_chunks` must be >= 1, got {num_chunks}")
    loss, _, _, _ = torch.ops.laqat.fused_linear_cross_entropy(
        x, target, weight, bias, int(ignore_index), float(label_smoothing), float(logit_scale),
        None if logit_softcapping is None else float(logit_softcapping), int(num_chunks), reduction,
        bool(use_l2warp), float(l2_penalty_factor), bool(accumulate_grad_in_fp32))
    return loss


def fused_linear_cross_entropy_forward(self, x, target, weight, bias=None):
    """``FusedLinearCrossEntropyLoss.forward`` (``torch.compiler.disable``'d in FLA)."""
    return fused_linear_cross_entropy_loss(
        x.reshape(-1, x.shape[-1]), target.reshape(-1), weight, bias, ignore_index=self.ignore_index,
        label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
        logit_softcapping=self.logit_softcapping, num_chunks=self.num_chunks, reduction=self.reduction,
        use_l2warp=self.use_l2warp, l2_penalty_factor=self.l2_penalty_factor,
        accumulate_grad_in_fp32=self.accumulate_grad_in_fp32, process_group=self.process_group)


def compute_logits_and_loss(self, hidden_states, labels=None, logits_to_keep=0, *, shift_labels=None,
                            num_items_in_batch=None, fuse_linear_cross_entropy=None, use_l2warp=None):
    """``FLAPreTrainedModel._compute_logits_and_loss`` (fla/models/modeling_utils.py, FLA 0.6) as FLA writes
    it, except that the shifted labels' padding reads ``nn.CrossEntropyLoss``'s default ``ignore_index``
    (-100) as a constant where the criterion is built here: Dynamo represents an ``nn.CrossEntropyLoss``
    constructed while tracing as a bound ``F.cross_entropy``, without attributes, and breaks the graph
    at ``criterion.ignore_index``."""
    if fuse_linear_cross_entropy is None:
        fuse_linear_cross_entropy = getattr(self.config, "fuse_linear_cross_entropy", False)
    if use_l2warp is None:
        use_l2warp = getattr(self.config, "use_l2warp", False)
    has_labels = labels is not None or shift_labels is not None
    loss, logits = None, None
    if not fuse_linear_cross_entropy or not has_labels:
        if has_labels or logits_to_keep is None:
            selected_states = hidden_states
        elif isinstance(logits_to_keep, int):
            selected_states = hidden_states[:, -logits_to_keep:]
        else:
            selected_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(selected_states)
    if not has_labels:
        return loss, logits

    criterion = getattr(self, "criterion", None)
    reduction = "mean" if num_items_in_batch is None else "sum"
    ignore_index = None
    if criterion is None:
        if fuse_linear_cross_entropy:
            criterion = FusedLinearCrossEntropyLoss(use_l2warp=use_l2warp, reduction=reduction)
        elif self.config.fuse_cross_entropy:
            criterion = FusedCrossEntropyLoss(inplace_backward=True, reduction=reduction)
        else:
            criterion = nn.CrossEntropyLoss(reduction=reduction)
            ignore_index = -100  # nn.CrossEntropyLoss's default
    elif num_items_in_batch is not None:
        if not hasattr(criterion, "reduction"):
            raise ValueError("A custom criterion must expose reduction to use num_items_in_batch.")
        criterion = copy.copy(criterion)
        criterion.reduction = "sum"
    if ignore_index is None:
        ignore_index = criterion.ignore_index

    if shift_labels is None:
        labels = labels.to(hidden_states.device)
        shift_labels = torch.cat((labels[..., 1:], torch.full_like(labels[:, :1], ignore_index)), dim=1)
    else:
        shift_labels = shift_labels.to(hidden_states.device)
    if fuse_linear_cross_entropy:
        loss = criterion(hidden_states, shift_labels, self.lm_head.weight, self.lm_head.bias)
    else:
        loss = criterion(logits.reshape(shift_labels.numel(), -1), shift_labels.reshape(-1))
        if use_l2warp:
            loss = l2_warp(loss, logits)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, logits


# ---- registration ---------------------------------------------------------------------------
def _substitutions():
    """(FLA's function object, its traceable replacement); aliases share one object."""
    import fla.modules.activations.ops as activation_ops
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.modules.fused_cross_entropy.ops as cross_entropy_ops
    import fla.modules.fused_linear_cross_entropy.ops as linear_cross_entropy_ops
    import fla.modules.norm.fused_norm_gate as norm_ops
    import fla.modules.norm.l2norm as l2norm_ops
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
        (l2norm_ops.l2norm, l2norm),
        (activation_ops.swiglu_linear, glu_linear_op.swiglu_linear),
        (activation_ops.swiglu_fwd, glu_formulas.swiglu_fwd),
        (activation_ops.swiglu_fwdbwd, glu_formulas.swiglu_fwdbwd),
        (activation_ops.powglu_linear, glu_linear_op.powglu_linear),
        (activation_ops.powglu_fwd, glu_formulas.powglu_fwd),
        (activation_ops.powglu_fwdbwd, glu_formulas.powglu_fwdbwd),
        (cross_entropy_ops.cross_entropy_loss, cross_entropy_loss),
        (linear_cross_entropy_ops.fused_linear_cross_entropy_loss, fused_linear_cross_entropy_loss),
    )


def _method_substitutions():
    """(FLA's class, method name, replacement): module methods Dynamo calls without the polyfill table."""
    from fla.models.modeling_utils import FLAPreTrainedModel

    return (
        (FusedCrossEntropyLoss, "forward", fused_cross_entropy_forward),
        (FusedLinearCrossEntropyLoss, "forward", fused_linear_cross_entropy_forward),
        (FLAPreTrainedModel, "_compute_logits_and_loss", compute_logits_and_loss),
    )


SUBSTITUTED: dict = {}  # FLA function object (a method: FLA's original) -> the replacement Dynamo traces instead


def _while_compiling(original, replacement):
    """``replacement`` under ``torch.compile``, FLA's ``original`` in eager mode."""
    def method(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    # name, doc and signature, but not __dict__: it holds torch.compiler.disable's mark
    functools.update_wrapper(method, original, updated=())
    method.__laqat_original__ = original
    return method


def _install() -> None:
    for original, replacement in _substitutions():
        if original in SUBSTITUTED:
            continue
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(replacement)
        SUBSTITUTED[original] = replacement
    for cls, name, replacement in _method_substitutions():
        current = cls.__dict__[name]
        original = getattr(current, "__laqat_original__", current)
        if original not in SUBSTITUTED:
            setattr(cls, name, _while_compiling(original, replacement))
            SUBSTITUTED[original] = replacement


_install()
