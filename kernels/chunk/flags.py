"""The constexpr values a spec fixes in the chunk kernels: what ``ChunkParams`` becomes at a launch.

``spec_constexprs(p)`` is one flat dict; each stage kernel declares the names it takes and its launcher passes
``pick(p, NAMES)``. Names:

* ``KDA``: the kind (per-key-channel decay) or GDN (one decay per head); ``STATE_VK``: h0 / ht stored [V, K];
* ``Q_<SITE>_<SIDE>`` of each GEMM operand site (``OPERAND_SITES``): "" (off), "fp8_e4m3" / "int8" (one scale
  per row or column of the operand) or "nvfp4" (blocks of 16, a global amax);
* ``ACC_<SITE>`` and ``ACC_<SITE>_BLOCK`` of each GEMM site: "" / "fp16" / "bf16", the reduction block (1 off);
* ``STATE_Q`` ("", "fp8_e4m3", "int8", "int8_h32"), ``STATE_TS`` (the state tile's width where the h stage
  holds all of V, else 0) and ``STATE_BLOCK`` (0: one scale per [K x BV] tile; N: one per key row x N values along
  V, the state's ``block<N>`` group); ``W_Q`` ("", "fp8_e4m3", "int8", "nvfp4") and ``W_BLOCK`` (0: one scale per row;
  N: blocks of N columns); ``W_AMAX_PASS``: W's row amax spans every key block (row scales, NVFP4);
* ``SOLVE`` ("blocked", "rows" (exact) or "neumann") and ``DEGREE`` (the Neumann degree, else 0);
* ``SUB_CHUNK``: KDA's sub-chunk rows (``ChunkParams.sub_chunk``; the whole-row pair products' blocks);
* the stage forms decided by the spec (``chunk/forms.py``): ``FACTORED_*``, ``GDN_DECAYS_VALUES``,
  ``PAIRS_ROUNDED``, ``SPLIT_PAIR_GRADS``, ``GDN_KEY_BLOCKS``, ``H_FULL_V``.
"""
from __future__ import annotations

import functools

from la_compiler.kernels.chunk import forms
from la_compiler.kernels.chunk.params import OPERAND_SITES, ChunkParams, parse_acc
from la_compiler.quant.config import QuantConfig
from la_compiler.spec import GEMM_SITES


def site_name(site: str) -> str:
    """"key_interaction.lhs" -> "Q_KEY_INTERACTION_LHS" (a GEMM operand site's constexpr)."""
    return "Q_" + site.replace(".", "_").upper()


def acc_name(site: str) -> str:
    """"state_update" -> "ACC_STATE_UPDATE" (with "_BLOCK" appended: its reduction block)."""
    return "ACC_" + site.upper()


def _format(text: str | None) -> str:
    return "" if text is None else QuantConfig.parse(text).format


@functools.lru_cache(maxsize=None)
def spec_constexprs(p: ChunkParams) -> dict:
    operands = dict(p.operands)
    values = {"KDA": p.kind == "kda", "STATE_VK": p.state == "vk"}
    for site in OPERAND_SITES:
        values[site_name(site)] = _format(operands.get(site))
    acc = dict(p.acc)
    for site in GEMM_SITES:
        name, block = parse_acc(acc[site]) if site in acc else ("", 1)
        values[acc_name(site)], values[acc_name(site) + "_BLOCK"] = name, block
    values["STATE_Q"] = _format(p.state_quant)
    values["STATE_TS"] = (p.state_block_v or 0) if p.h_full_v and values["STATE_Q"] not in ("", "int8_h32") else 0
    values["STATE_BLOCK"] = p.state_block
    w = None if p.w_quant is None else QuantConfig.parse(p.w_quant)
    values["W_Q"] = "" if w is None else w.format
    values["W_BLOCK"] = 0 if w is None or w.format == "nvfp4" or w.group == "row" else w.block_size
    values["W_AMAX_PASS"] = w is not None and (w.format == "nvfp4" or w.group == "row")
    values["SOLVE"] = "neumann" if p.solve == "neumann" else forms.solve_form(p)
    values["DEGREE"] = p.degree or 0
    values["SUB_CHUNK"] = p.sub_chunk  # KDA's sub-chunk rows (ChunkParams.sub_chunk)
    values.update(forms.stage_forms(p))
    return values


def pick(p: ChunkParams, names: tuple[str, ...]) -> dict:
    """The constexprs ``names`` of ``p`` (a stage kernel's spec-derived arguments)."""
    values = spec_constexprs(p)
    return {name: values[name] for name in names}
