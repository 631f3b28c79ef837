"""The Triton code the chunk templates are filled with, per kind and per quant site.

Each function returns source lines for one ``${PLACEHOLDER}`` of ``templates/chunk_*.tmpl``; the
dicts hold what differs between GDN (scalar decay per head) and KDA (per key channel).
``chunk_codegen`` picks them for a ``ChunkParams`` and renders the modules; the math they
implement is derived in docs/kernels-chunk.md.
"""
from __future__ import annotations

from la_compiler.kernels.chunk.params import ChunkParams, parse_acc
from la_compiler.quant.config import QuantConfig

PAIRWISE_SITES = ("key_interaction", "output_score")  # KDA: the decay sits inside these products' reduction


def parse_quant(text: str) -> QuantConfig:
    return QuantConfig.parse(text)


_QDQ = {"fp8_e4m3": ("fp8_scale", "qdq_fp8_e4m3"), "int8": ("int8_scale", "qdq_int8")}


def state_qdq(p: ChunkParams) -> str:
    if p.state_quant is None:
        return ""
    cfg = parse_quant(p.state_quant)
    if cfg.format == "int8_h32":
        return "b_h = tl.reshape(qdq_int8_h32(tl.reshape(b_h, (BK * BV // 32, 32))), (BK, BV))"
    scale_fn, qdq_fn = _QDQ[cfg.format]
    if not p.h_full_v:
        return (f"# state quantizer {p.state_quant}: one scale per [K x BV] tile\n"
                f"b_h = {qdq_fn}(b_h, {scale_fn}(tl.max(tl.max(amax_abs(b_h), axis=1), axis=0)))")
    ts = cfg.block_v  # the h tile holds all of V: one scale per [K x TS] sub-tile
    return lines(
        f"# state quantizer {p.state_quant}: one scale per [K x {ts}] tile of the all-V register tile",
        f"b_h3 = tl.reshape(b_h, (BK, BV // {ts}, {ts}))",
        f"b_h = tl.reshape({qdq_fn}(b_h3, {scale_fn}(tl.max(tl.max(amax_abs(b_h3), axis=2), axis=0))[None, :, None]), "
        "(BK, BV))")


def w_qdq(p: ChunkParams) -> str:
    """The W quantizer on one key block ``b_w`` [C x BK]. Row scales and NVFP4's global scale span all key
    columns: they take ``b_wamax`` (per-row amax over every key block, from ``w_amax_pass``) into account."""
    if p.w_quant is None:
        return ""
    cfg = parse_quant(p.w_quant)
    head = f"# W quantizer {p.w_quant}\n"
    row_amax = "tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1))"
    if cfg.format == "nvfp4":  # blocks of 16 along K; global amax over this chunk's W tile
        return head + (
            "b_w3 = tl.reshape(b_w, (C, BK // 16, 16))\n"
            f"b_gs = nvfp4_global_scale(tl.max({row_amax}, axis=0))\n"
            "b_sb = nvfp4_block_scale(tl.max(amax_abs(b_w3), axis=2), b_gs)\n"
            "b_w = tl.reshape(qdq_e2m1(b_w3, b_sb[:, :, None]), (C, BK))")
    scale_fn, qdq_fn = _QDQ[cfg.format]
    if cfg.group == "row":
        return head + f"b_w = {qdq_fn}(b_w, {scale_fn}({row_amax})[:, None])"
    n = cfg.block_size
    return head + (
        f"b_w3 = tl.reshape(b_w, (C, BK // {n}, {n}))\n"
        f"b_w = tl.reshape({qdq_fn}(b_w3, {scale_fn}(tl.max(amax_abs(b_w3), axis=2))[:, :, None]), (C, BK))")


def w_amax_pass(p: ChunkParams, w_key_block: str) -> str:
    """W's per-row amax over all key blocks, before any block is rounded (W quantizers with row groups or
    NVFP4's global scale; blocks of N columns are local). W is cheap to form twice (a [C x C] x [C x BK]
    dot per block), cheaper than storing it unrounded and reading it back; with one key block (K <= BK)
    the pass is skipped and the block's own amax is the row's."""
    if p.w_quant is None:
        return ""
    cfg = parse_quant(p.w_quant)
    if cfg.format != "nvfp4" and cfg.group != "row":
        return ""
    return lines(
        "b_wamax = tl.zeros([C], dtype=tl.float32)",
        "for i_k in range(0, tl.cdiv(K, BK) if K > BK else 0):",
        _indent(w_key_block),
        "    b_wamax = tl.maximum(b_wamax, tl.max(amax_abs(b_w), axis=1))")


