"""What a KDA serving profile's recurrence receives: vLLM's Kimi-K3 / Kimi-Linear pre-processing of the raw q, k, gate
and beta (docs/serving.md, "The server's pre-processing"), as ops that the serving pass (passes/serving_inputs.py)
puts in place of the model's own.

    laqat::serving_kda_l2norm(x [B, T, H, K], prefix) -> fp32                 q or k
    laqat::serving_kda_gate(g [B, T, HV, K], A_log [HV], dt_bias? [HV K]) -> fp32   the per-channel log-decay

beta is ``laqat::serving_sigmoid`` and the prefix mask ``laqat::serving_prefix`` (serving_inputs.py): vLLM's KDA
kernels compute them as its GDN kernels do.

vLLM prefills a prefix through ``chunk_kda_with_fused_gate``: q and k through ``l2norm_fwd``, stored in the model's
dtype; the gate and beta from the raw projections in ``fused_kda_gate_chunk_cumsum``, which writes the gate's cumsum
within each 64-token chunk (``tl.cumsum``), times 1 / ln 2 for the exp2 of its later stages. laqat's chunk kernels
take the per-token log-decay and run that cumsum themselves (``chunk_fwd_kernel_cumsum``, ``tl.cumsum`` over the
chunk's 64 rows, in fp32), so the gate op hands them the values the fused kernel sums: ``-exp(A_log) * softplus(g +
dt_bias)`` per token, in fp32, before the cumsum (docs/serving.md says what differs after it). Every later token
runs vLLM's packed decode kernel, which normalizes q and k in fp32 (``x / sqrt(sum(x²) + 1e-6)``, not rounded) and
computes the same gate in the step. So a prefix token's q and k hold model-dtype values, a decode token's full fp32
ones, and the recurrence takes fp32 q and k.

Backward: the exact derivative of each formula in fp32, straight through the prefix's rounding of q and k (the l2
norm's as serving_l2norm's; both of vLLM's norms are ``x / sqrt(sum(x²) + eps)``); the gate's from its output
(laqat::softplus_gate_backward).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from la_compiler.kernels.decode import serving_inputs
from la_compiler.kernels.decode import serving_inputs_kernels
from la_compiler.kernels.decode import serving_kda_inputs_kernels as kernels
from la_compiler.kernels.fla import softplus_gate_op

Tensor = torch.Tensor
PREFILL_MBLOCK = 32  # l2norm_fwd's MBLOCK
DECODE_WARPS = 4  # fused_recurrent_kda_packed_decode's num_warps
BLOCK = 1024


def _launch_l2norms(x: Tensor, prefill: Tensor, decode: Tensor) -> None:
    """l2norm_fwd's (32 rows) and the packed KDA decode's (one token, 4 warps)."""
    B, T, H, K = x.shape
    rows, BK = B * T * H, triton.next_power_of_2(K)
    kernels.l2norm_prefill_kernel[(triton.cdiv(rows, PREFILL_MBLOCK),)](
        x=x, out=prefill, n_rows=rows, eps=serving_inputs.L2NORM_EPS, D=K, BD=BK, MBLOCK=PREFILL_MBLOCK)
    serving_inputs_kernels.l2norm_decode_kernel[(B * T, H)](x=x, out=decode, H=H, K=K, BK=BK, num_warps=DECODE_WARPS)


def _l2norm_forward(x: Tensor, prefix: Tensor) -> Tensor:
    return serving_inputs.l2norm_by_phase(x, prefix, _launch_l2norms)


@torch.library.custom_op("laqat::serving_kda_l2norm", mutates_args=())
def serving_kda_l2norm(x: Tensor, prefix: Tensor) -> Tensor:
    return _l2norm_forward(x, prefix)


@serving_kda_l2norm.register_fake
def _(x, prefix):
    return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)


serving_kda_l2norm.register_autograd(serving_inputs._l2norm_backward, setup_context=serving_inputs._l2norm_setup)


@torch.library.custom_op("laqat::serving_kda_gate", mutates_args=())
def serving_kda_gate(g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor]) -> Tensor:
    HV, K = g.shape[-2:]
    g = g.contiguous()
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        A_flat = A_log.contiguous().view(-1)
        kernels.kda_gate_kernel[(triton.cdiv(n, BLOCK),)](
            g=g, A_log=A_flat, dt_bias=A_flat if dt_bias is None else dt_bias.contiguous().view(-1), out=out, n=n,
            HV=HV, K=K, HAS_DT_BIAS=dt_bias is not None, THRESHOLD=serving_inputs.SOFTPLUS_THRESHOLD, BLOCK=BLOCK)
    return out


@serving_kda_gate.register_fake
def _(g, A_log, dt_bias):
    return torch.empty_like(g, dtype=torch.float32, memory_format=torch.contiguous_format)


# the same formula as laqat::softplus_gate: its backward, from the output
serving_kda_gate.register_autograd(softplus_gate_op.gate_backward, setup_context=softplus_gate_op.gate_setup_context)


def raw_gate_log_decay(g: Tensor, gate: tuple[Tensor, Optional[Tensor]] | None) -> Tensor:
    """The log-decay of a phased node that takes its gate raw (``gate`` = (A_log, dt_bias);
    ir/delta_rule_phased.py): this module's gate op's values; ``g`` itself without a raw gate."""
    return g if gate is None else serving_kda_gate(g, *gate)


def raw_gate_grads(d_log_decay: Tensor, log_decay: Tensor, g: Tensor,
                   gate: tuple[Tensor, Optional[Tensor]]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(dg of the raw gate in its dtype, dA_log, ddt_bias or None) from the log-decay's gradient: the gate op's
    backward."""
    A_log, dt_bias = gate
    dg, dA_log, ddt_bias = softplus_gate_op.softplus_gate_backward(d_log_decay, log_decay, A_log, dt_bias is not None,
                                                                   g.dtype)
    return dg, dA_log, None if dt_bias is None else ddt_bias.reshape(dt_bias.shape).to(dt_bias.dtype)
