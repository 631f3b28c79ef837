"""Generates the chunked (WY) forward and backward kernels of GDN and KDA from templates, per spec.

Three stages (FLA's layout: one template per stage, ``chunk_<op>_fwd_kernel_<stage>``):

    intra   per chunk: G = cumsum(g), A, T = (I + A)^-1 (or Neumann), W (+ W quantizer), U, A_qk
    h       per sequence, chunk by chunk: h_n stored, V_new = U - W h_n, h_n+1 (+ state quantizer)
    o       per chunk: O = scale (Q ⊙ exp G) h_n + A_qk V_new

What the spec fixes is decided here (decay form of the kind, state layout, solve, the QDQ
calls of the state, W and GEMM operand quantizers); what the inputs decide stays a constexpr flag.
docs/kernels-chunk.md derives the algorithm and lists the rounding order.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

from la_compiler.kernels import cache
from la_compiler.kernels.codegen import CodegenError, module_source, render, template
from la_compiler.spec import GEMM_SITES, KINDS, STATE_LAYOUTS, RecurrenceSpec

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
    operands: tuple[tuple[str, str], ...] = ()  # ("<gemm site>.lhs|rhs", format), sorted

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
        for site, fmt in self.operands:
            cfg = _parse(fmt)
            if site not in OPERAND_SITES:
                raise CodegenError(f"chunk: q.{site} is not a GEMM operand site of the chunk kernels")
            if cfg.format not in ("fp8_e4m3", "int8") or cfg.group != "row" or cfg.ste != "identity":
                raise CodegenError(f"chunk: q.{site}={fmt} is not implemented by the chunk kernels "
                                   "(GEMM operands take fp8_e4m3/row or int8/row, identity STE)")
        if self.w_quant is not None:
            cfg = _parse(self.w_quant)
            ok = cfg.format in W_FORMATS and cfg.group in ("row", "block") and cfg.ste == "identity"
            if not ok:
                raise CodegenError(f"chunk: q.w={self.w_quant} is not implemented by the chunk kernels "
                                   f"(they take {W_FORMATS} with row or block<N> groups and the identity STE)")

    @property
    def sub_chunk(self) -> int:
        """KDA's sub-chunk rows (>= 2 blocks per chunk, so both block kinds always run)."""
        return max(1, min(16, self.chunk // 2))

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
                   state_quant=quant.get("state"), w_quant=w, operands=_operand_sites(quant))


def unsupported(spec: RecurrenceSpec) -> str | None:
    """None when the chunk kernels implement ``spec``'s numerics, else why not (for the selection table)."""
    if spec.phase != "none":
        return f"phase={spec.phase} (decode-phase training) is not a chunk-kernel feature"
    if spec.extra:
        return f"it applies no spec options {['x.' + k for k, _ in spec.extra]}"
    if spec.acc:
        return "accumulator emulation (acc.*) is not implemented in the chunk kernels"
    quant = spec.quant_map
    if "w" in quant and "state_read.lhs" in quant and quant["w"] != quant["state_read.lhs"]:
        return "q.w and q.state_read.lhs (the same quantizer) disagree"
    try:
        cls_args = dict(state_quant=quant.get("state"), w_quant=quant.get("w") or quant.get("state_read.lhs"),
                        operands=_operand_sites(quant))
        ChunkParams(kind=spec.kind, state=spec.state, chunk=spec.chunk, solve=spec.solve, degree=spec.degree,
                    **cls_args)
    except (CodegenError, ValueError) as e:
        return str(e)
    return None


PAIRWISE_SITES = ("key_interaction", "output_score")  # KDA: the decay sits inside these products' reduction
OPERAND_SITES = tuple(f"{s}.{side}" for s in GEMM_SITES for side in ("lhs", "rhs") if f"{s}.{side}" != "state_read.lhs")


def _operand_sites(quant: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((site, fmt) for site, fmt in quant.items() if site not in ("state", "w", "state_read.lhs")))


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


def _op(p: ChunkParams, site: str, var: str, axis: int, out: str | None = None) -> str:
    """``out = QDQ(var)`` for a GEMM operand site (identity when the site is off); ``axis`` is the
    reduction axis of the register tile: 1 = one scale per row, 0 = one scale per column."""
    out = out or var
    fmt = dict(p.operands).get(site)
    if fmt is None:
        return "" if out == var else f"{out} = {var}"
    scale_fn, qdq_fn = _QDQ[_parse(fmt).format]
    bcast = "[:, None]" if axis == 1 else "[None, :]"
    return f"{out} = {qdq_fn}({var}, {scale_fn}(tl.max(amax_abs({var}), axis={axis})){bcast})  # q.{site}={fmt}"


def _lines(*parts: str) -> str:
    return "\n".join(x for x in parts if x)


def _operand_values(p: ChunkParams) -> dict[str, str]:
    """Template values of the GEMM operand sites (empty or plain renames when no site is on)."""
    t_ops = _lines(_op(p, "wy_key.lhs", "b_T", 1, "b_Tw"), _op(p, "wy_value.lhs", "b_T", 1, "b_Tu"))
    return {
        "T_OPERANDS": t_ops,
        "WY_OPERANDS": _lines(t_ops, _op(p, "wy_key.rhs", "b_bk", 0)),
        "WY_KEY_RHS": _op(p, "wy_key.rhs", "b_bk", 0),
        "WY_VALUE_RHS": _op(p, "wy_value.rhs", "b_bv", 0),
        "STATE_READ_RHS": _op(p, "state_read.rhs", "b_h", 0, "b_hr"),
        "STATE_UPDATE_OPERANDS": _lines(_op(p, "state_update.lhs", "b_kd", 0),
                                        _op(p, "state_update.rhs", "b_v", 0, "b_vu")),
        "OUTPUT_STATE_OPERANDS": _lines(_op(p, "output_state.lhs", "b_qg", 1), _op(p, "output_state.rhs", "b_h", 0)),
        "OUTPUT_VALUE_OPERANDS": _lines(_op(p, "output_value.lhs", "b_A", 1), _op(p, "output_value.rhs", "b_v", 0)),
        "BWD_DH_OPERANDS": _lines(_op(p, "output_value.lhs", "b_A", 1), _op(p, "state_update.lhs", "b_kd", 0)),
        "OUTPUT_STATE_LHS": _op(p, "output_state.lhs", "b_qg", 1),
        "BWD_V_OPERANDS": _lines(_op(p, "output_value.rhs", "b_vn", 0, "b_vn_ov"),
                                 _op(p, "state_read.rhs", "b_hn", 0, "b_hn_sr"),
                                 _op(p, "output_state.rhs", "b_hn", 0, "b_hn_os"),
                                 _op(p, "state_update.rhs", "b_vn", 0, "b_vn_su")),
    }


def _gdn_pairs(p: ChunkParams) -> str:
    """b_Gam, b_P = (K_l K_r^T) ⊙ Γ and b_Pqk = (Q_l K_r2^T) ⊙ Γ with the operand sites' rounding."""
    return _lines(
        _op(p, "key_interaction.lhs", "b_k", 1, "b_kl"), _op(p, "key_interaction.rhs", "b_k", 1, "b_kr"),
        _op(p, "output_score.lhs", "b_q", 1, "b_ql"), _op(p, "output_score.rhs", "b_k", 1, "b_kr2"),
        "b_Gam = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))",
        "b_P = tl.dot(b_kl, tl.trans(b_kr), input_precision=DOT_PRECISION) * b_Gam",
        "b_Pqk = tl.dot(b_ql, tl.trans(b_kr2), input_precision=DOT_PRECISION) * b_Gam")


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

def _kda_pairs(p: ChunkParams) -> str:
    """b_P = K K^T ⊙ Γ and b_Pqk = Q K^T ⊙ Γ of one KDA chunk, per key channel (masks applied later).

    Off-diagonal sub-chunk blocks (rows in block b, columns before its first row r): dots of
    K exp(G - G_r) and K exp(G_r - G), both factors <= 1 (G falls along the chunk). Diagonal
    blocks: column jj of every block at once, exp(G_i - G_j) from the prefix difference masked to
    j <= i before the exp; the column's rows are gathered from k and g_cum in memory."""
    bc = p.sub_chunk
    return (
        f"# sub-chunks of {bc} rows: off-diagonal blocks by dots through a reference row, diagonal blocks columnwise\n"
        "b_P = tl.zeros([C, C], dtype=tl.float32)\n"
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)\n"
        f"o_blk = o_c // {bc}\n"
        f"for i_sb in range(1, C // {bc}):\n"
        f"    i_ref = i_sb * {bc}\n"
        "    b_gr = tl.sum(tl.where((o_c == i_ref)[:, None], b_G, 0.0), 0)\n"
        "    m_in = o_blk == i_sb\n"
        "    m_before = o_c < i_ref\n"
        "    b_el = tl.exp(tl.where(m_in[:, None], b_G - b_gr[None, :], 0.0))\n"
        "    b_er = tl.exp(tl.where(m_before[:, None], b_gr[None, :] - b_G, 0.0))\n"
        "    b_kr = tl.where(m_before[:, None], b_k * b_er, 0.0)\n"
        "    b_P += tl.dot(tl.where(m_in[:, None], b_k * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)\n"
        "    b_Pqk += tl.dot(tl.where(m_in[:, None], b_q * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)\n"
        f"for jj in range(0, {bc}):\n"
        f"    o_j = o_blk * {bc} + jj\n"
        "    t_j = i_t * C + o_j\n"
        "    m_jk = (t_j < seq_len)[:, None] & m_k[None, :]\n"
        "    b_kj = tl.load(k + ((bos + t_j) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jk, other=0).to(tl.float32)\n"
        "    b_gj = tl.load(g_cum + ((bos + t_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)\n"
        "    b_kj = b_kj * tl.exp(tl.where((o_c >= o_j)[:, None], b_G - b_gj, 0.0))\n"
        "    m_sel = o_c[None, :] == o_j[:, None]\n"
        "    b_P = tl.where(m_sel, tl.sum(b_k * b_kj, 1)[:, None], b_P)\n"
        "    b_Pqk = tl.where(m_sel, tl.sum(b_q * b_kj, 1)[:, None], b_Pqk)")


