"""The decode-phase variant (chunked prefix, fused Triton decode suffix; interpreter on CPU) against the fp64
decode reference.

Forward (outputs, final state) and the gradient of every input, across token / replay modes, codecs (per tile
and per key row x block), readouts, the decay grid, layouts, grouped heads, partial tiles, empty prefixes and
suffixes, padding and packed sequences; through the training path (the forward stores the suffix's checkpoints,
the backward reads them) with blocks of 4 tokens, so that every suffix spans several backward blocks and the
persistent backward grid takes several blocks per program; and the backward without them (it recomputes).
"""
from pathlib import Path

import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels import sources
from la_compiler.kernels.decode import suffix
from la_compiler.kernels.decode.fused import decode_fused_backward, decode_fused_forward
from la_compiler.kernels.decode.phased import residual_numel
from la_compiler.kernels.reference.decode import delta_rule_decode_reference
from la_compiler.kernels.registry import get_variant
from la_compiler.kernels.selection import select_kernel
from la_compiler.options import decode_options
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs

SERVING_BF16 = {"serving": "vllm-0.33", "state_dtype": "bfloat16"}
CASES = {
    # id: (kind, phase, state format, extras, layout, h0, B, T, H, HV, K, V, prefill, valid, cu_seqlens)
    "gdn-token-fp8-gqa": ("gdn", "token", "fp8_e4m3/tile16", {}, "kv", True, 2, 8, 1, 2, 4, 16, [3, 0], [8, 6], None),
    "kda-token-fp8-stored-grid-vk-empty-suffix": (
        "kda", "token", "fp8_e4m3/tile16", {"readout": "stored", "decay_log_step": "0.03125"}, "vk", True,
        2, 7, 2, 2, 4, 16, [7, 2], [7, 7], None),
    "kda-token-int8-partial-tiles": ("kda", "token", "int8/tile16", {}, "kv", False, 1, 7, 1, 1, 6, 24, [0], [6],
                                     None),
    "gdn-token-h32-stored": ("gdn", "token", "int8_h32/tile32", {"readout": "stored"}, "kv", True, 1, 6, 1, 1, 4, 32,
                             [2], [6], None),
    "kda-replay-fp8-factors-grid": ("kda", "replay", "fp8_e4m3/tile16",
                                    {"replay_window": "3", "replay_factor_qdq": "1", "decay_log_step": "0.015625"},
                                    "kv", True, 2, 9, 1, 1, 4, 16, [2, 5], [9, 8], None),
    "gdn-replay-h32-factors-vk-stored": ("gdn", "replay", "int8_h32/tile32",
                                         {"replay_window": "2", "replay_factor_qdq": "1", "readout": "stored"},
                                         "vk", True, 1, 7, 1, 1, 4, 32, [3], [7], None),
    "kda-token-fp8-packed": ("kda", "token", "fp8_e4m3/tile16", {"readout": "stored"}, "kv", True, 1, 12, 1, 2, 4,
                             16, [2, 0, 0], [5, 0, 6], [0, 5, 5, 12]),
    "kda-token-exact": ("kda", "token", None, {}, "kv", True, 1, 6, 1, 1, 4, 8, [2], [6], None),
    # one scale per key row and 16 values (two value tiles), V-first memory, stored readout, grouped heads
    "gdn-token-int8-block16-vk-stored": ("gdn", "token", "int8/block16", {"readout": "stored"}, "vk", True,
                                         2, 11, 1, 2, 4, 32, [3, 0], [11, 9], None),
    "kda-replay-fp8-block16-factors": ("kda", "replay", "fp8_e4m3/block16",
                                       {"replay_window": "3", "replay_factor_qdq": "1"}, "kv", False,
                                       1, 10, 1, 1, 4, 32, [1], [10], None),
    "gdn-token-fp8-grid-packed": ("gdn", "token", "fp8_e4m3/tile16", {"decay_log_step": "0.0625"}, "vk", True,
                                  1, 13, 1, 2, 4, 16, [1, 0, 3], [4, 0, 8], [0, 4, 4, 13]),
    # serving profiles: the state tile V-first in registers (vLLM's order), the cache dtype at every write
    "gdn-serving-bf16-cache-gqa-packed": ("gdn", "token", None, SERVING_BF16, "vk", True, 1, 12, 1, 2, 4, 16,
                                          [3, 0, 1], [6, 4, 2], [0, 6, 10, 12]),
    "kda-serving-fp16-cache-fp8-kv": ("kda", "token", "fp8_e4m3/tile16", {**SERVING_BF16, "state_dtype": "float16"},
                                      "kv", True, 2, 7, 1, 1, 4, 16, [2, 0], [7, 5], None),
    "gdn-serving-bf16-cache-int8-block16": ("gdn", "token", "int8/block16", SERVING_BF16, "vk", True,
                                            1, 9, 1, 1, 4, 32, [2], [9], None),
}


