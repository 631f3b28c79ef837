"""The fp64 decode-phase reference against independent oracles.

Oracles: the plain token-by-token reference (kernels/reference/recurrent.py) with a state hook that
rounds where docs/decode_phase.md says (token mode, replay without factor rounding), and a literal
anchor + ordered rank-one-update replayer written here (replay with factor rounding).
"""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.decode import (
    delta_rule_decode_reference, hadamard32, qdq_factor, qdq_int8_h32, qdq_state, round_e4m3,
    round_half_away, round_log_decay,
)
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from la_compiler.options import DecodeOptionsError, decode_options
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs


# ---- rounding functions ---------------------------------------------------------------------
def test_round_e4m3_matches_torch_float8_cast():
    x = torch.cat([torch.randn(4000) * 100, torch.randn(1000) * 1e-3, torch.tensor([0.0, 448.0, -448.0, 2**-9, 2**-10,
                   3 * 2**-10, 15.5, 14.5, 1.0625, 1.1875, 239.99, 0.01171875])]).float()
    x = x.clamp(-448, 448)
    want = x.to(torch.float8_e4m3fn).double()
    got = round_e4m3(x.double())
    assert torch.equal(got, want)


def test_round_half_away_ties():
    x = torch.tensor([0.5, -0.5, 1.5, -2.5, 2.4999999, 0.49999997, 126.5, -0.0], dtype=torch.float64)
    assert round_half_away(x).tolist() == [1.0, -1.0, 2.0, -3.0, 2.0, 0.0, 127.0, 0.0]


def test_hadamard32_is_orthonormal_and_matches_butterfly():
    h = hadamard32()
    assert torch.allclose(h @ h, torch.eye(32, dtype=torch.float64), atol=1e-14)
    x = torch.randn(5, 32, dtype=torch.float64)
    y = x.clone()  # fast Walsh-Hadamard butterfly, natural (Sylvester) order
    step = 1
    while step < 32:
        y = y.view(5, -1, 2, step)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2).view(5, 32)
        step *= 2
    assert torch.allclose(x @ h, y / 32**0.5, atol=1e-12)


def test_int8_h32_codec_error_and_scale_storage():
    x = torch.randn(3, 4, 64, dtype=torch.float64)
    r = qdq_int8_h32(x)
    assert rel_l2(r, x) < 0.02 and not torch.equal(r, x)
    # Rotated values are multiples of the fp16-stored scale.
    y = r.reshape(3, 4, 2, 32) @ hadamard32()
    s = (torch.clamp((x.reshape(3, 4, 2, 32) @ hadamard32()).abs().amax(-1, keepdim=True) / 127, min=6e-8)
         .half().double())
    q = y / s
    assert torch.allclose(q, q.round(), atol=1e-9) and q.abs().max() <= 127 + 1e-9
    with pytest.raises(ValueError, match="multiple of 32"):
        qdq_int8_h32(torch.randn(2, 48, dtype=torch.float64))


def test_state_tiles_have_independent_scales():
    S = torch.randn(2, 4, 8, dtype=torch.float64)
    S[:, :, 4:] *= 1000.0  # a large second tile must not coarsen the first
    r = qdq_state(S, "fp8_e4m3", 4)
    s0 = S[:, :, :4].abs().amax(dim=(1, 2), keepdim=True) / 448
    assert torch.equal(r[:, :, :4], round_e4m3((S[:, :, :4] / s0).clamp(-448, 448)) * s0)
    r_int8 = qdq_state(S, "int8", 8)
    s = S.abs().amax(dim=(1, 2), keepdim=True) / 127
    assert torch.equal(r_int8, torch.clamp(torch.round(S / s), -127, 127) * s)


def test_zero_tile_is_left_zero():
    assert torch.equal(qdq_state(torch.zeros(1, 4, 4, dtype=torch.float64), "fp8_e4m3", 4), torch.zeros(1, 4, 4,
                       dtype=torch.float64))
    assert torch.equal(qdq_factor(torch.zeros(2, 4, dtype=torch.float64), "int8", None), torch.zeros(2, 4,
                       dtype=torch.float64))


def test_log_decay_grid():
    g = torch.tensor([-0.1, -0.015625, -0.0234375, -1.0], dtype=torch.float64)
    assert round_log_decay(g, 1 / 32).tolist() == [-0.09375, 0.0, -0.03125, -1.0]