def _kda_rounds_pairs(p: ChunkParams) -> bool:
    return any(site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands)


def _kda_pairs_rounded(p: ChunkParams) -> str:
    """KDA pair products when key_interaction / output_score are quantized: the per-pair operand
    k_j exp(G_i - G_j) (row (i, j) over the key channels) must exist to be rounded, so column by column."""
    return _lines(
        "# column by column: the pairwise operands k_j exp(G_i - G_j) (rows (i, j) over K) are rounded per pair",
        _op(p, "key_interaction.lhs", "b_k", 1, "b_kl"), _op(p, "output_score.lhs", "b_q", 1, "b_ql"),
        "b_P = tl.zeros([C, C], dtype=tl.float32)",
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)",
        "for j in range(0, C):",
        "    m_j = o_c == j",
        "    b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)",
        "    b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)",
        "    b_e = tl.exp(tl.where((o_c >= j)[:, None], b_G - b_gj[None, :], 0.0))",
        "    b_pk = tl.where((o_c > j)[:, None], b_kj[None, :] * b_e, 0.0)",
        "    b_pq = tl.where((o_c >= j)[:, None], b_kj[None, :] * b_e, 0.0)",
        "    " + _op(p, "key_interaction.rhs", "b_pk", 1, "b_pk_q"),
        "    " + _op(p, "output_score.rhs", "b_pq", 1, "b_pq_q"),
        "    b_P = tl.where(m_j[None, :], tl.sum(b_kl * b_pk_q, 1)[:, None], b_P)",
        "    b_Pqk = tl.where(m_j[None, :], tl.sum(b_ql * b_pq_q, 1)[:, None], b_Pqk)")


