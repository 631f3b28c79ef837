"""Which form each chunk stage takes for a spec: the decisions the launchers and the kernels' constexprs share.

Each predicate says where a spec's numerics change the structure of a stage (which kernel runs, whether a
stage holds whole key rows, whether a product runs on grid values); ``stage_forms`` gives them to the kernels
as constexprs (``chunk/flags.py``). docs/kernels-chunk.md explains each form and its measurements.
"""
from __future__ import annotations

from la_compiler.kernels.chunk.params import ChunkParams

PAIRWISE_SITES = ("key_interaction", "output_score")  # KDA: the decay sits inside these products' reduction
KEY_SIDE_OPERAND_SITES = ("state_read.rhs", "output_state.rhs", "wy_key.rhs")  # rounded over all key rows
ROW_FORMATS = ("fp8_e4m3", "int8")  # the per-row formats whose grid values a product can run on
SOLVE_BLOCK = 16  # rows of the diagonal blocks of the blocked exact solve

# KDA's exact pair kernels take a diagonal sub-chunk block through its first real row f (tensor-core dots,
# like the blocks off the diagonal) when every |G_i - G_f| in it is at most this: the factors
# exp(G_i - G_f), exp(G_f - G_j) then lie within e^(+-40) (1e+-17), far inside fp32's (and TF32's) normal
# range, and their product keeps fp32's relative precision. A block with a steeper decay runs row by row
# (every exponent G_i - G_j <= 0). docs/kernels-chunk.md, "The diagonal blocks".
DIAG_DOT_MAX_RANGE = 40.0

# head_k of stages that hold whole [C x K] key rows (their shared memory at 256: docs/kernels-chunk-measurements.md,
# "Key blocks")
WHOLE_ROW_MAX_K = 128
MAX_HEAD_K = 256  # key-blocked stages (the h / dh stages hold a [K x BV] state tile)


def site_format(p: ChunkParams, site: str) -> str | None:
    """The format name of a GEMM operand site ("fp8_e4m3", "int8", "nvfp4"), None when it is off."""
    return p.formats.operand_format(site)


def nvfp4_site(p: ChunkParams, site: str) -> bool:
    return site_format(p, site) == "nvfp4"


def has_nvfp4_operands(p: ChunkParams) -> bool:
    """A GEMM operand site rounds to NVFP4 (the launch table keeps eight warps in the h, o and dh stages)."""
    return p.formats.has_nvfp4_operands()


def factored(p: ChunkParams, gemm: str) -> bool:
    """``gemm``'s product runs on grid values, its operands' row scales applied to the result
    (docs/kernels-chunk.md, "Rounded operands in 16-bit GEMMs"): both sides rounded per row to FP8 / INT8, no
    accumulator emulation (which rounds running sums of the scaled product). Against products of the dequantized
    operands: docs/kernels-chunk-measurements.md, "Factored scales"."""
    return (site_format(p, f"{gemm}.lhs") in ROW_FORMATS and site_format(p, f"{gemm}.rhs") in ROW_FORMATS
            and gemm not in p.formats.accumulators)


def gdn_decays_values(p: ChunkParams) -> bool:
    """GDN's h stage applies the chunk decay to V_new: no state_update operand rounded, no accumulator
    emulated there (K^T is then loaded as a [BK x C] tile, as FLA's h kernel does)."""
    return p.kind == "gdn" and not any(site.split(".")[0] == "state_update" for site, _ in p.operands + p.acc)


def kda_rounds_pairs(p: ChunkParams) -> bool:
    """KDA pair products with rounding (operand QDQ or accumulator emulation): the column-by-column path."""
    return any(site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)


def pairs_need_all_keys(p: ChunkParams) -> bool:
    """The forward intra stage must see all key columns in one block: GDN's rounded or accumulator-emulated
    pair product (row scales over K, NVFP4 global amax, reduction blocks rounded in order; KDA's come from
    chunk_fwd_kernel_pairs) or an NVFP4 wy_key.rhs (global amax over the chunk's [C x K] operand)."""
    rounded = p.kind == "gdn" and any(site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)
    return rounded or nvfp4_site(p, "wy_key.rhs")


def solve_form(p: ChunkParams) -> str:
    """"blocked" where the chunk splits into 16-row blocks, else "rows" (row-by-row forward substitution); both
    compute T = (I + A)^-1 exactly; the blocked solve is the faster (docs/kernels-chunk-measurements.md, "Solve
    forms")."""
    blockable = p.chunk % SOLVE_BLOCK == 0 and p.chunk > SOLVE_BLOCK
    return "blocked" if blockable else "rows"


def kda_pairs_kernel(p: ChunkParams) -> bool:
    """KDA's pair products run in their own forward kernel (chunk_fwd_kernel_pairs, one program per
    sub-chunk like FLA's): exact ones by key blocks and tensor-core dots, rounded ones (operand QDQ or
    accumulator emulation at key_interaction / output_score) column by column over whole key rows."""
    return p.kind == "kda"


