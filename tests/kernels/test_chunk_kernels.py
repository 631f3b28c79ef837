"""The chunked (WY) forward kernels against the fp64 chunk reference (interpreter on CPU).

With QDQ, the reference rounds at the same sites in the same order; QDQ'd intermediates (the
W tile and the chunk-start states h) must agree element for element except for rounding
flips (fp32 vs fp64 values on either side of a rounding boundary), which are counted and
bounded (docs/numerics.md, "How close is close").
"""
import pytest
import torch

from la_compiler.ir.spec import GEMM_SITES, RecurrenceSpec
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams, unsupported
from la_compiler.kernels.common.errors import KernelParamsError
from la_compiler.kernels.reference.chunk import _to_chunks, chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import sequence_bounds
from la_compiler.options import NumericsOptions
from tests.helpers import rel_l2
from tests.kernels.chunk_checks import (ALL_FP8, ALL_SITES_TOL, EXACT_TOL, GRAD_NAMES, MAX_FLIP_FRACTION, OPERAND_SITES,
                                       QDQ_TOL, assert_backward_matches, chunk_case, count_flips, kernel_chunks,
                                       run_kernel_and_reference)
from tests.kernels.chunk_inputs import grads_of, make_inputs


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("varlen,state", [(False, "kv"), (True, "vk")])
def test_exact_forward(kind, varlen, state):
    inputs, cu = chunk_case(kind, varlen, state)
    spec = RecurrenceSpec(kind=kind, chunk=4, state=state)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL


def test_neumann_forward():
    inputs, cu = chunk_case("kda", False, "kv")
    spec = RecurrenceSpec(kind="kda", chunk=8, solve="neumann", degree=2)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    o_exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=spec.replace(solve="exact", degree=None), scale=0.4,
                                            initial_state=inputs[5])
    assert rel_l2(o, o_exact) > 1e-4  # degree 2 < C - 1: really a different computation


@pytest.mark.parametrize("kind,varlen,quant", [
    ("gdn", True, {"state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row"}),
    ("kda", False, {"state": "int8/tile16", "w": "int8/block16"}),
    ("gdn", False, {"state": "int8_h32/tile32", "state_read.lhs": "nvfp4/block16",
                    "key_interaction.lhs": "int8/row", "output_value.rhs": "int8/row", "state_update.lhs": "int8/row"}),
    ("kda", True, {"state": "fp8_e4m3/tile16", "w": "nvfp4/block16"}),
])
def test_qdq_forward_rounds_like_the_reference(kind, varlen, quant):
    V = 32 if "int8_h32" in quant["state"] else 16
    inputs, cu = chunk_case(kind, varlen, "kv", K=16, V=V)
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(quant=quant)
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    w, h, active = kernel_chunks(parts, ref, inputs, cu, 8)
    w_flips = count_flips(w, ref["w"], ref["w"].abs().amax((-2, -1), keepdim=True))
    h_sel, h_ref_sel = h.transpose(1, 2)[active], ref["h"].transpose(1, 2)[active]  # [chunks, HV, K, V]
    h_flips = count_flips(h_sel, h_ref_sel, h_ref_sel.abs().amax((-2, -1), keepdim=True))
    print(f"{kind} {quant}: W flips {w_flips}/{w.numel()}, state flips {h_flips}/{h_sel.numel()}")
    assert w_flips <= MAX_FLIP_FRACTION * w.numel() and h_flips <= MAX_FLIP_FRACTION * h_sel.numel()
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    o_exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind=kind, chunk=8), scale=0.4,
                                            initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, o_exact) > max(2 * QDQ_TOL, 10 * rel_l2(o, o_ref))  # the rounding is really there