# ---- options --------------------------------------------------------------------------------
def _spec(kind="gdn", phase="token", state="fp8_e4m3/tile64", layout="kv", **extra):
    quant = (("state", state),) if state else ()
    return RecurrenceSpec(kind, phase=phase, state=layout, quant=quant,
                          extra=tuple(sorted((k, str(v)) for k, v in extra.items())))


def test_options_from_spec_and_errors():
    o = decode_options(_spec(phase="replay", state="int8_h32/tile32", replay_window=8, replay_factor_qdq=1,
                             readout="stored", decay_log_step=0.0039))
    assert (o.mode, o.codec, o.block_v, o.window, o.factor_format, o.readout, o.decay_log_step) == (
        "replay", "int8_h32", 32, 8, "int8", "stored", 0.0039)
    assert decode_options(_spec(phase="replay", replay_window=2, replay_factor_qdq=1)).factor_format == "fp8_e4m3"
    with pytest.raises(DecodeOptionsError, match="x.replay_factor_qdq: .* there is no state codec"):
        decode_options(_spec(phase="replay", state=None, replay_window=2, replay_factor_qdq=1))
    with pytest.raises(DecodeOptionsError, match="x.bogus"):
        decode_options(_spec(bogus=1))
    with pytest.raises(DecodeOptionsError, match="replay_window"):
        decode_options(_spec(phase="replay", replay_window=65))
    with pytest.raises(DecodeOptionsError, match="only for phase=replay"):
        decode_options(_spec(phase="token", replay_window=4))
    with pytest.raises(DecodeOptionsError, match="readout"):
        decode_options(_spec(readout="both"))
    with pytest.raises(DecodeOptionsError, match="state codec"):
        decode_options(_spec(state="fp8_e4m3/row"))
    with pytest.raises(DecodeOptionsError, match="q.w"):
        decode_options(_spec().replace(quant={"state": "fp8_e4m3/tile64", "w": "fp8_e4m3/row"}))
    with pytest.raises(DecodeOptionsError, match="solve=neumann"):
        decode_options(_spec().replace(solve="neumann", degree=3))
    with pytest.raises(DecodeOptionsError, match="phase=none"):
        decode_options(_spec(phase="none"))


# ---- oracles ----------------------------------------------------------------------------------
def _hook_oracle(inputs, cu, kind, opts, prefill, valid, layout, scale):
    """Per sequence: the plain reference with a rounding state hook (no factor rounding)."""
    q, k, v, g, beta, h0 = inputs
    B, T = q.shape[:2]
    codec = (lambda S: S) if opts.codec is None else (
        lambda S: S + (qdq_state(S.detach(), opts.codec, opts.block_v) - S).detach())
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, a, e) for a, e in zip(cu[:-1].tolist(),
                                                                                          cu[1:].tolist())]
    o = torch.zeros(B, T, v.shape[2], v.shape[3], dtype=torch.float64)
    finals = []
    for n, (b, start, _) in enumerate(bounds):
        p, L = prefill[n], valid[n]
        sl = slice(start, start + L)
        gs = g[b:b + 1, sl].double()
        if opts.decay_log_step is not None:
            gr = gs + (round_log_decay(gs.detach(), opts.decay_log_step) - gs).detach()
            gs = torch.cat([gs[:, :p], gr[:, p:]], dim=1)
        S0 = None
        if h0 is not None:
            S0 = h0[n].double()
            S0 = S0.transpose(-1, -2) if layout == "vk" else S0
            S0 = codec(S0)
            if p == 0 and L > 0:
                S0 = codec(S0)  # the handoff of an empty prefix
        elif p == 0 and L > 0:
            S0 = torch.zeros(v.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
        stored = {}

        def hook(S, _n, t_end):
            if t_end == p and t_end < L:
                return codec(S)  # the handoff, before the first suffix token
            if t_end > p and (opts.mode == "token" or (t_end - p) % opts.window == 0):
                S = codec(S)
            stored[t_end] = S
            return S

        if L == 0:
            zero = torch.zeros(v.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
            finals.append(S0 if S0 is not None else zero)
            continue
        on, Sn = delta_rule_reference(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], gs, beta[b:b + 1, sl],
                                      kind=kind, scale=scale, initial_state=None if S0 is None else S0[None],
                                      state_hook=hook)
        on = on[0]
        if opts.readout == "stored":
            qe = q[b, sl].double().repeat_interleave(v.shape[2] // q.shape[2], dim=1)
            rows = [on[i] if i < p else torch.einsum("hkv,hk->hv", stored[i + 1], qe[i] * scale) for i in range(L)]
            on = torch.stack(rows)
        o = o.index_put((torch.tensor([b]), torch.arange(start, start + L)), on)
        finals.append(Sn[0])
    ht = torch.stack(finals)
    return o, (ht.transpose(-1, -2) if layout == "vk" else ht)


def _replay_oracle(inputs, kind, opts, prefill, scale):
    """Literal ReplaySSM for B sequences without packing: an anchor and a list of factors."""
    q, k, v, g, beta, h0 = (x.double() if x is not None else None for x in inputs)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    codec = lambda S: S + (qdq_state(S.detach(), opts.codec, opts.block_v) - S).detach()  # noqa: E731
    fk = lambda x: x + (qdq_factor(x.detach(), opts.factor_format, None) - x).detach()  # noqa: E731
    fu = lambda x: x + (qdq_factor(x.detach(), opts.factor_format, opts.block_v) - x).detach()  # noqa: E731
    if opts.factor_format == "none":
        fk = fu = lambda x: x  # noqa: E731
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = []
    rep = HV // H
    for b in range(B):
        p = prefill[b]
        S = codec(h0[b]) if h0 is not None else torch.zeros(HV, K, V, dtype=torch.float64)
        for t in range(p):  # the prefix: exact
            dec = g[b, t].exp()
            S = S * (dec[:, None, None] if kind == "gdn" else dec[:, :, None])
            kt = k[b, t].repeat_interleave(rep, 0)
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t].repeat_interleave(rep, 0) * scale)
        anchor, factors = codec(S), []

        def replay():
            R = anchor
            for dec, kf, uf in factors:
                R = R * dec + kf[:, :, None] * uf[:, None, :]
            return R

        for t in range(p, T):
            dec = g[b, t].exp()
            dec = dec[:, None, None] if kind == "gdn" else dec[:, :, None]
            kt = k[b, t].repeat_interleave(rep, 0)
            S_a = replay() * dec
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S_a, kt))
            factors.append((dec, fk(kt), fu(u)))
            S = replay()
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t].repeat_interleave(rep, 0) * scale)
            if len(factors) == opts.window:
                anchor, factors = codec(S), []
        finals.append(replay())
    return o, torch.stack(finals)


