"""KDA's rounded pair products (key_interaction / output_score QDQ, accumulator emulation) in their own
kernels, one sub-chunk of rows per program: forward and every gradient against the fp64 reference that
rounds at the same sites (interpreter on CPU)."""
import pytest
import torch

from la_compiler.kernels.chunk_codegen import ChunkParams, chunk_fwd_source, kda_pairs_kernel, kda_splits_pair_grads
from la_compiler.kernels.chunk_pair_rounding import column_side_by_products
from la_compiler.kernels.chunk_reference import chunk_delta_rule_reference
from la_compiler.kernels.chunk_snippets import kda_rounds_pairs
from la_compiler.spec import RecurrenceSpec
from tests.helpers import rel_l2
from tests.kernels.chunk_inputs import make_inputs
from tests.kernels.test_chunk_kernels import QDQ_TOL, _assert_backward_matches, _run

PAIR_SITES = ("key_interaction.lhs", "key_interaction.rhs", "output_score.lhs", "output_score.rhs")


@pytest.mark.parametrize("fmt,acc,C,varlen,solve", [
    ("fp8_e4m3/row", None, 16, True, {}),
    ("nvfp4/block16", None, 16, True, {}),
    ("int8/row", {"key_interaction": "fp16:8", "output_score": "bf16:16"}, 32, False, {}),
    ("fp8_e4m3/row", None, 16, False, dict(solve="neumann", degree=3)),
])
def test_rounded_pairs_by_sub_chunk(fmt, acc, C, varlen, solve):
    """Sub-chunks of C / 2 rows (2 per chunk), several chunks per sequence, partial last chunks and an
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
    assert ("fwd_kernel_pair_amax" in chunk_fwd_source(params)) == fmt.startswith("nvfp4")
    assert column_side_by_products(params) == (not fmt.startswith("nvfp4"))  # both forms of the column side
    (o, ht, _), (o_ref, ht_ref, _) = _run(spec, inputs, cu)
    assert rel_l2(o, o_ref) <= QDQ_TOL and rel_l2(ht, ht_ref) <= QDQ_TOL
    exact, _ = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind="kda", chunk=C, **solve),
                                          scale=0.4, initial_state=inputs[5], cu_seqlens=cu)
    assert rel_l2(o, exact) > 10 * rel_l2(o, o_ref)  # the rounding is really there
    _assert_backward_matches(spec, inputs, cu, QDQ_TOL)