@pytest.mark.parametrize("kind,fmt,C,varlen", [  # int8/row operands: test_qdq_forward_rounds_like_the_reference
    ("gdn", "fp8_e4m3/row", 8, True), ("kda", "fp8_e4m3/row", 8, False), ("kda", "fp8_e4m3/row", 8, True),
    ("gdn", "nvfp4/block16", 16, True), ("kda", "nvfp4/block16", 16, False),
])
def test_operand_sites_forward_and_backward(kind, fmt, C, varlen):
    """All eight GEMM operand sites (+ state and W; KDA: per-pair rounding of its pairwise operands; NVFP4:
    global amax over each operand tile, all of V for value-spanning operands): QDQ'd W and h and the
    output_score product A_qk element for element (flips counted), outputs, and every gradient (identity STE: the products' other operands are the
    rounded ones)."""
    if varlen:  # GDN with NVFP4: V = 32 makes the h stage hold two [K x 16] state tiles in its all-V tile
        inputs, cu = chunk_case(kind, True, "kv", K=16, V=32 if fmt.startswith("nvfp4") else 16)
    else:  # KDA's rounded pairwise operands run column by column: a shorter sequence keeps the interpreter quick
        # (KDA varlen with NVFP4 everywhere is left out: re-rounding on-grid values makes exact ties, one of which
        # flips a W element and moves o by up to 3.4e-2 on some inputs; docs/kernels-chunk.md, section 5)
        inputs, cu = make_inputs(kind, B=1, T=C - 3, H=1, HV=2, K=16, V=16, dtype=torch.float32), None
    quant = {site: fmt for site in OPERAND_SITES if site != "state_read.lhs"}
    spec = RecurrenceSpec(kind=kind, chunk=C).replace(quant={**quant, "state": "fp8_e4m3/tile16", "w": fmt})
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    w, h, active = kernel_chunks(parts, ref, inputs, cu, C)
    w_flips = count_flips(w, ref["w"], ref["w"].abs().amax((-2, -1), keepdim=True))
    h_sel, h_ref_sel = h.transpose(1, 2)[active], ref["h"].transpose(1, 2)[active]
    h_flips = count_flips(h_sel, h_ref_sel, h_ref_sel.abs().amax((-2, -1), keepdim=True))
    B, T = inputs[0].shape[:2]
    A_qk = _to_chunks(parts["A_qk"].double(), sequence_bounds(B, T, cu), ref["A_qk"].shape[2], C)
    a_flips = count_flips(A_qk, ref["A_qk"], ref["A_qk"].abs().amax((-2, -1), keepdim=True))  # output_score's product
    print(f"{kind} all operand sites {fmt}: W flips {w_flips}/{w.numel()}, state flips {h_flips}/{h_sel.numel()}, "
          f"A_qk flips {a_flips}/{A_qk.numel()}")
    assert w_flips <= MAX_FLIP_FRACTION * w.numel() and h_flips <= MAX_FLIP_FRACTION * h_sel.numel()
    assert a_flips <= MAX_FLIP_FRACTION * A_qk.numel()
    # 16 rounding sites on tiny tiles: one fp32-vs-fp64 flip of an operand element (an FP8 step is 6-12 %)
    # moves a whole row or column of the product it feeds (observed: 1.4e-3 on dq, 7.9e-3 on a 512-element
    # final state), hence ALL_SITES_TOL; the kernel must still sit far closer to the rounding reference
    # than to exact numerics.
    exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind=kind, chunk=C), scale=0.4,
                                          initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, o_ref) <= ALL_SITES_TOL and rel_l2(ht, ht_ref) <= ALL_SITES_TOL
    assert rel_l2(o, exact) > max(2 * QDQ_TOL, 10 * rel_l2(o, o_ref))
    assert_backward_matches(spec, inputs, cu, ALL_SITES_TOL)


@pytest.mark.parametrize("kind,fmt", [("gdn", "fp8_e4m3/row"), ("kda", "fp8_e4m3/row"), ("gdn", "int8/row")])
def test_factored_scales_forward(kind, fmt):
    """The forward stages multiply the rounded pair products (GDN), W, U, the state update and both output
    products on grid values with the row scales applied to the result wherever both operands round per row to
    FP8 / INT8; with accumulator emulation at those sites they multiply the dequantized operands."""
    from la_compiler.kernels.chunk.flags import spec_constexprs

    factored = ("FACTORED_WY", "FACTORED_STATE_UPDATE", "FACTORED_OUTPUT_STATE", "FACTORED_OUTPUT_VALUE")
    quant = {site: fmt for site in OPERAND_SITES if site != "state_read.lhs"}
    params = ChunkParams.from_spec(RecurrenceSpec(kind=kind, chunk=8).replace(quant=quant))
    # W and U, the state update, both output products; GDN's pair products too (KDA's come from its pairs kernel)
    values = spec_constexprs(params)
    assert all(values[name] for name in factored) and values["FACTORED_PAIRS"]
    emulated = ChunkParams.from_spec(RecurrenceSpec(kind=kind, chunk=8).replace(
        quant=quant, acc={site: "fp16:4" for site in GEMM_SITES}))
    assert not any(spec_constexprs(emulated)[name] for name in (*factored, "FACTORED_PAIRS"))


