"""bf16 inputs through the chunk kernels' 16-bit GEMMs (chunk/precision.py) against the fp64 chunk reference.

The bar is FLA's for its own bf16 kernels (docs/numerics.md: relative L2 o 0.005, dq/dk/dv 0.008,
dg/dbeta 0.02), forward, final state and every gradient. The interpreter multiplies the 16-bit GEMMs'
operands rounded to bf16 in fp32 (its bf16 tl.dot is broken), which forms the same products.
"""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec, SpecError
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.precision import gemm_precision, intermediate_dtype
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from tests.helpers import rel_l2
from tests.kernels.chunk_checks import ALL_FP8, ALL_SITES_TOL
from tests.kernels.chunk_inputs import grads_of, make_inputs

FLA_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}
GRAD_NAMES = "dq dk dv dg dbeta dh0".split()
FP8_STATE = {"state": "fp8_e4m3/tile16"}
# a rounded state differs from the reference's wherever bf16 noise moved it across an FP8 boundary: one
# E4M3 step is >= 1/16 of the value; the test counts those elements and bounds their share (observed up to
# 3.7 % at these shapes), and gives the outputs and gradients, which those flips move too, twice FLA's bar
# (observed: o up to 0.0053)
MAX_STATE_FLIP_FRACTION = 0.08
FLIPS_FACTOR = 2


def _inputs(kind, varlen):
    if varlen:
        cu = torch.tensor([0, 5, 5, 37, 50])  # an empty sequence, partial chunks
        xs = make_inputs(kind, B=1, T=50, H=1, HV=2, K=16, V=16, N=4, dtype=torch.bfloat16)
    else:
        cu = None
        xs = make_inputs(kind, B=2, T=37, H=1, HV=1, K=16, V=32, dtype=torch.bfloat16)
    return xs, cu


def _assert_gradients(p, xs, x64, outputs64, scale, cu, tol):
    """chunk_bwd on the bf16 inputs ``xs`` against fp64 autograd of the reference's ``outputs64`` (from ``x64``),
    for fresh random cotangents: every gradient in its input's shape and dtype, within ``tol``."""
    o64, ht64 = outputs64
    do, dht = torch.randn_like(o64), torch.randn_like(ht64)
    want = grads_of([o64, ht64], [do, dht], x64)
    got = chunk_bwd(p, *xs[:5], scale, do.to(torch.bfloat16), dht.float(), xs[5], cu)
    for name, a, b, x in zip(GRAD_NAMES, got, want, xs):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert rel_l2(a, b) <= tol[name], (name, rel_l2(a, b))


def _state_flips(a, b):
    return float(((a.double() - b).abs() > b.abs() / 16 + 1e-3 * b.abs().max()).double().mean())


