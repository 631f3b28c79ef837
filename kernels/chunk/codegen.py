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
import functools
from types import ModuleType

from la_compiler.kernels.common import cache
from la_compiler.kernels.chunk import pair_rounding as chunk_pair_rounding
from la_compiler.kernels.chunk.bwd_snippets import (DT_FROM_W, GDN_DT_DONE, GDN_FINISH, GDN_KEY_BLOCK_DONE, GDN_LOAD_G,
                                                   GDN_STATE_SIDE_DT, HAND_OVER_PAIRS, HAND_OVER_SHARES,
                                                   STORE_INPUT_GRADS, da_from_dt, gdn_pair_grads_before_key_loop)
from la_compiler.kernels.chunk.snippets import (
    ACC_HELPERS, GDN_BWD, GDN_FWD, GDN_PAIRS_DECAY, KDA_BWD, KDA_FWD, PAIRWISE_SITES, QDQ_IMPORT, ROW_SUM_HELPER,
    GDN_CHUNK_DECAY_ON_VALUES, SUB_DOT_HELPER, gdn_decays_values, gdn_pair_block, gdn_pairs,
    acc_dot, kda_pair_grads, acc_values, kda_pair_grads_rounded, kda_pairs, kda_pairs_rounded, kda_rounds_pairs,
    factored_values, operand_values, lines, load_solved, solve, state_qdq, w_amax_pass, w_qdq)
from la_compiler.kernels.chunk.precision import GEMM_HELPER
from la_compiler.kernels.chunk.forms import DIAG_DOT_MAX_RANGE  # noqa: F401
from la_compiler.kernels.chunk.params import ChunkParams, OPERAND_SITES, parse_acc, unsupported  # noqa: F401
from la_compiler.kernels.common.codegen import CodegenError, module_source, render, template  # noqa: F401

TEMPLATES = "la_compiler.kernels.chunk.templates"

# ---- template values -------------------------------------------------------------------------
def _state_offsets(layout: str) -> str:
    """Offsets of a [BK, BV] state tile in h0 / ht / dht / dh0 ([K, V], or [V, K] for the vk layout)."""
    return "o_k[:, None] * V + o_v[None, :]" if layout == "kv" else "o_k[:, None] + o_v[None, :] * K"


_W_KEY_BLOCK = """o_k = i_k * BK + tl.arange(0, BK)
m_k = o_k < K
m_ck = m_c[:, None] & m_k[None, :]
b_k = tl.load(k + ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
${KEY_BLOCK_DECAY}
b_bk = b_k * (b_beta[:, None] * ${KEY_DECAY})
${WY_KEY_RHS}
${WY_KEY_DOT}"""


_PAIRS_BY_KEY_BLOCKS = """b_P = tl.zeros([C, C], dtype=tl.float32)
b_Pqk = tl.zeros([C, C], dtype=tl.float32)
for i_k in range(0, tl.cdiv(K, BK)):
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    r_qk = ((bos + t_c) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)
    b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)
    ${PAIR_PRODUCTS}
${PAIRS_DONE}"""

_PAIRS_FROM_KERNEL = (
    "# P, P_qk from chunk_kda_fwd_kernel_pairs (the blocks above the diagonal are unwritten: masked here)\n"
    "b_P = tl.load(p_pairs + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_causal, other=0)\n"
    "b_Pqk = tl.load(A_qk + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None] & m_causal, other=0)")




def kda_pairs_kernel(p: ChunkParams) -> bool:
    """KDA's pair products run in their own forward kernel (chunk_kda_fwd_kernel_pairs, one program per
    sub-chunk like FLA's): exact ones by key blocks and tensor-core dots, rounded ones (operand QDQ or
    accumulator emulation at key_interaction / output_score) column by column over whole key rows."""
    return p.kind == "kda"