@pytest.mark.parametrize("kind,acc", [
    ("gdn", {site: "bf16:4" for site in ("key_interaction", "wy_value", "wy_key", "state_read", "state_update",
                                          "output_state", "output_score", "output_value")}),
    ("kda", {"key_interaction": "fp16:4", "output_value": "fp16:4", "state_update": "fp16:4"}),
    ("kda", {site: "bf16:4" for site in ("wy_value", "wy_key", "state_read", "output_state", "output_score")}),
])
def test_accumulator_emulation_forward_and_backward(kind, acc):
    """acc.<site>: the products accumulated block by block in fp16/bf16 (rounded after every block's add),
    straight-through gradients; kernel against the reference's emulation, forward and every gradient."""
    inputs, cu = chunk_case(kind, kind == "gdn", "kv", K=16, V=16)
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(acc=acc)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind=kind, chunk=8), scale=0.4,
                                          initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, exact) > 10 * rel_l2(o, o_ref)  # the emulation is really there
    assert_backward_matches(spec, inputs, cu, QDQ_TOL)


@pytest.mark.parametrize("kind,varlen,state,extra", [
    ("gdn", False, "kv", {}),
    ("kda", True, "vk", {}),
    ("gdn", True, "kv", dict(solve="neumann", degree=2)),
    ("kda", True, "kv", dict(solve="neumann", degree=2)),  # exact pair products: their gradients in the intra kernel
])
def test_backward_exact(kind, varlen, state, extra):
    """Every gradient (dq, dk, dv, dg, dbeta, dh0) of the Triton backward against fp64 autograd."""
    inputs, cu = chunk_case(kind, varlen, state)
    spec = RecurrenceSpec(kind=kind, chunk=8, state=state, **extra)
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


@pytest.mark.parametrize("kind,varlen,state,HV", [("kda", False, "kv", 1), ("kda", True, "vk", 2),
                                                  ("gdn", False, "vk", 2), ("gdn", True, "kv", 1)])
def test_pair_gradients_by_key_block(kind, varlen, state, HV):
    """The exact backward runs its key-side gradients by key blocks (the intra stage) and the pair products'
    (KDA: after them, in a second kernel, one sub-chunk x key block per program; GDN: in the same key loop,
    dA complete before it): above 64 columns with fp32 inputs, blocks of 32, so K = 72 takes two full blocks
    and a masked partial one. Every gradient against fp64 autograd, on a packed batch and with grouped value
    heads."""
    from la_compiler.kernels.chunk.forms import bwd_intra_by_key_blocks
    from la_compiler.kernels.chunk.launch import key_block

    cu = torch.tensor([0, 9, 25]) if varlen else None
    q, k, v, g, beta, h0 = make_inputs(kind, B=1 if varlen else 2, T=25 if varlen else 13, H=1, HV=HV, K=72, V=8,
                                       N=2, dtype=torch.float32)
    if state == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    spec = RecurrenceSpec(kind=kind, chunk=8, state=state)
    assert bwd_intra_by_key_blocks(ChunkParams.from_spec(spec)) and key_block(128, None) < 72
    assert_backward_matches(spec, (q, k, v, g, beta, h0), cu, EXACT_TOL)


def test_gdn_whole_row_backward_by_value_blocks_of_32():
    """GDN's backward intra stage over whole key rows (a key-side operand site rounds: one key block) steps
    through V in blocks of 32 (chunk.launch.GDN_WHOLE_ROW_BWD_VALUE_BLOCK): V = 80 takes two full blocks and a
    masked partial one. Every gradient against fp64 autograd of the rounding reference, packed sequences."""
    from la_compiler.kernels.chunk.forms import bwd_intra_by_key_blocks
    from la_compiler.kernels.chunk.launch import GDN_WHOLE_ROW_BWD_VALUE_BLOCK

    cu = torch.tensor([0, 9, 25])
    inputs = make_inputs("gdn", B=1, T=25, H=1, HV=2, K=16, V=80, N=2, dtype=torch.float32)
    spec = RecurrenceSpec(kind="gdn", chunk=8).replace(quant={"state_read.rhs": "fp8_e4m3/row"})
    assert not bwd_intra_by_key_blocks(ChunkParams.from_spec(spec)) and GDN_WHOLE_ROW_BWD_VALUE_BLOCK == 32
    assert_backward_matches(spec, inputs, cu, QDQ_TOL)


