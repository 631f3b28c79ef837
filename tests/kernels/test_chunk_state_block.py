"""The state quantizer's ``block<N>`` group in the chunk kernels (ModelOpt's block-scaled state, the
``state_int8_block32`` recipe): one scale per key row x N consecutive values along V, the state seen as [K, V]
whatever its memory layout, rounded when loaded and after every chunk (chunk.device.qdq_state, STATE_BLOCK).

Against the fp64 chunk reference that rounds the same way (kernels/reference/rounding_from_spec.py): outputs, final
state, the chunk-start states (rounding flips counted) and every gradient (the backward recomputes the rounded
states through the same h stage), fp32 and bf16, GDN and KDA, kv and vk, packed batches with an empty sequence and
partial chunks, initial states. V = 48 gives a full block and a shorter last one (block32) or three blocks in two
32-wide h-stage tiles (block16); V = 16 under block32 makes the h stage's tile narrower than a block (it holds all
of V). Negative checks: the kernel's final state sits on the block grid, where a tile-rounded state does not, and
the outputs and gradients of the tile-rounding reference are far from the kernel's.
"""
import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.flags import spec_constexprs
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams, unsupported
from la_compiler.kernels.reference.chunk import chunk_delta_rule_reference
from la_compiler.quant import formats as F
from tests.helpers import rel_l2
from tests.kernels.chunk_checks import GRAD_NAMES, MAX_FLIP_FRACTION, QDQ_TOL, count_flips, kernel_chunks
from tests.kernels.chunk_inputs import grads_of, make_inputs
from tests.kernels.test_chunk_bf16 import FLA_TOL, FLIPS_FACTOR, MAX_STATE_FLIP_FRACTION

SCALE = 0.4
C = 8
# with an NVFP4 operand besides the state, a fp32-vs-fp64 flip of one of its elements (a step of 1/6 to 1/2 of the
# value) moves dq, dk, dg by up to 1.1e-3 (24 seeds, a block or a tile state alike); the block-vs-tile difference
# there is 1.3e-2 or more
NVFP4_FLIP_TOL = 5e-3


def _case(kind, varlen, state, V, dtype, chunk=C):
    """Fresh random inputs (state, v of unit scale: an INT8 step is ~1e-2 of a block's amax, far above fp32 noise),
    h0 in the spec's layout."""
    if varlen:  # an empty sequence; lengths not multiples of the chunk, up to three chunks
        cu = torch.tensor([0, 3, 3, 12, 20]) if chunk == 8 else torch.tensor([0, 5, 5, 37, 50])
        xs = make_inputs(kind, B=1, T=int(cu[-1]), H=1, HV=2, K=16, V=V, N=4, dtype=dtype)
    else:
        cu = None
        xs = make_inputs(kind, B=2, T=11, H=1, HV=2, K=16, V=V, dtype=dtype)
    q, k, v, g, beta, h0 = xs
    if state == "vk":
        h0 = h0.transpose(-1, -2).contiguous()
    return (q, k, v, g, beta, h0), cu


def _spec(kind, state, fmt, extra=None, chunk=C):
    return RecurrenceSpec(kind=kind, chunk=chunk, state=state).replace(quant={"state": fmt, **(extra or {})})


def _tile_of(fmt, V):
    """The same format with one scale per [K x BV] tile, BV the h stage's tile width: what a kernel that ignored the
    group would compute."""
    return f"{fmt.split('/')[0]}/tile{16 if V <= 16 else 32}"


def _reference(spec, inputs, cu, grad=False, record=None):
    xs = [x.double().requires_grad_(grad) for x in inputs]
    o, ht = chunk_delta_rule_reference(*xs[:5], spec=spec, scale=SCALE, initial_state=xs[5], cu_seqlens=cu,
                                       record=record)
    return xs, o, ht


def _kv(ht, state):
    return ht.transpose(-1, -2) if state == "vk" else ht


def _off_block_grid(ht_kv, fmt):
    """Elements of a state [.., K, V] that are not on the grid of their (key row, N values) block: x / s with s the
    block's amax / qmax must be an INT8 integer or an E4M3 value."""
    name, block = fmt.split("/")
    n = int(block.removeprefix("block"))
    x = ht_kv.double()
    x = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % n)).unflatten(-1, (-1, n))
    qmax = 127.0 if name == "int8" else 448.0
    s = x.abs().amax(-1, keepdim=True) / qmax
    steps = x / torch.where(s > 0, s, torch.ones_like(s))
    grid = steps.round() if name == "int8" else F.round_e4m3(steps.float()).double()
    return int(((steps - grid).abs() > 1e-4 * steps.abs() + 1e-6).sum())


