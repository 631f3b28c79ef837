"""The chunked (WY) fp64 reference against the token-by-token fp64 reference."""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from la_compiler.kernels.reference.rounding import ChunkRounding
from tests.kernels.chunk_inputs import grads_of, make_inputs

TOL = 1e-10


def _max_err(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _case(kind, varlen, state):
    if varlen:
        cu = torch.tensor([0, 3, 3, 12, 19])  # an empty sequence, lengths not multiples of the chunk
        q, k, v, g, beta, h0 = make_inputs(kind, B=1, T=19, N=4)
    else:
        cu = None
        q, k, v, g, beta, h0 = make_inputs(kind, B=2, T=13)
    if state == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)], cu


def _grid_state(block_v):
    """A coarse per-[K x BV]-tile rounding with identity gradient (the shape of a state quantizer)."""
    def round_state(S):
        K, V = S.shape[-2:]
        tiles = S.reshape(*S.shape[:-1], V // block_v, block_v).transpose(-3, -2)  # [.., V/BV, K, BV]
        s = tiles.detach().abs().amax((-2, -1), keepdim=True).clamp_min(1e-30) / 7
        q = (torch.round(tiles / s) * s).transpose(-3, -2).reshape(S.shape)
        return S + (q - S).detach()
    return round_state


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("varlen,state", [(False, "kv"), (True, "vk")])
def test_exact_chunk_equals_token_reference(kind, varlen, state):
    inputs, cu = _case(kind, varlen, state)
    spec = RecurrenceSpec(kind=kind, chunk=4, state=state)
    o, ht = chunk_delta_rule_reference(*inputs[:5], spec=spec, scale=0.3, initial_state=inputs[5], cu_seqlens=cu)
    o_ref, ht_ref = delta_rule_reference(*inputs[:5], kind=kind, scale=0.3, initial_state=inputs[5],
                                         cu_seqlens=cu, state_layout=state)
    assert _max_err(o, o_ref) < TOL and _max_err(ht, ht_ref) < TOL
    cot = [torch.randn_like(o), torch.randn_like(ht)]
    for name, a, b in zip("q k v g beta h0".split(), grads_of([o, ht], cot, inputs),
                          grads_of([o_ref, ht_ref], cot, inputs)):
        assert _max_err(a, b) < TOL, name


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_state_rounding_at_chunk_boundaries_equals_token_reference_with_hook(kind):
    inputs, cu = _case(kind, True, "kv")
    C, lengths = 4, (cu[1:] - cu[:-1]).tolist()
    round_state = _grid_state(block_v=4)
    spec = RecurrenceSpec(kind=kind, chunk=C)
    o, ht = chunk_delta_rule_reference(*inputs[:5], spec=spec, initial_state=inputs[5], cu_seqlens=cu,
                                       rounding=ChunkRounding(state=round_state))

    def hook(S, n, t_end):  # round after every full chunk and after the sequence's last token
        return round_state(S) if t_end % C == 0 or t_end == lengths[n] else S

    h0_rounded = round_state(inputs[5])
    o_ref, ht_ref = delta_rule_reference(*inputs[:5], kind=kind, initial_state=h0_rounded, cu_seqlens=cu,
                                         state_hook=hook)
    assert _max_err(o, o_ref) < TOL and _max_err(ht, ht_ref) < TOL
    o_exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=spec, initial_state=inputs[5], cu_seqlens=cu)
    assert _max_err(o, o_exact) > 1e-3  # the rounding really happened
    cot = [torch.randn_like(o), torch.randn_like(ht)]
    for name, a, b in zip("q k v g beta h0".split(), grads_of([o, ht], cot, inputs),
                          grads_of([o_ref, ht_ref], cot, inputs)):
        assert _max_err(a, b) < TOL, name


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_neumann_solve(kind):
    inputs, cu = _case(kind, False, "kv")
    exact = RecurrenceSpec(kind=kind, chunk=4)
    o, ht = chunk_delta_rule_reference(*inputs[:5], spec=exact, initial_state=inputs[5])
    full = exact.replace(solve="neumann", degree=3)  # A is nilpotent: degree C-1 is the exact inverse
    o3, ht3 = chunk_delta_rule_reference(*inputs[:5], spec=full, initial_state=inputs[5])
    assert _max_err(o3, o) < TOL and _max_err(ht3, ht) < TOL
    low = exact.replace(solve="neumann", degree=1)  # I - A: a different computation
    o1, _ = chunk_delta_rule_reference(*inputs[:5], spec=low, initial_state=inputs[5])
    assert _max_err(o1, o) > 1e-4
    # backward = autograd of the polynomial: check one directional derivative numerically
    q, k = inputs[0].detach(), inputs[1].detach()
    dk = torch.randn_like(k)
    f = lambda kk: chunk_delta_rule_reference(q, kk, *[x.detach() for x in inputs[2:5]], spec=low,  # noqa: E731
                                              initial_state=inputs[5].detach())[0].sum()
    kk = k.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(kk), kk)
    eps = 1e-6
    numeric = (f(k + eps * dk) - f(k - eps * dk)) / (2 * eps)
    assert abs((grad * dk).sum().item() - numeric.item()) < 1e-6 * max(1.0, abs(numeric.item()))


