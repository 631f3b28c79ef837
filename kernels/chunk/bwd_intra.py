"""The backward intra stage: every input gradient of one chunk (dq, dk, dv, dbeta, dg), one program per chunk x
value head, from the stored chunk-start state h_n (rounded), the state gradient dh = dS_n+1 and dV_new, with A and
T recomputed (docs/kernels-chunk.md, "What the backward recomputes and what it keeps"). Its device functions,
shared by the stage's three kernels, one per form (forms.bwd_intra_form):

* ``split_pairs`` (bwd_intra_split_pairs.py; KDA with the exact solve): the key-side gradients key block by key
  block; dP, dP_qk and its fp32 shares of dq, dk, dG go to chunk_bwd_kernel_pairs;
* ``key_blocks`` (bwd_intra_key_blocks.py; GDN with exact pair products and the exact solve): dT, hence dA and
  the pair products' gradients, complete before its key loop, whose blocks then store their final dq, dk;
* ``rows`` (bwd_intra_rows.py; every other spec): whole key rows (BK >= K, one key block), the pair products and
  their gradients (row_pairs.py) before the value loop where the Neumann solve needs A, else after it.

Two passes over the value blocks: the first for what reduces over V alone (``value_block_grads``: dA_qk, dT from
U, dv), the second once per key block for the key-side gradients (``key_block_value_sums``, then the block's
gradients through output_state, W and the state update). QDQ sites pass gradients straight through.
"""
import triton
import triton.language as tl

from la_compiler.kernels.chunk.device import gemm, qdq_operand, row_sum, tile_amax


# ---- decays of the two kinds -----------------------------------------------------------------------------------
@triton.jit
def load_g_cumsum(g, r_hv, o_k, m_c, m_ck, K: tl.constexpr, KDA: tl.constexpr):
    """G = cumsum(g) over the chunk: [C] (GDN, one decay per row) or the key block's [C x BK] (KDA)."""
    if KDA:
        return tl.cumsum(tl.load(g + r_hv[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32), 0)
    else:
        return tl.cumsum(tl.load(g + r_hv, mask=m_c, other=0).to(tl.float32), 0)


@triton.jit
def exp_g(b_G, KDA: tl.constexpr):
    """exp(G) as a factor of a [C x BK] tile."""
    if KDA:
        return tl.exp(b_G)
    else:
        return tl.exp(b_G)[:, None]


@triton.jit
def key_rows(x, KDA: tl.constexpr):
    """dG's share of a [C x BK] tile: per key channel (KDA), or summed over the row (GDN's one decay per row)."""
    if KDA:
        return x
    else:
        return row_sum(x)


@triton.jit
def gdn_pairs_decay(b_P, b_Pqk, b_G, m_causal):
    """Γ_ij = exp(G_i - G_j) on the summed products: (P ⊙ Γ, P_qk ⊙ Γ, Γ)."""
    b_Gam = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0))
    b_P = b_P * b_Gam
    b_Pqk = b_Pqk * b_Gam
    return b_P, b_Pqk, b_Gam