def _grads(fn, inputs):
    o, ht = fn()
    gen = torch.Generator().manual_seed(1)  # the same loss weights for every implementation
    wo = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    wh = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    diff = [x for x in inputs if x is not None]
    return o, ht, torch.autograd.grad((o * wo).sum() + (ht * wh).sum(), diff)


def _compare(a, b, tol=1e-12):
    for name, x, y in zip(("o", "ht"), a[:2], b[:2]):
        assert rel_l2(x, y) < tol, (name, rel_l2(x, y))
    for i, (x, y) in enumerate(zip(a[2], b[2])):
        assert rel_l2(x, y) < tol, (f"grad {i}", rel_l2(x, y))


CASES = [
    # kind, mode, codec, readout, decay step, window, layout, initial state, B, T, prefill, valid
    ("gdn", "token", "fp8_e4m3/tile64", "working", None, 1, "kv", True, 2, 9, [4, 0], [9, 7]),
    ("kda", "token", "fp8_e4m3/tile16", "stored", 1 / 32, 1, "vk", True, 2, 8, [3, 8], [8, 8]),
    ("kda", "token", "int8/tile16", "working", None, 1, "kv", False, 1, 7, [0], [5]),
    ("gdn", "token", "int8_h32/tile32", "stored", None, 1, "kv", True, 1, 6, [2], [6]),
    ("kda", "replay", "fp8_e4m3/tile16", "working", 1 / 64, 3, "kv", True, 2, 10, [2, 5], [10, 9]),
    ("gdn", "replay", "int8_h32/tile32", "stored", None, 2, "vk", True, 1, 7, [3], [7]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_reference_matches_hook_oracle(case):
    kind, mode, codec, readout, step, window, layout, h0, B, T, prefill, valid = case
    V = 32 if "h32" in codec else 16
    extra = {"readout": readout}
    if step:
        extra["decay_log_step"] = step
    if mode == "replay":
        extra["replay_window"] = window
    spec = _spec(kind, mode, codec, layout, **extra)
    opts = decode_options(spec)
    inputs, cu = random_inputs(kind, B=B, T=T, H=1, HV=2, K=4, V=V, initial_state=h0, dtype=torch.float64,
                               state_layout=layout)
    scale = 0.5
    ref = _grads(lambda: delta_rule_decode_reference(*inputs[:5], kind=kind, options=opts, prefill_lengths=prefill,
                                                     valid_lengths=valid, scale=scale, initial_state=inputs[5],
                                                     state_layout=layout), inputs)
    want = _grads(lambda: _hook_oracle(inputs, cu, kind, opts, prefill, valid, layout, scale), inputs)
    _compare(ref, want)
    # Padding tokens: zero output, zero gradient.
    for n, L in enumerate(valid):
        assert ref[0][n, L:].abs().max().item() == 0 if L < T else True
        assert ref[2][2][n, L:].abs().max().item() == 0 if L < T else True


def test_reference_packed_matches_hook_oracle():
    opts = decode_options(_spec("kda", "token", "fp8_e4m3/tile16", readout="stored"))
    cu = [0, 5, 5, 12]  # an empty sequence in the middle
    inputs, cu_t = random_inputs("kda", B=1, T=12, H=2, K=4, V=16, initial_state=True, dtype=torch.float64,
                                 cu_seqlens=cu)
    prefill, valid = [2, 0, 0], [5, 0, 6]
    ref = _grads(lambda: delta_rule_decode_reference(*inputs[:5], kind="kda", options=opts, prefill_lengths=prefill,
                                                     valid_lengths=valid, scale=0.5, initial_state=inputs[5],
                                                     cu_seqlens=cu_t), inputs)
    want = _grads(lambda: _hook_oracle(inputs, cu_t, "kda", opts, prefill, valid, "kv", 0.5), inputs)
    _compare(ref, want)
    assert ref[0][0, 11].abs().max() == 0  # the padding token of the last sequence


def test_no_codec_no_grid_is_the_plain_recurrence():
    opts = decode_options(_spec("gdn", "token", None))
    inputs, _ = random_inputs("gdn", B=2, T=6, H=2, K=4, V=4, initial_state=True, dtype=torch.float64)
    a = delta_rule_decode_reference(*inputs[:5], kind="gdn", options=opts, prefill_lengths=[3, 0],
                                    valid_lengths=[6, 6], initial_state=inputs[5])
    b = delta_rule_reference(*inputs[:5], kind="gdn", initial_state=inputs[5])
    assert rel_l2(a[0], b[0]) < 1e-14 and rel_l2(a[1], b[1]) < 1e-14


@pytest.mark.parametrize("codec,factor", [("fp8_e4m3/tile16", 0), ("fp8_e4m3/tile16", 1), ("int8/tile16", 1)])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_replay_matches_literal_anchor_plus_factors(kind, codec, factor):
    extra = {"replay_window": 3, "replay_factor_qdq": factor}
    opts = decode_options(_spec(kind, "replay", codec, **extra))
    inputs, _ = random_inputs(kind, B=2, T=9, H=1, HV=2, K=4, V=32, initial_state=True, dtype=torch.float64)
    prefill = [2, 0]
    ref = _grads(lambda: delta_rule_decode_reference(*inputs[:5], kind=kind, options=opts, prefill_lengths=prefill,
                                                     valid_lengths=[9, 9], scale=0.5, initial_state=inputs[5]), inputs)
    want = _grads(lambda: _replay_oracle(inputs, kind, opts, prefill, 0.5), inputs)
    _compare(ref, want, tol=1e-11)


def test_rounding_changes_results_and_window_one_replay_is_token_mode():
    inputs, _ = random_inputs("gdn", B=1, T=8, H=2, K=4, V=16, initial_state=True, dtype=torch.float64)
    run = lambda spec, p=3: delta_rule_decode_reference(  # noqa: E731
        *inputs[:5], kind="gdn", options=decode_options(spec), prefill_lengths=[p], valid_lengths=[8],
        initial_state=inputs[5])
    exact = run(_spec("gdn", "token", None))
    token = run(_spec("gdn", "token", "fp8_e4m3/tile16"))
    replay1 = run(_spec("gdn", "replay", "fp8_e4m3/tile16", replay_window=1))
    replay4 = run(_spec("gdn", "replay", "fp8_e4m3/tile16", replay_window=4))
    assert rel_l2(token[0], exact[0]) > 1e-4
    assert rel_l2(replay1[0], token[0]) < 1e-15
    assert rel_l2(replay4[0], token[0]) > 1e-5
    with pytest.raises(ValueError, match="prefill"):
        run(_spec("gdn", "token", None), p=9)