def _kda_pairs_kernels(p: ChunkParams, program: str) -> list[str]:
    """The forward's cumsum kernel, then the pairs kernel: exact, or rounded (after the NVFP4 pair amax)."""
    kernels = [render(template(TEMPLATES, "chunk_fwd_cumsum"), {"OP": p.kind, "PROGRAM": program}, where="chunk_fwd_cumsum")]
    if not kda_rounds_pairs(p):
        return kernels + [SUB_DOT_HELPER, render(template(TEMPLATES, "chunk_fwd_pairs"), {"OP": p.kind, "PROGRAM": program},
                                                 where="chunk_fwd_pairs")]
    if chunk_pair_rounding.kda_pairs_nvfp4(p):
        kernels.append(render(template(TEMPLATES, "chunk_fwd_pair_amax"), {"OP": p.kind, "PROGRAM": program},
                              where="chunk_fwd_pair_amax"))
    return kernels + [render(template(TEMPLATES, "chunk_fwd_pairs_rounded"), {
        "OP": p.kind, "PROGRAM": program, **chunk_pair_rounding.fwd_values(p)}, where="chunk_fwd_pairs_rounded")]


INTRA_DOC = '''"""Everything of one chunk that does not depend on the state (one program per chunk x value head):
G = cumsum(g); A = strict_tril(diag(beta)(K K^T ⊙ Γ)); T = (I + A)^-1; W = T diag(beta)(exp(G) ⊙ K);
U = T diag(beta) V; A_qk = scale tril(Q K^T ⊙ Γ); T itself when STORE_T; KDA: kd = K ⊙ exp(G_C - G) for the
h and dh stages.
Keys are read in blocks of BK columns (the pair products are sums over key columns; W's columns are
independent), so no program holds a full-width [C x K] tile; BK >= K where a rounded pair operand or
the W quantizer's tile needs all columns at once (chunk.fwd.intra_key_block). KDA's exact pair
products come from chunk_kda_fwd_kernel_pairs (P in p_pairs, P_qk in A_qk, G in g_cum)."""'''
WU_DOC = '''"""The intra stage's second half, for the backward's recompute from a kept residual:
W = T diag(beta)(exp(G) ⊙ K) (+ W quantizer), U = T diag(beta) V, KDA's decayed keys, from the T (and GDN's G)
that the training forward kept (chunk/residual.py)."""'''
# T from the training forward's residual (rows past the sequence end: the identity's, as its solve gives them)
LOAD_T = ("b_T = tl.load(t_out + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0)\n"
          "b_T = tl.where(m_c[:, None], b_T, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0))")


