"""The "fla_chunk" kernel variant: FLA's own chunk kernels (exact numerics, CUDA only).

Forward calls ``chunk_gated_delta_rule`` / ``chunk_kda`` on the canonical inputs; backward
reruns that forward under torch autograd and differentiates it (FLA's autograd function
recomputes what its backward needs). Always registered; ``supports`` refuses where ``fla`` is not
installed. FLA itself is imported at the first call (importing it costs seconds).

FLA's GDN chunk backward refuses to run with Triton >= 3.4, < 3.7.1 on Hopper (it
miscompiles ``chunk_bwd_dqkwg``); ``gdn_backward_blocker()`` says so before the selection
table picks this variant, and the backward raises the same reason rather than run anything else.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.autograd_inside_op import recompute_vjp
from la_compiler.kernels.common.support import needs, not_float64
from la_compiler.kernels.fla.autotune_searches import searched
from la_compiler.kernels.registry import SelectionContext, get_variant, register_variant, spec_of


def _fla_chunk(kind: str):
    if kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    return chunk_kda


def gdn_backward_blocker() -> str | None:
    """Why FLA's GDN chunk backward cannot run on this machine, or None if it can (FLA's own guard)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        import triton

        return (f"FLA's GDN chunk backward refuses Triton {triton.__version__} on Hopper "
                "(>= 3.4, < 3.7.1 miscompiles chunk_bwd_dqkwg)")
    return None


def _check(spec, q):
    if not spec.is_exact:
        raise RuntimeError(f"kernel variant fla_chunk computes exact numerics only; {spec} asks for rounding")
    if q.device.type != "cuda":
        raise RuntimeError(f"kernel variant fla_chunk needs CUDA tensors, got device {q.device}")


def _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    o, ht = searched(_fla_chunk(spec.kind))(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=True,
        state_v_first=spec.state == "vk", cu_seqlens=cu_seqlens,
    )
    return o, ht


def fla_chunk_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    spec = spec_of(spec)
    _check(spec, q)
    o, ht = _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale)
    return o.to(q.dtype), ht.to(torch.float32)


def fla_chunk_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    spec = spec_of(spec)
    if spec.kind == "gdn" and (why := gdn_backward_blocker()) is not None:
        raise RuntimeError(f"kernel variant fla_chunk cannot differentiate {spec}: {why}; "
                           "select kernel=fused_recurrent (policy backend) for GDN training here")
    _check(spec, q)
    return recompute_vjp(lambda *xs: _run(spec, *xs, cu_seqlens, scale), q, k, v, g, beta, initial_state, do, dht)


@functools.lru_cache(maxsize=None)
def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def supports(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    return needs(
        (ctx.device == "cuda", f"FLA's chunk kernels need CUDA (device is {ctx.device})"),
        (spec.is_exact, "FLA's kernels apply no quantization (spec has quant sites, a non-exact solve or a phase)"),
        (_fla_available(), "flash-linear-attention is not installed"),
        (ctx.head_k <= 256 and ctx.head_v <= 256, "FLA supports head dims up to 256"),
        not_float64(ctx),
    ) or _gdn_backward_blocked(spec) or _laqat_kda_chunk_is_faster(spec, ctx)


def _laqat_kda_chunk_is_faster(spec: RecurrenceSpec, ctx: SelectionContext) -> str | None:
    """KDA's exact training step runs faster on laqat's chunk kernels than on FLA's, at the same accuracy
    (measured: docs/kernels-chunk-measurements.md, "Kernel selection: KDA exact on the chunk kernels"); FLA's
    kernel stays the choice where the chunk kernels cannot run the spec."""
    if spec.kind != "kda" or get_variant("chunk").supports(spec, ctx) is not None:
        return None
    return "laqat's chunk kernels run KDA's exact fwd+bwd faster on CUDA (0.72x FLA's, docs/performance.md)"


def _gdn_backward_blocked(spec: RecurrenceSpec) -> str | None:
    """A variant is chosen for forward and backward together, so GDN goes to another variant where FLA
    refuses its GDN chunk backward."""
    return gdn_backward_blocker() if spec.kind == "gdn" else None


register_variant(
    "fla_chunk",
    fla_chunk_forward,
    fla_chunk_backward,
    "FLA's chunk_gated_delta_rule / chunk_kda (CUDA; exact numerics)",
    supports=supports,
    summary="FLA's own chunk kernel: exact numerics on CUDA",
)