# ---- the solve -------------------------------------------------------------------------------------------------
@triton.jit
def neumann_solve(b_A, C: tl.constexpr, DEGREE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Neumann polynomial of degree DEGREE: T = sum_{i<=DEGREE} (-A)^i (Horner)
    o_c = tl.arange(0, C)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_T = b_I
    for _ in tl.static_range(DEGREE):
        b_T = b_I - tl.dot(b_A, b_T, input_precision=DOT_PRECISION)
    return b_T


@triton.jit
def exact_solve_grad(b_T, b_dT, DOT_PRECISION: tl.constexpr):
    # T = (I + A)^-1: dA = -T^T dT T^T
    return -tl.dot(tl.trans(b_T), tl.dot(b_dT, tl.trans(b_T), input_precision=DOT_PRECISION),
                   input_precision=DOT_PRECISION)


@triton.jit
def neumann_solve_grad(b_A, b_dT, C: tl.constexpr, DEGREE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Horner T_m+1 = I - A T_m (m < DEGREE) differentiated step by step; T_m recomputed
    o_c = tl.arange(0, C)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    b_dTm = b_dT
    for i_r in range(0, DEGREE):
        b_Tm = b_I
        for _ in range(0, DEGREE - 1 - i_r):
            b_Tm = b_I - tl.dot(b_A, b_Tm, input_precision=DOT_PRECISION)
        b_dA -= tl.dot(b_dTm, tl.trans(b_Tm), input_precision=DOT_PRECISION)
        b_dTm = -tl.dot(tl.trans(b_A), b_dTm, input_precision=DOT_PRECISION)
    return b_dA


@triton.jit
def load_solved_t(t_solved, r_hv, o_c, m_c, C: tl.constexpr):
    """T stored by the forward recompute (chunk_fwd STORE_T; rows past the sequence end are the identity's, as a
    solve of their zero rows gives)."""
    b_T = tl.load(t_solved + r_hv[:, None] * C + o_c[None, :], mask=m_c[:, None], other=0).to(tl.float32)
    return tl.where(m_c[:, None], b_T, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0))


@triton.jit
def refined_t(b_T, b_A, REFINE_T: tl.constexpr):
    """T for the solve's gradient: with REFINE_T (T kept in 16 bits, chunk/residual.py) one Newton step towards
    (I + A)^-1 from the rounded T, T + T (I - (I + A) T) = 2T - (T + T A) T, which squares its relative error
    (2^-9 -> ~2^-18, below TF32's 2^-11) for two [C x C] products in three-pass TF32 (fp32-accurate on tensor
    cores); else T unchanged. A: strict_tril(diag(beta) P) in fp32, zero in rows past the sequence end (whose T
    rows are the identity's)."""
    if REFINE_T:
        b_TA = b_T + tl.dot(b_T, b_A, input_precision="tf32x3")
        return 2 * b_T - tl.dot(b_TA, b_T, input_precision="tf32x3")
    else:
        return b_T


@triton.jit
def wy_t_operands(b_T, C: tl.constexpr, Q_WY_KEY_LHS: tl.constexpr, Q_WY_VALUE_LHS: tl.constexpr):
    """T rounded as W's (wy_key) and U's (wy_value) left operand: (T_w, T_u)."""
    # a second site with the same format reuses the first's rounding
    b_Tw = qdq_operand(b_T, 0.0, Q_WY_KEY_LHS, 1, C, C, False)
    if Q_WY_VALUE_LHS == Q_WY_KEY_LHS:
        b_Tu = b_Tw
    else:
        b_Tu = qdq_operand(b_T, 0.0, Q_WY_VALUE_LHS, 1, C, C, False)
    return b_Tw, b_Tu


# ---- the value loops -------------------------------------------------------------------------------------------
@triton.jit
def value_operand_amaxes(v, v_new, b_beta, r_hv, m_c, V: tl.constexpr, BV: tl.constexpr,
                         Q_WY_VALUE_RHS: tl.constexpr, Q_OUTPUT_VALUE_RHS: tl.constexpr,
                         Q_STATE_UPDATE_RHS: tl.constexpr):
    """NVFP4 operands spanning every value block (the tiles see one block at a time) take their global amax
    first: (beta V's, V_new's); 0.0 where no format reads it."""
    b_gam_wv = 0.0
    b_gam_vn = 0.0
    if Q_WY_VALUE_RHS == "nvfp4":
        b_gam_wv = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(v + r_hv[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :],
                               other=0).to(tl.float32) * b_beta[:, None]
            b_gam_wv = tl.maximum(b_gam_wv, tile_amax(b_amax_x))
    if Q_OUTPUT_VALUE_RHS == "nvfp4" or Q_STATE_UPDATE_RHS == "nvfp4":
        b_gam_vn = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(v_new + r_hv[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :],
                               other=0)
            b_gam_vn = tl.maximum(b_gam_vn, tile_amax(b_amax_x))
    return b_gam_wv, b_gam_vn


@triton.jit
def state_amax(p_hn, o_k, m_k, V: tl.constexpr, BV: tl.constexpr, Q_OUTPUT_STATE_RHS: tl.constexpr,
               Q_STATE_READ_RHS: tl.constexpr):
    """NVFP4 h_n (state_read / output_state): its global amax over the key columns o_k (all of them: such a
    form holds whole key rows) and every value block; 0.0 where no format reads it."""
    b_gam_h = 0.0
    if Q_OUTPUT_STATE_RHS == "nvfp4" or Q_STATE_READ_RHS == "nvfp4":
        b_gam_h = tl.max(tl.zeros([BV], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            b_amax_x = tl.load(p_hn + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & (o_v < V)[None, :],
                               other=0)
            b_gam_h = tl.maximum(b_gam_h, tile_amax(b_amax_x))
    return b_gam_h


@triton.jit
def value_block_grads(b_dAqk, b_dT, b_dbeta, i_v, v, v_new, dv_new, do, dv, b_Tu, b_beta, b_gam_wv, b_gam_vn, r_hv,
                      m_c, C: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, GEMM_PRECISION: tl.constexpr,
                      Q_OUTPUT_VALUE_RHS: tl.constexpr, Q_WY_VALUE_RHS: tl.constexpr):
    """Value block i_v of the first value loop: its shares of dA_qk, dT (from U) and dbeta added, its dv stored.
    Returns (dA_qk, dT, dbeta, the block's columns o_v, its dV_new)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_cv = m_c[:, None] & (o_v < V)[None, :]
    r_cv = r_hv[:, None] * V + o_v[None, :]
    b_do = tl.load(do + r_cv, mask=m_cv, other=0).to(tl.float32)
    b_vn = tl.load(v_new + r_cv, mask=m_cv, other=0).to(tl.float32)
    b_dvn = tl.load(dv_new + r_cv, mask=m_cv, other=0).to(tl.float32)
    b_v = tl.load(v + r_cv, mask=m_cv, other=0).to(tl.float32)
    # the forward's rounded operands (the other side of every product; identity STE)
    b_vn_ov = qdq_operand(b_vn, b_gam_vn, Q_OUTPUT_VALUE_RHS, 0, C, BV, True)
    b_dAqk += gemm(b_do, tl.trans(b_vn_ov), GEMM_PRECISION)
    # U = T (beta V): dU = dV_new
    b_bv = b_v * b_beta[:, None]
    b_bv = qdq_operand(b_bv, b_gam_wv, Q_WY_VALUE_RHS, 0, C, BV, True)
    b_dT += gemm(b_dvn, tl.trans(b_bv), GEMM_PRECISION)
    b_dBv = gemm(tl.trans(b_Tu), b_dvn, GEMM_PRECISION)
    tl.store(dv + r_cv, (b_dBv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_cv)
    b_dbeta += tl.sum(b_dBv * b_v, 1)
    return b_dAqk, b_dT, b_dbeta, o_v, b_dvn


@triton.jit
def key_block_value_sums(p_hn, p_dhn, v_new, dv_new, do, b_gam_h, b_gam_vn, r_hv, m_c, o_k, m_k, C: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GEMM_PRECISION: tl.constexpr,
                         Q_STATE_READ_RHS: tl.constexpr, Q_OUTPUT_STATE_RHS: tl.constexpr,
                         Q_STATE_UPDATE_RHS: tl.constexpr):
    """The second value loop: key block o_k's share of everything that reduces over V, [C x BK] each but the
    last, [BK]: (dW, dQ_g (Q exp(G)'s, before the scale), dK_d (the decayed keys'), dlast (exp(G_C)'s))."""
    b_dW = tl.zeros([C, BK], dtype=tl.float32)
    b_dQg = tl.zeros([C, BK], dtype=tl.float32)
    b_dKd = tl.zeros([C, BK], dtype=tl.float32)
    b_dlast = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_c[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        r_cv = r_hv[:, None] * V + o_v[None, :]
        b_do = tl.load(do + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_vn = tl.load(v_new + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_dvn = tl.load(dv_new + r_cv, mask=m_cv, other=0).to(tl.float32)
        b_hn = tl.load(p_hn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
        b_dhn = tl.load(p_dhn + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
        # state_read and output_state round the same h_n block: one QDQ where their formats agree
        b_hn_sr = qdq_operand(b_hn, b_gam_h, Q_STATE_READ_RHS, 0, BK, BV, True)
        if Q_OUTPUT_STATE_RHS == Q_STATE_READ_RHS:
            b_hn_os = b_hn_sr
        else:
            b_hn_os = qdq_operand(b_hn, b_gam_h, Q_OUTPUT_STATE_RHS, 0, BK, BV, True)
        b_vn_su = qdq_operand(b_vn, b_gam_vn, Q_STATE_UPDATE_RHS, 0, C, BV, True)
        b_dW -= gemm(b_dvn, tl.trans(b_hn_sr), GEMM_PRECISION)
        b_dQg += gemm(b_do, tl.trans(b_hn_os), GEMM_PRECISION)
        b_dKd += gemm(b_vn_su, tl.trans(b_dhn), GEMM_PRECISION)
        b_dlast += tl.sum(b_dhn * b_hn, 1)
    return b_dW, b_dQg, b_dKd, b_dlast


# ---- one key block's gradients ---------------------------------------------------------------------------------
@triton.jit
def output_state_grads(b_q, b_G, b_dQg, scale, KDA: tl.constexpr):
    """Q exp(G) (output_state): exp(G), and the key block's dq and its first share of dG."""
    b_eG = exp_g(b_G, KDA)
    b_dq = b_eG * b_dQg * scale
    b_dG = key_rows(b_q * b_eG * b_dQg * scale, KDA)
    return b_eG, b_dq, b_dG


@triton.jit
def wy_key_operand(b_k, b_beta, b_eG, C: tl.constexpr, BK: tl.constexpr, Q_WY_KEY_RHS: tl.constexpr):
    """beta exp(G) K, rounded as W's right operand (wy_key.rhs): its product with dW is the block's share of dT."""
    return qdq_operand(b_k * (b_beta[:, None] * b_eG), 0.0, Q_WY_KEY_RHS, 0, C, BK, False)


@triton.jit
def wy_key_grads(b_dG, b_dbeta, b_k, b_beta, b_eG, b_Tw, b_dW, GEMM_PRECISION: tl.constexpr, KDA: tl.constexpr):
    """W = T (beta exp(G) K): the key block's dk, and its shares of dG and dbeta added."""
    b_dBk = gemm(tl.trans(b_Tw), b_dW, GEMM_PRECISION)
    b_dk = b_dBk * (b_beta[:, None] * b_eG)
    b_t = b_k * b_eG * b_dBk
    b_dbeta += tl.sum(b_t, 1)
    b_dG += key_rows(b_t * b_beta[:, None], KDA)
    return b_dk, b_dG, b_dbeta


@triton.jit
def state_update_grads(b_dk, b_dG, b_k, b_G, b_dKd, b_dlast, o_c, m_c, i_row_last, KDA: tl.constexpr):
    """K exp(G_C - G) and exp(G_C) (state_update): their shares of the key block's dk and dG added."""
    if KDA:
        b_glast = tl.sum(tl.where((o_c == i_row_last)[:, None], b_G, 0.0), 0)
        b_ed = tl.where(m_c[:, None], tl.exp(b_glast[None, :] - b_G), 0.0)
        b_dk += b_ed * b_dKd
        b_t = b_k * b_dKd * b_ed
        b_dG -= b_t
        b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * b_dlast
        b_dG += tl.where((o_c == i_row_last)[:, None], b_dGlast[None, :], 0.0)
    else:
        b_glast = tl.sum(tl.where(o_c == i_row_last, b_G, 0.0), 0)
        b_ed = tl.where(m_c, tl.exp(b_glast - b_G), 0.0)
        b_dk += b_ed[:, None] * b_dKd
        b_t = tl.sum(b_k * b_dKd, 1) * b_ed
        b_dG -= b_t
        b_dGlast = tl.sum(b_t, 0) + tl.exp(b_glast) * tl.sum(b_dlast, 0)
        b_dG += tl.where(o_c == i_row_last, b_dGlast, 0.0)
    return b_dk, b_dG