@pytest.mark.parametrize("kind,varlen,quant", [
    ("gdn", True, {}),
    ("kda", False, {}),
    ("gdn", False, {"state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row", "wy_key.rhs": "fp8_e4m3/row"}),
    ("kda", True, {"state": "int8/tile16", "w": "nvfp4/block16"}),
])
def test_forward_intra_by_key_blocks(kind, varlen, quant):
    """The forward intra stage reads keys in blocks (64 columns by default; 16 here (n.key_block), so K = 40 takes
    two full blocks and a masked one): pair products summed over blocks, W block by block with its row /
    NVFP4 global amax from a first pass over all blocks. Forward, W element by element, every gradient."""
    from la_compiler.kernels.chunk.blocks import intra_key_block

    inputs, cu = chunk_case(kind, varlen, "kv", K=40, V=16)
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(quant=quant, numerics={"key_block": 16})
    assert intra_key_block(ChunkParams.from_spec(spec), 64, 16) == 16
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    tol = QDQ_TOL if quant else EXACT_TOL
    assert rel_l2(o, o_ref) <= tol and rel_l2(ht, ht_ref) <= tol
    w, _, _ = kernel_chunks(parts, ref, inputs, cu, 8)
    assert count_flips(w, ref["w"], ref["w"].abs().amax((-2, -1), keepdim=True)) == 0
    assert_backward_matches(spec, inputs, cu, tol)


def test_intra_key_block_choice():
    """All key columns at once where a pair product or wy_key.rhs is rounded over them; a bad override
    is refused by name."""
    from la_compiler.kernels.chunk.blocks import intra_key_block
    from la_compiler.options import OptionsError

    exact = ChunkParams.from_spec(RecurrenceSpec(kind="kda", chunk=64))
    assert intra_key_block(exact, 256, 16) == 32 and intra_key_block(exact, 128, 16) == 32
    assert intra_key_block(exact, 64, 16) == 64 and intra_key_block(exact, 32, 16) == 32
    for quant in ({"key_interaction.rhs": "fp8_e4m3/row"}, {"wy_key.rhs": "nvfp4/block16"}):
        assert intra_key_block(ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=64).replace(quant=quant)),
                               128, 16) == 128
    assert intra_key_block(ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=64).replace(acc={"output_score": "fp16:16"})),
                           256, 16) == 256
    blocks16 = ChunkParams.from_spec(RecurrenceSpec(kind="kda", chunk=64).replace(numerics={"key_block": 16}))
    assert intra_key_block(blocks16, 128, 16) == 16 and intra_key_block(blocks16, 128, 32) == 32  # >= a W block
    with pytest.raises(OptionsError, match=r"key_block: must be one of \[None, 16, 32, 64, 128\], got 48"):
        ChunkParams(kind="kda", state="kv", chunk=64, numerics=NumericsOptions(key_block=48))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_head_k_256(kind):
    """K = 256 (the issue's largest head): the forward intra stage and the backward's key-side and pair
    gradients in key blocks of 32; FP8 state and W, forward and every gradient against fp64. A GDN pair
    product rounded over whole key rows is refused at that width, by name."""
    q, k, v, g, beta, h0 = make_inputs(kind, B=1, T=10, H=1, HV=1, K=256, V=16, dtype=torch.float32)
    # KDA: rounded pair products too (their own kernels hold [4 x 256] rows)
    pairs = {"key_interaction.lhs": "fp8_e4m3/row", "output_score.rhs": "fp8_e4m3/row"} if kind == "kda" else {}
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(quant={"state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row", **pairs})
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, (q, k, v, g, beta, h0), None)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    assert_backward_matches(spec, (q, k, v, g, beta, h0), None, QDQ_TOL)
    if kind == "gdn":
        rounded = RecurrenceSpec(kind="gdn", chunk=8).replace(quant={"key_interaction.lhs": "fp8_e4m3/row"})
        with pytest.raises(ValueError, match="GDN's backward with a rounded pair product"):
            chunk_fwd(ChunkParams.from_spec(rounded), q, k, v, g, beta, 0.4)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_head_v_256(kind):
    """V = 256 (the issue's largest value head): several value blocks per head in every stage (64 columns in
    the intra, h and dh stages and the backward's value loops, 128 in the o stage); INT8 state tiles of 64
    along V. Forward and every gradient against fp64."""
    inputs = make_inputs(kind, B=1, T=11, H=1, HV=2, K=16, V=256, dtype=torch.float32)
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(quant={"state": "int8/tile64"})
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, None)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    assert_backward_matches(spec, inputs, None, QDQ_TOL)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_hadamard_state_codec_forward_and_backward(kind):
    """q.state=int8_h32/tile32 (INT8 after a Hadamard-32 rotation along V, then back): the chunk-start states
    element for element (flips counted), outputs, final state and every gradient (identity STE through the
    codec), varlen with an empty sequence, grouped value heads, two 32-wide state tiles."""
    inputs, cu = chunk_case(kind, True, "kv", K=16, V=64)
    spec = RecurrenceSpec(kind=kind, chunk=8).replace(quant={"state": "int8_h32/tile32"})
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    _, h, active = kernel_chunks(parts, ref, inputs, cu, 8)
    h_sel, h_ref_sel = h.transpose(1, 2)[active], ref["h"].transpose(1, 2)[active]
    h_flips = count_flips(h_sel, h_ref_sel, h_ref_sel.abs().amax((-2, -1), keepdim=True))
    print(f"{kind} int8_h32 state: flips {h_flips}/{h_sel.numel()}")
    assert h_flips <= MAX_FLIP_FRACTION * h_sel.numel()
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    o_exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind=kind, chunk=8), scale=0.4,
                                            initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, o_exact) > 10 * rel_l2(o, o_ref)
    assert_backward_matches(spec, inputs, cu, QDQ_TOL)


