"""Generates the chunked (WY) forward kernels of GDN and KDA from templates, per spec.

Three stages (FLA's layout: one template per stage, ``chunk_<op>_fwd_kernel_<stage>``):

    intra   per chunk: G = cumsum(g), A, T = (I + A)^-1 (or Neumann), W (+ W quantizer), U, A_qk
    h       per sequence, chunk by chunk: h_n stored, V_new = U - W h_n, h_n+1 (+ state quantizer)
    o       per chunk: O = scale (Q ⊙ exp G) h_n + A_qk V_new

What the spec fixes is decided here (decay form of the kind, state layout, solve, the QDQ
calls of the state and W quantizers); what the inputs decide stays a constexpr flag.
docs/kernels-chunk.md derives the algorithm and lists the rounding order.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

from la_compiler.kernels import cache
from la_compiler.kernels.codegen import CodegenError, module_source, render, template
from la_compiler.spec import KINDS, STATE_LAYOUTS, RecurrenceSpec

STATE_FORMATS = ("fp8_e4m3", "int8", "int8_h32")  # with group tile<BV>
W_FORMATS = ("fp8_e4m3", "int8", "nvfp4")  # fp8/int8 with group row or block<N>; nvfp4/block16


@dataclasses.dataclass(frozen=True)
class ChunkParams:
    """What the chunk forward kernels are specialized on."""

    kind: str
    state: str  # layout of h0 / ht: "kv" or "vk"
    chunk: int
    solve: str = "exact"
    degree: int | None = None
    state_quant: str | None = None  # canonical QuantConfig string of q.state
    w_quant: str | None = None  # canonical QuantConfig string of q.w (= q.state_read.lhs)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise CodegenError(f"chunk: kind must be one of {KINDS}, got {self.kind!r}")
        if self.state not in STATE_LAYOUTS:
            raise CodegenError(f"chunk: state layout must be one of {STATE_LAYOUTS}, got {self.state!r}")
        if self.chunk < 1 or self.chunk & (self.chunk - 1):
            raise CodegenError(f"chunk: chunk size must be a power of two, got {self.chunk}")
        if (self.solve == "neumann") != (self.degree is not None) or self.solve not in ("exact", "neumann"):
            raise CodegenError(f"chunk: solve must be exact or neumann with a degree, got {self.solve}/{self.degree}")
        if self.state_quant is not None:
            cfg = _parse(self.state_quant)
            if cfg.format not in STATE_FORMATS or cfg.group != "tile" or cfg.ste != "identity":
                raise CodegenError(f"chunk: q.state={self.state_quant} is not implemented by the chunk kernels "
                                   f"(they take {STATE_FORMATS} with tile<BV> groups and the identity STE)")
        if self.w_quant is not None:
            cfg = _parse(self.w_quant)
            ok = cfg.format in W_FORMATS and cfg.group in ("row", "block") and cfg.ste == "identity"
            if not ok:
                raise CodegenError(f"chunk: q.w={self.w_quant} is not implemented by the chunk kernels "
                                   f"(they take {W_FORMATS} with row or block<N> groups and the identity STE)")

    @property
    def state_block_v(self) -> int | None:
        return None if self.state_quant is None else _parse(self.state_quant).block_v

    @classmethod
    def from_spec(cls, spec: RecurrenceSpec | str) -> "ChunkParams":
        spec = spec if isinstance(spec, RecurrenceSpec) else RecurrenceSpec.parse(spec)
        why = unsupported(spec)
        if why:
            raise CodegenError(f"chunk kernels cannot run {spec}: {why}")
        quant = spec.quant_map
        w = quant.get("w") or quant.get("state_read.lhs")
        return cls(kind=spec.kind, state=spec.state, chunk=spec.chunk, solve=spec.solve, degree=spec.degree,
                   state_quant=quant.get("state"), w_quant=w)


def unsupported(spec: RecurrenceSpec) -> str | None:
    """None when the chunk kernels implement ``spec``'s numerics, else why not (for the selection table)."""
    if spec.phase != "none":
        return f"phase={spec.phase} (decode-phase training) is not a chunk-kernel feature"
    if spec.extra:
        return f"it applies no spec options {['x.' + k for k, _ in spec.extra]}"
    if spec.acc:
        return "accumulator emulation (acc.*) is not implemented in the chunk kernels"
    quant = spec.quant_map
    operand_sites = sorted(s for s in quant if s not in ("state", "w", "state_read.lhs"))
    if operand_sites:
        return f"GEMM operand quantization ({', '.join(operand_sites)}) is not implemented in the chunk kernels"
    if "w" in quant and "state_read.lhs" in quant and quant["w"] != quant["state_read.lhs"]:
        return "q.w and q.state_read.lhs (the same quantizer) disagree"
    try:
        cls_args = dict(state_quant=quant.get("state"), w_quant=quant.get("w") or quant.get("state_read.lhs"))
        ChunkParams(kind=spec.kind, state=spec.state, chunk=spec.chunk, solve=spec.solve, degree=spec.degree,
                    **cls_args)
    except (CodegenError, ValueError) as e:
        return str(e)
    return None


