"""What a training forward of the chunk kernels keeps for its backward (kernels/chunk/residual.py): the backward
from the kept residual computes what the backward that recomputes everything computes, bit for bit (interpreter)."""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.residual import residual_layout, residual_size, residual_views
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.options import OptionsError, TuningOptions
from tests.helpers import rel_l2
from tests.kernels.chunk_inputs import grads_of
from tests.kernels.chunk_checks import ALL_FP8, ALL_SITES_TOL, EXACT_TOL, GRAD_NAMES, QDQ_TOL, chunk_case

NVFP4_PAIRS = {f"{site}.{side}": "nvfp4/block16" for site in ("key_interaction", "output_score")
               for side in ("lhs", "rhs")}


CASES = [
    ("gdn", True, {}, {}),
    ("gdn", False, ALL_FP8, {}),
    ("gdn", True, {"state": "int8/tile16", "w": "fp8_e4m3/row"}, {}),
    ("gdn", False, {}, dict(solve="neumann", degree=2)),
    ("kda", True, {}, {}),
    ("kda", False, ALL_FP8, {}),
    ("kda", False, NVFP4_PAIRS, dict(chunk=16)),
]
# t.keep_residual=all keeps W, U, h, V_new (KDA: G, kd) as the forward computes them, rounded or not: the quantized
# KDA cases run the default mode only (each takes half a minute in the interpreter); GDN's rounded cases keep all.
MODES = [(mode, *case) for case in CASES for mode in ("intra", "all")
         if mode == "intra" or not (case[0] == "kda" and case[2])]