def _op(p: ChunkParams, site: str, var: str, axis: int, out: str | None = None,
        shape: tuple[str, str] | None = None, gam: str | None = None, tag: str = "") -> str:
    """``out = QDQ(var)`` for a GEMM operand site (identity when the site is off); ``axis`` is the
    reduction axis of the register tile: 1 = one scale per row, 0 = one scale per column. NVFP4 needs
    the tile's ``shape`` (constexpr names) for its blocks of 16 along the reduction, and takes its
    global amax over the tile, or ``gam`` (an amax computed over the whole operand when the tile is a
    value block of it). ``tag`` names the NVFP4 temporary apart where one kernel rounds a site's operand
    in tiles of two shapes."""
    out = out or var
    fmt = dict(p.operands).get(site)
    if fmt is None:
        return "" if out == var else f"{out} = {var}"
    cfg = parse_quant(fmt)
    if cfg.format == "nvfp4":
        m, n = shape
        gam = gam or f"tl.max(tl.max(amax_abs({var}), axis=1), axis=0)"
        if axis == 1:
            blocks, red_axis, bcast = f"({m}, {n} // 16, 16)", 2, "[:, :, None]"
        else:
            blocks, red_axis, bcast = f"({m} // 16, 16, {n})", 1, "[:, None, :]"
        x3 = f"b_x3_{site.replace('.', '_')}{tag}"  # one name per site: loops must not see a temporary change shape
        return lines(
            f"{x3} = tl.reshape({var}, {blocks})  # q.{site}={fmt}",
            f"{out} = tl.reshape(qdq_e2m1({x3}, nvfp4_block_scale(tl.max(amax_abs({x3}), axis={red_axis}), "
            f"nvfp4_global_scale({gam})){bcast}), ({m}, {n}))")
    scale_fn, qdq_fn = _QDQ[cfg.format]
    bcast = "[:, None]" if axis == 1 else "[None, :]"
    return f"{out} = {qdq_fn}({var}, {scale_fn}(tl.max(amax_abs({var}), axis={axis})){bcast})  # q.{site}={fmt}"


def _ops(p: ChunkParams, *calls: tuple) -> str:
    """``_op`` for each call (its positional arguments); a call that rounds the same tile with the same format
    and axis as an earlier one (sites sharing an operand: K for key_interaction and output_score, T for
    wy_key and wy_value) reuses that result instead of rounding again (Triton's common-subexpression pass
    does not merge the amax reductions, operations with a region)."""
    done, parts = {}, []
    for site, var, axis, out, *rest in calls:
        fmt = dict(p.operands).get(site)
        key = (fmt, var, axis, *rest)
        if fmt is not None and key in done:
            parts.append(f"{out} = {done[key]}  # q.{site}: the same rows, the same rounding")
            continue
        parts.append(_op(p, site, var, axis, out, *rest))
        if fmt is not None:
            done[key] = out or var
    return lines(*parts)


_GRID = {"fp8_e4m3": "quant_fp8_e4m3", "int8": "quant_int8"}  # grid values of the per-row formats


def _row_format(p: ChunkParams, site: str) -> str | None:
    """"fp8_e4m3" / "int8" where ``site`` rounds per row to one of them (its grid values exist), else None."""
    fmt = dict(p.operands).get(site)
    name = None if fmt is None else parse_quant(fmt).format
    return name if name in _GRID else None


def factored(p: ChunkParams, gemm: str) -> bool:
    """``gemm``'s product runs on grid values, its operands' row scales applied to the result
    (docs/kernels-chunk.md, "Rounded operands in 16-bit GEMMs"): both sides rounded per row to FP8 / INT8, no
    accumulator emulation (which rounds running sums of the scaled product). On the H200 at [8, 4096, 16, 128]
    bf16, all FP8 sites f+b, against products of the dequantized operands: GDN 17.61 -> 17.41 ms, KDA 37.74 ->
    37.28; the o stage 0.97 -> 0.83 ms (examples/benchmarks/results/comparisons.jsonl, topics residual and
    factored-scales)."""
    return (_row_format(p, f"{gemm}.lhs") is not None and _row_format(p, f"{gemm}.rhs") is not None
            and gemm not in dict(p.acc))


def _grid_ops(p: ChunkParams, *calls: tuple) -> str:
    """For each (site, var, axis, name): b_s_<name>, the row scales of ``var`` (axis: the reduction axis of the
    register tile), and b_q_<name>, its grid values; a call rounding the same tile the same way as an earlier
    one reuses its names (``_ops``)."""
    done, parts = {}, []
    for site, var, axis, name in calls:
        fmt = _row_format(p, site)
        if (fmt, var, axis) in done:
            prev = done[(fmt, var, axis)]
            parts.append(f"b_s_{name}, b_q_{name} = b_s_{prev}, b_q_{prev}  # q.{site}: the same rows, the same rounding")
            continue
        done[(fmt, var, axis)] = name
        scale_fn = _QDQ[fmt][0]
        bcast = "[:, None]" if axis == 1 else "[None, :]"
        parts.append(lines(f"b_s_{name} = {scale_fn}(tl.max(amax_abs({var}), axis={axis}))",
                           f"b_q_{name} = {_GRID[fmt]}({var}, b_s_{name}{bcast})  # q.{site}={dict(p.operands)[site]}: "
                           "grid values, the scale apart"))
    return lines(*parts)


def grid_gemm(out: str, lhs: str, rhs: str, lhs_scale: str, rhs_scale: str, precision: str) -> str:
    """``out = Q(lhs) @ Q(rhs)`` from grid values: one scale per row of the result and one per column."""
    return f"{out} = grid_dot({lhs}, {rhs}, {precision}) * {lhs_scale}[:, None] * {rhs_scale}[None, :]"


def has_nvfp4_operands(p: ChunkParams) -> bool:
    """A GEMM operand site rounds to NVFP4 (the launch table keeps eight warps in the h, o and dh stages)."""
    return any(fmt.startswith("nvfp4") for _, fmt in p.operands)


def _nvfp4(p: ChunkParams, site: str) -> bool:
    fmt = dict(p.operands).get(site)
    return fmt is not None and fmt.startswith("nvfp4")