def _parse(text: str):
    from la_compiler.quant.config import QuantConfig

    return QuantConfig.parse(text)


# ---- template values -------------------------------------------------------------------------
_QDQ = {"fp8_e4m3": ("fp8_scale", "qdq_fp8_e4m3"), "int8": ("int8_scale", "qdq_int8")}


def _state_qdq(p: ChunkParams) -> str:
    if p.state_quant is None:
        return ""
    cfg = _parse(p.state_quant)
    if cfg.format == "int8_h32":
        return "b_h = tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))"
    scale_fn, qdq_fn = _QDQ[cfg.format]
    return (f"# state quantizer {p.state_quant}: one scale per [K x BV] tile\n"
            f"b_h = {qdq_fn}(b_h, {scale_fn}(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))")


def _w_qdq(p: ChunkParams) -> str:
    if p.w_quant is None:
        return ""
    cfg = _parse(p.w_quant)
    head = f"# W quantizer {p.w_quant}\n"
    if cfg.format == "nvfp4":  # blocks of 16 along K; global amax over this chunk's W tile
        return head + (
            "b_w3 = tl.reshape(b_w, (C, BK // 16, 16))\n"
            "b_gs = nvfp4_global_scale(tl.max(tl.max(amax_abs(b_w), axis=1), axis=0))\n"
            "b_sb = nvfp4_block_scale(tl.max(amax_abs(b_w3), axis=2), b_gs)\n"
            "b_w = tl.reshape(qdq_e2m1(b_w3, b_sb[:, :, None]), (C, BK))")
    scale_fn, qdq_fn = _QDQ[cfg.format]
    if cfg.group == "row":
        return head + f"b_w = {qdq_fn}(b_w, {scale_fn}(tl.max(amax_abs(b_w), axis=1))[:, None])"
    n = cfg.block_size
    return head + (
        f"b_w3 = tl.reshape(b_w, (C, BK // {n}, {n}))\n"
        f"b_w = tl.reshape({qdq_fn}(b_w3, {scale_fn}(tl.max(amax_abs(b_w3), axis=2))[:, :, None]), (C, BK))")


def _solve(p: ChunkParams) -> str:
    eye = "tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)"
    if p.solve == "exact":
        return (
            "# forward substitution: row i of T = e_i - sum_{j<i} A_ij T_j\n"
            f"b_T = {eye}\n"
            "for i in range(1, C):\n"
            "    m_i = o_c == i\n"
            "    b_a = tl.sum(tl.where(m_i[:, None], b_A, 0.0), 0)\n"
            "    b_T = tl.where(m_i[:, None], b_T - tl.sum(b_a[:, None] * b_T, 0)[None, :], b_T)")
    return (
        f"# Neumann polynomial of degree {p.degree}: T = sum_{{i<={p.degree}}} (-A)^i (Horner)\n"
        f"b_I = {eye}\n"
        "b_T = b_I\n"
        f"for _ in tl.static_range({p.degree}):\n"
        "    b_T = b_I - tl.dot(b_A, b_T, input_precision=DOT_PRECISION)")


_GDN = {
    "LOAD_DECAY": (
        "b_g = tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32)\n"
        "b_G = tl.cumsum(b_g, 0)\n"
        "tl.store(g_cum + r_hv, b_G, mask=m_c)"),
    "PAIR_PRODUCTS": (
        "b_decay = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))\n"
        "b_A = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION) * b_decay * b_beta[:, None]\n"
        "b_Aqk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * b_decay * scale"),
    "KEY_DECAY": "tl.exp(b_G)[:, None]",
    "CHUNK_DECAY": (
        "b_g = tl.load(g_cum + (bos + t_c) * HV + i_hv, mask=m_c, other=0)\n"
        "b_glast = tl.load(g_cum + i_last * HV + i_hv)\n"
        "b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]\n"
        "b_h *= tl.exp(b_glast)"),
    "QUERY_DECAY": (
        "b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)\n"
        "b_qg = b_q * tl.exp(b_g)[:, None]"),
}

