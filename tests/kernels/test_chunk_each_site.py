"""Each GEMM operand site alone, in each format, GDN and KDA: the chunk kernels against the fp64 chunk
reference that rounds at that one site (interpreter on CPU).

With one site rounding there is nothing for an fp32/fp64 flip to spread through, so docs/numerics.md's bar holds
as written: outputs, final state and every gradient within 1e-3 relative L2 (observed ~1e-7), and the
QDQ'd intermediates the reference records (W, the chunk-start states h, the score product A_qk) equal element
for element but for counted, bounded flips. The all-sites tests (test_chunk_kernels.py) run the sixteen sites
together at a looser bar; this file is what ties each site to its own place in the computation.
"""
import pytest

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.chunk import _to_chunks, chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import sequence_bounds
from tests.helpers import rel_l2
from tests.kernels.chunk_checks import (MAX_FLIP_FRACTION, OPERAND_SITES, QDQ_TOL, assert_backward_matches, chunk_case,
                                       count_flips, kernel_chunks, run_kernel_and_reference)

SITES = [site for site in OPERAND_SITES if site != "state_read.lhs"]  # state_read.lhs is q.w: its own tests
FORMATS = ["fp8_e4m3/row", "int8/row", "nvfp4/block16"]
# Each site's backward: GDN in every format; KDA (twice GDN's time in the interpreter) in the two scalings, per row
# and per block of 16, as int8/row rounds at the sites fp8_e4m3/row does.
KDA_BACKWARD_FORMATS = ("fp8_e4m3/row", "nvfp4/block16")


def _counted_flips(parts, ref, inputs, cu, C) -> dict:
    w, h, active = kernel_chunks(parts, ref, inputs, cu, C)
    h_sel, h_ref_sel = h.transpose(1, 2)[active], ref["h"].transpose(1, 2)[active]  # [chunks, HV, K, V]
    B, T = inputs[0].shape[:2]
    A_qk = _to_chunks(parts["A_qk"].double(), sequence_bounds(B, T, cu), ref["A_qk"].shape[2], C)
    flips = {}
    for name, got, want in (("W", w, ref["w"]), ("h", h_sel, h_ref_sel), ("A_qk", A_qk, ref["A_qk"])):
        flips[name] = (count_flips(got, want, want.abs().amax((-2, -1), keepdim=True)), want.numel())
    return flips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_each_operand_site_alone(kind, site, fmt):
    """Varlen with an empty sequence and lengths off the chunk grid, grouped value heads (HV = 2 H); NVFP4
    takes chunks of 16 so that its blocks of 16 along a token reduction are whole."""
    C = 16 if fmt.startswith("nvfp4") else 8
    inputs, cu = chunk_case(kind, True, "kv", K=16, V=16)
    spec = RecurrenceSpec(kind=kind, chunk=C).replace(quant={site: fmt})
    (o, ht, parts), (o_ref, ht_ref, ref) = run_kernel_and_reference(spec, inputs, cu)
    flips = _counted_flips(parts, ref, inputs, cu, C)
    print(f"{kind} {site} {fmt}: o {rel_l2(o, o_ref):.1e}, ht {rel_l2(ht, ht_ref):.1e}, flips {flips}")
    for name, (count, total) in flips.items():
        assert count <= MAX_FLIP_FRACTION * total, name
    error = max(rel_l2(o, o_ref), rel_l2(ht, ht_ref))
    assert error <= QDQ_TOL
    # the site really rounds: the kernel sits far closer to the rounding reference than to exact numerics
    o_exact, ht_exact = chunk_delta_rule_reference(*inputs[:5], spec=RecurrenceSpec(kind=kind, chunk=C), scale=0.4,
                                                   initial_state=inputs[5], cu_seqlens=cu)
    assert max(rel_l2(o, o_exact), rel_l2(ht, ht_exact)) > max(1e-5, 100 * error)
    if kind == "gdn" or fmt in KDA_BACKWARD_FORMATS:
        assert_backward_matches(spec, inputs, cu, QDQ_TOL)