def whole_operand_amax(p: ChunkParams, kernel: str) -> str:
    """Loops that take the global amax of NVFP4 operands spanning every value block (the kernel's
    tiles see one block at a time): b_gam_wv (beta V), b_gam_h (h_n), b_gam_vn (V_new)."""
    def amax_loop(name, load):
        return lines(
            f"{name} = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)",
            "for i_v in range(0, tl.cdiv(V, BV)):",
            "    o_v = i_v * BV + tl.arange(0, BV)",
            f"    b_amax_x = {load}",
            f"    {name} = tl.maximum({name}, tl.max(tl.max(amax_abs(b_amax_x), axis=1), axis=0))")
    m_cv = "m_c[:, None] & (o_v < V)[None, :]"
    beta_v = f"tl.load(v + r_hv[:, None] * V + o_v[None, :], mask={m_cv}, other=0).to(tl.float32) * b_beta[:, None]"
    h_n = ("tl.load(h + (i_chunk * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], "
           "mask=m_k[:, None] & (o_v < V)[None, :], other=0)")
    v_new_ = f"tl.load(v_new + r_hv[:, None] * V + o_v[None, :], mask={m_cv}, other=0)"
    parts = []
    if kernel in ("fwd_intra", "bwd_intra") and _nvfp4(p, "wy_value.rhs"):
        parts.append(amax_loop("b_gam_wv", beta_v))
    if (kernel == "fwd_o" and _nvfp4(p, "output_state.rhs")) or (
            kernel == "bwd_intra" and (_nvfp4(p, "output_state.rhs") or _nvfp4(p, "state_read.rhs"))):
        parts.append(amax_loop("b_gam_h", h_n))
    if (kernel == "fwd_o" and _nvfp4(p, "output_value.rhs")) or (
            kernel == "bwd_intra" and (_nvfp4(p, "output_value.rhs") or _nvfp4(p, "state_update.rhs"))):
        parts.append(amax_loop("b_gam_vn", v_new_))
    return lines(*parts)


ACC_ROUNDING = {"fp16": "({}).to(tl.float16).to(tl.float32)", "bf16": "_round_bf16({})"}

# fp32 -> bf16 -> fp32, round to nearest even, written on the bits: Triton's interpreter truncates in
# .to(tl.bfloat16) (GPUs round to nearest even), so the cast is not used.
ACC_HELPERS = """@triton.jit
def _round_bf16(x):
    b_bits = x.to(tl.int32, bitcast=True)
    b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & -65536
    return tl.where(x == x, b_bits.to(tl.float32, bitcast=True), x)"""


def acc_dot(p: ChunkParams, site: str, out: str, lhs: str, rhs: str, red: str,
            precision: str = "GEMM_PRECISION") -> str:
    """``out = lhs @ rhs`` for a GEMM site; with ``acc.<site>`` the reduction (length ``red``, a
    constexpr name) runs block by block, the running sum rounded to fp16/bf16 after every block's add
    (the first block's product included), as the reference's accumulator emulation does. ``precision``
    names the kernel's constexpr: GEMM_PRECISION, or DOT_PRECISION for the pair products
    (chunk/precision.py)."""
    dot = "_gemm({}, " + rhs + f", {precision})"
    acc = dict(p.acc).get(site)
    if acc is None:
        return f"{out} = " + dot.format(lhs)
    name, block = parse_acc(acc)
    rnd = ACC_ROUNDING[name]
    o_red = f"o_red_{site}"  # one name per site: a loop must not see it change shape (BK vs C)
    blk = f"tl.where((({o_red} >= i_rb * {block}) & ({o_red} < i_rb * {block} + {block}))[None, :], {lhs}, 0.0)"
    return lines(
        f"# acc.{site}={acc}: {name} accumulator, reduction blocks of {block}",
        f"{o_red} = tl.arange(0, {red})",
        f"{out} = " + rnd.format(dot.format(f"tl.where(({o_red} < {block})[None, :], {lhs}, 0.0)")),
        f"for i_rb in range(1, tl.cdiv({red}, {block})):",
        f"    {out} = " + rnd.format(f"{out} + " + dot.format(blk)))


def acc_row_sum(p: ChunkParams, site: str, out: str, x: str) -> str:
    """``out = tl.sum(x, 1)`` (a reduction over the key channels, KDA's pair products) with the site's
    accumulator emulation, like ``acc_dot``."""
    acc = dict(p.acc).get(site)
    if acc is None:
        return f"{out} = tl.sum({x}, 1)"
    name, block = parse_acc(acc)
    rnd = ACC_ROUNDING[name]
    part = f"tl.sum(tl.where(((o_k >= i_rb * {block}) & (o_k < i_rb * {block} + {block}))[None, :], {x}, 0.0), 1)"
    return lines(
        f"{out} = " + rnd.format(f"tl.sum(tl.where((o_k < {block})[None, :], {x}, 0.0), 1)"),
        f"for i_rb in range(1, tl.cdiv(BK, {block})):",
        f"    {out} = " + rnd.format(f"{out} + {part}"))


def acc_values(p: ChunkParams) -> dict[str, str]:
    """Template values of the GEMMs outside the pair products."""
    return {
        "WY_KEY_DOT": acc_dot(p, "wy_key", "b_w", "b_Tw", "b_bk", "C"),
        "WY_VALUE_DOT": acc_dot(p, "wy_value", "b_u", "b_Tu", "b_bv", "C"),
        "STATE_READ_DOT": acc_dot(p, "state_read", "b_wh", "b_w", "b_hr", "BK"),
        "STATE_UPDATE_DOT": acc_dot(p, "state_update", "b_upd", "tl.trans(b_kd)", "b_vu", "C"),
        "OUTPUT_STATE_DOT": acc_dot(p, "output_state", "b_os", "b_qg", "b_h", "BK"),
        "OUTPUT_VALUE_DOT": acc_dot(p, "output_value", "b_ov", "b_A", "b_v", "C"),
    }


def lines(*parts: str) -> str:
    return "\n".join(x for x in parts if x)


