"""Megatron-Core frontend: what Megatron's GDN path needs so that Dynamo traces it in one graph.

Megatron-Core (0.19.2) runs its GatedDeltaNet recurrence through FLA's ``chunk_gated_delta_rule``
(the FLA frontend's substitution turns it into a laqat node) or, with ``deterministic_mode=True``,
through its torch fallback ``torch_chunk_gated_delta_rule`` (the torch frontend matches it), so the
recurrence itself needs nothing here. What breaks the graph is Megatron's warnings, since Dynamo
cannot trace ``warnings.warn``:

- ``RowParallelLinear.forward`` passes ``tp_group=None`` to ``linear_with_grad_accumulation_and_async_allreduce``,
  whose ``get_tensor_model_parallel_group_if_none`` then warns (a deprecation) on rank 0 at every forward:
  every row-parallel linear (each layer's ``out_proj`` and MLP ``linear_fc2``) ended a graph;
- with tensor parallelism, ``linear_with_grad_accumulation_and_async_allreduce`` advises setting
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` once per process (``allreduce_dgrad`` or ``sequence_parallel``).

A third thing breaks the graph under tensor parallelism: the backward of Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` (every column-parallel linear) all-reduces the input
gradient with ``async_op=True``, to overlap it with the weight-gradient GEMM, and Dynamo cannot trace an
asynchronous collective: each column-parallel linear became a graph break, its autograd.Function run
eagerly. Where the call uses none of that function's other machinery (no gradient-accumulation fusion, no
sequence parallelism, no deferred weight gradients, no GTP remat), the substituted
``linear_with_grad_accumulation_and_async_allreduce`` applies ``_LinearAllReduceDgrad`` instead: the same
matmuls in the same order and the same all-reduce, issued synchronously (only the overlap is lost; the
values are the same). Any other call applies Megatron's own function (a graph break, Megatron's numerics).

Both functions are substituted (``torch._dynamo.substitute_in_graph``, keyed on Megatron's function
objects, so every module that imported them is covered) by the same functions, whose warnings are issued
by ``torch._dynamo.assume_constant_result`` helpers: Dynamo runs those while it traces, so under
``torch.compile`` each warning is issued when the call is traced (at compile time) instead of breaking the
graph. (Dynamo's ``reorderable_logging_functions`` would move the call after the graph, but Dynamo 2.13
drops such calls made inside inlined functions, i.e. the warning would vanish.) The warnings keep
Megatron's messages, categories and once-per-process flag; eager calls run Megatron's originals.

Megatron's own compile points (``megatron.core.jit.jit_fuser``, i.e. ``torch.compile``, on
``_prepare_input_for_gated_delta_rule``, ``_compute_g_and_beta`` and ``_apply_gated_norm``) need
nothing: Dynamo inlines a ``torch.compile``d function called inside a frame it is tracing.

Imported once, when ``megatron.core.utils`` has been imported (``install_trace_frontends``), so a
process that never uses Megatron never imports it.
"""
from __future__ import annotations

import inspect
import os
import warnings

import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

TP_GROUP_DEPRECATION = ("Warning: tp_group is None, using default tp group. "
                        "Passing tp_group will be mandatory soon")  # Megatron-Core 0.19.2's text


@torch._dynamo.assume_constant_result
def _tp_group_deprecation(message: str) -> bool:
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    return True


def tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """``megatron.core.utils.get_tensor_model_parallel_group_if_none`` (0.19.2), its warning issued while Dynamo traces."""
    if not torch.distributed.is_initialized():
        return None
    if not parallel_state.is_initialized():
        return tp_group
    if tp_group is None:
        if torch.distributed.get_rank() == 0:
            _tp_group_deprecation(TP_GROUP_DEPRECATION)
        if is_expert:
            tp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        else:
            tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
    return tp_group


@torch._dynamo.assume_constant_result
def _cuda_max_connections_advice(sequence_parallel: bool, allreduce_dgrad: bool) -> bool:
    """Megatron's advice, as ``linear_with_grad_accumulation_and_async_allreduce`` (0.19.2) gives it: once per
    process (its ``warned`` flag), unless ``CUDA_DEVICE_MAX_CONNECTIONS`` is 1."""
    original = megatron_layers.linear_with_grad_accumulation_and_async_allreduce
    if original.warned or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return True
    for on, what in ((sequence_parallel, "sequence parallelism"), (allreduce_dgrad, "async grad allreduce")):
        if on:
            warnings.warn(f"When using {what} it is recommended to set the environment variable "
                          f"CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", stacklevel=2)
            original.warned = True
    return True


class _LinearAllReduceDgrad(torch.autograd.Function):
    """``LinearWithGradAccumulationAndAsyncCommunication`` (0.19.2) without gradient-accumulation fusion, sequence
    parallelism, deferred weight gradients and GTP remat, its input-gradient all-reduce synchronous."""

    @staticmethod
    @megatron_layers.custom_fwd
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.use_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @megatron_layers.custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                      wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):
    """``megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce`` (0.19.2),
    its advice issued while Dynamo traces, its plain calls through ``_LinearAllReduceDgrad``."""
    tp_group = tensor_model_parallel_group_if_none(tp_group)
    _cuda_max_connections_advice(sequence_parallel, allreduce_dgrad)
    if not (gradient_accumulation_fusion or sequence_parallel or grad_output_buffer is not None
            or gtp_remat_size != 1):
        return _LinearAllReduceDgrad.apply(input, weight, bias, allreduce_dgrad, tp_group)
    return megatron_layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, grad_output_buffer,
        wgrad_deferral_limit, tp_group, gtp_remat_size)


SUBSTITUTED: dict = {}  # Megatron's function object -> the replacement Dynamo traces instead

# (module, function name, its parameters in Megatron-Core 0.19.2, the replacement)
_SUBSTITUTIONS = (
    (megatron_utils, "get_tensor_model_parallel_group_if_none", ["tp_group", "is_expert", "check_initialized"],
     tensor_model_parallel_group_if_none),
    (megatron_layers, "linear_with_grad_accumulation_and_async_allreduce",
     ["input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
      "grad_output_buffer", "wgrad_deferral_limit", "tp_group", "gtp_remat_size"],
     linear_with_grad_accumulation_and_async_allreduce),
)


def _install() -> None:
    for module, name, parameters, replacement in _SUBSTITUTIONS:
        original = getattr(module, name, None)
        if original is None or list(inspect.signature(original).parameters) != parameters:
            continue  # another Megatron-Core: its own function runs (a graph break, never other numerics)
        if original not in SUBSTITUTED:
            torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(replacement)
            SUBSTITUTED[original] = replacement


_install()
