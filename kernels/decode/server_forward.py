"""A serving profile's forward on the server's own kernels (``x.forward=server``, the policy's ``serving.forward``).

Where the server's package is importable at the profile's release (vLLM 0.33.0: ``vllm.__version__``), the
decode-phase serving op's forward runs vLLM's Triton kernels as vLLM's serving loop does (docs/serving.md §1):

1. the state cache ``[slots, HV, V, K]`` in the cache dtype, slot 0 vLLM's NULL block; an initial state is
   written into it with ``.to(cache dtype)``;
2. the prefixes of every sequence with one, packed, through vLLM's chunk kernel (``chunk_gated_delta_rule``,
   vLLM's copy of FLA, or Kimi's ``chunk_kda_with_fused_gate`` stages, ``kda_prefill_with_fused_gate``) from the
   cached states; the final states go back into the cache with ``.to(cache dtype)``;
3. the decode steps through laqat's decode kernels (kernels/decode/kernels.py) from the cached states. vLLM's
   layers decode with its packed kernels (``fused_recurrent_gated_delta_rule_packed_decode``,
   ``fused_recurrent_kda_packed_decode``), which take the raw projections and compute the l2 norm, the gate and
   beta themselves; the serving op receives those already computed (passes/serving_inputs.py). vLLM's kernels that
   take them computed (``fused_recurrent_gated_delta_rule``, ``fused_recurrent_kda_fwd``) sum in another register
   layout on a GPU and differ from the packed kernels in the last bits of some states, where laqat's decode kernels,
   laid out as the packed kernels, equal them bit for bit (docs/serving.md, "The GPU check").

The outputs and the final states (the cache, widened to fp32) are then what vLLM's layers compute, bit for bit,
wherever the prefix's inputs are (docs/serving.md says where they are not). The backward is laqat's
reproduction's (kernels/decode/phased.py) at the same inputs: a training forward runs laqat's forward as well, for
the residuals its backward reads (the decode phase's checkpoints), and returns the server's outputs.

tests/serving/vllm_serving.py is the independent oracle of this module (the same loop, written separately).
"""
from __future__ import annotations

import functools
import importlib

import torch

from la_compiler.error_base import LaqatError
from la_compiler.kernels.decode import suffix
from la_compiler.options import SERVING_RELEASES, decode_options

# vLLM's kernel modules, by role (the same names in vLLM's package and in the tests' stand-in of it).
VLLM_MODULES = {
    "gdn_chunk": "vllm.third_party.flash_linear_attention.ops.chunk",
    "kda_chunk": "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk",
}


class ServerKernelsUnavailable(LaqatError, RuntimeError):
    """``x.forward=server`` where the server's kernels cannot run the inputs."""


def unavailable(profile: str) -> str | None:
    """None where the server's kernels of ``profile`` (``vllm-0.33``) are importable at its release, else why not."""
    engine, release = profile.partition("-")[0], SERVING_RELEASES[profile]
    if engine != "vllm":
        return f"laqat drives no {engine} kernels"
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as e:
        return f"vllm is not importable ({e})"
    found = getattr(vllm, "__version__", None)
    if str(found).partition("+")[0] != release:
        return f"vllm {found} is importable, the profile reproduces {release}"
    try:
        for name in VLLM_MODULES.values():
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (an import of a kernel file can fail in many ways)
        return f"vllm {found}'s kernel modules do not import ({type(e).__name__}: {e})"
    envs = _vllm_envs()
    if envs is not None and not envs.VLLM_TRITON_FORCE_FIRST_CONFIG:
        return ("VLLM_TRITON_FORCE_FIRST_CONFIG is not set: the profile pins autotuned kernels to their first config "
                "(set VLLM_TRITON_FORCE_FIRST_CONFIG=1 here and on the server)")
    return None


def _vllm_envs():
    """vLLM's ``envs`` module, None in a stand-in package without it (the tests' oracle pins the first config
    itself)."""
    try:
        return importlib.import_module("vllm.envs")
    except ImportError:
        return None


def _modules():
    return {role: importlib.import_module(name) for role, name in VLLM_MODULES.items()}


def kda_prefill_with_fused_gate(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                                gate=None):
    """Kimi's prefill as its layers run it (``chunk_kda_with_fused_gate``): the fused gate kernel's cumsum
    (``tl.cumsum`` within each 64-token chunk, times 1 / ln 2), then its later stages. With ``gate`` = (A_log,
    dt_bias), g is the raw gate, summed as vLLM's layer calls the kernel (its product -exp(A_log) * softplus(g +
    dt_bias) inside the sum, which a GPU contracts into one FMA). Without, g is the log-decay: the kernel fed the raw
    gate -g with A_log 0 and a softplus linear everywhere (threshold -inf), so that its gate ``-exp(0) * -g`` is g
    exactly. (``chunk_kda``, the canonical-gate entry no layer calls, sums G with a masked dot: other fp32 bits.)"""
    chunk = _modules()["kda_chunk"]
    chunk_indices = chunk.prepare_chunk_indices(cu_seqlens, chunk.FLA_CHUNK_SIZE)
    if gate is None:
        raw, gate_args = -g, dict(A_log=g.new_zeros(g.shape[2], dtype=torch.float32), g_bias=None,
                                  threshold=float("-inf"))
    else:
        raw, gate_args = g, dict(A_log=gate[0], g_bias=gate[1])
    g_cum, _ = chunk.fused_kda_gate_chunk_cumsum(raw, raw_beta=beta, cu_seqlens=cu_seqlens,
                                                  chunk_indices=chunk_indices, chunk_size=chunk.FLA_CHUNK_SIZE,
                                                  **gate_args)
    return chunk._chunk_kda_fwd_with_cumulative_g(
        q=q, k=k, v=v, g=g_cum, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_size=chunk.FLA_CHUNK_SIZE)


