"""Shared checks of the chunk-kernel tests: small fp32 cases, the kernel and the fp64 chunk reference run side by
side, every gradient against fp64 autograd, and rounding flips counted (docs/numerics.md, "How close is close")."""
import torch

from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.reference.chunk import _to_chunks, chunk_delta_rule_reference
from la_compiler.kernels.reference.recurrent import sequence_bounds
from tests.helpers import rel_l2
from tests.kernels.chunk_inputs import grads_of, make_inputs

EXACT_TOL = 1e-5  # fp32 kernel vs fp64 reference, no QDQ
QDQ_TOL = 1e-3  # outputs with QDQ
MAX_FLIP_FRACTION = 0.02  # of the QDQ'd elements compared
ALL_SITES_TOL = 2e-2  # outputs and gradients with all sixteen sites rounding (see the test)

GRAD_NAMES = "dq dk dv dg dbeta dh0".split()
OPERAND_SITES = [f"{s}.{side}" for s in ("key_interaction", "wy_value", "wy_key", "state_read", "state_update",
                                         "output_state", "output_score", "output_value") for side in ("lhs", "rhs")]
ALL_FP8 = {**{site: "fp8_e4m3/row" for site in OPERAND_SITES if site != "state_read.lhs"},
           "state": "fp8_e4m3/tile16", "w": "fp8_e4m3/row"}


def chunk_case(kind, varlen, state, K=8, V=16):
    if varlen:
        cu = torch.tensor([0, 3, 3, 12, 18])  # an empty sequence; lengths not multiples of the chunk
        xs = make_inputs(kind, B=1, T=18, H=1, HV=2, K=K, V=V, N=4, dtype=torch.float32)
    else:
        cu = None
        xs = make_inputs(kind, B=2, T=11, H=1, HV=2, K=K, V=V, dtype=torch.float32)
    q, k, v, g, beta, h0 = xs
    if state == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    return (q, k, v, g, beta, h0), cu


def run_kernel_and_reference(spec, inputs, cu, scale=0.4):
    kernel_parts, ref_parts = {}, {}
    o, ht = chunk_fwd(ChunkParams.from_spec(spec), *inputs[:5], scale, inputs[5], cu, intermediates=kernel_parts)
    o_ref, ht_ref = chunk_delta_rule_reference(*inputs[:5], spec=spec, scale=scale, initial_state=inputs[5],
                                               cu_seqlens=cu, record=ref_parts)
    assert o.dtype == inputs[0].dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    return (o, ht, kernel_parts), (o_ref, ht_ref, ref_parts)


def assert_backward_matches(spec, inputs, cu, tol):
    """Every gradient (dq, dk, dv, dg, dbeta, dh0) of the Triton backward against fp64 autograd of the
    chunk reference, on fresh random cotangents; each in its input's shape and dtype."""
    x64 = [x.double().requires_grad_() for x in inputs]
    o64, ht64 = chunk_delta_rule_reference(*x64[:5], spec=spec, scale=0.4, initial_state=x64[5], cu_seqlens=cu)
    do, dht = torch.randn_like(o64).float(), torch.randn_like(ht64).float()
    want = grads_of([o64, ht64], [do.double(), dht.double()], x64)
    got = chunk_bwd(ChunkParams.from_spec(spec), *inputs[:5], 0.4, do, dht, inputs[5], cu)
    for name, a, b, x in zip(GRAD_NAMES, got, want, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert rel_l2(a, b) <= tol, name


def kernel_chunks(parts, ref, inputs, cu, C):
    """The kernel's w and h in the reference's [N, HV, NC, ...] layout."""
    B, T = inputs[0].shape[:2]
    seqs = sequence_bounds(B, T, cu)
    NC = ref["w"].shape[2]
    w = _to_chunks(parts["w"].double(), seqs, NC, C)
    h_ref = ref["h"]
    lengths = [e - s for _, s, e in seqs]
    counts = [(n + C - 1) // C for n in lengths]
    h = torch.zeros_like(h_ref)
    row = 0
    for n, c in enumerate(counts):  # kernel h rows: every sequence's chunks, in order
        h[n, :, :c] = parts["h"][row: row + c].transpose(0, 1).double()
        row += c
    active = torch.tensor([[i < c for i in range(NC)] for c in counts])
    return w, h, active


def count_flips(a, b, tile_amax):
    """Elements that differ by more than fp32 noise: a rounding boundary was straddled."""
    return int(((a - b).abs() > 1e-4 * b.abs() + 1e-6 * tile_amax).sum())