@pytest.mark.parametrize("kind,C,state", [("gdn", 64, "kv"), ("kda", 32, "vk"), ("kda", 64, "kv")])
def test_blocked_solve_forward_and_backward(kind, C, state):
    """Chunks of 32 and 64 rows take the blocked exact solve (16-row diagonal blocks, then the
    block-lower series): forward, final state and every gradient against fp64 autograd, with keys
    strongly correlated (A far from small) and a packed batch whose last chunks are partial."""
    cu = torch.tensor([0, 50, 50, 121])
    q, k, v, g, beta, h0 = make_inputs(kind, B=1, T=121, H=1, HV=2, K=8, V=16, N=3, dtype=torch.float32, decay=0.05)
    k = torch.nn.functional.normalize(k + 2.0 * torch.randn(8), dim=-1)  # a shared direction: |k_i . k_j| ~ 1
    beta = 0.5 + 0.5 * beta
    if state == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    inputs = (q, k, v, g, beta, h0)
    spec = RecurrenceSpec(kind=kind, chunk=C, state=state)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


def test_kda_sub_chunk_kernels_with_strong_decay_and_padded_sub_chunks():
    """KDA's pair-product kernels run one 16-row sub-chunk per program (forward: chunk_fwd_kernel_pairs;
    backward: chunk_bwd_kernel_pairs) through the first / last REAL row of the block as the decay
    reference. Chunks of 32 with sequences of 17 and 33 tokens leave sub-chunks with one real row and
    sub-chunks with none; g down to about -6 per token makes G fall by ~100 across a sub-chunk, so any
    exponent taken from a padded row or the wrong side of the diagonal overflows fp32 (exp(88.7)) and
    shows up as inf / NaN. Forward, final state and every gradient against fp64 autograd."""
    from la_compiler.kernels.chunk.forms import kda_pairs_kernel, kda_splits_pair_grads

    cu = torch.tensor([0, 17, 17, 50])
    q, k, v, g, beta, h0 = make_inputs("kda", B=1, T=50, H=1, HV=2, K=8, V=16, N=3, dtype=torch.float32, decay=8.0)
    assert g.min() < -6
    spec = RecurrenceSpec(kind="kda", chunk=32)
    params = ChunkParams.from_spec(spec)
    assert params.sub_chunk == 16 and kda_pairs_kernel(params) and kda_splits_pair_grads(params)
    inputs = (q, k, v, g, beta, h0)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunk_variant_through_the_ir_op(kind):
    """torch.ops.laqat.delta_rule with kernel=chunk and state + W QDQ: forward and every gradient
    (Triton backward, identity STE) against the fp64 chunk reference under autograd (HV > H, varlen)."""
    import la_compiler.ir.delta_rule  # noqa: F401  (registers the op)

    inputs, cu = chunk_case(kind, True, "kv")
    spec = RecurrenceSpec(kind=kind, chunk=8, kernel="chunk").replace(
        quant={"state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row"})
    xs = [x.clone().requires_grad_() for x in inputs]
    o, ht = torch.ops.laqat.delta_rule(*xs[:5], xs[5], cu, 0.4, str(spec))
    x64 = [x.detach().double().requires_grad_() for x in inputs]
    o_ref, ht_ref = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    cot = [torch.randn_like(o), torch.randn_like(ht)]
    got = grads_of([o, ht], cot, xs)
    want = grads_of([o_ref, ht_ref], [c.double() for c in cot], x64)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert a.dtype == torch.float32 and rel_l2(a, b) <= QDQ_TOL, name