def server_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths, valid_lengths,
                   gate=None):
    """(o [B, T, HV, V] in q's dtype, zero past each valid length; final states fp32 in the spec's layout): what
    the server computes for these tokens (module docstring). ``gate``: (A_log, dt_bias) where g is KDA's raw gate."""
    from la_compiler.kernels.decode.phased import plan
    from la_compiler.kernels.decode.serving_kda_inputs import raw_gate_log_decay

    options = decode_options(spec)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    if spec.kind == "gdn" and v.dtype == torch.float32 and any(int(x) > 0 for x in prefill_lengths.tolist()):
        raise ServerKernelsUnavailable(
            f"spec {spec}: vLLM {SERVING_RELEASES[options.serving]}'s GDN chunk kernel refuses fp32 inputs, and this "
            f"batch has a prefix; set serving.forward: laqat (laqat's reproduction) for an fp32 model")
    p = plan(B, T, cu_seqlens, prefill_lengths, valid_lengths, dev)
    cache_dtype = getattr(torch, options.cache_dtype(spec.kind, v.dtype))
    m = _modules()
    cache = torch.zeros(p.n + 1, HV, V, K, dtype=cache_dtype, device=dev)
    if initial_state is not None:
        cache[1:] = (initial_state if spec.state == "vk" else initial_state.transpose(-1, -2)).to(cache_dtype)
    o = torch.zeros(B * T, HV, V, dtype=q.dtype, device=dev)

    def tokens(x, rows):
        return x.reshape(-1, *x.shape[2:])[rows].unsqueeze(0).contiguous()

    if p.prefix_seqs:
        slots = torch.tensor([i + 1 for i in p.prefix_seqs], device=dev)
        # a serving pass's fp32 q, k hold v's dtype's values on prefix tokens (passes/serving_inputs.py)
        args = [tokens(x, p.prefix_rows) for x in (q.to(v.dtype), k.to(v.dtype), v, g, beta)]
        if spec.kind == "gdn":
            chunk = m["gdn_chunk"].chunk_gated_delta_rule
        else:
            chunk = functools.partial(kda_prefill_with_fused_gate, gate=gate)
        o_pre, ht = chunk(*args, scale=scale, initial_state=cache[slots].clone(), output_final_state=True,
                          cu_seqlens=p.prefix_cu)
        o[p.prefix_rows] = o_pre[0].to(q.dtype)
        cache[slots] = ht.to(cache_dtype)

    if p.suffix_seqs:  # the decode steps: laqat's kernels, bit for bit vLLM's packed decode (module docstring)
        seqs = torch.tensor(p.suffix_seqs, device=dev)
        handoff = cache[1:][seqs]
        handoff = handoff if spec.state == "vk" else handoff.transpose(-1, -2)
        log_decay = raw_gate_log_decay(tokens(g, p.suffix_rows), gate)  # the decode steps' tokens only
        o_suf, ht = suffix.suffix_forward(spec, *(tokens(x, p.suffix_rows) for x in (q, k, v)), log_decay,
                                          tokens(beta, p.suffix_rows), handoff, p.suffix_cu, scale)
        o[p.suffix_rows] = o_suf[0].to(q.dtype)
        cache[1:][seqs] = (ht if spec.state == "vk" else ht.transpose(-1, -2)).to(cache_dtype)
    final = cache[1:].float()
    final = final if spec.state == "vk" else final.transpose(-1, -2)
    return o.view(B, T, HV, V), final.contiguous()


def forward_with(laqat_forward):
    """The serving variant's forward: ``laqat_forward`` (phased.phased_forward) for ``x.forward=laqat``; for
    ``x.forward=server`` the server's outputs, with laqat's forward run first where a training forward keeps
    residuals (``save_to``) for laqat's backward."""

    def forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale, *, prefill_lengths=None,
                valid_lengths=None, save_to: torch.Tensor | None = None, gate=None):
        from la_compiler.kernels.registry import spec_of

        if decode_options(spec_of(spec)).forward != "server":
            return laqat_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                 prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, save_to=save_to,
                                 gate=gate)
        if save_to is not None:
            laqat_forward(spec, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                          prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, save_to=save_to, gate=gate)
        from la_compiler.kernels.common.decode_phase import require_lengths

        require_lengths(spec_of(spec), prefill_lengths, valid_lengths)
        return server_forward(spec_of(spec), q, k, v, g, beta, initial_state, cu_seqlens, scale,
                              prefill_lengths=prefill_lengths, valid_lengths=valid_lengths, gate=gate)

    return forward

