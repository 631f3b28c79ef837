"""A serving profile's forward on the server's own kernels (``serving.forward: server``,
kernels/decode/server_forward.py) against the oracle (tests/serving/vllm_serving.py's ``serve``): the outputs and
final states are vLLM's bit for bit, the gradients laqat's reproduction's. The oracle's ``load()`` makes its
stand-in ``vllm`` package importable at 0.33.0, so ``auto`` resolves to the server's kernels here."""
import pytest
import torch

import la_compiler.kernels  # noqa: F401  (registers the variants)
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.decode import server_forward
from la_compiler.kernels.registry import get_variant
from la_compiler.policy.file_format import with_precision_alias
from la_compiler.policy.resolution import Policy
from tests.serving.test_vllm_parity import _inputs
from tests.serving.vllm_serving import serve

BF16 = torch.bfloat16
CASES = {
    # id: (kind, policy cfg, vLLM cache dtype, state layout, cu_seqlens | B, T, H, HV, K, V, prefill, valid)
    "gdn-bf16-cache-packed-gqa": ("gdn", {"precision": "vllm"}, BF16, "vk", [0, 20, 28, 33], 33, 1, 2, 16, 16,
                                  [12, 0, 4], [20, 8, 5]),
    "kda-fp32-cache-batch": ("kda", {"precision": "vllm_kimi_k3"}, torch.float32, "kv", 2, 14, 1, 1, 16, 16,
                             [9, 13], [14, 14]),
}


def _spec(cfg, kind, layout, forward):
    cfg = with_precision_alias(cfg)
    cfg["serving"] = {**cfg["serving"], "forward": forward}
    res = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": cfg}]}).resolve("model.layers.0.attn",
                                                                                            kind)
    return RecurrenceSpec(kind, state=layout, phase=res.phase, quant=res.quant, extra=res.extra,
                          kernel="decode_serving"), res


def _case(case):
    kind, cfg, cache, layout, batch, T, H, HV, K, V, prefill, valid = CASES[case]
    cu = torch.tensor(batch, dtype=torch.long) if isinstance(batch, list) else None
    B, n = (1, len(batch) - 1) if cu is not None else (batch, batch)
    torch.manual_seed(0)
    xs = _inputs(kind, BF16, B, T, H, HV, K, V, n, layout, True)
    return kind, cfg, cache, layout, cu, xs, torch.tensor(prefill), torch.tensor(valid)


def _run(spec, xs, cu, prefill, valid, do, dht):
    q, k, v, g, beta, h0 = xs
    variant = get_variant("decode_serving")
    saved = torch.empty(variant.residual_numel(spec, q, v, cu), dtype=torch.float32)
    o, ht = variant.forward(spec, q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5, prefill_lengths=prefill,
                            valid_lengths=valid, save_to=saved)
    grads = variant.backward(spec, q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5, do, dht, prefill_lengths=prefill,
                             valid_lengths=valid, saved=saved)
    return o, ht, grads


@pytest.mark.parametrize("case", list(CASES))
def test_server_forward_is_vllms_and_its_backward_laqats(case, vllm, as_gpu):
    kind, cfg, cache, layout, cu, xs, prefill, valid = _case(case)
    spec, res = _spec(cfg, kind, layout, "auto")
    assert dict(spec.extra)["forward"] == "server", res.rules  # auto: the oracle's vllm 0.33.0 is importable
    assert any("forward: the server's kernels (vllm 0.33.0) for the prefix, laqat's decode kernels (laid out as its "
               "packed decode) for the decode steps, laqat's backward (auto: the server's package is importable)" in r
               for r in res.rules), res.rules
    q, k, v, g, beta, h0 = xs
    h0_kv = h0.transpose(-1, -2) if layout == "vk" else h0
    o_ref, h_ref = serve(vllm, kind, q, k, v, g, beta, prefill_lengths=prefill.tolist(),
                         valid_lengths=valid.tolist(), cache_dtype=cache, initial_state=h0_kv, cu_seqlens=cu)
    do, dht = torch.randn(o_ref.shape).to(BF16), torch.randn(h0.shape)
    o, ht, grads = _run(spec, xs, cu, prefill, valid, do, dht)
    ht = ht.transpose(-1, -2) if layout == "vk" else ht
    assert o.dtype == o_ref.dtype and torch.equal(o, o_ref) and torch.equal(ht, h_ref)

    laqat_spec, _ = _spec(cfg, kind, layout, "laqat")
    assert "forward" not in dict(laqat_spec.extra)
    _, _, laqat_grads = _run(laqat_spec, xs, cu, prefill, valid, do, dht)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, laqat_grads):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_forward_laqat_runs_laqats_kernels(vllm, as_gpu, monkeypatch):
    kind, cfg, cache, layout, cu, xs, prefill, valid = _case("gdn-bf16-cache-packed-gqa")
    spec, res = _spec(cfg, kind, layout, "laqat")
    assert any("forward: laqat's reproduction, laqat's backward" in r for r in res.rules), res.rules

    def refused(*args, **kwargs):
        raise AssertionError("the server's kernels ran under forward: laqat")

    monkeypatch.setattr(server_forward, "server_forward", refused)
    q, k, v, g, beta, h0 = xs
    o, ht = get_variant("decode_serving").forward(spec, q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5,
                                                  prefill_lengths=prefill, valid_lengths=valid)
    from la_compiler.kernels.decode.phased import phased_forward

    o2, ht2 = phased_forward(spec, q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5, prefill_lengths=prefill,
                             valid_lengths=valid)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_server_forward_refuses_an_fp32_gdn_prefill(vllm):
    spec, _ = _spec({"precision": "vllm"}, "gdn", "kv", "server")
    q, k, v, g, beta, h0 = _inputs("gdn", torch.float32, 1, 6, 1, 1, 16, 16, 1, "kv", False)
    with pytest.raises(server_forward.ServerKernelsUnavailable, match="refuses fp32 inputs.*serving.forward: laqat"):
        get_variant("decode_serving").forward(spec, q, k, v, g, beta, None, None, 0.25,
                                              prefill_lengths=torch.tensor([3]), valid_lengths=torch.tensor([6]))