def _kda_pair_grads_rounded(p: ChunkParams) -> str:
    """Gradients of ``_kda_pairs_rounded``: the rounded other operand in every product, identity STE."""
    return _lines(
        "for j in range(0, C):",
        "    m_j = o_c == j",
        "    b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)",
        "    b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)",
        "    b_e = tl.exp(tl.where((o_c >= j)[:, None], b_G - b_gj[None, :], 0.0))",
        "    b_pk = tl.where((o_c > j)[:, None], b_kj[None, :] * b_e, 0.0)",
        "    b_pq = tl.where((o_c >= j)[:, None], b_kj[None, :] * b_e, 0.0)",
        "    " + _op(p, "key_interaction.rhs", "b_pk", 1, "b_pkq"),
        "    " + _op(p, "output_score.rhs", "b_pq", 1, "b_pqq"),
        "    b_dPj = tl.sum(tl.where(m_j[None, :], b_dP, 0.0), 1)",
        "    b_dQj = tl.sum(tl.where(m_j[None, :], b_dPqk, 0.0), 1)",
        "    b_dk += b_dPj[:, None] * b_pkq",
        "    b_dq += b_dQj[:, None] * b_pqq",
        "    b_dpk = b_dPj[:, None] * b_kl",
        "    b_dpq = b_dQj[:, None] * b_ql",
        "    b_t = b_dpk * b_pk + b_dpq * b_pq",
        "    b_dG += b_t",
        "    b_dk = tl.where(m_j[:, None], b_dk + tl.sum((b_dpk + b_dpq) * b_e, 0)[None, :], b_dk)",
        "    b_dG = tl.where(m_j[:, None], b_dG - tl.sum(b_t, 0)[None, :], b_dG)")