@pytest.mark.parametrize("text,match", [
    ("kda[chunk=8; q.output_value.lhs=int8/block16]", "output_value.lhs"),
    ("gdn[chunk=8; q.output_value.lhs=nvfp4/block16]", "output_value.lhs"),
    ("gdn[chunk=8; acc.wy_key=fp8:16]", "acc.wy_key"),
    ("gdn[chunk=8; q.state=fp8_e4m3/row]", "q.state"),
    ("kda[chunk=8; q.w=fp8_e4m3/tensor]", "q.w"),
    ("kda[chunk=8; q.state=fp8_e4m3/tile16/clip]", "q.state"),
    ("gdn[chunk=8; phase=token]", "phase"),
])
def test_unsupported_specs_are_refused_by_name(text, match):
    spec = RecurrenceSpec.parse(text)
    assert match in unsupported(spec)
    with pytest.raises(KernelParamsError, match=match):
        ChunkParams.from_spec(spec)


def test_selection_row_takes_only_what_the_kernels_implement():
    from la_compiler.kernels.selection import select_kernel

    def choose(text, head_k=64):
        return select_kernel(RecurrenceSpec.parse(text), device="cuda", dtype=torch.bfloat16, head_k=head_k,
                             head_v=64)

    assert choose("kda[chunk=64; q.state=int8/tile64; q.w=fp8_e4m3/row]").variant == "chunk"
    assert choose("gdn[chunk=64; solve=neumann:3]").variant == "chunk"
    assert choose("gdn[chunk=64; q.state=fp8_e4m3/tile64; q.output_value.lhs=fp8_e4m3/row]").variant == "chunk"
    assert choose("kda[chunk=64; q.key_interaction.rhs=fp8_e4m3/row]").variant == "chunk"
    assert choose("kda[chunk=64; q.output_value.rhs=nvfp4/block16; acc.wy_key=bf16:16]").variant == "chunk"
    operand = choose("kda[chunk=64; q.state=fp8_e4m3/tile64; q.output_value.lhs=fp8_e4m3/row/clip]")
    assert operand.variant == "reference" and "output_value.lhs" in dict(operand.rejected)["chunk"]
    # the key-blocked stages take K up to 256, unless a site rounds over whole key rows
    assert choose("gdn[chunk=64; q.state=fp8_e4m3/tile64]", head_k=256).variant == "chunk"
    assert choose("kda[chunk=64; q.state=fp8_e4m3/tile64; q.w=fp8_e4m3/row]", head_k=256).variant == "chunk"
    assert choose("kda[chunk=64]", head_k=512).variant == "reference"
    # KDA's rounded pair products run in their own kernels: the intra stages stay key-blocked
    assert choose("kda[chunk=64; q.key_interaction.lhs=fp8_e4m3/row; q.output_score.rhs=nvfp4/block16]",
                  head_k=256).variant == "chunk"
    wide = choose("gdn[chunk=64; acc.output_score=bf16:32]", head_k=256)
    assert wide.variant == "reference" and "GDN's backward with a rounded pair product" in dict(wide.rejected)["chunk"]
    for text in ("kda[chunk=64; q.state_read.rhs=fp8_e4m3/row]", "kda[chunk=64; solve=neumann:3]",
                 "kda[chunk=64; solve=neumann:3; q.key_interaction.lhs=fp8_e4m3/row]", "gdn[chunk=64; solve=neumann:3]",
                 "gdn[chunk=64; q.output_state.rhs=fp8_e4m3/row]", "gdn[chunk=64; q.key_interaction.rhs=fp8_e4m3/row]"):
        assert choose(text, head_k=128).variant == "chunk"
        wide = choose(text, head_k=256)
        assert wide.variant == "reference" and "head_k <= 128" in dict(wide.rejected)["chunk"], text


