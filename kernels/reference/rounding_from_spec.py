"""Builds the chunk reference's rounding callables from a spec's format strings.

Formats and their arithmetic come from ``la_compiler.quant`` (``QuantConfig.parse``,
``fake_quant``, ``formats``); this module only decides WHICH tensor each quantizer sees in the
chunked algorithm (docs/kernels-chunk.md, "Quant sites"):

- state: ``tile<BV>`` on S [N, HV, K, V] (always the kv view, whatever the storage layout);
  also ``row`` / ``block<N>`` (groups along V) and ``int8_h32/tile<BV>``.
- w and GEMM operands: the operand with its reduction dim last, ``row`` or ``block<N>``.
- NVFP4 (``nvfp4/block16``): blocks of 16 along the reduction dim under a global scale whose
  amax is taken over ONE OPERAND TILE (the last two dims: one (sequence, head, chunk)), or the
  last three for KDA's pairwise operands [.., C, C, K] -- a chunked kernel cannot know a
  whole-tensor amax of operands it makes chunk by chunk.
- ``tensor`` and ``axis:`` groups name a whole tensor the chunked algorithm never holds: rejected.

"""
from __future__ import annotations

import functools

import torch

from la_compiler.error_base import LaqatError
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.rounding import ChunkRounding
from la_compiler.quant import QuantConfig, fake_quant
from la_compiler.quant import formats as F

ACC_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ChunkQuantError(LaqatError, ValueError):
    """A quant site or accumulator value the chunked algorithm cannot apply."""


def rounding_from_spec(spec: RecurrenceSpec) -> ChunkRounding:
    """The roundings of ``spec``'s quant sites and accumulators (none: the exact ``ChunkRounding()``)."""
    if not spec.quant and not spec.acc:
        return ChunkRounding()
    quant = {site: QuantConfig.parse(text) for site, text in spec.quant}
    w_cfg = quant.pop("w", None)
    read_lhs = quant.pop("state_read.lhs", None)
    if w_cfg is not None and read_lhs is not None and w_cfg != read_lhs:
        raise ChunkQuantError(f"q.w={w_cfg} and q.state_read.lhs={read_lhs} disagree: state_read.lhs IS the W "
                              "quantizer (set one, or both to the same format)")
    w_cfg = w_cfg or read_lhs
    state_cfg = quant.pop("state", None)
    operands = {}
    for site, cfg in quant.items():
        gemm, side = site.split(".")
        operands[(gemm, side)] = _operand_rounder(cfg, f"q.{site}")
    accumulators = {site: parse_acc(text, f"acc.{site}") for site, text in spec.acc}
    return ChunkRounding(
        state=None if state_cfg is None else _state_rounder(state_cfg),
        w=None if w_cfg is None else functools.partial(_operand_rounder(w_cfg, "q.w"), tile_dims=2),
        operands=operands,
        accumulators=accumulators,
    )


def parse_acc(text: str, key: str = "acc") -> tuple[torch.dtype, int]:
    """``fp16:16`` -> (torch.float16, 16): accumulator dtype and reduction block."""
    name, sep, block = text.partition(":")
    if name not in ACC_DTYPES or not sep or not block.isdigit() or int(block) <= 0:
        raise ChunkQuantError(f"{key}={text!r}: must read '<fp16|bf16>:<reduction block>', e.g. 'fp16:16'")
    return ACC_DTYPES[name], int(block)


def _state_rounder(cfg):
    if cfg.format == "log_grid" or cfg.group in ("tensor", "axis"):
        raise ChunkQuantError(f"q.state={cfg}: the state takes tile<BV>, row or block<N> groups of fp8_e4m3/int8, "
                              "or int8_h32/tile<BV>")
    if cfg.format == "nvfp4":
        return functools.partial(_nvfp4_tiled, cfg=cfg, tile_dims=2)
    return functools.partial(fake_quant, cfg=cfg)


def _operand_rounder(cfg, key):
    if cfg.format in ("log_grid", "int8_h32") or cfg.group not in ("row", "block"):
        raise ChunkQuantError(f"{key}={cfg}: GEMM operands and W take row or block<N> groups (fp8_e4m3, int8) "
                              "or nvfp4/block16; tensor/axis groups name a whole tensor the chunked algorithm "
                              "never holds")
    if cfg.format == "nvfp4":
        return lambda x, tile_dims: _nvfp4_tiled(x, cfg=cfg, tile_dims=tile_dims)
    return lambda x, tile_dims: fake_quant(x, cfg)


def _nvfp4_tiled(x: torch.Tensor, *, cfg, tile_dims: int) -> torch.Tensor:
    """NVFP4 (blocks of 16 along the last dim) with one global scale per tile of the last
    ``tile_dims`` dims: ``fake_quant``'s NVFP4 applied to every tile, batched."""
    if cfg.ste != "identity":  # the clipped STE: exactly fake_quant, tile by tile
        flat = x.reshape((-1,) + tuple(x.shape[-tile_dims:]))
        return torch.stack([fake_quant(t, cfg) for t in flat.unbind(0)]).reshape(x.shape)
    with torch.no_grad():
        xf = x.to(torch.float32)
        mag = torch.nan_to_num(xf.abs(), nan=0.0, posinf=float("inf"))
        gamax = mag.amax(tuple(range(-tile_dims, 0)), keepdim=True)
        gs = gamax / (F.E2M1_MAX * F.FP8_E4M3_MAX)
        gs = torch.where(gs > 0, gs, torch.ones_like(gs))[..., None]
        pad = (-x.shape[-1]) % 16
        xb = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, 16))
        bamax = torch.nn.functional.pad(mag, (0, pad)).unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
        sb = F.round_e4m3(torch.clamp_max(bamax / (F.E2M1_MAX * gs), F.FP8_E4M3_MAX)) * gs
        sb = torch.where(sb < F.NVFP4_SCALE_FLOOR, torch.ones_like(sb), sb)
        out = F.qdq_e2m1(xb, sb).flatten(-2)[..., : x.shape[-1]].to(x.dtype)
    return x + (out - x).detach()