def test_bad_inputs_are_named():
    q, k, v, g, beta, h0 = make_inputs("gdn")
    spec = RecurrenceSpec(kind="kda", chunk=4)
    with pytest.raises(ValueError, match="KDA g"):
        chunk_delta_rule_reference(q, k, v, g, beta, spec=spec)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_delta_rule_reference(q, k, v, g, beta, spec=spec.replace(kind="gdn"), initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="phase"):
        chunk_delta_rule_reference(q, k, v, g, beta, spec=spec.replace(kind="gdn", phase="token"))
    with pytest.raises(ValueError, match="state_read.lhs"):
        ChunkRounding(operands={("state_read", "lhs"): lambda x: x})


@pytest.mark.parametrize("kind,fmt", [("gdn", "fp8_e4m3/tile16"), ("kda", "int8/tile16")])
def test_spec_state_quant_equals_token_reference_with_fake_quant_hook(kind, fmt):
    from la_compiler.quant import fake_quant

    cu = torch.tensor([0, 7, 7, 20])
    inputs = [x.requires_grad_() for x in make_inputs(kind, B=1, T=20, K=8, V=32, N=3)]
    C, lengths = 8, (cu[1:] - cu[:-1]).tolist()
    spec = RecurrenceSpec(kind=kind, chunk=C).replace(quant={"state": fmt})
    o, ht = chunk_delta_rule_reference(*inputs[:5], spec=spec, initial_state=inputs[5], cu_seqlens=cu)

    def hook(S, n, t_end):
        return fake_quant(S, fmt) if t_end % C == 0 or t_end == lengths[n] else S

    o_ref, ht_ref = delta_rule_reference(*inputs[:5], kind=kind, initial_state=fake_quant(inputs[5], fmt),
                                         cu_seqlens=cu, state_hook=hook)
    assert _max_err(o, o_ref) < TOL and _max_err(ht, ht_ref) < TOL
    cot = [torch.randn_like(o), torch.randn_like(ht)]
    for name, a, b in zip("q k v g beta h0".split(), grads_of([o, ht], cot, inputs),
                          grads_of([o_ref, ht_ref], cot, inputs)):
        assert _max_err(a, b) < TOL, name


SITES = ["w"] + [f"{s}.{side}" for s in
                 ("key_interaction", "wy_value", "wy_key", "state_update", "output_state", "output_score",
                  "output_value") for side in ("lhs", "rhs")] + ["state_read.rhs"]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_every_site_rounds_something(kind):
    """Each quant site alone changes the output (and nothing else is touched when it is off)."""
    q, k, v, g, beta, h0 = make_inputs(kind, T=12, K=16, V=16)
    base = RecurrenceSpec(kind=kind, chunk=8)
    o0, _ = chunk_delta_rule_reference(q, k, v, g, beta, spec=base, initial_state=h0)
    for site in SITES:
        for fmt in ("fp8_e4m3/row", "nvfp4/block16"):
            o, _ = chunk_delta_rule_reference(q, k, v, g, beta, spec=base.replace(quant={site: fmt}), initial_state=h0)
            assert 1e-7 < _max_err(o, o0) < 0.5, (site, fmt)
    for gemm in ("key_interaction", "output_value", "state_update"):
        o, _ = chunk_delta_rule_reference(q, k, v, g, beta, spec=base.replace(acc={gemm: "fp16:4"}), initial_state=h0)
        assert 1e-7 < _max_err(o, o0) < 0.05, gemm


def test_w_is_state_read_lhs():
    q, k, v, g, beta, h0 = make_inputs("gdn", T=12, K=16, V=16)
    base = RecurrenceSpec(kind="gdn", chunk=8)
    a, _ = chunk_delta_rule_reference(q, k, v, g, beta, spec=base.replace(quant={"w": "fp8_e4m3/row"}))
    b, _ = chunk_delta_rule_reference(q, k, v, g, beta, spec=base.replace(quant={"state_read.lhs": "fp8_e4m3/row"}))
    assert torch.equal(a, b)


@pytest.mark.parametrize("quant,acc,match", [
    ({"w": "fp8_e4m3/row", "state_read.lhs": "int8/row"}, {}, "state_read.lhs"),
    ({"output_value.lhs": "fp8_e4m3/tensor"}, {}, "q.output_value.lhs"),
    ({"state": "fp8_e4m3/axis:0,1"}, {}, "q.state"),
    ({}, {"wy_key": "fp8:16"}, "acc.wy_key"),
])
def test_bad_site_configs_are_named(quant, acc, match):
    q, k, v, g, beta, _ = make_inputs("gdn", T=4, K=16, V=16, with_state=False)
    spec = RecurrenceSpec(kind="gdn", chunk=4).replace(quant=quant, acc=acc)
    with pytest.raises(ValueError, match=match):
        chunk_delta_rule_reference(q, k, v, g, beta, spec=spec)