def factored_values(p: ChunkParams) -> dict[str, str]:
    """The forward's products on grid values (``factored``), as template values that replace ``operand_values``' and
    ``acc_values``': W = Q(T) Q(beta e^G K) and U = Q(T) Q(beta V) (intra stage; both or neither, T is shared),
    Q(K_d)^T Q(V_new) (h stage), Q(Q_g) Q(h_n) and Q(A_qk) Q(V_new) (o stage). Only the forward stages: the
    backward's products have a gradient operand."""
    values = {}
    if factored(p, "wy_key") and factored(p, "wy_value"):
        values.update({
            "T_OPERANDS": _grid_ops(p, ("wy_key.lhs", "b_T", 1, "Tw"), ("wy_value.lhs", "b_T", 1, "Tu")),
            "WY_KEY_RHS": _grid_ops(p, ("wy_key.rhs", "b_bk", 0, "bk")),
            "WY_KEY_DOT": grid_gemm("b_w", "b_q_Tw", "b_q_bk", "b_s_Tw", "b_s_bk", "GEMM_PRECISION"),
            "WY_VALUE_RHS": _grid_ops(p, ("wy_value.rhs", "b_bv", 0, "bv")),
            "WY_VALUE_DOT": grid_gemm("b_u", "b_q_Tu", "b_q_bv", "b_s_Tu", "b_s_bv", "GEMM_PRECISION")})
    if factored(p, "state_update"):  # K_d [C x BK] and V_new [C x BV], both rounded per column (over the chunk)
        values.update({
            "STATE_UPDATE_OPERANDS": _grid_ops(p, ("state_update.lhs", "b_kd", 0, "kd"),
                                               ("state_update.rhs", "b_v", 0, "vu")),
            "STATE_UPDATE_DOT": grid_gemm("b_upd", "tl.trans(b_q_kd)", "b_q_vu", "b_s_kd", "b_s_vu", "GEMM_PRECISION")})
    if factored(p, "output_state"):
        values.update({
            "OUTPUT_STATE_OPERANDS": _grid_ops(p, ("output_state.lhs", "b_qg", 1, "qg"),
                                               ("output_state.rhs", "b_h", 0, "h")),
            "OUTPUT_STATE_DOT": grid_gemm("b_os", "b_q_qg", "b_q_h", "b_s_qg", "b_s_h", "GEMM_PRECISION")})
    if factored(p, "output_value"):
        values.update({
            "OUTPUT_VALUE_OPERANDS": _grid_ops(p, ("output_value.lhs", "b_A", 1, "A"), ("output_value.rhs", "b_v", 0, "v")),
            "OUTPUT_VALUE_DOT": grid_gemm("b_ov", "b_q_A", "b_q_v", "b_s_A", "b_s_v", "GEMM_PRECISION")})
    return values


def operand_values(p: ChunkParams) -> dict[str, str]:
    """Template values of the GEMM operand sites (empty or plain renames when no site is on)."""
    CC, CK, CV, KV = ("C", "C"), ("C", "BK"), ("C", "BV"), ("BK", "BV")
    t_ops = _ops(p, ("wy_key.lhs", "b_T", 1, "b_Tw", CC), ("wy_value.lhs", "b_T", 1, "b_Tu", CC))
    wv_rhs = _op(p, "wy_value.rhs", "b_bv", 0, None, CV, "b_gam_wv")
    return {
        "T_OPERANDS": t_ops,
        "WY_KEY_RHS": _op(p, "wy_key.rhs", "b_bk", 0, None, CK),
        "WY_VALUE_RHS": wv_rhs,
        # the h stage holds all of V in one tile when an NVFP4 operand needs it (ChunkParams.h_full_v)
        "STATE_READ_RHS": _op(p, "state_read.rhs", "b_h", 0, "b_hr", KV),
        "STATE_UPDATE_OPERANDS": lines(_op(p, "state_update.lhs", "b_kd", 0, None, CK),
                                        _op(p, "state_update.rhs", "b_v", 0, "b_vu", CV)),
        "OUTPUT_STATE_OPERANDS": lines(_op(p, "output_state.lhs", "b_qg", 1, None, CK),
                                        _op(p, "output_state.rhs", "b_h", 0, None, KV, "b_gam_h")),
        "OUTPUT_VALUE_OPERANDS": lines(_op(p, "output_value.lhs", "b_A", 1, None, CC),
                                        _op(p, "output_value.rhs", "b_v", 0, None, CV, "b_gam_vn")),
        "BWD_DH_OPERANDS": lines(_op(p, "output_value.lhs", "b_A", 1, None, CC),
                                  _op(p, "state_update.lhs", "b_kd", 0, None, CK)),
        "OUTPUT_STATE_LHS": _op(p, "output_state.lhs", "b_qg", 1, None, CK),
        "BWD_V_OPERANDS_VALUE": _op(p, "output_value.rhs", "b_vn", 0, "b_vn_ov", CV, "b_gam_vn"),
        "BWD_V_OPERANDS_KEY": _ops(p, ("state_read.rhs", "b_hn", 0, "b_hn_sr", KV, "b_gam_h"),
                                   ("output_state.rhs", "b_hn", 0, "b_hn_os", KV, "b_gam_h"),
                                   ("state_update.rhs", "b_vn", 0, "b_vn_su", CV, "b_gam_vn")),
        "FWD_INTRA_AMAX": whole_operand_amax(p, "fwd_intra"),
        "FWD_O_AMAX": whole_operand_amax(p, "fwd_o"),
        "BWD_INTRA_AMAX": whole_operand_amax(p, "bwd_intra"),
    }