def _kda_pair_grads(p: ChunkParams) -> str:
    """Gradients of the KDA pair products (same blocking as ``_kda_pairs``) into dk, dq, dG."""
    bc = p.sub_chunk
    return (
        "# off-diagonal blocks: P_b = (K e^(G - G_r)) (K e^(G_r - G))^T\n"
        f"o_blk = o_c // {bc}\n"
        f"for i_sb in range(1, C // {bc}):\n"
        f"    i_ref = i_sb * {bc}\n"
        "    b_gr = tl.sum(tl.where((o_c == i_ref)[:, None], b_G, 0.0), 0)\n"
        "    m_in = o_blk == i_sb\n"
        "    m_before = o_c < i_ref\n"
        "    m_blk = m_in[:, None] & m_before[None, :]\n"
        "    b_el = tl.exp(tl.where(m_in[:, None], b_G - b_gr[None, :], 0.0))\n"
        "    b_er = tl.exp(tl.where(m_before[:, None], b_gr[None, :] - b_G, 0.0))\n"
        "    b_kl = tl.where(m_in[:, None], b_k * b_el, 0.0)\n"
        "    b_ql = tl.where(m_in[:, None], b_q * b_el, 0.0)\n"
        "    b_kr = tl.where(m_before[:, None], b_k * b_er, 0.0)\n"
        "    b_dPb = tl.where(m_blk, b_dP, 0.0)\n"
        "    b_dQb = tl.where(m_blk, b_dPqk, 0.0)\n"
        "    b_dkl = tl.dot(b_dPb, b_kr, input_precision=DOT_PRECISION)\n"
        "    b_dql = tl.dot(b_dQb, b_kr, input_precision=DOT_PRECISION)\n"
        "    b_dkr = tl.dot(tl.trans(b_dPb), b_kl, input_precision=DOT_PRECISION) \\\n"
        "        + tl.dot(tl.trans(b_dQb), b_ql, input_precision=DOT_PRECISION)\n"
        "    b_dk += b_el * b_dkl + b_er * b_dkr\n"
        "    b_dq += b_el * b_dql\n"
        "    b_tl = b_kl * b_dkl + b_ql * b_dql\n"
        "    b_tr = b_kr * b_dkr\n"
        "    b_dG += b_tl - b_tr\n"
        "    b_dG += tl.where((o_c == i_ref)[:, None], (tl.sum(b_tr, 0) - tl.sum(b_tl, 0))[None, :], 0.0)\n"
        "# diagonal blocks, column jj of every block at once; row j of each block collects its column's sums\n"
        f"for jj in range(0, {bc}):\n"
        f"    o_j = o_blk * {bc} + jj\n"
        "    t_j = i_t * C + o_j\n"
        "    m_jk = (t_j < seq_len)[:, None] & m_k[None, :]\n"
        "    b_kj = tl.load(k + ((bos + t_j) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jk, other=0).to(tl.float32)\n"
        "    b_gj = tl.load(g_cum + ((bos + t_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)\n"
        "    b_e = tl.exp(tl.where((o_c >= o_j)[:, None], b_G - b_gj, 0.0))\n"
        "    m_sel = o_c[None, :] == o_j[:, None]\n"
        "    b_dPj = tl.sum(tl.where(m_sel, b_dP, 0.0), 1)\n"
        "    b_dQj = tl.sum(tl.where(m_sel, b_dPqk, 0.0), 1)\n"
        "    b_kje = b_kj * b_e\n"
        "    b_dk += b_dPj[:, None] * b_kje\n"
        "    b_dq += b_dQj[:, None] * b_kje\n"
        "    b_x = (b_dPj[:, None] * b_k + b_dQj[:, None] * b_q) * b_e\n"
        "    b_tj = b_x * b_kj\n"
        "    b_dG += b_tj\n"
        "    m_isj = ((o_c % " + str(bc) + ") == jj)[:, None]\n"
        f"    b_xs = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(b_x, (C // {bc}, {bc}, BK)), 1)[:, None, :], "
        f"(C // {bc}, {bc}, BK)), (C, BK))\n"
        f"    b_ts = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(b_tj, (C // {bc}, {bc}, BK)), 1)[:, None, :], "
        f"(C // {bc}, {bc}, BK)), (C, BK))\n"
        "    b_dk += tl.where(m_isj, b_xs, 0.0)\n"
        "    b_dG -= tl.where(m_isj, b_ts, 0.0)")


