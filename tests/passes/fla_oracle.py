"""An eager oracle for FLA's GDN/KDA layers on the CPU, built from FLA's own torch references.

FLA's chunk kernels cannot run on the CPU, so ``naive_fla()`` monkeypatches what the layers
call with FLA's naive recurrences (fla/ops/*/naive.py), FLA's torch gate references
(``naive_gdn_gate``, ``naive_kda_gate``, ``naive_kda_lowerbound_gate``), ``F.conv1d`` (what
``ShortConvolution``, an ``nn.Conv1d``, computes), FLA's ``rms_norm_ref`` functions,
``F.silu(x) * y`` for GatedMLP's SwiGLU and the PowGLU gate as FLA's docstring states it, and for
FLA's fused losses ``F.cross_entropy`` on the scaled / softcapped logits (plus the z-loss) and FLA's
own ``l2_warp``. None of this shares code with the laqat frontend.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from fla.modules.l2warp import l2_warp
from fla.modules.norm.layernorm import rms_norm_ref as plain_rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda


def fla_l2norm(x):
    """As FLA's kernels write it: x / sqrt(sum(x^2) + 1e-6), in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _per_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens):
    """Runs ``run`` on each sequence of a packed batch (B == 1) and re-packs the results."""
    if cu_seqlens is None:
        return run(q, k, v, g, beta, initial_state)
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        s = slice(bounds[n], bounds[n + 1])
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, ht = run(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], h0)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def naive_delta_rule(kind, q, k, v, g, beta, *, scale=None, initial_state=None, state_v_first=False,
                     cu_seqlens=None):
    """Canonical inputs (log decay, activated beta) -> (o, final state) with FLA's naive recurrences."""
    HV = v.shape[2]
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)

    def run(q, k, v, g, beta, h0):
        if kind == "kda":
            return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
        # FLA's naive GDN has no grouped heads: give every value head its q/k head
        q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
        return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale, initial_state=h0,
                                                output_final_state=True)

    o, ht = _per_sequence(run, q, k, v, g, beta, initial_state, cu_seqlens)
    return o, (ht.transpose(-1, -2) if state_v_first else ht)


def naive_fla_call(kind, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                   use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
                   cu_seqlens=None, **ignored):
    """What FLA's chunk/fused_recurrent GDN or KDA op computes, per its docstrings and torch references."""
    if use_qk_l2norm_in_kernel:
        q, k = fla_l2norm(q), fla_l2norm(k)
    if use_gate_in_kernel:
        if kind == "gdn":
            g = naive_gdn_gate(g, A_log, dt_bias)
        elif lower_bound is not None:
            g = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound)
        else:
            g = naive_kda_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
    o, ht = naive_delta_rule(kind, q.float(), k.float(), v.float(), g.float(), beta.float(), scale=scale,
                             initial_state=initial_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), (ht.float() if output_final_state else None)


def conv1d_oracle(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, cu_seqlens=None, **ignored):
    """Depthwise causal conv as ``nn.Conv1d(padding=W-1)`` computes it, per sequence (no cache support)."""
    assert initial_state is None and not output_final_state
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        parts = [conv1d_oracle(x[:, bounds[i]:bounds[i + 1]], weight, bias, None, activation=activation)[0]
                 for i in range(len(bounds) - 1)]
        y = torch.cat(parts, 1)
        return (y if residual is None else y + residual), None
    D, W = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :x.shape[1]]
    y = y.transpose(1, 2)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if residual is not None:
        y = y + residual
    return y, None


def rms_norm_gated_oracle(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                          residual_in_fp32=False, eps=1e-6):
    assert residual is None and not prenorm
    if activation in ("swish", "silu"):
        return rms_norm_ref(x, weight, bias, z=g, eps=eps, norm_before_gate=True)
    return (rms_norm_ref(x, weight, bias, eps=eps, upcast=True).float() * g.float().sigmoid()).to(x.dtype)