def chunk_fwd_source(p: ChunkParams) -> str:
    fwd = GDN_FWD if p.kind == "gdn" else KDA_FWD
    if p.kind == "gdn":
        pairs = render(_PAIRS_BY_KEY_BLOCKS, {"PAIR_PRODUCTS": gdn_pair_block(p, forward=True),
                                              "PAIRS_DONE": GDN_PAIRS_DECAY}, where="chunk_fwd_intra pairs")
    else:
        pairs = _PAIRS_FROM_KERNEL
    ops = operand_values(p)
    dots = acc_values(p)
    grid = factored_values(p)  # products on grid values (snippets.factored): the forward stages only
    ops, dots = dict(ops, **grid), dict(dots, **grid)
    program = template(TEMPLATES, "chunk_fwd_program")
    state_hook = state_qdq(p)
    state_offsets = _state_offsets(p.state)
    w_key_block = render(_W_KEY_BLOCK, {
        "KEY_BLOCK_DECAY": fwd["KEY_BLOCK_DECAY"], "KEY_DECAY": fwd["KEY_DECAY"],
        "WY_KEY_RHS": ops["WY_KEY_RHS"], "WY_KEY_DOT": dots["WY_KEY_DOT"]}, where="chunk_fwd_intra W block")
    solve_half = render(template(TEMPLATES, "chunk_fwd_intra_solve"), {
        "LOAD_DECAY": fwd["LOAD_DECAY"], "PAIRS": pairs, "SOLVE": solve(p)}, where="chunk_fwd_intra_solve")
    wu_half = render(template(TEMPLATES, "chunk_fwd_intra_wu"), {
        "T_OPERANDS": ops["T_OPERANDS"], "W_AMAX": w_amax_pass(p, w_key_block), "W_KEY_BLOCK": w_key_block,
        "ON_W": w_qdq(p), "DECAYED_KEYS": fwd["DECAYED_KEYS"],
        "WY_VALUE_RHS": ops["WY_VALUE_RHS"], "WY_VALUE_DOT": dots["WY_VALUE_DOT"],
        "FWD_INTRA_AMAX": ops["FWD_INTRA_AMAX"]}, where="chunk_fwd_intra_wu")
    # the intra stage as one kernel, and its second half alone (the backward's recompute from a kept residual)
    intra, intra_wu = (
        render(template(TEMPLATES, "chunk_fwd_intra"), {"OP": p.kind, "NAME": name, "DOC": doc, "PROGRAM": program, "BODY": body},
               where=f"chunk_fwd_{name}")
        for name, doc, body in (("intra", INTRA_DOC, solve_half + "\n\n" + wu_half),
                                ("wu", WU_DOC, lines(fwd["LOAD_CUMSUM"], LOAD_T, wu_half))))
    on_values = gdn_decays_values(p)
    h = render(template(TEMPLATES, "chunk_fwd_h"), {
        "OP": p.kind, "STATE_OFFSETS": state_offsets,
        "CHUNK_DECAY": GDN_CHUNK_DECAY_ON_VALUES if on_values else fwd["CHUNK_DECAY"],
        "ON_STATE_LOAD": state_hook, "ON_STATE_WRITE": state_hook,
        "STATE_READ_RHS": ops["STATE_READ_RHS"], "STATE_UPDATE_OPERANDS": ops["STATE_UPDATE_OPERANDS"],
        "STATE_READ_DOT": dots["STATE_READ_DOT"],
        "STATE_UPDATE_DOT": acc_dot(p, "state_update", "b_upd", "b_kd", "b_vu", "C") if on_values  # b_kd: K^T
        else dots["STATE_UPDATE_DOT"]}, where="chunk_fwd_h")
    o = render(template(TEMPLATES, "chunk_fwd_o"), {
        "OP": p.kind, "PROGRAM": program, "QUERY_DECAY": fwd["QUERY_DECAY"],
        "OUTPUT_STATE_OPERANDS": ops["OUTPUT_STATE_OPERANDS"], "OUTPUT_VALUE_OPERANDS": ops["OUTPUT_VALUE_OPERANDS"],
        "OUTPUT_STATE_DOT": dots["OUTPUT_STATE_DOT"], "OUTPUT_VALUE_DOT": dots["OUTPUT_VALUE_DOT"],
        "FWD_O_AMAX": ops["FWD_O_AMAX"]}, where="chunk_fwd_o")
    kernels = [intra, h, o, intra_wu]
    if kda_pairs_kernel(p):
        kernels[:0] = _kda_pairs_kernels(p, program)
    title = f"Chunked (WY) {p.kind.upper()} forward kernels: " + (
        "cumsum, pairs, intra, h, o." if kda_pairs_kernel(p) else "intra, h, o.")
    return module_source(title, dataclasses.asdict(p), [QDQ_IMPORT, ACC_HELPERS, GEMM_HELPER, *kernels])


def chunk_fwd_module(p: ChunkParams) -> ModuleType:
    """The loaded module with ``chunk_<kind>_fwd_kernel_{intra,h,o,wu}``."""
    return _module("fwd", p)


# ---- backward --------------------------------------------------------------------------------
KEY_SIDE_OPERAND_SITES = ("state_read.rhs", "output_state.rhs", "wy_key.rhs")  # rounded over all key rows


def bwd_intra_by_key_blocks(p: ChunkParams) -> bool:
    """The backward intra stage runs its key-side gradients key block by key block: when the pair products'
    gradients are separable by key column (KDA: in their own kernel, ``kda_splits_pair_grads``; GDN: a
    second key loop, ``gdn_pair_grads_by_key_blocks``) and no operand it rounds spans all key rows (h_n's
    columns for state_read / output_state, NVFP4 or row scales over K)."""
    separable = kda_splits_pair_grads(p) or gdn_pair_grads_by_key_blocks(p)
    return separable and not any(site in KEY_SIDE_OPERAND_SITES for site, _ in p.operands)


def gdn_pair_grads_by_key_blocks(p: ChunkParams) -> bool:
    """GDN with exact pair products and the exact solve: P, P_qk are recomputed over key blocks once dA is
    known, and their gradients added to each key block's shares in a second key loop."""
    return p.kind == "gdn" and p.solve == "exact" and not any(
        site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)


