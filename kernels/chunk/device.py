"""Device functions shared by the chunk stages: GEMMs at a precision, the rounding of a GEMM operand site,
accumulator emulation, products on grid values, the state and W quantizers.

Every function is specialized by constexpr arguments that the stage's launcher takes from the spec
(``chunk/flags.py``): a site's format is a string ("" when the site is off, "fp8_e4m3", "int8" (one scale per
row or column of the register tile) or "nvfp4" (blocks of 16 along the reduction)), an accumulator a dtype
("" when not emulated, "fp16", "bf16") and a reduction block. With a site off each function is the identity
(or the plain product), so an unquantized spec runs exactly the unrounded kernel.
docs/kernels-chunk.md derives where each stage rounds; docs/numerics.md defines the formats.
"""
import triton
import triton.language as tl

from la_compiler.kernels.common.qdq import (amax_abs, fp8_scale, grid_dot, int8_scale, nvfp4_block_scale,
                                            nvfp4_global_scale, qdq_e2m1, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32,
                                            qdq_rows_3d, quant_fp8_e4m3, quant_int8)


RCP_LN2 = tl.constexpr(1.4426950216293335)  # 1 / ln 2 in fp32, as vLLM's vllm/utils/math_utils.py writes it


@triton.jit
def gate_exp(x, GATE_EXP2: tl.constexpr):
    """A decay from KDA's cumulative gate: exp2(x) where G is in log2 units (GATE_EXP2, vLLM's Kimi-K3 chunk
    kernels: G / ln 2 summed, then exp2 of its differences), else exp(x)."""
    if GATE_EXP2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


# fp32 -> bf16 -> fp32, round to nearest even, written on the bits: Triton's interpreter truncates in
# .to(tl.bfloat16) (GPUs round to nearest even), so the cast is not used.
@triton.jit
def round_bf16(x):
    b_bits = x.to(tl.int32, bitcast=True)
    b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & -65536
    return tl.where(x == x, b_bits.to(tl.float32, bitcast=True), x)


@triton.jit
def gemm(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation: operands cast to bf16 / fp16 (16-bit GEMMs), or fp32 operands at
    PRECISION ("ieee", "tf32", "tf32x3"); chunk/precision.py says which a launch takes."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PRECISION == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif PRECISION == "bf16_rounded":  # the interpreter's stand-in for "bf16" (chunk.precision.gemm_precision)
        return tl.dot(round_bf16(a.to(tl.float32)), round_bf16(b.to(tl.float32)), input_precision="ieee")
    elif PRECISION == "fp16_rounded":
        return tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), input_precision="ieee")
    else:  # fp32 operands (a 16-bit load, GDN's K^T in the h stage, is widened; fp32 ones are unchanged)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)


@triton.jit
def cast_for(x, buffer, PRECISION: tl.constexpr):
    """x (fp32) in ``buffer``'s element type, rounded to nearest even (the GPU's conversion; the
    interpreter's truncates, so its stand-in rounds on the bits first)."""
    if PRECISION == "bf16_rounded":
        x = round_bf16(x)
    return x.to(buffer.dtype.element_ty)


@triton.jit
def cast_kept(x, buffer, PRECISION: tl.constexpr):
    """x (fp32) for T, A_qk or KDA's P, in ``buffer``'s element type: a part of the training forward's residual
    kept in the GEMM operand dtype (16-bit GEMMs, chunk/residual.py) takes x rounded to nearest even, the value
    every GEMM rounds it to anyway; an fp32 buffer (a recompute's scratch, an fp32 part) takes x unchanged."""
    if PRECISION == "bf16_rounded":  # the interpreter's stand-in: round on the bits for a bf16 buffer only
        if buffer.dtype.element_ty == tl.bfloat16:
            x = round_bf16(x)
    return x.to(buffer.dtype.element_ty)


@triton.jit
def row_sum(x):
    return tl.sum(x, 1)


@triton.jit
def sub_dot(a, b, DOT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr):
    """a @ b for the sub-chunk kernels' [BC x ..] tiles: tl.dot from 16 rows up, else a broadcast sum
    (tl.dot needs 16)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], 1)


# ---- program ids -------------------------------------------------------------------------------------
@triton.jit
def chunk_program(i_c, i_b, i_hv, cu_seqlens, chunk_indices, T, HV: tl.constexpr, H: tl.constexpr,
                  C: tl.constexpr, IS_VARLEN: tl.constexpr, INDEX_64: tl.constexpr):
    """(i_n, i_t, bos, seq_len, i_chunk, i_h) of a per-chunk program: chunk i_t of sequence i_n (varlen: from
    chunk_indices, whose row i is (sequence, chunk within it)) starting at token bos, the sequence's length, the
    chunk's index over all sequences, and the q/k head i_h of value head i_hv."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64 if INDEX_64 else tl.int32)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64 if INDEX_64 else tl.int32)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64 if INDEX_64 else tl.int32) - bos).to(tl.int32)
        i_chunk = i_c.to(tl.int64 if INDEX_64 else tl.int32)
    else:
        i_n = i_b.to(tl.int64 if INDEX_64 else tl.int32)
        i_t = i_c.to(tl.int32)
        bos = i_n * T
        seq_len = T
        i_chunk = i_n * tl.cdiv(T, C) + i_t
    i_h = i_hv // (HV // H)
    return i_n, i_t, bos, seq_len, i_chunk, i_h