@pytest.mark.parametrize("kind,varlen", [("gdn", False), ("gdn", True), ("kda", False), ("kda", True)])
@pytest.mark.parametrize("quant", [{}, FP8_STATE], ids=["exact", "fp8_state"])
def test_bf16_inputs_forward_and_backward(kind, varlen, quant):
    xs, cu = _inputs(kind, varlen)
    spec = RecurrenceSpec(kind=kind, chunk=16).replace(quant=quant)
    p = ChunkParams.from_spec(spec)
    parts = {}
    o, ht = chunk_fwd(p, *xs[:5], 0.4, xs[5], cu, intermediates=parts)
    assert all(parts[name].dtype == torch.bfloat16 for name in ("w", "u", "h", "v_new"))  # the 16-bit path ran
    x64 = [x.double().requires_grad_() for x in xs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    tol = {name: t * (FLIPS_FACTOR if quant else 1) for name, t in FLA_TOL.items()}
    assert o.dtype == torch.bfloat16 and rel_l2(o, o64) <= tol["o"]
    if quant:
        assert _state_flips(ht, ht64) <= MAX_STATE_FLIP_FRACTION
    else:
        assert rel_l2(ht, ht64) <= tol["ht"]
    _assert_gradients(p, xs, x64, (o64, ht64), 0.4, cu, tol)


def test_gemm_precision_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def prec(quant, dtype=torch.bfloat16, numerics=None):
        spec = RecurrenceSpec(kind="kda", chunk=64).replace(quant=quant, numerics=numerics or {})
        return gemm_precision(ChunkParams.from_spec(spec), dtype)

    assert prec({}) == "bf16" and prec(FP8_STATE) == "bf16" and prec({}, torch.float16) == "fp16"
    assert prec({}, torch.float32) == "ieee"  # fp32 inputs: the exact-numerics contract
    # a rounded operand is no 16-bit number: its GEMM keeps fp32 operands
    assert prec({"w": "fp8_e4m3/row"}) == "tf32"
    assert prec({"state_update.rhs": "fp8_e4m3/row"}) == "tf32"
    assert intermediate_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert intermediate_dtype("tf32", torch.bfloat16) == torch.float32
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert prec({}) == "bf16_rounded" and intermediate_dtype("bf16_rounded", torch.bfloat16) == torch.bfloat16
    tf32 = {"gemm": "tf32"}
    assert prec({}, numerics=tf32) == "tf32" and prec({}, torch.float32, numerics=tf32) == "ieee"
    with pytest.raises(SpecError, match=r"n.gemm: must be one of \['input', 'tf32'\], got 'fp8'"):
        prec({}, numerics={"gemm": "fp8"})


def test_tf32_knob_keeps_fp32_intermediates():
    xs, cu = _inputs("gdn", False)
    spec = RecurrenceSpec(kind="gdn", chunk=16).replace(numerics={"gemm": "tf32"})
    parts = {}
    o, _ = chunk_fwd(ChunkParams.from_spec(spec), *xs[:5], 0.4, xs[5], cu, intermediates=parts)
    assert all(parts[name].dtype == torch.float32 for name in ("w", "u", "h", "v_new"))
    o64, _ = chunk_delta_rule_reference(*[x.double() for x in xs[:5]], spec=spec, scale=0.4,
                                        initial_state=xs[5].double(), cu_seqlens=cu)
    assert rel_l2(o, o64) <= FLA_TOL["o"]


def test_bf16_kda_backward_by_key_blocks_of_64():
    """KDA with 16-bit GEMMs runs its key-blocked backward in blocks of 64 columns above 64 (chunk.bwd.bwd_key_block):
    K = 72 pads to 128 and takes two blocks, the second partial; every gradient at FLA's bars."""
    from la_compiler.kernels.chunk.blocks import bwd_key_block

    xs = make_inputs("kda", B=1, T=20, H=1, HV=1, K=72, V=16, dtype=torch.bfloat16)
    spec = RecurrenceSpec(kind="kda", chunk=16)
    p = ChunkParams.from_spec(spec)
    assert bwd_key_block(p, torch.bfloat16) == 64 and bwd_key_block(p, torch.float32) == 32
    x64 = [x.double().requires_grad_() for x in xs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5])
    do, dht = torch.randn_like(o64), torch.randn_like(ht64)
    want = grads_of([o64, ht64], [do, dht], x64)
    got = chunk_bwd(p, *xs[:5], 0.4, do.to(torch.bfloat16), dht.float(), xs[5], None)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert rel_l2(a, b) <= FLA_TOL[name], (name, rel_l2(a, b))


def test_selection_explains_the_gemm_precision(monkeypatch):
    """The kernel choice says what the chunk kernels multiply in (explain shows it for every node)."""
    from la_compiler.kernels.selection import select_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def reason(text, dtype=torch.bfloat16):
        choice = select_kernel(RecurrenceSpec.parse(text), device="cuda", dtype=dtype, head_k=128, head_v=128,
                               requested="chunk")
        return choice.reason

    assert "in bf16 with fp32 accumulation" in reason("kda[chunk=64; q.state=fp8_e4m3/tile64]")
    assert "in fp16 with fp32 accumulation" in reason("gdn[chunk=64]", torch.float16)
    assert "fp32 GEMM operands and intermediates, dots in tf32 (the spec rounds GEMM operands)" in reason(
        "kda[chunk=64; q.state=fp8_e4m3/tile64; q.w=fp8_e4m3/row]")
    assert "every dot in fp32 (ieee)" in reason("kda[chunk=64]", torch.float32)
    assert "(n.gemm=tf32)" in reason("kda[chunk=64; n.gemm=tf32]")


