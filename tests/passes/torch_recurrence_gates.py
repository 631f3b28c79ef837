"""The gate and beta pre-processing of the GDN/KDA variants FLA supports, as the transformers
5.24 models spell them, around the recurrences of ``torch_recurrence_spellings.py``.

Each function takes raw pre-activations: q, k [B, T, H, K], v [B, T, HV, V], ``g`` the gate
input ([B, T, HV] for GDN, [B, T, HV, K] for KDA), ``beta`` the beta logits [B, T, HV], and an
initial state; it computes the gate and beta as the model does and calls the recurrence.
"""
import torch
import torch.nn.functional as F

from tests.passes import torch_recurrence_spellings as spellings

LOWER_BOUND = -5.0  # FLA's and the models' default lower bound of the safe gate


def gdn_gate(a, A_log=0.4, dt_bias=0.2):
    """OLMo-Hybrid / Qwen3-Next: g = -exp(A_log) * softplus(a + dt_bias) (outside the region:
    softplus is no rule)."""
    return -torch.exp(torch.tensor(A_log)) * F.softplus(a + dt_bias)


def safe_gate(x, A_log=0.3):
    """Bailing-hybrid ``kda_safe_gate`` / GLM5-next ``linear_lower_bound`` (FLA ``safe_gate``,
    ``lower_bound``): g = lower_bound * sigmoid(exp(A_log) * x), in [lower_bound, 0]."""
    decay_rate = torch.exp(torch.tensor(A_log))
    return LOWER_BOUND * torch.sigmoid(decay_rate * x)


def olmo_neg_eigval_chunked(q, k, v, g, beta, h0=None):
    """OLMo-Hybrid ``linear_allow_neg_eigval=True``: beta = 2 sigmoid(b) in [0, 2]."""
    beta = beta.sigmoid() * 2.0
    return spellings.gdn_chunked_solve(q, k, v, gdn_gate(g), beta, h0)


def olmo_neg_eigval_token(q, k, v, g, beta, h0=None):
    beta = 2.0 * torch.sigmoid(beta)
    return spellings.gdn_unbind_cat(q, k, v, gdn_gate(g), beta, h0)


def safe_gate_fla_chunk_kda(q, k, v, g, beta, h0=None):
    from fla.ops.kda.naive import naive_chunk_kda
    return naive_chunk_kda(q, k, v, safe_gate(g), beta.sigmoid(), initial_state=h0, output_final_state=True,
                           chunk_size=4)


def safe_gate_bf16_fla_chunk_kda(q, k, v, g, beta, h0=None):
    """The lower-bound gate rounded to bf16 before the call (Bailing-hybrid's ``gate.to(dtype)``
    in a bf16 model); the function casts it back to fp32: the IR node gets the same rounded gate."""
    from fla.ops.kda.naive import naive_chunk_kda
    return naive_chunk_kda(q, k, v, safe_gate(g).bfloat16(), beta.sigmoid(), initial_state=h0,
                           output_final_state=True, chunk_size=4)


def safe_gate_token_kda(q, k, v, g, beta, h0=None):
    gate = safe_gate(g).to(q.dtype)  # Bailing: gate.to(hidden_states.dtype)
    return spellings.kda_bhtd_setitem_bmm(q, k, v, gate, torch.sigmoid(beta), h0)


def scaled_values_with_state(q, k, v, g, beta, h0=None):
    """v scaled by a constant before the loop, with an initial state: not a query scale (the state
    does not scale with it), so it must be replayed on v."""
    return spellings.gdn_unbind_cat(q, k, v * 0.5, g, beta, h0)


def scale_after_pad(q, k, v, g, beta, h0=None):
    """beta scaled after F.pad, inside the chunked function (an entry chain at the padded length)."""
    return spellings.gdn_chunked_solve(q, k, v, g, beta.sigmoid(), h0, beta_scale=2.0)


def half_scaled_beta(q, k, v, g, beta, h0=None):
    """beta scaled for the key update but not for the value: no single beta (not the delta rule)."""
    beta = beta.sigmoid()
    K = q.shape[-1]
    S = h0
    outs = []
    for t in range(q.shape[1]):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        S = g[:, t].exp()[..., None, None] * S
        u = (bt * 2.0)[..., None] * vt - bt[..., None] * (S * kt[..., None]).sum(-2)
        S = S + kt[..., None] * u[..., None, :]
        outs.append(((S * q[:, t][..., None]).sum(-2) * K ** -0.5))
    return torch.stack(outs, 1), S


def neg_eigval_in_the_loop(q, k, v, g, beta, h0=None):
    """beta doubled inside the loop, one step's slice at a time (``b_t = 2 * beta[:, t]``)."""
    beta = beta.sigmoid()
    K = q.shape[-1]
    S = h0
    outs = []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], 2.0 * beta[:, t]
        S = g[:, t].exp()[..., None, None] * S
        u = bt[..., None] * (v[:, t] - (S * kt[..., None]).sum(-2))
        S = S + kt[..., None] * u[..., None, :]
        outs.append((S * q[:, t][..., None]).sum(-2) * K ** -0.5)
    return torch.stack(outs, 1), S