def _backward(spec, inputs, cu, dtype):
    """The kernel's gradients for fresh random cotangents, with those of the block and of the tile reference."""
    x64, o64, ht64 = _reference(spec, inputs, cu, grad=True)
    do, dht = torch.randn_like(o64), torch.randn_like(ht64)
    want = grads_of([o64, ht64], [do, dht], x64)
    tile = spec.replace(quant={"state": _tile_of(spec.quant_map["state"], inputs[2].shape[-1])})
    t64, o_t, ht_t = _reference(tile, inputs, cu, grad=True)
    want_tile = grads_of([o_t, ht_t], [do, dht], t64)
    got = chunk_bwd(ChunkParams.from_spec(spec), *inputs[:5], SCALE, do.to(dtype), dht.float(), inputs[5], cu)
    for name, a, x in zip(GRAD_NAMES, got, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype and torch.isfinite(a).all(), name
    return got, want, want_tile


# each format, kind, dtype, layout, packed / padded batch and tile form at least once, not the cross product
@pytest.mark.parametrize("kind,fmt,state,varlen,V,extra", [
    ("gdn", "int8/block32", "kv", True, 48, None),
    ("kda", "fp8_e4m3/block16", "vk", False, 48, None),
    ("kda", "int8/block32", "vk", True, 16, None),  # the h stage's tile (16) narrower than a block: all of V
    # an NVFP4 state_read operand (chunks of 16): the h stage holds all of V in one tile (ChunkParams.h_full_v)
    ("gdn", "fp8_e4m3/block16", "kv", True, 48, {"state_read.rhs": "nvfp4/block16"}),
])
def test_block_state_fp32_forward_and_backward(kind, fmt, state, varlen, V, extra):
    chunk = 16 if extra else C
    inputs, cu = _case(kind, varlen, state, V, torch.float32, chunk)
    spec = _spec(kind, state, fmt, extra, chunk)
    parts, ref = {}, {}
    o, ht = chunk_fwd(ChunkParams.from_spec(spec), *inputs[:5], SCALE, inputs[5], cu, intermediates=parts)
    assert o.dtype == torch.float32 and torch.isfinite(o).all() and torch.isfinite(ht).all()  # NaN-filled buffers
    _, o_ref, ht_ref = _reference(spec, inputs, cu, record=ref)
    _, o_tile, ht_tile = _reference(spec.replace(quant={**spec.quant_map, "state": _tile_of(fmt, V)}), inputs, cu)
    _, o_exact, _ = _reference(spec.replace(quant=extra or {}), inputs, cu)
    # the chunk-start states element for element (fp32 vs fp64 flips counted), outputs, final state
    _, h, active = kernel_chunks(parts, ref, inputs, cu, chunk)
    h_sel, h_ref = h.transpose(1, 2)[active], ref["h"].transpose(1, 2)[active]
    flips = count_flips(h_sel, h_ref, h_ref.abs().amax((-2, -1), keepdim=True))
    assert flips <= MAX_FLIP_FRACTION * h_sel.numel(), flips
    err_o, err_ht = rel_l2(o, o_ref), rel_l2(ht, ht_ref)
    print(f"{kind} {fmt} {state} V={V}: o {err_o:.1e} ht {err_ht:.1e}, state flips {flips}/{h_sel.numel()}; "
          f"tile rounding o {rel_l2(o, o_tile):.1e}, exact {rel_l2(o, o_exact):.1e}")
    assert err_o <= QDQ_TOL and err_ht <= QDQ_TOL
    assert rel_l2(o, o_exact) > 10 * err_o  # the rounding shows
    # a kernel rounding per tile would fail: its state would be off the block grid, its outputs the tile reference's
    assert _off_block_grid(_kv(ht, state), fmt) == 0 and _off_block_grid(_kv(ht_tile, state), fmt) > 0
    assert rel_l2(o, o_tile) > max(QDQ_TOL, 10 * err_o) and rel_l2(ht, ht_tile) > max(QDQ_TOL, 10 * err_ht)
    got, want, want_tile = _backward(spec, inputs, cu, torch.float32)
    tol = NVFP4_FLIP_TOL if extra else QDQ_TOL
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert rel_l2(a, b) <= tol, (name, rel_l2(a, b))
    assert rel_l2(got[0], want_tile[0]) > 2 * tol  # dq reads the rounded states


@pytest.mark.parametrize("kind,fmt,state,varlen,V", [
    ("gdn", "fp8_e4m3/block16", "vk", False, 48),
    ("kda", "int8/block32", "kv", True, 48),
])
def test_block_state_bf16_forward_and_backward(kind, fmt, state, varlen, V):
    """bf16 inputs (16-bit GEMMs, the state carried in fp32): bf16 noise moves rounded elements across grid
    boundaries, so the final state's flips are counted and outputs and gradients get twice FLA's bar
    (tests/kernels/test_chunk_bf16.py); the final state must sit on its block grid."""
    inputs, cu = _case(kind, varlen, state, V, torch.bfloat16)
    spec = _spec(kind, state, fmt)
    o, ht = chunk_fwd(ChunkParams.from_spec(spec), *inputs[:5], SCALE, inputs[5], cu)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32 and torch.isfinite(ht).all()
    _, o_ref, ht_ref = _reference(spec, inputs, cu)
    _, _, ht_tile = _reference(spec.replace(quant={"state": _tile_of(fmt, V)}), inputs, cu)
    tol = {name: t * FLIPS_FACTOR for name, t in FLA_TOL.items()}
    a, b = _kv(ht, state).double(), _kv(ht_ref, state)
    state_flips = float(((a - b).abs() > b.abs() / 16 + 1e-3 * b.abs().max()).double().mean())
    print(f"{kind} {fmt} bf16: o {rel_l2(o, o_ref):.1e}, state flips {state_flips:.3f}")
    assert rel_l2(o, o_ref) <= tol["o"] and state_flips <= MAX_STATE_FLIP_FRACTION
    assert _off_block_grid(_kv(ht, state), fmt) == 0 and _off_block_grid(_kv(ht_tile, state), fmt) > 0
    got, want, _ = _backward(spec, inputs, cu, torch.bfloat16)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert rel_l2(a, b) <= tol[name], (name, rel_l2(a, b))


def test_block_state_params_and_constexprs():
    """block<16|32> of fp8_e4m3 / int8 is a chunk-kernel state group (STATE_BLOCK = N; 0 for every tile group, whose
    kernels it leaves as they were); other state groups and formats are still refused by name."""
    for fmt, block in (("int8/block32", 32), ("fp8_e4m3/block16", 16), ("int8/block16", 16),
                       ("fp8_e4m3/block32", 32), ("fp8_e4m3/tile64", 0), ("int8_h32/tile32", 0)):
        spec = _spec("kda", "kv", fmt)
        assert unsupported(spec) is None, fmt
        values = spec_constexprs(ChunkParams.from_spec(spec))
        assert values["STATE_BLOCK"] == block and values["STATE_TS"] == 0, fmt
    assert spec_constexprs(ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=C)))["STATE_BLOCK"] == 0
    full_v = ChunkParams.from_spec(_spec("gdn", "kv", "int8/block32", {"state_read.rhs": "nvfp4/block16"}, 16))
    assert full_v.h_full_v and spec_constexprs(full_v)["STATE_TS"] == 0 and full_v.state_block_v is None
    for fmt in ("nvfp4/block16", "fp8_e4m3/row", "int8/block32/clip"):
        assert "q.state" in unsupported(_spec("gdn", "kv", fmt)), fmt


def test_state_int8_block32_recipe_selects_the_chunk_kernels():
    """On CUDA the recipe's GDN and KDA specs go to the chunk kernels (FLA's runs exact specs only), not to the fp64
    torch reference."""
    from la_compiler.kernels.selection import select_kernel
    from la_compiler.policy.resolution import load_recipe

    policy = load_recipe("state_int8_block32")
    for kind in ("gdn", "kda"):
        res = policy.resolve("model.layers.0.attn", kind)
        spec = RecurrenceSpec(kind=kind).replace(quant=res.quant, acc=res.acc, solve=res.solve, degree=res.degree,
                                                 chunk=res.chunk, phase=res.phase, extra=res.extra,
                                                 numerics=res.numerics)
        assert spec.quant_map == {"state": "int8/block32"}
        choice = select_kernel(spec, device="cuda", dtype=torch.bfloat16, head_k=128, head_v=128)
        assert choice.variant == "chunk", choice.explain()
        assert "fla_chunk" in dict(choice.rejected)