def _gdn_pair_operands(p: ChunkParams) -> str:
    return _ops(p, ("key_interaction.lhs", "b_k", 1, "b_kl", ("C", "BK")),
                ("key_interaction.rhs", "b_k", 1, "b_kr", ("C", "BK")),
                ("output_score.lhs", "b_q", 1, "b_ql", ("C", "BK")),
                ("output_score.rhs", "b_k", 1, "b_kr2", ("C", "BK")))


def gdn_pair_block(p: ChunkParams, forward: bool = False) -> str:
    """One key block's share of K_l K_r^T and Q_l K_r2^T, added to b_P, b_Pqk (Γ after the last block).
    GEMM_PRECISION: GDN's pair operands are the raw inputs (Γ comes after the sum), so with 16-bit GEMMs
    they are 16-bit numbers, which TF32 holds exactly: bf16 operands form the same products at twice the
    tensor-core rate. Where GEMM_PRECISION is not 16-bit (rounded operands, fp32 inputs) it is DOT_PRECISION.
    ``forward``: the forward intra stage, where both products may run on grid values (``factored``)."""
    if forward and factored(p, "key_interaction") and factored(p, "output_score"):
        return lines(
            _grid_ops(p, ("key_interaction.lhs", "b_k", 1, "kl"), ("key_interaction.rhs", "b_k", 1, "kr"),
                      ("output_score.lhs", "b_q", 1, "ql"), ("output_score.rhs", "b_k", 1, "kr2")),
            grid_gemm("b_Pb", "b_q_kl", "tl.trans(b_q_kr)", "b_s_kl", "b_s_kr", "GEMM_PRECISION"),
            grid_gemm("b_Pqkb", "b_q_ql", "tl.trans(b_q_kr2)", "b_s_ql", "b_s_kr2", "GEMM_PRECISION"),
            "b_P += b_Pb",
            "b_Pqk += b_Pqkb")
    return lines(
        _gdn_pair_operands(p),
        acc_dot(p, "key_interaction", "b_Pb", "b_kl", "tl.trans(b_kr)", "BK", "GEMM_PRECISION"),
        acc_dot(p, "output_score", "b_Pqkb", "b_ql", "tl.trans(b_kr2)", "BK", "GEMM_PRECISION"),
        "b_P += b_Pb",
        "b_Pqk += b_Pqkb")


GDN_PAIRS_DECAY = lines(  # Γ_ij = exp(G_i - G_j) on the summed products
    "b_Gam = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))",
    "b_P = b_P * b_Gam",
    "b_Pqk = b_Pqk * b_Gam")


def gdn_pairs(p: ChunkParams) -> str:
    """b_Gam, b_P = (K_l K_r^T) ⊙ Γ and b_Pqk = (Q_l K_r2^T) ⊙ Γ with the operand sites' rounding (whole rows)."""
    return lines(
        "b_P = tl.zeros([C, C], dtype=tl.float32)",
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)",
        gdn_pair_block(p),
        GDN_PAIRS_DECAY)


def pairs_need_all_keys(p: ChunkParams) -> bool:
    """The forward intra stage must see all key columns in one block: GDN's rounded or accumulator-emulated
    pair product (row scales over K, NVFP4 global amax, reduction blocks rounded in order; KDA's come from
    chunk_kda_fwd_kernel_pairs) or an NVFP4 wy_key.rhs (global amax over the chunk's [C x K] operand)."""
    rounded = p.kind == "gdn" and any(site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)
    return rounded or _nvfp4(p, "wy_key.rhs")


SOLVE_BLOCK = 16  # rows of the diagonal blocks of the blocked exact solve


def solve_form(p: ChunkParams) -> str:
    """"blocked" where the chunk splits into 16-row blocks, else "rows" (row-by-row forward substitution); both
    compute T = (I + A)^-1 exactly. On the H200 the forward intra stage takes 1.93 ms per call with the blocked
    solve against 3.85 row by row (GDN [8, 4096, 16, 128] bf16; comparisons.jsonl, topic solve-forms)."""
    blockable = p.chunk % SOLVE_BLOCK == 0 and p.chunk > SOLVE_BLOCK
    return "blocked" if blockable else "rows"


def solve(p: ChunkParams) -> str:
    eye = "tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)"
    if p.solve == "exact" and solve_form(p) == "blocked":
        return blocked_solve(p)
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


def blocked_solve(p: ChunkParams) -> str:
    """T = (I + A)^-1 by blocks (docs/kernels-chunk.md, "Blocked solve"): the 16 x 16 diagonal blocks D
    by forward substitution, all blocks at once (16 steps instead of C); then with L the strictly
    block-lower part and M = (I + D)^-1 L (nilpotent of order C/16), T = sum_n<C/16 (-M)^n (I + D)^-1.

    The substitution holds the blocks transposed, X[b, c, j] = (I + D_b)^-1[j, c]: step i's sum over the
    rows j < i then runs along the tile's last axis, inside a warp, where a sum over its middle axis crossed
    warps (a shared-memory round trip per step). Row i of every D_b comes from ``solve_row``."""
    nb, bs = p.chunk // SOLVE_BLOCK, SOLVE_BLOCK
    return lines(
        f"# blocked exact solve: {nb} diagonal blocks of {bs} rows",
        f"o_sb = tl.arange(0, {nb})",
        f"o_sr = tl.arange(0, {bs})",
        "m_same_blk = o_sb[:, None, None, None] == o_sb[None, None, :, None]",
        solve_row_setup(p),
        "# X[b, c, j] = (I + D_b)^-1[j, c]; step i: column i of X = e_i - sum_j<i D_b[i, j] X[b, :, j]",
        "m_col = o_sr[None, None, :]",
        f"b_X = tl.where(o_sr[None, :, None] == m_col, 1.0, 0.0) + tl.zeros([{nb}, {bs}, {bs}], dtype=tl.float32)",
        f"for i in range(1, {bs}):",
        solve_row(p),
        "    b_s = tl.sum(b_a[:, None, :] * b_X, 2)",
        "    b_X = tl.where(m_col == i, tl.where(o_sr == i, 1.0, 0.0)[None, :, None] - b_s[:, :, None], b_X)",
        "b_Td = tl.permute(b_X, (0, 2, 1))",
        "b_Tbd = tl.reshape(tl.where(m_same_blk, b_Td[:, :, None, :], 0.0), [C, C])",
        f"b_M = tl.dot(b_Tbd, tl.where((o_c // {bs})[:, None] > (o_c // {bs})[None, :], b_A, 0.0),",
        "             input_precision=DOT_PRECISION)",
        "b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)",
        "b_X = b_I - b_M",
        f"for _ in tl.static_range({nb - 2}):",
        "    b_X = b_I - tl.dot(b_M, b_X, input_precision=DOT_PRECISION)",
        "b_T = tl.dot(b_X, b_Tbd, input_precision=DOT_PRECISION)")