_GDN = {
    "LOAD_DECAY": (
        "b_g = tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32)\n"
        "b_G = tl.cumsum(b_g, 0)\n"
        "tl.store(g_cum + r_hv, b_G, mask=m_c)"),
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
        "tl.store(g_cum + r_hv[:, None] * K + o_k[None, :], b_G, mask=m_ck)\n"
        "tl.debug_barrier()  # the pair products gather rows of g_cum written just now"),
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
    pairs = _gdn_pairs(p) if p.kind == "gdn" else _kda_pairs_rounded(p) if _kda_rounds_pairs(p) else _kda_pairs(p)
    decay = dict(_GDN if p.kind == "gdn" else _KDA,
                 PAIR_PRODUCTS=pairs + "\nb_A = b_P * b_beta[:, None]\nb_Aqk = b_Pqk * scale")
    ops = _operand_values(p)
    program = template("chunk_fwd_program")
    state_qdq = _state_qdq(p)
    state_offsets = "o_k[:, None] * V + o_v[None, :]" if p.state == "kv" else "o_k[:, None] + o_v[None, :] * K"
    intra = render(template("chunk_fwd_intra"), {
        "OP": p.kind, "PROGRAM": program, "LOAD_DECAY": decay["LOAD_DECAY"], "PAIR_PRODUCTS": decay["PAIR_PRODUCTS"],
        "SOLVE": _solve(p), "KEY_DECAY": decay["KEY_DECAY"], "ON_W": _w_qdq(p),
        "WY_OPERANDS": ops["WY_OPERANDS"], "WY_VALUE_RHS": ops["WY_VALUE_RHS"]}, where="chunk_fwd_intra")
    h = render(template("chunk_fwd_h"), {
        "OP": p.kind, "STATE_OFFSETS": state_offsets, "CHUNK_DECAY": decay["CHUNK_DECAY"],
        "ON_STATE_LOAD": state_qdq, "ON_STATE_WRITE": state_qdq,
        "STATE_READ_RHS": ops["STATE_READ_RHS"] or "b_hr = b_h",
        "STATE_UPDATE_OPERANDS": _lines(ops["STATE_UPDATE_OPERANDS"], "" if "b_vu =" in ops["STATE_UPDATE_OPERANDS"]
                                        else "b_vu = b_v")}, where="chunk_fwd_h")
    o = render(template("chunk_fwd_o"), {
        "OP": p.kind, "PROGRAM": program, "QUERY_DECAY": decay["QUERY_DECAY"],
        "OUTPUT_STATE_OPERANDS": ops["OUTPUT_STATE_OPERANDS"], "OUTPUT_VALUE_OPERANDS": ops["OUTPUT_VALUE_OPERANDS"]},
        where="chunk_fwd_o")
    title = f"Chunked (WY) {p.kind.upper()} forward kernels: intra, h, o."
    return module_source(title, dataclasses.asdict(p), [QDQ_IMPORT, intra, h, o])