@pytest.mark.parametrize("max_range", [-1.0, 40.0], ids=["rows", "dots"])
def test_kda_diagonal_blocks_by_dots_and_by_rows(monkeypatch, max_range):
    """KDA's exact pair kernels take a diagonal sub-chunk block through its first real row (tensor-core dots)
    when its decay range is at most chunk.forms.DIAG_DOT_MAX_RANGE, else row by row: each form alone
    (-1 forces rows everywhere; at 40 these inputs' blocks all go by dots), forward and every gradient."""
    from la_compiler.kernels.chunk import forms as chunk_forms

    monkeypatch.setattr(chunk_forms, "DIAG_DOT_MAX_RANGE", max_range)
    cu = torch.tensor([0, 17, 17, 50])
    inputs = make_inputs("kda", B=1, T=50, H=1, HV=2, K=16, V=16, N=3, dtype=torch.float32)
    spec = RecurrenceSpec(kind="kda", chunk=32)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


def test_kda_diagonal_dots_need_the_range_guard(monkeypatch):
    """Without the range guard a steep block's factors exp(G_f - G_j) overflow: the guard is what keeps the
    strong-decay test finite."""
    from la_compiler.kernels.chunk import forms as chunk_forms

    monkeypatch.setattr(chunk_forms, "DIAG_DOT_MAX_RANGE", 1e9)
    q, k, v, g, beta, h0 = make_inputs("kda", B=1, T=32, H=1, HV=1, K=8, V=8, dtype=torch.float32, decay=8.0)
    g[:, :16] = -7.0  # G falls by 105 across the first sub-chunk
    o, _ = chunk_fwd(ChunkParams.from_spec(RecurrenceSpec(kind="kda", chunk=32)), q, k, v, g, beta, 0.4, h0)
    assert not torch.isfinite(o).all()