def kda_splits_pair_grads(p: ChunkParams) -> bool:
    """KDA with the exact solve: the pair products' gradients run in a second kernel by sub-chunk (exact
    pair products also by key blocks), so that no program holds the chunk's full-width tiles through the
    pair loops (at K = 128 the one-kernel form spilled 3.5 KB per thread). The Neumann solve's backward
    still takes them inside the intra kernel."""
    return p.kind == "kda" and p.solve == "exact"


WHOLE_ROW_MAX_K = 128  # head_k of stages that hold whole [C x K] key rows (GDN's bwd intra: 356 KB of smem at 256)
MAX_HEAD_K = 256  # key-blocked stages (the limit; the h / dh stages hold a [K x BV] state tile)


def max_head_k(p: ChunkParams) -> tuple[int, str]:
    """The largest head_k the chunk kernels take for ``p``, and why not more."""
    if bwd_intra_by_key_blocks(p):
        return MAX_HEAD_K, f"the chunk kernels take head_k <= {MAX_HEAD_K}"
    if p.kind == "gdn" and not gdn_pair_grads_by_key_blocks(p):
        why = "GDN's backward with a rounded pair product or the Neumann solve"
    elif p.kind == "gdn":
        why = f"GDN's backward with q.{'/'.join(KEY_SIDE_OPERAND_SITES)} rounded over all key rows"
    elif not kda_splits_pair_grads(p):
        why = "KDA's backward with the Neumann solve"
    else:
        why = f"KDA's backward with q.{'/'.join(KEY_SIDE_OPERAND_SITES)} rounded over all key rows"
    return WHOLE_ROW_MAX_K, f"{why} holds whole key rows in registers: head_k <= {WHOLE_ROW_MAX_K}"