def chunk_fwd_module(p: ChunkParams) -> ModuleType:
    """The loaded module with ``chunk_<kind>_fwd_kernel_{intra,h,o}``."""
    return cache.load_source(f"chunk_{p.kind}_fwd", chunk_fwd_source(p), {"family": "chunk_fwd", **dataclasses.asdict(p)})



# ---- backward --------------------------------------------------------------------------------
def _solve_grad(p: ChunkParams) -> str:
    if p.solve == "exact":
        return ("# T = (I + A)^-1: dA = -T^T dT T^T\n"
                "b_dA = -tl.dot(tl.trans(b_T), tl.dot(b_dT, tl.trans(b_T), input_precision=DOT_PRECISION),\n"
                "               input_precision=DOT_PRECISION)")
    return (
        f"# Horner T_m+1 = I - A T_m (m < {p.degree}) differentiated step by step; T_m recomputed\n"
        "b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)\n"
        "b_dA = tl.zeros([C, C], dtype=tl.float32)\n"
        "b_dTm = b_dT\n"
        f"for i_r in range(0, {p.degree}):\n"
        f"    b_Tm = b_I\n"
        f"    for _ in range(0, {p.degree} - 1 - i_r):\n"
        "        b_Tm = b_I - tl.dot(b_A, b_Tm, input_precision=DOT_PRECISION)\n"
        "    b_dA -= tl.dot(b_dTm, tl.trans(b_Tm), input_precision=DOT_PRECISION)\n"
        "    b_dTm = -tl.dot(tl.trans(b_A), b_dTm, input_precision=DOT_PRECISION)")


_GDN_BWD = {
    "LOAD_G": (
        "b_G = tl.cumsum(tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32), 0)"),
    "EXP_G": "tl.exp(b_G)[:, None]",
    "ROWS": "_row_sum",
    "PAIR_GRADS": (
        "# P = (K_l K_r^T) ⊙ Γ, P_qk = (Q_l K_r2^T) ⊙ Γ, Γ_ij = exp(G_i - G_j); rounded operands, identity STE\n"
        "b_dKK = b_dP * b_Gam\n"
        "b_dQK = b_dPqk * b_Gam\n"
        "b_dk += tl.dot(b_dKK, b_kr, input_precision=DOT_PRECISION) \\\n"
        "    + tl.dot(tl.trans(b_dKK), b_kl, input_precision=DOT_PRECISION) \\\n"
        "    + tl.dot(tl.trans(b_dQK), b_ql, input_precision=DOT_PRECISION)\n"
        "b_dq += tl.dot(b_dQK, b_kr2, input_precision=DOT_PRECISION)\n"
        "b_M = b_dP * b_P + b_dPqk * b_Pqk\n"
        "b_dG += tl.sum(b_M, 1) - tl.sum(b_M, 0)"),
    "LAST_ROW_GRADS": (
        "b_glast = tl.sum(tl.where(o_c == i_row_last, b_G, 0.0), 0)\n"
        "b_ed = tl.where(m_c, tl.exp(b_glast - b_G), 0.0)\n"
        "b_dk += b_ed[:, None] * b_dKd\n"
        "b_t = tl.sum(b_k * b_dKd, 1) * b_ed\n"
        "b_dG -= b_t\n"
        "b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * tl.sum(b_dlast, 0)\n"
        "b_dG += tl.where(o_c == i_row_last, b_dGlast, 0.0)"),
    "STORE_DG": "tl.store(dg + r_hv, b_dg.to(dg.dtype.element_ty), mask=m_c)",
    "KEY_TO_END": (
        "b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)\n"
        "b_glast = tl.load(g_cum + i_last * HV + i_hv)\n"
        "b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]\n"
        "b_dlast = tl.exp(b_glast)"),
}

