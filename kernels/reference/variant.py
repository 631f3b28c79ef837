"""The "reference" kernel variant: the fp64 torch reference, run as a kernel.

Slow (in Python) but exact, on every device; the lower pass selects it only where a policy
asks for it (``backend: reference``) or where no Triton kernel implements the spec,
and ``explain`` says so. Backward recomputes the forward under autograd.

It applies a prefill spec's numerics (docs/numerics.md, "Where the rounding happens"):
- no rounding, or state rounding only: the token-by-token reference; the state is rounded
  once when loaded and, through ``state_hook``, after every chunk of ``spec.chunk`` tokens
  (the partial last chunk included). Within a chunk, token t reads the rounded incoming state
  plus the exact updates of the chunk's earlier tokens: the chunked algorithm's arithmetic.
- W / GEMM-operand sites, accumulator emulation or a Neumann solve: the chunked (WY)
  reference, ``reference/chunk.py``, which rounds every site in its stated order.
Decode-phase specs (phase=token|replay) and ``x.`` options are not applied here:
``unsupported_reason`` says so and the selection table picks another variant or fails.
"""
from __future__ import annotations

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.autograd_inside_op import recompute_vjp
from la_compiler.kernels.common.canonical_inputs import final_state_dtype
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import delta_rule_reference, sequence_bounds
from la_compiler.kernels.reference.rounding_from_spec import rounding_from_spec
from la_compiler.kernels.registry import register_variant, spec_of
from la_compiler.quant import QuantConfig, fake_quant


def _needs_chunked(spec: RecurrenceSpec) -> bool:
    return spec.solve != "exact" or bool(spec.acc) or any(site != "state" for site, _ in spec.quant)


def unsupported_reason(spec: RecurrenceSpec, head_v: int | None = None) -> str | None:
    """None when this variant applies every rounding of ``spec`` (on values of ``head_v``
    columns); else why not (for the kernel-selection table)."""
    if spec.phase != "none":
        return f"phase={spec.phase}: the reference variant computes prefill only (decode needs a decode variant)"
    if spec.extra:
        return f"it applies no spec options {['x.' + k for k, _ in spec.extra]}"
    try:
        if _needs_chunked(spec):
            rounding_from_spec(spec)
        state = QuantConfig.parse(spec.quant_map["state"]) if "state" in spec.quant_map else None
    except (ImportError, ValueError) as e:
        return f"cannot build the rounding of {spec}: {e}"
    if state is not None and state.format == "int8_h32" and head_v is not None and head_v % 32:
        return f"the Hadamard-32 state codec needs a value head dim that is a multiple of 32, got V={head_v}"
    return None


def _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    spec = spec_of(spec)
    if _needs_chunked(spec):
        return chunk_delta_rule_reference(q, k, v, g, beta, spec=spec, scale=scale, initial_state=initial_state,
                                          cu_seqlens=cu_seqlens, dtype=torch.float64)
    state_fmt = spec.quant_map.get("state")
    hook = None
    if state_fmt is not None:
        if initial_state is not None:  # a stored state: rounded once, when loaded
            kv = initial_state.transpose(-1, -2) if spec.state == "vk" else initial_state  # tiles are [K x BV]
            kv = fake_quant(kv, state_fmt)
            initial_state = kv.transpose(-1, -2) if spec.state == "vk" else kv
        lengths = [end - start for _, start, end in sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)]

        def hook(state, n, t_end):  # state [HV, K, V]: round after every chunk and after the last token
            if t_end % spec.chunk == 0 or t_end == lengths[n]:
                return fake_quant(state, state_fmt)
            return state

    return delta_rule_reference(
        q, k, v, g, beta,
        kind=spec.kind, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_layout=spec.state, dtype=torch.float64, state_hook=hook,
    )


def reference_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    o, ht = _run(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale)
    return o.to(q.dtype), ht.to(final_state_dtype(q.dtype))


def reference_backward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dht):
    return recompute_vjp(lambda *xs: _run(spec, *xs, cu_seqlens, scale), q, k, v, g, beta, initial_state, do, dht)


register_variant(
    "reference",
    reference_forward,
    reference_backward,
    "fp64 torch reference: token by token, or chunked where W/GEMM sites round (any device; slow)",
    supports=lambda spec, ctx: unsupported_reason(spec, ctx.head_v),
    summary="fp64 torch reference: any prefill spec, any device, slow",
    implementation="torch",
)
