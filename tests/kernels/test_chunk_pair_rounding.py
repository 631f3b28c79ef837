"""KDA's rounded pair products (key_interaction / output_score QDQ, accumulator emulation) in their own
kernels, one sub-chunk of rows per program: forward and every gradient against the fp64 reference that
rounds at the same sites (interpreter on CPU)."""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk.flags import spec_constexprs
from la_compiler.kernels.chunk.forms import (column_side_by_products, kda_pairs_kernel, kda_rounds_pairs,
                                            kda_splits_pair_grads)
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.reference.chunk import _to_chunks, chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import sequence_bounds
from tests.helpers import rel_l2
from tests.kernels.chunk_inputs import make_inputs
from tests.kernels.chunk_checks import (MAX_FLIP_FRACTION, QDQ_TOL, assert_backward_matches, count_flips,
                                       run_kernel_and_reference)

PAIR_SITES = ("key_interaction.lhs", "key_interaction.rhs", "output_score.lhs", "output_score.rhs")


@pytest.mark.parametrize("fmt,acc,C,varlen,solve", [
    ("fp8_e4m3/row", None, 16, True, {}),
    ("nvfp4/block16", None, 16, True, {}),
    ("int8/row", {"key_interaction": "fp16:8", "output_score": "bf16:16"}, 32, False, {}),
    ("fp8_e4m3/row", None, 16, False, dict(solve="neumann", degree=3)),
])
def test_rounded_pairs_by_sub_chunk(fmt, acc, C, varlen, solve):
    """A and A_qk (the rounded pair operands' products) element for element against the rounding reference,
    flips counted and bounded; forward, final state and every gradient. Sub-chunks of C / 2 rows (2 per chunk), several chunks per sequence, partial last chunks and an
    empty sequence (varlen), grouped value heads, K = 32 (two NVFP4 blocks per row). The NVFP4 global
    amaxes span the chunk: each sub-chunk program contributes its share first. The backward's column side
    runs by products (FP8 / INT8) and row by row (NVFP4 lhs rows). The Neumann solve keeps
    its backward's pair gradients inside the intra kernel but takes the forward's pairs kernel."""
    if varlen:
        cu = torch.tensor([0, 13, 13, 37])
        inputs = make_inputs("kda", B=1, T=37, H=1, HV=2, K=32, V=8, N=3, dtype=torch.float32, decay=2.0)
    else:
        cu = None
        inputs = make_inputs("kda", B=1 if C > 16 else 2, T=35 if C > 16 else 21, H=1, HV=2, K=32, V=8,
                             dtype=torch.float32, decay=2.0)
    spec = RecurrenceSpec(kind="kda", chunk=C, **solve).replace(quant={site: fmt for site in PAIR_SITES},
                                                                  acc=acc or {})
    params = ChunkParams.from_spec(spec)
    assert kda_pairs_kernel(params) and kda_rounds_pairs(params)
    assert kda_splits_pair_grads(params) == (not solve)
    assert spec_constexprs(params)["PAIRS_NVFP4"] == fmt.startswith("nvfp4")  # the chunk-wide amax kernel runs
    assert column_side_by_products(params) == (not fmt.startswith("nvfp4"))  # both forms of the column side
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    # the products of the rounded pair operands element for element: A = beta P (strict) and A_qk, flips counted
    B, T = inputs[0].shape[:2]
    seqs = sequence_bounds(B, T, cu)
    NC = ref["A"].shape[2]
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    P = _to_chunks(parts["p_pairs"].double(), seqs, NC, C)  # unwritten above the diagonal: masked here
    A = torch.where(strict, P * _to_chunks(inputs[4].double(), seqs, NC, C)[..., None], 0.0)
    A_qk = _to_chunks(parts["A_qk"].double(), seqs, NC, C)
    for name, got in (("A", A), ("A_qk", A_qk)):
        want = ref[name]
        flips = count_flips(got, want, want.abs().amax((-2, -1), keepdim=True))
        print(f"{fmt} {name}: {flips} of {want.numel()} elements off by more than fp32 noise")
        assert flips <= MAX_FLIP_FRACTION * want.numel(), name
    exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind="kda", chunk=C, **solve),
                                          scale=0.4, initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, exact) > 10 * rel_l2(o, o_ref)  # the rounding is really there
    assert_backward_matches(spec, inputs, cu, QDQ_TOL)


def test_nvfp4_pair_amax_is_the_pair_tiles_max():
    """chunk_fwd_kernel_pair_amax takes the amax of the chunk's [C x C x K] pair tiles from a reverse
    running max of G (O(C x K)): it must equal the max over the tile the reference rounds (zero-padded
    chunks, so a sequence's last real row meets padded rows i with e^0 = 1), for j < i and j <= i, and of
    |K| / |Q| over the chunk. Growing and decaying channels (g of both signs), a packed batch whose chunks
    end mid-way and one longer than a chunk (row C is the next chunk's: excluded)."""
    from la_compiler.kernels.chunk.fwd import chunk_fwd
    from la_compiler.kernels.chunk.layout import chunk_layout
    from la_compiler.kernels.reference.chunk import _pair_decay

    C = 16
    cu = torch.tensor([0, 5, 5, 40])
    q, k, v, g, beta, h0 = make_inputs("kda", B=1, T=40, H=1, HV=2, K=32, V=8, N=3, dtype=torch.float32)
    g = g + 0.3 * torch.randn_like(g)  # some channels grow: the largest G is not always the latest row's
    spec = RecurrenceSpec(kind="kda", chunk=C).replace(quant={"output_score.rhs": "nvfp4/block16"})
    parts = {}
    chunk_fwd(ChunkParams.from_spec(spec), q, k, v, g, beta, 0.4, h0, cu, intermediates=parts)
    seqs = sequence_bounds(1, 40, cu)
    NC = 3
    G = _to_chunks(g.double(), seqs, NC, C).cumsum(3)  # [N, HV, NC, C, K]
    Kc = _to_chunks(k.double().expand(-1, -1, 2, -1), seqs, NC, C)
    Qc = _to_chunks(q.double().expand(-1, -1, 2, -1), seqs, NC, C)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    lay = chunk_layout(1, 40, C, cu)
    got = parts["pair_amax"].double()  # [chunks, heads, 4]
    rows = [(n, c) for n, (_, s, e) in enumerate(seqs) for c in range((e - s + C - 1) // C)]
    assert len(rows) == lay.NT == got.shape[0]
    for i_chunk, (n, c) in enumerate(rows):
        for hv in range(2):
            kc, Gc = Kc[n, hv, c], G[n, hv, c]
            strict = (kc[None, :, :] * _pair_decay(Gc, causal.tril(-1))).abs().max()
            full = (kc[None, :, :] * _pair_decay(Gc, causal)).abs().max()
            want = torch.stack([strict, full, kc.abs().max(), Qc[n, hv, c].abs().max()])
            torch.testing.assert_close(got[i_chunk, hv], want, rtol=1e-6, atol=0)
