"""The constexpr values a spec fixes in the chunk kernels: what ``ChunkParams`` becomes at a launch.

``spec_constexprs(p)`` is one flat dict; a stage kernel takes those of its ``tl.constexpr`` arguments that the dict
names (``kernel_spec_constexprs(p, kernel)``, read from the kernel's signature): a new one is a kernel argument and
its value here. Names:

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
* ``GATE_EXP2``: KDA's G in log2 units and its decays exp2 (``ChunkParams.gate_exp2``: a serving profile's prefix
  forward, vLLM's Kimi-K3 chunk kernels' order of operations; no spec field);
* the stage forms decided by the spec (``chunk/forms.py``): ``FACTORED_*``, ``GDN_DECAYS_VALUES``,
  ``PAIRS_ROUNDED``, ``PAIRS_NVFP4``, ``COLUMN_SIDE_BY_PRODUCTS``, ``SHARES_PAIR_RHS``, ``H_FULL_V``. The intra
  stages' forms are no constexprs: each is a kernel of its own, named in the stage key (``forms.fwd_intra_form``,
  ``forms.bwd_intra_form``; chunk/stages.py).
"""
from __future__ import annotations

import functools
import inspect

import triton.language as tl

from la_compiler.ir.spec import GEMM_SITES
from la_compiler.kernels.chunk import forms
from la_compiler.kernels.chunk.formats import Accumulator
from la_compiler.kernels.chunk.params import OPERAND_SITES, ChunkParams

_NO_ACCUMULATOR = Accumulator("", 1)


def site_name(site: str) -> str:
    """"key_interaction.lhs" -> "Q_KEY_INTERACTION_LHS" (a GEMM operand site's constexpr)."""
    return "Q_" + site.replace(".", "_").upper()


def acc_name(site: str) -> str:
    """"state_update" -> "ACC_STATE_UPDATE" (with "_BLOCK" appended: its reduction block)."""
    return "ACC_" + site.upper()


@functools.lru_cache(maxsize=None)
def spec_constexprs(p: ChunkParams) -> dict:
    formats = p.formats
    values = {"KDA": p.kind == "kda", "STATE_VK": p.state == "vk"}
    for site in OPERAND_SITES:
        values[site_name(site)] = formats.operand_format(site) or ""
    for site in GEMM_SITES:
        acc = formats.accumulators.get(site, _NO_ACCUMULATOR)
        values[acc_name(site)], values[acc_name(site) + "_BLOCK"] = acc.dtype, acc.block
    values["STATE_Q"] = "" if formats.state is None else formats.state.format
    values["STATE_TS"] = (p.state_block_v or 0) if p.h_full_v and values["STATE_Q"] not in ("", "int8_h32") else 0
    values["STATE_BLOCK"] = p.state_block
    w = formats.w
    values["W_Q"] = "" if w is None else w.format
    values["W_BLOCK"] = 0 if w is None or w.format == "nvfp4" or w.group == "row" else w.block_size
    values["W_AMAX_PASS"] = w is not None and (w.format == "nvfp4" or w.group == "row")
    values["SOLVE"] = "neumann" if p.solve == "neumann" else forms.solve_form(p)
    values["DEGREE"] = p.degree or 0
    values["GATE_EXP2"] = p.gate_exp2  # KDA's G in log2 units, exp2 decays (ChunkParams.gate_exp2)
    values["SUB_CHUNK"] = p.sub_chunk  # KDA's sub-chunk rows (ChunkParams.sub_chunk)
    values.update(forms.stage_forms(p))
    return values


@functools.lru_cache(maxsize=None)
def spec_constexpr_names(kernel) -> tuple[str, ...]:
    """The ``tl.constexpr`` arguments of a ``@triton.jit`` kernel that a spec fixes (``spec_constexprs``' names),
    in the kernel's order."""
    spec_names = spec_constexprs(ChunkParams("gdn", "kv", 64)).keys()  # the same names for every spec
    arguments = inspect.signature(kernel.fn).parameters.values()
    return tuple(a.name for a in arguments if a.annotation is tl.constexpr and a.name in spec_names)


def kernel_spec_constexprs(p: ChunkParams, kernel) -> dict:
    """The constexprs ``p`` fixes in ``kernel`` (a stage kernel's spec-derived arguments)."""
    values = spec_constexprs(p)
    return {name: values[name] for name in spec_constexpr_names(kernel)}