def test_int64_offsets_where_an_offset_may_pass_2_31():
    """The per-chunk kernels take int32 offsets unless an element offset may pass 2^31: rows of the
    [B, T, heads, ..] buffers (up to 2C wide, each sequence's last chunk padded) or the chunk states."""
    from la_compiler.kernels.chunk.blocks import needs_int64_index

    rows_edge = 2 ** 24 - 64  # (T + C) * 1 head * 128 (= 2C) columns reaches 2^31
    assert not needs_int64_index(1, rows_edge - 1, 64, 1, 64, 64, (rows_edge - 1) // 64 + 1, 1)
    assert needs_int64_index(1, rows_edge, 64, 1, 64, 64, rows_edge // 64, 1)
    T = 2 ** 21 + 64  # rows far below 2^31, but the chunk states [chunks, 1, 256, 256] pass it
    assert needs_int64_index(1, T, 64, 1, 256, 256, T // 64, 1)
    assert not needs_int64_index(8, 4096, 64, 16, 128, 128, 8 * 64, 16)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_int64_offsets_compute_what_int32_ones_do(monkeypatch, request, kind):
    """Small inputs forced onto the int64-offset path (INDEX_64, taken by shapes past 2^31 elements) match
    the fp64 reference like the int32 path: forward, final state and every gradient, packed sequences."""
    from la_compiler.kernels.chunk import blocks, plan

    monkeypatch.setattr(blocks, "needs_int64_index", lambda *shape: True)
    plan._plan.cache_clear()  # plans made with int32 offsets, before and after
    request.addfinalizer(plan._plan.cache_clear)
    cu = torch.tensor([0, 40, 90])
    inputs = make_inputs(kind, B=1, T=90, H=1, HV=2, K=16, V=16, N=2, dtype=torch.float32)
    spec = RecurrenceSpec(kind=kind, chunk=32)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


@pytest.mark.parametrize("varlen", [False, True])
def test_kda_decayed_keys_and_a_wide_output_block(varlen):
    """KDA's intra stage writes kd = K ⊙ exp(G_last - G) for the h and dh stages (G_last: the chunk's last real
    row, so partial chunks too), by key blocks of 16 here (K = 40: a masked block); V = 96 runs the output stage
    as one masked 128-wide value block. kd against fp64 from the inputs, o and ht against the fp64 reference,
    every gradient against fp64 autograd (the dh stage reads kd from the backward's recompute)."""
    from la_compiler.kernels.chunk.blocks import output_value_block

    C = 8
    inputs, cu = chunk_case("kda", varlen, "kv", K=40, V=96)
    assert output_value_block(96, rounds_operands=False) == 128
    spec = RecurrenceSpec(kind="kda", chunk=C).replace(numerics={"key_block": 16})
    (o, ht, parts), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= EXACT_TOL and rel_l2(ht, ht_ref) <= EXACT_TOL
    k, g = inputs[1].double(), inputs[3].double()
    HV, H = g.shape[2], k.shape[2]
    kd_ref = torch.full_like(g, float("nan"))
    for b, start, end in sequence_bounds(k.shape[0], k.shape[1], cu):
        for t0 in range(start, end, C):
            t1 = min(t0 + C, end)
            G = g[b, t0:t1].cumsum(0)
            kd_ref[b, t0:t1] = k[b, t0:t1].repeat_interleave(HV // H, 1) * torch.exp(G[-1] - G)
    written = ~torch.isnan(kd_ref)
    assert written.any() and torch.isfinite(parts["kd"][written]).all()
    assert rel_l2(parts["kd"][written], kd_ref[written]) <= EXACT_TOL
    assert_backward_matches(spec, inputs, cu, EXACT_TOL)


@pytest.mark.parametrize("quant,acc,on_values", [
    ({}, {}, True),
    ({"state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row", "state_read.rhs": "fp8_e4m3/row"}, {}, True),
    ({"state_update.lhs": "fp8_e4m3/row"}, {}, False),
    ({"state_update.rhs": "int8/row"}, {}, False),
    ({}, {"state_update": "bf16:16"}, False),
])
def test_gdn_chunk_decay_on_values_only_where_no_state_update_operand_rounds(quant, acc, on_values):
    """GDN's h stage scales V_new's rows by the chunk decay (K^T loaded as is) unless the state_update operands are
    rounded or accumulated: docs/numerics.md's state_update.lhs is K ⊙ exp(G_C - G), so that form stays there. Both
    forms against the fp64 reference (which rounds at the same sites)."""
    from la_compiler.kernels.chunk.flags import spec_constexprs
    from la_compiler.kernels.chunk.forms import gdn_decays_values

    spec = RecurrenceSpec(kind="gdn", chunk=8).replace(quant=quant, acc=acc)
    p = ChunkParams.from_spec(spec)
    assert gdn_decays_values(p) == on_values
    assert spec_constexprs(p)["GDN_DECAYS_VALUES"] == on_values  # the h stage's form (chunk/fwd_h.py)
    assert not gdn_decays_values(ChunkParams.from_spec(RecurrenceSpec(kind="kda", chunk=8)))
    inputs, cu = chunk_case("gdn", True, "kv", K=16, V=16)
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)
    tol = EXACT_TOL if not quant and not acc else QDQ_TOL
    assert rel_l2(o, o_ref) <= tol and rel_l2(ht, ht_ref) <= tol


@pytest.mark.parametrize("kind,site", [("kda", "output_value.rhs"), ("gdn", "output_state.rhs")])
def test_nvfp4_output_operand_over_several_value_blocks(kind, site):
    """An NVFP4 output operand whose global amax spans every value block (V = 128: two output blocks of 64): each
    program still writes its own block of o (its amax loop must not move the program's value columns), every
    element finite and the forward as the reference rounds it."""
    inputs, cu = chunk_case(kind, False, "kv", K=16, V=128)
    spec = RecurrenceSpec(kind=kind, chunk=16).replace(quant={site: "nvfp4/block16"})
    (o, ht, _), (o_ref, ht_ref, _) = run_kernel_and_reference(spec, inputs, cu)  # finite: no block left unwritten
    assert rel_l2(o[..., :64], o_ref[..., :64]) <= QDQ_TOL and rel_l2(o[..., 64:], o_ref[..., 64:]) <= QDQ_TOL
    assert rel_l2(ht, ht_ref) <= QDQ_TOL
