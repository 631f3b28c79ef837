"""``laqat::causal_conv1d``: FLA's short causal convolution as one opaque custom op.

FLA's ``causal_conv1d`` (fla/modules/causal_conv1d/ops.py, what ``ShortConvolution`` and
GDN's fused q/k/v convolution call) launches autotuned Triton kernels from an
``autograd.Function``; Dynamo cannot trace that, so a layer that uses it breaks the graph.
The FLA frontend substitutes the function with a call to this op.

    laqat::causal_conv1d(x [B, T, D], weight [D, W], bias? [D], residual? [B, T, D],
                         initial_state? [N, D, W], cu_seqlens? [N + 1], activation?, output_final_state)
        -> (y [B, T, D] in x.dtype, final_state [N, D, W] in x.dtype, or [0] when not requested)

    y[t] = act(sum_w weight[:, w] * x_ext[t + 1 + w] + bias) + residual[t],  x_ext = [cache; x]

where the cache (the initial state, zeros without one) holds the W inputs before the
sequence and the final state is the last W rows of ``x_ext``.

Implementations: on CUDA, FLA's own ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` Triton
kernels (the original numerics); elsewhere (FLA's Triton kernels need a GPU) the fp32 torch
reference below, differentiated by torch autograd. FLA ships no torch reference for this
convolution; the reference is checked against ``torch.nn.functional.conv1d`` (what
``ShortConvolution``, an ``nn.Conv1d``, computes) in tests/passes/test_fla_frontend.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from la_compiler.kernels.common.autograd_inside_op import autograd_enabled
from la_compiler.kernels.fla.autotune_searches import searched
from la_compiler.kernels.fla.backward_ahead import compile_backward_ahead, describe

Tensor = torch.Tensor
ACTIVATIONS = (None, "silu", "swish")


def _sequences(x: Tensor, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int, int]]:
    if cu_seqlens is None:
        return [(b, 0, x.shape[1]) for b in range(x.shape[0])]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def causal_conv1d_reference(x, weight, bias, residual, initial_state, cu_seqlens, activation):
    """fp32 torch reference; returns (y in x.dtype, final_state [N, D, W] in x.dtype)."""
    W = weight.shape[1]
    w = weight.float()
    ys, finals = [], []
    for n, (b, start, end) in enumerate(_sequences(x, cu_seqlens)):
        xs = x[b, start:end].float()  # [L, D]
        cache = initial_state[n].float().transpose(0, 1) if initial_state is not None else xs.new_zeros(W, xs.shape[1])
        ext = torch.cat([cache, xs], dim=0)  # [W + L, D]
        windows = ext[1:].unfold(0, W, 1)  # [L, D, W]: window t covers x_ext[t + 1 : t + 1 + W]
        y = (windows * w).sum(-1)
        if bias is not None:
            y = y + bias.float()
        if activation is not None:
            y = F.silu(y)
        ys.append(y)
        finals.append(ext[-W:].transpose(0, 1))
    if cu_seqlens is None:
        y = torch.stack(ys)
    else:
        y = torch.cat(ys, dim=0).unsqueeze(0)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype), torch.stack(finals).to(x.dtype)


def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,))


@torch.library.custom_op("laqat::causal_conv1d", mutates_args=())
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: Optional[str],
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        y, final = searched(causal_conv1d_fwd)(
            x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
            output_final_state=output_final_state, activation=activation, cu_seqlens=cu_seqlens)
        y = y.contiguous()
        saved = (x, weight, bias, residual, initial_state, cu_seqlens, activation)
        compile_backward_ahead("causal_conv1d", describe(y.dtype, *saved[:5], cu_seqlens is None, activation),
                               x.device,
                               lambda: _fla_backward(torch.empty_like(y), None, *saved))  # no final state's gradient
        return y, final if output_final_state else _empty(x)
    y, final = causal_conv1d_reference(x, weight, bias, residual, initial_state, cu_seqlens, activation)
    return y.contiguous(), final.contiguous() if output_final_state else _empty(x)


@causal_conv1d.register_fake
def _(x, weight, bias, residual, initial_state, cu_seqlens, activation, output_final_state):
    if not output_final_state:
        return torch.empty_like(x, memory_format=torch.contiguous_format), _empty(x)
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((n, weight.shape[0], weight.shape[1])))


def _fla_backward(dy, dht, x, weight, bias, residual, initial_state, cu_seqlens, activation):
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    return searched(causal_conv1d_bwd)(
        x=x, dy=dy.contiguous(), dht=dht, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
        activation=activation, cu_seqlens=cu_seqlens)


@torch.library.custom_op("laqat::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    dy: Tensor,
    dht: Optional[Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: Optional[str],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dweight, dbias, dresidual, dinitial_state); an empty tensor for an absent input."""
    if x.is_cuda:
        dx, dw, db, dr, dh0 = _fla_backward(dy, dht, x, weight, bias, residual, initial_state, cu_seqlens, activation)
        dr = None if dr is None else dr.clone()  # FLA returns dy itself; an op output may not alias an input
    else:
        inputs = [t.detach().requires_grad_(True) if t is not None else None
                  for t in (x, weight, bias, residual, initial_state)]
        with autograd_enabled():
            y, final = causal_conv1d_reference(*inputs[:5], cu_seqlens, activation)
            outs, grads = [y], [dy]
            if dht is not None:
                outs.append(final)
                grads.append(dht)
            wrt = [t for t in inputs if t is not None]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
        dx, dw, db, dr, dh0 = [None if t is None else next(got) for t in inputs]
        # autograd may hand back dy itself (the residual's gradient): an op output must not alias an input
        dx, dw, db, dr, dh0 = [g.clone(memory_format=torch.contiguous_format) if g is not None
                               else None if t is None else torch.zeros_like(t)
                               for g, t in zip((dx, dw, db, dr, dh0), inputs)]
    return tuple(_empty(x) if g is None else g.contiguous() for g in (dx, dw, db, dr, dh0))


@causal_conv1d_backward.register_fake
def _(dy, dht, x, weight, bias, residual, initial_state, cu_seqlens, activation):
    like = (x, weight, bias, residual, initial_state)
    return tuple(_empty(x) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in like)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, initial_state, cu_seqlens, activation, output_final_state = inputs
    ctx.save_for_backward(x, weight, bias, residual, initial_state, cu_seqlens)
    ctx.activation, ctx.output_final_state = activation, output_final_state


def _backward(ctx, dy, dht):
    x, weight, bias, residual, initial_state, cu_seqlens = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    if not ctx.output_final_state:
        dht = None
    dx, dw, db, dr, dh0 = torch.ops.laqat.causal_conv1d_backward(
        dy, dht, x, weight, bias, residual, initial_state, cu_seqlens, ctx.activation)
    return (dx, dw, db if bias is not None else None, dr if residual is not None else None,
            dh0 if initial_state is not None else None, None, None, None)


causal_conv1d.register_autograd(_backward, setup_context=_setup_context)