def chunk_bwd_source(p: ChunkParams) -> str:
    fwd = GDN_FWD if p.kind == "gdn" else KDA_FWD
    split = kda_splits_pair_grads(p)
    if p.kind == "gdn":
        bwd = dict(GDN_BWD, PAIRS=gdn_pairs(p))
    elif split:  # the pair products and their gradients run in chunk_kda_bwd_kernel_pairs
        bwd = dict(KDA_BWD)
    elif kda_rounds_pairs(p):  # the Neumann solve: pair products inside the intra kernel
        bwd = dict(KDA_BWD, PAIRS=kda_pairs_rounded(p), PAIR_GRADS=kda_pair_grads_rounded(p))
    else:
        bwd = dict(KDA_BWD, PAIRS=kda_pairs(p), PAIR_GRADS=kda_pair_grads(p))
    gdn_blocks = bwd_intra_by_key_blocks(p) and p.kind == "gdn"
    ops = operand_values(p)
    state_offsets = _state_offsets(p.state)
    dh = render(template(TEMPLATES, "chunk_bwd_dh"), {
        "OP": p.kind, "STATE_OFFSETS": state_offsets, "KEY_TO_END": bwd["KEY_TO_END"],
        "QUERY_DECAY": fwd["QUERY_DECAY"], "BWD_DH_OPERANDS": ops["BWD_DH_OPERANDS"],
        "OUTPUT_STATE_LHS": ops["OUTPUT_STATE_LHS"]}, where="chunk_bwd_dh")
    # q, k, G: per key block in the key loop (split), else whole rows with the pair products, before the
    # value loop when the Neumann solve needs A there, else after it (T comes from the forward recompute)
    loads = "\n".join(["b_q = tl.load(q + r_qk, mask=m_ck, other=0).to(tl.float32)",
                       "b_k = tl.load(k + r_qk, mask=m_ck, other=0).to(tl.float32)", bwd["LOAD_G"]])
    pairs = "" if split or gdn_blocks else "\n".join(
        [loads, bwd["PAIRS"], "b_A = tl.where(m_strict, b_P * b_beta[:, None], 0.0)"])
    before = p.solve != "exact"
    finish = lines(da_from_dt(p), HAND_OVER_PAIRS) if split else GDN_FINISH if gdn_blocks else render("\n".join([
        da_from_dt(p), "b_dbeta += tl.sum(b_dA * b_P, 1)", "b_dP = b_dA * b_beta[:, None]", "${PAIR_GRADS}", "",
        STORE_INPUT_GRADS]), {"PAIR_GRADS": bwd["PAIR_GRADS"], "STORE_DG": bwd["STORE_DG"]}, where="bwd_intra finish")
    # one key block without the split: the loop's gradients are carried out of it into the pair products' part
    dG_shape = "[C]" if p.kind == "gdn" else "[C, BK]"
    init = "" if split or gdn_blocks else "\n".join([
        "b_dq = tl.zeros([C, BK], dtype=tl.float32)", "b_dk = tl.zeros([C, BK], dtype=tl.float32)",
        f"b_dG = tl.zeros({dG_shape}, dtype=tl.float32)"])
    intra = render(template(TEMPLATES, "chunk_bwd_intra"), {
        "OP": p.kind, "PROGRAM": template(TEMPLATES, "chunk_fwd_program"), "SOLVE": load_solved(p),
        "PAIRS_BEFORE_LOOP": GDN_LOAD_G if gdn_blocks else pairs if before else "# q, k, G, P: after the value loop",
        "PAIRS_AFTER_LOOP": gdn_pair_grads_before_key_loop(p) if gdn_blocks else "" if before else pairs,
        "STATE_SIDE_DT": GDN_STATE_SIDE_DT if gdn_blocks else "",
        "DT_FROM_W": GDN_DT_DONE if gdn_blocks else DT_FROM_W, "FINISH": finish, "KEY_GRADS_INIT": init,
        "KEY_BLOCK_LOADS": loads if split or gdn_blocks else "# q, k, G: the whole rows loaded with the pair products",
        "KEY_BLOCK_DONE": HAND_OVER_SHARES if split else GDN_KEY_BLOCK_DONE if gdn_blocks else "",
        **{key: bwd[key] for key in ("EXP_G", "ROWS", "LAST_ROW_GRADS")},
        **{key: ops[key] for key in ("T_OPERANDS", "BWD_V_OPERANDS_VALUE", "BWD_V_OPERANDS_KEY", "WY_VALUE_RHS",
                                     "WY_KEY_RHS", "BWD_INTRA_AMAX")}},
        where="chunk_bwd_intra")
    kernels = [dh, intra]
    if split and kda_rounds_pairs(p):
        kernels.append(SUB_DOT_HELPER)
        kernels.append(render(template(TEMPLATES, "chunk_bwd_pairs_rounded"), {
            "OP": p.kind, "PROGRAM": template(TEMPLATES, "chunk_fwd_program"), **chunk_pair_rounding.bwd_values(p)},
            where="chunk_bwd_pairs_rounded"))
    elif split:
        kernels.append(SUB_DOT_HELPER)
        kernels.append(render(template(TEMPLATES, "chunk_bwd_pairs"), {"OP": p.kind, "PROGRAM": template(TEMPLATES, "chunk_fwd_program")},
                              where="chunk_bwd_pairs"))
    if split:
        kernels.append(render(template(TEMPLATES, "chunk_bwd_dg"), {"OP": p.kind, "PROGRAM": template(TEMPLATES, "chunk_fwd_program"),
                                                         "STORE_DG": bwd["STORE_DG"]}, where="chunk_bwd_dg"))
    title = f"Chunked (WY) {p.kind.upper()} backward kernels: dh (state gradient), intra (input gradients)" + (
        ", pairs (the pair products' share, by sub-chunk and key block), dg (reverse cumsum)." if split else ".")
    return module_source(title, dataclasses.asdict(p), [QDQ_IMPORT, ACC_HELPERS, GEMM_HELPER, ROW_SUM_HELPER, *kernels])


def chunk_bwd_module(p: ChunkParams) -> ModuleType:
    """The loaded module with ``chunk_<kind>_bwd_kernel_{dh,intra}``."""
    return _module("bwd", p)


# Generating and hashing the source takes ~1 ms of host time: once per process and params.
@functools.lru_cache(maxsize=None)
def _module(direction: str, p: ChunkParams) -> ModuleType:
    source = chunk_fwd_source(p) if direction == "fwd" else chunk_bwd_source(p)
    params = {"family": f"chunk_{direction}", **dataclasses.asdict(p)}
    return cache.load_source(f"chunk_{p.kind}_{direction}", source, params)