# ---- GEMM operand sites ------------------------------------------------------------------------------
@triton.jit
def tile_amax(x):
    """max |x| over a 2-d tile (NVFP4's global amax of an operand held in one tile)."""
    return tl.max(tl.max(amax_abs(x), axis=1), axis=0)


@triton.jit
def qdq_operand(x, gam, FMT: tl.constexpr, AXIS: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                WHOLE_AMAX: tl.constexpr):
    """QDQ of a GEMM operand held as the [M x N] register tile ``x``; AXIS is the reduction axis of the tile
    (1: one scale per row, 0: one per column). NVFP4 takes blocks of 16 along AXIS and its global amax over
    the tile, or ``gam`` when WHOLE_AMAX (an amax over the whole operand, of which the tile is a block);
    ``gam`` is unused otherwise. FMT "": x unchanged."""
    if FMT == "nvfp4":
        # the block amaxes before the tile's global one (this order fixes the instructions' order on sm_90; the
        # values do not depend on it)
        if AXIS == 1:
            x3 = tl.reshape(x, (M, N // 16, 16))
            b_bamax = tl.max(amax_abs(x3), axis=2)
            if not WHOLE_AMAX:
                gam = tile_amax(x)
            return tl.reshape(qdq_e2m1(x3, nvfp4_block_scale(b_bamax, nvfp4_global_scale(gam))[:, :, None]), (M, N))
        else:
            x3 = tl.reshape(x, (M // 16, 16, N))
            b_bamax = tl.max(amax_abs(x3), axis=1)
            if not WHOLE_AMAX:
                gam = tile_amax(x)
            return tl.reshape(qdq_e2m1(x3, nvfp4_block_scale(b_bamax, nvfp4_global_scale(gam))[:, None, :]), (M, N))
    elif FMT == "fp8_e4m3":
        if AXIS == 1:
            return qdq_fp8_e4m3(x, fp8_scale(tl.max(amax_abs(x), axis=1))[:, None])
        else:
            return qdq_fp8_e4m3(x, fp8_scale(tl.max(amax_abs(x), axis=0))[None, :])
    elif FMT == "int8":
        if AXIS == 1:
            return qdq_int8(x, int8_scale(tl.max(amax_abs(x), axis=1))[:, None])
        else:
            return qdq_int8(x, int8_scale(tl.max(amax_abs(x), axis=0))[None, :])
    else:
        return x


@triton.jit
def grid_operand(x, FMT: tl.constexpr, AXIS: tl.constexpr):
    """(scales, grid values) of ``x`` rounded per row (AXIS 1) or per column (AXIS 0) to FP8 / INT8: the
    operand is scales * grid values, the scale kept apart for a product on grid values (``grid_gemm``)."""
    if FMT == "fp8_e4m3":
        s = fp8_scale(tl.max(amax_abs(x), axis=AXIS))
        if AXIS == 1:
            return s, quant_fp8_e4m3(x, s[:, None])
        else:
            return s, quant_fp8_e4m3(x, s[None, :])
    else:
        s = int8_scale(tl.max(amax_abs(x), axis=AXIS))
        if AXIS == 1:
            return s, quant_int8(x, s[:, None])
        else:
            return s, quant_int8(x, s[None, :])


@triton.jit
def grid_gemm(lhs, rhs, lhs_scale, rhs_scale, PRECISION: tl.constexpr):
    """Q(lhs) @ Q(rhs) from grid values: one scale per row of the result and one per column."""
    return grid_dot(lhs, rhs, PRECISION) * lhs_scale[:, None] * rhs_scale[None, :]


# ---- accumulator emulation ---------------------------------------------------------------------------
@triton.jit
def acc_round(x, ACC: tl.constexpr):
    """The running sum rounded to the accumulator's dtype (and back to fp32)."""
    if ACC == "fp16":
        return x.to(tl.float16).to(tl.float32)
    else:
        return round_bf16(x)


@triton.jit
def acc_gemm(lhs, rhs, PRECISION: tl.constexpr, RED: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """lhs @ rhs for a GEMM site; with an emulated accumulator (ACC "fp16" / "bf16") the reduction (length RED)
    runs block by block, the running sum rounded after every block's add (the first block's product
    included), as the reference's accumulator emulation does. ACC "": the plain product."""
    if ACC == "":
        return gemm(lhs, rhs, PRECISION)
    else:
        o_red = tl.arange(0, RED)
        out = acc_round(gemm(tl.where((o_red < BLOCK)[None, :], lhs, 0.0), rhs, PRECISION), ACC)
        for i_rb in range(1, tl.cdiv(RED, BLOCK)):
            out = acc_round(out + gemm(tl.where(((o_red >= i_rb * BLOCK) & (o_red < i_rb * BLOCK + BLOCK))[None, :],
                                                lhs, 0.0), rhs, PRECISION), ACC)
        return out


@triton.jit
def acc_row_sum(x, o_k, BK: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """tl.sum(x, 1) (a reduction over the key channels o_k of a [.. x BK] tile: KDA's pair products) with the
    site's accumulator emulation, like ``acc_gemm``."""
    if ACC == "":
        return tl.sum(x, 1)
    else:
        out = acc_round(tl.sum(tl.where((o_k < BLOCK)[None, :], x, 0.0), 1), ACC)
        for i_rb in range(1, tl.cdiv(BK, BLOCK)):
            out = acc_round(out + tl.sum(tl.where(((o_k >= i_rb * BLOCK) & (o_k < i_rb * BLOCK + BLOCK))[None, :],
                                                  x, 0.0), 1), ACC)
        return out


# ---- the state and W quantizers ----------------------------------------------------------------------
@triton.jit
def qdq_state(b_h, STATE_Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TS: tl.constexpr,
              BLOCK: tl.constexpr):
    """The state quantizer on a [BK x BV] state tile (the kv view: key rows x value columns): one scale per
    [K x BV] tile, or per [K x TS] sub-tile where TS > 0 (the h stage holding all of V: ChunkParams.h_full_v);
    BLOCK N > 0 (the block<N> group): one scale per key row x N consecutive values, and per key row of the tile
    where the tile is narrower than N (it then holds all of V; the columns past V are zeros); int8_h32 by rows of
    32 along the flattened tile. STATE_Q "": b_h unchanged."""
    if STATE_Q == "int8_h32":
        return tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))
    elif STATE_Q == "":
        return b_h
    elif BLOCK > 0:
        if BV <= BLOCK:  # one block per key row of the tile
            if STATE_Q == "fp8_e4m3":
                return qdq_fp8_e4m3(b_h, fp8_scale(tl.max(amax_abs(b_h), axis=1))[:, None])
            else:
                return qdq_int8(b_h, int8_scale(tl.max(amax_abs(b_h), axis=1))[:, None])
        else:
            return tl.reshape(qdq_rows_3d(tl.reshape(b_h, (BK, BV // BLOCK, BLOCK)), STATE_Q == "fp8_e4m3"), (BK, BV))
    elif TS == 0:
        if STATE_Q == "fp8_e4m3":
            return qdq_fp8_e4m3(b_h, fp8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
        else:
            return qdq_int8(b_h, int8_scale(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))
    else:
        b_h3 = tl.reshape(b_h, (BK, BV // TS, TS))
        if STATE_Q == "fp8_e4m3":
            return tl.reshape(qdq_fp8_e4m3(b_h3, fp8_scale(tl.max(tl.max(amax_abs(b_h3), axis=2), axis=0))[None, :, None]),
                              (BK, BV))
        else:
            return tl.reshape(qdq_int8(b_h3, int8_scale(tl.max(tl.max(amax_abs(b_h3), axis=2), axis=0))[None, :, None]),
                              (BK, BV))


@triton.jit
def qdq_w(b_w, b_wamax, W_Q: tl.constexpr, W_BLOCK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """The W quantizer on one key block ``b_w`` [C x BK]. W_BLOCK 0: one scale per row, which spans all key
    columns: it takes ``b_wamax`` (the per-row amax over every key block) into account, as NVFP4's global
    scale does; W_BLOCK N > 0: FP8 / INT8 blocks of N columns (local). W_Q "": b_w unchanged."""
    if W_Q == "nvfp4":  # blocks of 16 along K; global amax over this chunk's W tile
        b_w3 = tl.reshape(b_w, (C, BK // 16, 16))
        b_gs = nvfp4_global_scale(tl.max(tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1)), axis=0))
        b_sb = nvfp4_block_scale(tl.max(amax_abs(b_w3), axis=2), b_gs)
        return tl.reshape(qdq_e2m1(b_w3, b_sb[:, :, None]), (C, BK))
    elif W_Q == "":
        return b_w
    elif W_BLOCK == 0:
        if W_Q == "fp8_e4m3":
            return qdq_fp8_e4m3(b_w, fp8_scale(tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1)))[:, None])
        else:
            return qdq_int8(b_w, int8_scale(tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1)))[:, None])
    else:
        return tl.reshape(qdq_rows_3d(tl.reshape(b_w, (C, BK // W_BLOCK, W_BLOCK)), W_Q == "fp8_e4m3"), (C, BK))
