"""The eager oracle of the Megatron tests: the uncompiled Megatron model on the CPU.

Megatron's GDN calls three FLA functions, all Triton kernels that cannot run on the CPU (FLA's autotuner
needs a GPU driver, its chunk kernels fail in Triton's interpreter). ``eager_megatron(model)`` runs the
model as Megatron wrote it with those three replaced by FLA's own torch references, the same ones the FLA
frontend's tests use (tests/passes/fla_oracle.py, which shares no code with laqat):

- ``l2norm`` (q and k, in ``_prepare_input_for_gated_delta_rule``): ``x / sqrt(sum(x^2) + 1e-6)`` in fp32;
- ``causal_conv1d`` (the FLA path's short convolution): ``F.conv1d`` with W - 1 left padding, per sequence;
- the recurrence: FLA's ``chunk_gated_delta_rule`` / ``chunk_kda`` becomes FLA's naive token-by-token
  recurrence (``naive_recurrent_gated_delta_rule`` / ``naive_recurrent_kda``), per packed sequence.
  With ``deterministic_mode=True`` the recurrence is Megatron's own torch fallback
  (``torch_chunk_gated_delta_rule``) or, for the KDA test layer, FLA's ``naive_chunk_kda``: unchanged.

``eager_megatron(model, recurrence=fn)`` runs ``fn`` as every layer's recurrence instead (the decode-phase
test gives it laqat's fp64 decode reference, kernels/reference/decode.py).

Megatron's ``jit_fuser`` (``torch.compile``) methods run eagerly inside ``eager_megatron`` (compiler stance
``force_eager``), so the oracle is never an Inductor build of Megatron's code.
"""
from __future__ import annotations

import contextlib

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.kda import chunk_kda

from tests.megatron.megatron_models import gdn_layers
from tests.passes.fla_oracle import conv1d_oracle, fla_l2norm, naive_fla_call


def _l2norm(x):
    return fla_l2norm(x).to(x.dtype)


def _naive_gdn(*args, **kwargs):
    return naive_fla_call("gdn", *args, **kwargs)


def _naive_kda(*args, **kwargs):
    return naive_fla_call("kda", *args, **kwargs)


NAIVE_RECURRENCE = {chunk_gated_delta_rule: _naive_gdn, chunk_kda: _naive_kda}


@contextlib.contextmanager
def eager_megatron(model, recurrence=None):
    import megatron.core.ssm.gated_delta_net.common as gdn_common
    import megatron.core.ssm.gated_delta_net.gdn as gdn_forward

    layers = gdn_layers(model)
    saved_rules = [layer.gated_delta_rule for layer in layers]
    saved = (gdn_common.l2norm, gdn_forward.causal_conv1d)
    try:
        gdn_common.l2norm, gdn_forward.causal_conv1d = _l2norm, conv1d_oracle
        for layer in layers:
            layer.gated_delta_rule = recurrence or NAIVE_RECURRENCE.get(layer.gated_delta_rule, layer.gated_delta_rule)
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        gdn_common.l2norm, gdn_forward.causal_conv1d = saved
        for layer, rule in zip(layers, saved_rules):
            layer.gated_delta_rule = rule