_KDA_BWD = {
    "LOAD_G": (
        "b_G = tl.cumsum(tl.load(g + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32), 0)"),
    "EXP_G": "tl.exp(b_G)",
    "ROWS": "",
    "LAST_ROW_GRADS": (
        "b_glast = tl.sum(tl.where((o_c == i_row_last)[:, None], b_G, 0.0), 0)\n"
        "b_ed = tl.where(m_c[:, None], tl.exp(b_glast[None, :] - b_G), 0.0)\n"
        "b_dk += b_ed * b_dKd\n"
        "b_t = b_k * b_dKd * b_ed\n"
        "b_dG -= b_t\n"
        "b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * b_dlast\n"
        "b_dG += tl.where((o_c == i_row_last)[:, None], b_dGlast[None, :], 0.0)"),
    "STORE_DG": "tl.store(dg + r_hv[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty), mask=m_ck)",
    "KEY_TO_END": (
        "b_g = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)\n"
        "b_kd = b_k * tl.where(m_ck, tl.exp(b_glast[None, :] - b_g), 0.0)\n"
        "b_dlast = tl.exp(b_glast)[:, None]"),
}

ROW_SUM_HELPER = "@triton.jit\ndef _row_sum(x):\n    return tl.sum(x, 1)"


def chunk_bwd_source(p: ChunkParams) -> str:
    fwd = _GDN if p.kind == "gdn" else _KDA
    if p.kind == "gdn":
        bwd = dict(_GDN_BWD, PAIRS=_gdn_pairs(p))
    elif _kda_rounds_pairs(p):
        bwd = dict(_KDA_BWD, PAIRS=_kda_pairs_rounded(p), PAIR_GRADS=_kda_pair_grads_rounded(p))
    else:
        bwd = dict(_KDA_BWD, PAIRS=_kda_pairs(p), PAIR_GRADS=_kda_pair_grads(p))
    ops = _operand_values(p)
    state_offsets = "o_k[:, None] * V + o_v[None, :]" if p.state == "kv" else "o_k[:, None] + o_v[None, :] * K"
    dh = render(template("chunk_bwd_dh"), {
        "OP": p.kind, "STATE_OFFSETS": state_offsets, "KEY_TO_END": bwd["KEY_TO_END"],
        "QUERY_DECAY": fwd["QUERY_DECAY"], "BWD_DH_OPERANDS": ops["BWD_DH_OPERANDS"],
        "OUTPUT_STATE_LHS": ops["OUTPUT_STATE_LHS"]}, where="chunk_bwd_dh")
    intra = render(template("chunk_bwd_intra"), {
        "OP": p.kind, "PROGRAM": template("chunk_fwd_program"), "SOLVE": _solve(p), "SOLVE_GRAD": _solve_grad(p),
        **{key: bwd[key] for key in ("LOAD_G", "PAIRS", "EXP_G", "ROWS", "PAIR_GRADS", "LAST_ROW_GRADS", "STORE_DG")},
        **{key: ops[key] for key in ("T_OPERANDS", "BWD_V_OPERANDS", "WY_VALUE_RHS", "WY_KEY_RHS")}},
        where="chunk_bwd_intra")
    title = f"Chunked (WY) {p.kind.upper()} backward kernels: dh (state gradient), intra (input gradients)."
    return module_source(title, dataclasses.asdict(p), [QDQ_IMPORT, ROW_SUM_HELPER, dh, intra])


def chunk_bwd_module(p: ChunkParams) -> ModuleType:
    """The loaded module with ``chunk_<kind>_bwd_kernel_{dh,intra}``."""
    return cache.load_source(f"chunk_{p.kind}_bwd", chunk_bwd_source(p), {"family": "chunk_bwd", **dataclasses.asdict(p)})