@pytest.mark.parametrize("mode,kind,varlen,quant,extra", MODES)
def test_backward_from_the_kept_residual(mode, kind, varlen, quant, extra):
    """A training forward keeps T, A_qk and G (GDN) or P (KDA), with t.keep_residual=all also W, U, h, V_new (KDA:
    G, kd) (chunk_fwd's save_to); the backward's recompute loads them and runs only the W / U and h kernels, or
    none: the same outputs and every gradient as the forward and backward without it, bit for bit, a second
    backward from the same residual too (retain_graph), and against fp64 autograd; every kept part (NaN-filled
    before) holds what the recompute computes, wherever that is written."""
    tuning = TuningOptions(keep_residual=mode)
    inputs, cu = chunk_case(kind, varlen, "kv", K=16, V=16)
    spec = RecurrenceSpec(kind=kind, **{"chunk": 8, **extra}).replace(quant=quant)
    p = ChunkParams.from_spec(spec)
    q, v = inputs[0], inputs[2]
    do, dht = torch.randn(v.shape), torch.randn(inputs[5].shape)
    residual = torch.full((residual_size(p, q, v, cu, mode),), float("nan"))
    names = {part.name for part in residual_layout(p, q, v, cu, mode)[0]}
    assert names >= {"t_solved", "A_qk", "g_cum" if kind == "gdn" else "p_pairs"}
    assert (mode == "all") == (names >= {"w", "u", "h", "v_new"})
    kept = [*chunk_fwd(p, *inputs[:5], 0.4, inputs[5], cu, save_to=residual, tuning=tuning),
            *chunk_bwd(p, *inputs[:5], 0.4, do, dht, inputs[5], cu, saved=residual, tuning=tuning)]
    parts = {}
    plain = [*chunk_fwd(p, *inputs[:5], 0.4, inputs[5], cu, intermediates=parts),
             *chunk_bwd(p, *inputs[:5], 0.4, do, dht, inputs[5], cu)]
    # the backward leaves the residual as it was
    again = chunk_bwd(p, *inputs[:5], 0.4, do, dht, inputs[5], cu, saved=residual, tuning=tuning)
    for a, b in zip(kept + list(again), plain + plain[2:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    views = residual_views(p, residual, q, v, cu, mode)
    assert torch.isfinite(views["t_solved"]).all() and torch.isfinite(views["A_qk"]).all()
    for name, view in views.items():  # KDA's P: the sub-chunk blocks above the diagonal are never written
        if parts[name] is None:  # (the Neumann solve's recompute keeps no T)
            continue
        # h: the recompute's chunk-start states are the first of a varlen batch's bound
        view = view[: parts[name].shape[0]] if name == "h" else view
        torch.testing.assert_close(view, parts[name], rtol=0, atol=0, equal_nan=True, msg=name)
    x64 = [x.double().requires_grad_() for x in inputs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    want = grads_of([o64, ht64], [do.double(), dht.double()], x64)
    tol = ALL_SITES_TOL if quant is ALL_FP8 else QDQ_TOL if quant else EXACT_TOL
    assert rel_l2(kept[0], o64) <= tol
    for name, a, b in zip(GRAD_NAMES, kept[2:], want):
        assert rel_l2(a, b) <= tol, name


def test_bf16_parts_share_the_fp32_buffer():
    """With 16-bit GEMMs T, A_qk, W, U, h, V_new are kept in the input dtype (G and KDA's P in fp32): views of the
    fp32 buffer reinterpreted, each starting aligned, none overlapping, the buffer no larger than their sum
    (aligned). Where the GEMMs keep fp32 operands (a rounded operand, n.gemm=tf32) every part is fp32."""
    p = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=16))
    q = torch.randn(1, 40, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(1, 40, 4, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 40])
    parts, size = residual_layout(p, q, v, cu, "all")
    by_name = {part.name: part for part in parts}
    assert all(by_name[name].dtype == torch.bfloat16 for name in ("t_solved", "A_qk", "w", "u", "h", "v_new"))
    assert by_name["g_cum"].dtype == torch.float32
    for kind in ("gdn", "kda"):
        for quant, numerics, want in (({}, {}, torch.bfloat16), ({"w": "fp8_e4m3/row"}, {}, torch.float32),
                                      ({}, {"gemm": "tf32"}, torch.float32)):
            spec = RecurrenceSpec(kind=kind, chunk=16).replace(quant=quant, numerics=numerics)
            kept = residual_layout(ChunkParams.from_spec(spec), q, v, cu, "intra")[0]
            assert {part.name: part.dtype for part in kept} == {
                "t_solved": want, "A_qk": want, ("g_cum" if kind == "gdn" else "p_pairs"): torch.float32}
    assert by_name["h"].shape == (5, 4, 16, 32)  # ceil(40 / 16) + 2 sequences: a bound of the chunks (here 1 + 3)
    ends = 0
    for part in parts:
        assert part.offset % 16 == 0 and part.offset >= ends
        ends = part.offset + part.fp32_elements()
    assert size - ends < 16
    views = residual_views(p, torch.zeros(size), q, v, cu, "all")
    assert views["w"].dtype == torch.bfloat16 and views["w"].shape == (1, 40, 4, 16)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_bf16_residual_gives_every_mode_the_same_gradients(kind):
    """bf16 inputs, 16-bit GEMMs: T and A_qk are kept in bf16, and the recompute without a residual rounds T the
    same way (the solve's gradient refines it against A in both), so t.keep_residual=intra, all and none compute
    every output and gradient bit for bit alike (a packed batch with an empty sequence and grouped value heads);
    the kept parts hold what the recompute computes, and every gradient stays within FLA's bars against fp64
    autograd."""
    from tests.kernels.chunk_inputs import make_inputs
    from tests.kernels.test_chunk_bf16 import FLA_TOL

    cu = torch.tensor([0, 5, 5, 37, 50])
    xs = make_inputs(kind, B=1, T=50, H=1, HV=2, K=16, V=16, N=4, dtype=torch.bfloat16)
    spec = RecurrenceSpec(kind=kind, chunk=16)
    p = ChunkParams.from_spec(spec)
    q, v = xs[0], xs[2]
    do, dht = torch.randn(v.shape).to(torch.bfloat16), torch.randn(xs[5].shape)
    parts = {}
    plain = [*chunk_fwd(p, *xs[:5], 0.4, xs[5], cu, intermediates=parts),
             *chunk_bwd(p, *xs[:5], 0.4, do, dht, xs[5], cu)]
    assert parts["t_solved"].dtype == torch.bfloat16
    for mode in ("intra", "all"):
        tuning = TuningOptions(keep_residual=mode)
        residual = torch.full((residual_size(p, q, v, cu, mode),), float("nan"))
        kept = [*chunk_fwd(p, *xs[:5], 0.4, xs[5], cu, save_to=residual, tuning=tuning),
                *chunk_bwd(p, *xs[:5], 0.4, do, dht, xs[5], cu, saved=residual, tuning=tuning)]
        for a, b in zip(kept, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        views = residual_views(p, residual, q, v, cu, mode)
        assert views["t_solved"].dtype == views["A_qk"].dtype == torch.bfloat16
        torch.testing.assert_close(views["t_solved"], parts["t_solved"], rtol=0, atol=0, equal_nan=True)
        if kind == "kda":
            torch.testing.assert_close(views["p_pairs"], parts["p_pairs"], rtol=0, atol=0, equal_nan=True)
        # A_qk: the recompute's is fp32 scratch; the kept one is it rounded to nearest even
        torch.testing.assert_close(views["A_qk"], parts["A_qk"].to(torch.bfloat16), rtol=0, atol=0)
    x64 = [x.double().requires_grad_() for x in xs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    want = grads_of([o64, ht64], [do.double(), dht.double()], x64)
    for name, a, b in zip(GRAD_NAMES, plain[2:], want):
        assert rel_l2(a, b) <= FLA_TOL[name], name


def test_kept_residual_is_checked():
    """A residual of the wrong size or dtype, one read under another t.keep_residual than it was written with, or
    one passed with t.keep_residual=none, is refused by name; so is a bad value of the option, and saved with
    need_output."""
    inputs, _ = chunk_case("gdn", False, "kv")
    q, v = inputs[0], inputs[2]
    p = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8))
    n = residual_size(p, q, v)
    rows = q.shape[0] * q.shape[1] * v.shape[2]
    assert n == 2 * (-(-rows * 8 // 16) * 16) + -(-rows // 16) * 16  # T, A_qk, G, each aligned to 16 elements
    for bad in (torch.zeros(n - 1), torch.zeros(n, dtype=torch.float64)):
        with pytest.raises(ValueError, match="residual"):
            chunk_fwd(p, *inputs[:5], 0.4, inputs[5], save_to=bad)
    with pytest.raises(ValueError, match="need_output"):
        chunk_fwd(p, *inputs[:5], 0.4, inputs[5], saved=torch.zeros(n))
    do = torch.randn(v.shape)
    for mode in ("all", "none"):
        with pytest.raises(ValueError, match=f"t.keep_residual={mode}"):
            chunk_bwd(p, *inputs[:5], 0.4, do, None, inputs[5], saved=torch.zeros(n),
                      tuning=TuningOptions(keep_residual=mode))
    assert residual_size(p, q, v, keep="none") == 0
    with pytest.raises(OptionsError, match=r"keep_residual: must be one of \['intra', 'all', 'none'\], got 'no'"):
        TuningOptions(keep_residual="no")
    with pytest.raises(ValueError, match="keep must be one of"):
        residual_size(p, q, v, keep="no")