def _spec(kind, phase, fmt, extras, layout):
    return RecurrenceSpec(kind, phase=phase, state=layout, kernel="decode_fused",
                          quant=(("state", fmt),) if fmt else (), extra=tuple(sorted(extras.items())))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(suffix, "CHECKPOINT_EVERY", 4)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_decode_matches_reference(case, small_blocks):
    kind, phase, fmt, extras, layout, use_h0, B, T, H, HV, K, V, prefill, valid, cu = CASES[case]
    spec = _spec(kind, phase, fmt, extras, layout)
    (q, k, v, g, beta, h0), cu_t = random_inputs(kind, B=B, T=T, H=H, HV=HV, K=K, V=V, initial_state=use_h0,
                                                 cu_seqlens=cu, state_layout=layout)
    pre, val = torch.tensor(prefill, dtype=torch.int32), torch.tensor(valid, dtype=torch.int32)
    scale = K ** -0.5
    residual = torch.full((residual_numel(spec, q, v, cu_t),), float("nan"))
    o, ht = decode_fused_forward(spec, q, k, v, g, beta, h0, cu_t, scale, prefill_lengths=pre, valid_lengths=val,
                                 save_to=residual)
    ro, rh = delta_rule_decode_reference(q, k, v, g, beta, kind=kind, options=decode_options(spec),
                                         prefill_lengths=prefill, valid_lengths=valid, scale=scale,
                                         initial_state=h0, cu_seqlens=cu_t, state_layout=layout)
    # with a codec or a serving cache dtype the state is rounded: 1e-4 leaves room for a rounding flip (fp32 and fp64
    # on two sides of a boundary) and is below what leaving the bf16 / fp16 cache rounding out costs (1e-3 here)
    tol = 1e-5 if fmt is None and "state_dtype" not in extras else 1e-4
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ro) < tol and rel_l2(ht, rh) < tol, (rel_l2(o, ro), rel_l2(ht, rh))
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = decode_fused_backward(spec, q, k, v, g, beta, h0, cu_t, scale, do, dht, prefill_lengths=pre,
                                  valid_lengths=val, saved=residual)
    leaves = [x for x in (q, k, v, g, beta, h0) if x is not None]
    want = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(), leaves)
    assert (grads[5] is None) == (h0 is None)
    for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        assert rel_l2(got, ref) < tol, (name, rel_l2(got, ref))


def test_selection_picks_the_fused_kernel_for_decode_specs_and_honours_implementation():
    spec = _spec("kda", "token", "fp8_e4m3/tile64", {}, "kv").replace(kernel="auto")
    assert select_kernel(spec, device="cpu", dtype=torch.float32, head_k=64, head_v=64).variant == "decode_fused"
    choice = select_kernel(spec, device="cpu", dtype=torch.float32, head_k=64, head_v=64, family="torch")
    assert choice.variant == "decode_reference"
    assert any(name == "decode_fused" and "implementation" in why for name, why in choice.rejected)
    h32 = _spec("kda", "token", "int8_h32/tile32", {}, "kv").replace(kernel="auto")
    choice = select_kernel(h32, device="cpu", dtype=torch.float32, head_k=16, head_v=48)
    assert choice.variant == "decode_reference" and "multiple of 32" in dict(choice.rejected)["decode_fused"]
    exact = RecurrenceSpec("kda")
    assert "phase=none" in dict(select_kernel(exact, device="cpu", dtype=torch.float32, head_k=8, head_v=8)
                                .rejected).get("decode_fused", "phase=none")
    assert get_variant("decode_fused").forward is decode_fused_forward