_KDA = {
    "LOAD_DECAY": (
        "b_g = tl.load(g + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)\n"
        "b_G = tl.cumsum(b_g, 0)\n"
        "tl.store(g_cum + r_hv[:, None] * K + o_k[None, :], b_G, mask=m_ck)"),
    "PAIR_PRODUCTS": (
        "# per-channel pairwise decays exp(G_i - G_j), masked to j <= i before the exp (no overflow);\n"
        "# column j of A and A_qk: sum_d x_id (k_jd exp(G_id - G_jd))\n"
        "b_A = tl.zeros([C, C], dtype=tl.float32)\n"
        "b_Aqk = tl.zeros([C, C], dtype=tl.float32)\n"
        "for j in range(0, C):\n"
        "    m_j = o_c == j\n"
        "    b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)\n"
        "    b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)\n"
        "    b_kjd = b_kj[None, :] * tl.exp(tl.where((o_c >= j)[:, None], b_G - b_gj[None, :], 0.0))\n"
        "    b_A = tl.where(m_j[None, :], tl.sum(b_k * b_kjd, 1)[:, None], b_A)\n"
        "    b_Aqk = tl.where(m_j[None, :], tl.sum(b_q * b_kjd, 1)[:, None], b_Aqk)\n"
        "b_A = b_A * b_beta[:, None]\n"
        "b_Aqk = b_Aqk * scale"),
    "KEY_DECAY": "tl.exp(b_G)",
    "CHUNK_DECAY": (
        "b_g = tl.load(g_cum + ((bos + t_c) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)\n"
        "b_kd = b_k * tl.where(m_ck, tl.exp(b_glast[None, :] - b_g), 0.0)\n"
        "b_h *= tl.exp(b_glast)[:, None]"),
    "QUERY_DECAY": (
        "b_g = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_qg = b_q * tl.exp(b_g)"),
}

QDQ_IMPORT = ("from la_compiler.kernels.qdq import (amax_abs, fp8_scale, int8_scale, nvfp4_block_scale,  # noqa: F401\n"
              "    nvfp4_global_scale, qdq_e2m1, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32)")


def chunk_fwd_source(p: ChunkParams) -> str:
    decay = _GDN if p.kind == "gdn" else _KDA
    program = template("chunk_fwd_program")
    state_qdq = _state_qdq(p)
    state_offsets = "o_k[:, None] * V + o_v[None, :]" if p.state == "kv" else "o_k[:, None] + o_v[None, :] * K"
    intra = render(template("chunk_fwd_intra"), {
        "OP": p.kind, "PROGRAM": program, "LOAD_DECAY": decay["LOAD_DECAY"], "PAIR_PRODUCTS": decay["PAIR_PRODUCTS"],
        "SOLVE": _solve(p), "KEY_DECAY": decay["KEY_DECAY"], "ON_W": _w_qdq(p)}, where="chunk_fwd_intra")
    h = render(template("chunk_fwd_h"), {
        "OP": p.kind, "STATE_OFFSETS": state_offsets, "CHUNK_DECAY": decay["CHUNK_DECAY"],
        "ON_STATE_LOAD": state_qdq, "ON_STATE_WRITE": state_qdq}, where="chunk_fwd_h")
    o = render(template("chunk_fwd_o"), {"OP": p.kind, "PROGRAM": program, "QUERY_DECAY": decay["QUERY_DECAY"]},
               where="chunk_fwd_o")
    title = f"Chunked (WY) {p.kind.upper()} forward kernels: intra, h, o."
    return module_source(title, dataclasses.asdict(p), [QDQ_IMPORT, intra, h, o])


def chunk_fwd_module(p: ChunkParams) -> ModuleType:
    """The loaded module with ``chunk_<kind>_fwd_kernel_{intra,h,o}``."""
    return cache.load_source(f"chunk_{p.kind}_fwd", chunk_fwd_source(p), {"family": "chunk_fwd", **dataclasses.asdict(p)})