@pytest.mark.parametrize("key_block", [None, 32], ids=["default", "blocks_of_32"])
def test_gdn_bf16_backward_by_key_blocks(key_block):
    """GDN's backward intra stage with 16-bit GEMMs: dT (hence dA) complete before its key loop, whose blocks
    store their final dq, dk; the pair products' gradients multiplied in bf16. K = 72: by default one masked
    block of 128 columns; with blocks of 32, two full ones and a masked partial one. Every gradient against
    fp64 autograd at FLA's bar, with grouped value heads on a packed batch."""
    from la_compiler.kernels.chunk.blocks import bwd_key_block
    from la_compiler.kernels.chunk.forms import bwd_intra_by_key_blocks

    cu = torch.tensor([0, 21, 40])
    xs = make_inputs("gdn", B=1, T=40, H=1, HV=2, K=72, V=16, N=2, dtype=torch.bfloat16)
    spec = RecurrenceSpec(kind="gdn", chunk=16).replace(numerics={"bwd_key_block": key_block} if key_block else {})
    p = ChunkParams.from_spec(spec)
    assert bwd_intra_by_key_blocks(p) and bwd_key_block(p, torch.bfloat16) == 128
    x64 = [x.double().requires_grad_() for x in xs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.3, initial_state=x64[5], cu_seqlens=cu)
    _assert_gradients(p, xs, x64, (o64, ht64), 0.3, cu, FLA_TOL)


INT8_STATE = {"state": "int8/tile16"}


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("quant", [INT8_STATE, ALL_FP8], ids=["int8_state", "all_fp8_sites"])
def test_bf16_inputs_with_rounding(kind, quant):
    """bf16 inputs with an INT8 state (16-bit GEMMs) and with every FP8 site (fp32 GEMM operands, the forward's
    two-sided products factored into grid values): against the fp64 reference that rounds at the same sites,
    on a packed batch with an empty sequence and grouped value heads. bf16 noise moves rounded elements
    across grid boundaries: the final state's flips are counted as in the FP8-state test, and outputs and
    gradients get twice FLA's bar (INT8 state) or the all-sites bar of the fp32 tests (2e-2, with sixteen
    sites rounding)."""
    xs, cu = _inputs(kind, True)
    spec = RecurrenceSpec(kind=kind, chunk=16).replace(quant=quant)
    p = ChunkParams.from_spec(spec)
    o, ht = chunk_fwd(p, *xs[:5], 0.4, xs[5], cu)
    x64 = [x.double().requires_grad_() for x in xs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    bar = ALL_SITES_TOL if quant is ALL_FP8 else 0.0
    tol = {name: max(t * FLIPS_FACTOR, bar) for name, t in FLA_TOL.items()}
    print(f"{kind} {sorted(quant)[:2]}: o {rel_l2(o, o64):.1e}, state flips {_state_flips(ht, ht64):.3f}")
    assert o.dtype == torch.bfloat16 and rel_l2(o, o64) <= tol["o"]
    assert _state_flips(ht, ht64) <= MAX_STATE_FLIP_FRACTION
    if quant is ALL_FP8:  # closer to the rounding reference than to exact numerics
        exact, _ = chunk_delta_rule_reference(*[x.double() for x in xs[:5]], spec=RecurrenceSpec(kind=kind, chunk=16),
                                              scale=0.4, initial_state=xs[5].double(), cu_seqlens=cu)
        assert rel_l2(o, exact) > 2 * rel_l2(o, o64)
    else:  # an INT8 step moves o less than bf16 noise does: the final state must sit on its INT8 grid instead
        tiles = ht.unflatten(-1, (-1, 16))  # [N, HV, K, V / 16, 16]: one scale per [K x 16] tile
        steps = tiles / (tiles.abs().amax((-3, -1), keepdim=True) / 127)
        assert (steps - steps.round()).abs().max() < 1e-3
    _assert_gradients(p, xs, x64, (o64, ht64), 0.4, cu, tol)