def fwd_intra_form(p: ChunkParams) -> str:
    """The forward intra stage's kernel: "kda" (its pair products from the pairs kernel, ``kda_pairs_kernel``) or
    "gdn" (G and the pair products in the kernel)."""
    return "kda" if kda_pairs_kernel(p) else "gdn"


def kda_pairs_nvfp4(p: ChunkParams) -> bool:
    """NVFP4 at a pairwise site: its global amax spans the chunk (chunk_fwd_kernel_pair_amax first)."""
    return any(nvfp4_site(p, f"{site}.{side}") for site in PAIRWISE_SITES for side in ("lhs", "rhs"))


def column_side_by_products(p: ChunkParams) -> bool:
    """The backward's column side takes the blocks after the sub-chunk as products unless an lhs row is
    NVFP4-rounded: its [BC x K] block QDQ makes the kernel slower there (docs/kernels-chunk-measurements.md,
    "Rounded pair products")."""
    return not any(nvfp4_site(p, f"{site}.lhs") for site in PAIRWISE_SITES)


def shares_pair_rhs(p: ChunkParams) -> bool:
    """key_interaction.rhs and output_score.rhs round the same rows k_j e^(G_i - G_j) (i > j; they differ
    only on the diagonal) in the same per-row format: one QDQ serves both. P's diagonal, where they
    differ, is never read (A is strictly lower; dP is masked to i > j). NVFP4's global amaxes differ
    (the causal tile holds the diagonal), so NVFP4 rounds twice."""
    lhs, rhs = p.formats.operands.get("key_interaction.rhs"), p.formats.operands.get("output_score.rhs")
    return lhs == rhs and (lhs is None or lhs.format != "nvfp4")


def kda_splits_pair_grads(p: ChunkParams) -> bool:
    """KDA with the exact solve: the pair products' gradients run in a second kernel by sub-chunk (exact
    pair products also by key blocks), so that no program holds the chunk's full-width tiles through the
    pair loops (at K = 128 the one-kernel form spills: docs/kernels-chunk-measurements.md, "KDA pair products").
    The Neumann solve's backward takes them inside the intra kernel."""
    return p.kind == "kda" and p.solve == "exact"


def gdn_pair_grads_by_key_blocks(p: ChunkParams) -> bool:
    """GDN with exact pair products and the exact solve: P, P_qk are recomputed over key blocks once dA is
    known, and their gradients added to each key block's shares in a second key loop."""
    return p.kind == "gdn" and p.solve == "exact" and not any(
        site.split(".")[0] in PAIRWISE_SITES for site, _ in p.operands + p.acc)


def bwd_intra_by_key_blocks(p: ChunkParams) -> bool:
    """The backward intra stage runs its key-side gradients key block by key block: when the pair products'
    gradients are separable by key column (KDA: in their own kernel, ``kda_splits_pair_grads``; GDN: a
    second key loop, ``gdn_pair_grads_by_key_blocks``) and no operand it rounds spans all key rows (h_n's
    columns for state_read / output_state, NVFP4 or row scales over K)."""
    separable = kda_splits_pair_grads(p) or gdn_pair_grads_by_key_blocks(p)
    return separable and not any(site in KEY_SIDE_OPERAND_SITES for site, _ in p.operands)


def bwd_intra_form(p: ChunkParams) -> str:
    """The backward intra stage's kernel: "split_pairs" (KDA, ``kda_splits_pair_grads``), "key_blocks" (GDN,
    ``bwd_intra_by_key_blocks``) or "rows" (whole key rows, the pair products' gradients in the kernel)."""
    if kda_splits_pair_grads(p):
        return "split_pairs"
    return "key_blocks" if bwd_intra_by_key_blocks(p) else "rows"


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


def stage_forms(p: ChunkParams) -> dict:
    """The forms above as the kernels' constexprs (``chunk/flags.py``)."""
    return {
        "FACTORED_WY": factored(p, "wy_key") and factored(p, "wy_value"),
        "FACTORED_PAIRS": factored(p, "key_interaction") and factored(p, "output_score"),
        "FACTORED_STATE_UPDATE": factored(p, "state_update"),
        "FACTORED_OUTPUT_STATE": factored(p, "output_state"),
        "FACTORED_OUTPUT_VALUE": factored(p, "output_value"),
        "GDN_DECAYS_VALUES": gdn_decays_values(p),
        "PAIRS_ROUNDED": kda_rounds_pairs(p),
        "PAIRS_NVFP4": kda_pairs_nvfp4(p),
        "COLUMN_SIDE_BY_PRODUCTS": column_side_by_products(p),
        "SHARES_PAIR_RHS": shares_pair_rhs(p),
        "H_FULL_V": p.h_full_v,
    }