def rms_norm_oracle(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return plain_rms_norm_ref(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm, upcast=True)


def swiglu_linear_oracle(x, y, weight, bias):
    return F.linear(F.silu(x) * y, weight, bias)


def swiglu_oracle(x, y):
    return F.silu(x) * y


def powglu_oracle(x, y, power=3.0):
    """FLA's PowGLU: ``x ** (power / (sqrt(x) + 1)) * sigmoid(x) * y`` for x > 0, ``silu(x) * y`` otherwise."""
    positive = x.clamp_min(1e-30)
    gate = torch.where(x > 0, positive ** (power / (positive.sqrt() + 1)) * torch.sigmoid(x), F.silu(x))
    return gate * y


def powglu_linear_oracle(x, y, weight, bias, power=3.0):
    return F.linear(powglu_oracle(x, y, power), weight, bias)


def _transformed_logits(logits, logit_scale, logit_softcapping):
    z = logits.float() * logit_scale
    return z if logit_softcapping is None else logit_softcapping * torch.tanh(z / logit_softcapping)


def cross_entropy_oracle(logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                         logit_softcapping=None, ignore_index=-100, **ignored):
    """FLA's ``cross_entropy_loss``: per-token (loss including the z-loss, z-loss), 0 at ``ignore_index``."""
    z = _transformed_logits(logits, logit_scale, logit_softcapping)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    z_loss = torch.where(target != ignore_index, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    return loss + z_loss, z_loss.detach()


def fused_cross_entropy_oracle_forward(self, input, target):
    """``FusedCrossEntropyLoss.forward``: reductions over the non-ignored targets."""
    loss, z_loss = cross_entropy_oracle(input, target, self.label_smoothing, self.logit_scale, self.lse_square_scale,
                                        self.logit_softcapping, self.ignore_index)
    if self.reduction != "none":
        count = (target != self.ignore_index).sum() if self.reduction == "mean" else 1
        loss, z_loss = loss.sum() / count, z_loss.sum() / count
    return (loss, z_loss) if self.return_z_loss else loss


def fused_linear_cross_entropy_oracle(x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0,
                                      logit_scale=1.0, logit_softcapping=None, reduction="mean", use_l2warp=False,
                                      l2_penalty_factor=1e-4, **ignored):
    """FLA's ``fused_linear_cross_entropy_loss``: the LM head, cross-entropy, and FLA's ``l2_warp`` over
    all N tokens."""
    logits = F.linear(x, weight, bias)
    z = _transformed_logits(logits, logit_scale, logit_softcapping)
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    if use_l2warp:
        loss = l2_warp(loss, logits.reshape(1, -1, logits.shape[-1]), l2_penalty_factor)
    return loss


def fused_linear_cross_entropy_oracle_forward(self, x, target, weight, bias=None):
    return fused_linear_cross_entropy_oracle(x, target, weight, bias, self.ignore_index, self.label_smoothing,
                                             self.logit_scale, self.logit_softcapping, self.reduction,
                                             self.use_l2warp, self.l2_penalty_factor)


@contextlib.contextmanager
def naive_fla():
    """Eager FLA layers on the CPU: their kernels swapped for the torch references above."""
    import fla.layers.gated_deltanet as gdn_layer
    import fla.layers.kda as kda_layer
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.modules.fused_cross_entropy.ops as cross_entropy_ops
    import fla.modules.fused_linear_cross_entropy.ops as linear_cross_entropy_ops
    import fla.modules.mlp as mlp
    import fla.modules.norm.fused_norm_gate as norm_ops
    import fla.modules.norm.layernorm as plain_norm_ops

    patches = [
        (gdn_layer, "chunk_gated_delta_rule", lambda *a, **kw: naive_fla_call("gdn", *a, **kw)),
        (gdn_layer, "fused_recurrent_gated_delta_rule", lambda *a, **kw: naive_fla_call("gdn", *a, **kw)),
        (kda_layer, "chunk_kda", lambda *a, **kw: naive_fla_call("kda", *a, **kw)),
        (kda_layer, "fused_recurrent_kda", lambda *a, **kw: naive_fla_call("kda", *a, **kw)),
        (gdn_layer, "causal_conv1d", conv1d_oracle),
        (conv_ops, "causal_conv1d", conv1d_oracle),
        (norm_ops, "rms_norm_gated", rms_norm_gated_oracle),
        (plain_norm_ops, "rms_norm", rms_norm_oracle),
        (mlp, "swiglu_linear", swiglu_linear_oracle),
        (mlp, "swiglu", swiglu_oracle),
        (mlp, "powglu", powglu_oracle),
        (mlp, "powglu_linear", powglu_linear_oracle),
        (cross_entropy_ops.FusedCrossEntropyLoss, "forward", fused_cross_entropy_oracle_forward),
        (linear_cross_entropy_ops.FusedLinearCrossEntropyLoss, "forward", fused_linear_cross_entropy_oracle_forward),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, fn in patches:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