def solve_row_setup(p: ChunkParams) -> str:
    """Set-up of ``solve_row``: GDN's diagonal blocks D [nb, 16, 16] out of the register tile of A."""
    if p.kind == "kda":
        return "# row i of D_b below: beta_i P_ij from p_pairs (chunk_kda_fwd_kernel_pairs wrote P)"
    nb, bs = p.chunk // SOLVE_BLOCK, SOLVE_BLOCK
    return f"b_D = tl.sum(tl.where(m_same_blk, tl.reshape(b_A, [{nb}, {bs}, {nb}, {bs}]), 0.0), 2)"


def solve_row(p: ChunkParams) -> str:
    """b_a [nb, 16]: row i of every diagonal block D_b, zero from column i on. KDA's A = diag(beta) P is
    read from p_pairs in memory, as FLA's solve_tril reads its rows; GDN's A exists only in registers (its
    pair products are computed in the same kernel). Each was the faster form for its kind on the H200
    (KDA [8, 4096, 16, 128] intra stage: 0.58 ms against 0.81 from registers; GDN: 0.51 against 0.54 from a
    copy of the diagonal blocks in memory)."""
    bs = SOLVE_BLOCK
    if p.kind == "kda":
        return lines(
            f"    x_i = (bos + i_t * C + o_sb * {bs} + i) * HV + i_hv  # row i of every diagonal block",
            f"    m_ri = (i_t * C + o_sb * {bs} + i) < seq_len",
            f"    b_a = tl.load(p_pairs + x_i[:, None] * C + (o_sb * {bs})[:, None] + o_sr[None, :],",
            "                  mask=m_ri[:, None] & (o_sr < i)[None, :], other=0)",
            "    b_a = b_a * tl.load(beta + x_i, mask=m_ri, other=0).to(tl.float32)[:, None]")
    return "    b_a = tl.sum(tl.where(o_sr[None, :, None] == i, b_D, 0.0), 1)"


def _off_diagonal_loop(bc: int) -> str:
    """Head of KDA's off-diagonal-block loop: sub-chunk i_sb against the rows before its first row r,
    through the decay factors exp(G - G_r) (rows in the block) and exp(G_r - G) (rows before it), both <= 1."""
    return (f"o_blk = o_c // {bc}\n"
            f"for i_sb in range(1, C // {bc}):\n"
            f"    i_ref = i_sb * {bc}\n"
            "    b_gr = tl.sum(tl.where((o_c == i_ref)[:, None], b_G, 0.0), 0)\n"
            "    m_in = o_blk == i_sb\n"
            "    m_before = o_c < i_ref\n"
            "    b_el = tl.exp(tl.where(m_in[:, None], b_G - b_gr[None, :], 0.0))\n"
            "    b_er = tl.exp(tl.where(m_before[:, None], b_gr[None, :] - b_G, 0.0))\n")


def _diagonal_column_loop(bc: int) -> str:
    """Head of KDA's diagonal-block loop: step jj gathers column j = bc b + jj of every sub-chunk b,
    its key rows b_kj and cumulative decays b_gj from memory."""
    return (f"for jj in range(0, {bc}):\n"
            f"    o_j = o_blk * {bc} + jj\n"
            "    t_j = i_t * C + o_j\n"
            "    m_jk = (t_j < seq_len)[:, None] & m_k[None, :]\n"
            "    b_kj = tl.load(k + ((bos + t_j) * H + i_h)[:, None] * K + o_k[None, :],\n"
            "                   mask=m_jk, other=0).to(tl.float32)\n"
            "    b_gj = tl.load(g_cum + ((bos + t_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)\n")