def test_kernels_are_specialized_per_spec_by_constexprs_and_viewable():
    from la_compiler.kernels.decode import kernels
    from la_compiler.kernels.decode.suffix import DecodeParams

    replay = _spec("gdn", "replay", "int8_h32/tile32", {"replay_window": "4", "replay_factor_qdq": "1"}, "vk")
    token = _spec("kda", "token", "fp8_e4m3/tile64", {"readout": "stored"}, "kv")
    a, b = sources.constexprs_of_spec(replay), sources.constexprs_of_spec(token.to_string())
    assert a["CODEC"] == 3 and a["REPLAY"] is True and a["STATE_VK"] is True and a["FACTOR"] == 2  # int8 factors
    assert b["CODEC"] == 1 and b["READ_STORED"] is True and b["IS_KDA"] is True and b["REPLAY"] is False
    assert a != b and sources.path_of(replay) == sources.path_of(token) == Path(kernels.__file__)
    text = sources.source_of(replay)
    assert "def decode_fwd_kernel(" in text and "def decode_bwd_kernel(" in text
    # a serving profile: vLLM's order; with state_dtype auto, GDN's cache dtype is the inputs' (fixed at launch)
    auto = _spec("gdn", "token", None, {"serving": "vllm-0.33", "state_dtype": "auto"}, "vk")
    assert sources.constexprs_of_spec(auto)["VFIRST"] is True and "CACHE" not in sources.constexprs_of_spec(auto)
    assert [DecodeParams.from_spec(auto, dtype).constants()["CACHE"]
            for dtype in (torch.float32, torch.bfloat16, torch.float16)] == [0, 1, 2]
    assert sources.constexprs_of_spec(_spec("gdn", "token", None, SERVING_BF16, "vk"))["CACHE"] == 1


def test_fused_decode_rejects_bad_lengths():
    spec = _spec("gdn", "token", "fp8_e4m3/tile16", {}, "kv")
    (q, k, v, g, beta, _), _ = random_inputs("gdn", B=2, T=4, H=1, K=4, V=16, requires_grad=False)
    with pytest.raises(ValueError, match="prefill/valid lengths"):
        decode_fused_forward(spec, q, k, v, g, beta, None, None, 0.5, prefill_lengths=torch.tensor([1]),
                             valid_lengths=torch.tensor([4]))


def test_backward_without_the_forward_checkpoints_recomputes_them():
    """The backward called without ``saved`` (no training forward before it) runs the forward again: same grads."""
    spec = _spec("kda", "token", "int8/block16", {}, "kv")
    (q, k, v, g, beta, h0), _ = random_inputs("kda", B=2, T=9, H=1, HV=1, K=4, V=32, initial_state=True)
    pre, val = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([9, 8], dtype=torch.int32)
    residual = torch.empty(residual_numel(spec, q, v, None))
    o, ht = decode_fused_forward(spec, q, k, v, g, beta, h0, None, 0.5, prefill_lengths=pre, valid_lengths=val,
                                 save_to=residual)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    lengths = dict(prefill_lengths=pre, valid_lengths=val)
    kept = decode_fused_backward(spec, q, k, v, g, beta, h0, None, 0.5, do, dht, saved=residual, **lengths)
    again = decode_fused_backward(spec, q, k, v, g, beta, h0, None, 0.5, do, dht, **lengths)
    for a, b in zip(kept, again):
        assert torch.equal(a, b)


def test_block_codec_is_not_the_tile_codec():
    """One INT8 scale per key row x 16 values is not one per [K x 16] tile: with key rows of different magnitudes
    the two differ by far more than the kernel's distance from the block reference (a kernel ignoring the group
    would fail the reference comparison above)."""
    (q, k, v, g, beta, h0), _ = random_inputs("gdn", B=1, T=8, H=1, HV=1, K=4, V=16, initial_state=True)
    k = k * torch.tensor([1.0, 0.01, 3.0, 0.1])  # key rows of the state at very different magnitudes
    pre, val = torch.tensor([2], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    outs = {}
    for fmt in ("int8/block16", "int8/tile16"):
        spec = _spec("gdn", "token", fmt, {"readout": "stored"}, "kv")
        outs[fmt] = delta_rule_decode_reference(q, k, v, g, beta, kind="gdn", options=decode_options(spec),
                                                prefill_lengths=[2], valid_lengths=[8], scale=0.5, initial_state=h0)
        o, ht = decode_fused_forward(spec, q, k, v, g, beta, h0, None, 0.5, prefill_lengths=pre, valid_lengths=val)
        assert rel_l2(ht, outs[fmt][1]) < 1e-5
    assert rel_l2(outs["int8/block16"][1], outs["int8/tile16"][1]) > 1e-3


def test_decay_grid_rounds_every_suffix_decay():
    """The pre-pass against torch: round-half-even of g / step, in fp32."""
    g = torch.randn(3, 10, 2, 4) * 0.3
    got = suffix.decay_on_grid(g, 0.125)
    assert torch.equal(got, torch.round(g / 0.125) * 0.125)
    assert suffix.decay_on_grid(g, None) is g