def kda_pairs(p: ChunkParams) -> str:
    """b_P = K K^T ⊙ Γ and b_Pqk = Q K^T ⊙ Γ of one KDA chunk over the key columns in b_q, b_k, b_G
    (masks applied later).

    Off-diagonal sub-chunk blocks (rows in block b, columns before its first row r): dots of
    K exp(G - G_r) and K exp(G_r - G), both factors <= 1 (G falls along the chunk). Diagonal
    blocks: column jj of every block at once, exp(G_i - G_j) from the prefix difference masked to
    j <= i before the exp; the column's rows are gathered from k and g_cum in memory."""
    bc = p.sub_chunk
    return (
        f"# sub-chunks of {bc} rows: off-diagonal blocks by dots through a reference row, diagonal blocks columnwise\n"
        + "b_P = tl.zeros([C, C], dtype=tl.float32)\n"
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)\n"
        + _off_diagonal_loop(bc) +
        "    b_kr = tl.where(m_before[:, None], b_k * b_er, 0.0)\n"
        "    b_P += tl.dot(tl.where(m_in[:, None], b_k * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)\n"
        "    b_Pqk += tl.dot(tl.where(m_in[:, None], b_q * b_el, 0.0), tl.trans(b_kr), input_precision=DOT_PRECISION)\n"
        + _diagonal_column_loop(bc) +
        "    b_kj = b_kj * tl.exp(tl.where((o_c >= o_j)[:, None], b_G - b_gj, 0.0))\n"
        "    m_sel = o_c[None, :] == o_j[:, None]\n"
        "    b_P += tl.where(m_sel, tl.sum(b_k * b_kj, 1)[:, None], 0.0)\n"
        "    b_Pqk += tl.where(m_sel, tl.sum(b_q * b_kj, 1)[:, None], 0.0)")


def kda_rounds_pairs(p: ChunkParams) -> bool:
    """KDA pair products with rounding (operand QDQ or accumulator emulation): the column-by-column path."""
    return any(site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)


_PAIR_ROWS = (
    "    m_j = o_c == j",
    "    b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)",
    "    b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)",
    "    b_e = tl.exp(tl.where((o_c >= j)[:, None], b_G - b_gj[None, :], 0.0))",
    "    b_pk = tl.where((o_c > j)[:, None], b_kj[None, :] * b_e, 0.0)",
    "    b_pq = tl.where((o_c >= j)[:, None], b_kj[None, :] * b_e, 0.0)",
)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) if text else ""


def _pair_amax(p: ChunkParams) -> str:
    """NVFP4 on the pairwise operands: the global amax over the chunk's whole [C x C x K] pair tile, first."""
    if not (_nvfp4(p, "key_interaction.rhs") or _nvfp4(p, "output_score.rhs")):
        return ""
    return lines(
        "b_gam_pk = tl.max(tl.zeros([C], dtype=tl.float32), axis=0)",
        "b_gam_pq = tl.max(tl.zeros([C], dtype=tl.float32), axis=0)",
        "for j in range(0, C):",
        *_PAIR_ROWS,
        "    b_gam_pk = tl.maximum(b_gam_pk, tl.max(tl.max(amax_abs(b_pk), axis=1), axis=0))",
        "    b_gam_pq = tl.maximum(b_gam_pq, tl.max(tl.max(amax_abs(b_pq), axis=1), axis=0))")


def _pair_operands(p: ChunkParams, pk: str, pq: str) -> str:
    return lines(_indent(_op(p, "key_interaction.rhs", "b_pk", 1, pk, ("C", "BK"), "b_gam_pk")),
                 _indent(_op(p, "output_score.rhs", "b_pq", 1, pq, ("C", "BK"), "b_gam_pq")))


def kda_pairs_rounded(p: ChunkParams) -> str:
    """KDA pair products when key_interaction / output_score are quantized: the per-pair operand
    k_j exp(G_i - G_j) (row (i, j) over the key channels) must exist to be rounded, so column by column
    over whole key rows: the Neumann solve's backward intra kernel (the exact solve's pair products run in
    chunk_pair_rounding's kernels)."""
    return lines(
        "# column by column: the pairwise operands k_j exp(G_i - G_j) (rows (i, j) over K) are rounded per pair",
        _op(p, "key_interaction.lhs", "b_k", 1, "b_kl", ("C", "BK")),
        _op(p, "output_score.lhs", "b_q", 1, "b_ql", ("C", "BK")),
        _pair_amax(p),
        "b_P = tl.zeros([C, C], dtype=tl.float32)",
        "b_Pqk = tl.zeros([C, C], dtype=tl.float32)",
        "for j in range(0, C):",
        *_PAIR_ROWS,
        _pair_operands(p, "b_pk_q", "b_pq_q"),
        _indent(acc_row_sum(p, "key_interaction", "b_cp", "b_kl * b_pk_q")),
        _indent(acc_row_sum(p, "output_score", "b_cq", "b_ql * b_pq_q")),
        "    b_P += tl.where(m_j[None, :], b_cp[:, None], 0.0)",
        "    b_Pqk += tl.where(m_j[None, :], b_cq[:, None], 0.0)")


def kda_pair_grads_rounded(p: ChunkParams) -> str:
    """Gradients of ``kda_pairs_rounded``: the rounded other operand in every product, identity STE."""
    return lines(
        _pair_amax(p),
        "for j in range(0, C):",
        *_PAIR_ROWS,
        _pair_operands(p, "b_pkq", "b_pqq"),
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


def kda_pair_grads(p: ChunkParams) -> str:
    """Gradients of the KDA pair products (same blocking as ``kda_pairs``) into dk, dq, dG [C x BK] tiles,
    where the backward intra kernel holds whole key rows (chunk_kda_bwd_kernel_pairs has its own form)."""
    bc = p.sub_chunk
    return (
        "# off-diagonal blocks: P_b = (K e^(G - G_r)) (K e^(G_r - G))^T\n"
        + _off_diagonal_loop(bc) +
        "    m_blk = m_in[:, None] & m_before[None, :]\n"
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
        + _diagonal_column_loop(bc) +
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


GDN_FWD = {
    "LOAD_CUMSUM": "b_G = tl.load(g_cum + r_hv, mask=m_c, other=0)",  # the recompute's W / U kernel
    "LOAD_DECAY": (
        "b_g = tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32)\n"
        "b_G = tl.cumsum(b_g, 0)\n"
        "tl.store(g_cum + r_hv, b_G, mask=m_c)"),
    "KEY_BLOCK_DECAY": "",
    "KEY_DECAY": "tl.exp(b_G)[:, None]",
    "DECAYED_KEYS": "",
    "CHUNK_DECAY": (
        "b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)\n"
        "b_g = tl.load(g_cum + (bos + t_c) * HV + i_hv, mask=m_c, other=0)\n"
        "b_glast = tl.load(g_cum + i_last * HV + i_hv)\n"
        "b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]\n"
        "b_h *= tl.exp(b_glast)"),
    "QUERY_DECAY": (
        "b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)\n"
        "b_qg = b_q * tl.exp(b_g)[:, None]"),
}

# GDN's state update with no state_update operand rounded: the chunk decay exp(G_C - G) (one number per row)
# scales V_new's rows instead of K's, K^T loaded as a [BK x C] tile, as FLA's h kernel does; the form above
# scales K in fp32 and transposes it in registers (state_update.lhs is K ⊙ decay: NUMERICS.md's operand)
GDN_CHUNK_DECAY_ON_VALUES = (
    "b_kd = tl.load(k + ((bos + t_c) * H + i_h)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_c[None, :], "
    "other=0)  # K^T\n"
    "b_g = tl.load(g_cum + (bos + t_c) * HV + i_hv, mask=m_c, other=0)\n"
    "b_glast = tl.load(g_cum + i_last * HV + i_hv)\n"
    "b_v = b_v * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]\n"
    "b_h *= tl.exp(b_glast)")


def gdn_decays_values(p: ChunkParams) -> bool:
    """GDN's h stage applies the chunk decay to V_new (GDN_CHUNK_DECAY_ON_VALUES): no state_update operand
    rounded, no accumulator emulated there."""
    return p.kind == "gdn" and not any(site.split(".")[0] == "state_update" for site, _ in p.operands + p.acc)


KDA_FWD = {
    "LOAD_CUMSUM": "",  # G comes per key block from g_cum (KEY_BLOCK_DECAY)
    "LOAD_DECAY": "",
    "KEY_BLOCK_DECAY": "b_G = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)",
    "KEY_DECAY": "tl.exp(b_G)",
    # K ⊙ exp(G_last - G) of the chunk's state update, written by the intra stage (which holds K and G by key
    # block) for the h and dh stages: each of their value-block programs would otherwise load G [C x K] and
    # exponentiate it again (docs/kernels-chunk.md, "Decayed keys")
    "DECAYED_KEYS": (
        "b_glast = tl.load(g_cum + ((bos + tl.minimum(i_t * C + C, seq_len) - 1) * HV + i_hv) * K + o_k, "
        "mask=m_k, other=0)\n"
        "b_kd = b_k * tl.where(m_ck, tl.exp(b_glast[None, :] - b_G), 0.0)\n"
        "tl.store(kd + r_hv[:, None] * K + o_k[None, :], _cast_for(b_kd, kd, GEMM_PRECISION), mask=m_ck)"),
    "CHUNK_DECAY": (
        "b_kd = tl.load(kd + ((bos + t_c) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)\n"
        "b_h *= tl.exp(b_glast)[:, None]"),
    "QUERY_DECAY": (
        "b_g = tl.load(g_cum + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_qg = b_q * tl.exp(b_g)"),
}

QDQ_IMPORT = ("from la_compiler.kernels.common.qdq import (amax_abs, fp8_scale, grid_dot, int8_scale,  # noqa: F401\n"
              "    nvfp4_block_scale, nvfp4_global_scale, qdq_e2m1, qdq_fp8_e4m3, qdq_int8, qdq_int8_h32, quant_fp8_e4m3,\n"
              "    quant_int8)")



def load_solved(p: ChunkParams) -> str:
    """The backward's T: the exact solve's T stored by the forward recompute (rows past the sequence end
    are the identity's, as a solve of their zero rows gives); a Neumann polynomial is recomputed (cheap dots)."""
    if p.solve != "exact":
        return solve(p)
    return ("# T stored by the forward recompute (chunk_fwd STORE_T)\n"
            "b_T = tl.load(t_solved + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0)\n"
            "b_T = tl.where(m_c[:, None], b_T, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0))")


def solve_grad(p: ChunkParams) -> str:
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


GDN_BWD = {
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
        "b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)\n"
        "b_g = tl.load(g_cum + r_hv, mask=m_c, other=0)\n"
        "b_glast = tl.load(g_cum + i_last * HV + i_hv)\n"
        "b_kd = b_k * tl.where(m_c, tl.exp(b_glast - b_g), 0.0)[:, None]\n"
        "b_dlast = tl.exp(b_glast)"),
}

KDA_BWD = {
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
    "KEY_TO_END": (  # K ⊙ exp(G_last - G) from the forward recompute's intra stage (KDA_FWD's DECAYED_KEYS)
        "b_kd = tl.load(kd + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0)\n"
        "b_glast = tl.load(g_cum + (i_last * HV + i_hv) * K + o_k, mask=m_k, other=0)\n"
        "b_dlast = tl.exp(b_glast)[:, None]"),
}

ROW_SUM_HELPER = "@triton.jit\ndef _row_sum(x):\n    return tl.sum(x, 1)"

SUB_DOT_HELPER = '''@triton.jit
def _sub_dot(a, b, DOT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr):
    """a @ b for the sub-chunk kernels' [BC x ..] tiles: tl.dot from 16 rows up, else a broadcast sum
    (tl.dot needs 16)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], 1)'''
