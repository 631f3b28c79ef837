"""One exception family, unwrapped: every error the FLA frontend raises while Dynamo traces, and every input error of
the laqat ops' fake implementations, reaches the user as itself (a subclass of ``la_compiler.LaqatError``, not
Dynamo's ``InternalTorchDynamoError`` / ``TorchRuntimeError`` / ``BackendCompilerFailed``), naming the argument.

``SITES`` has one case per raise site of passes/frontends/fla/substitutions.py (a ``_refuse`` call);
``test_every_raise_site_has_a_case`` reads the sites from the source, so a new one needs a case here. The Megatron
frontend raises nothing itself (it routes Megatron's GatedDeltaNet to FLA's functions and the torch frontend).
Each case compiles once, with the eager hand-off (the errors arise while Dynamo traces, before any hand-off); a
few run with Inductor too, and the ops' fake implementations with both, with and without ``fullgraph``.
"""
import ast
import inspect

import pytest
import torch

pytest.importorskip("fla")

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402,F401  (installs the FLA substitutions)
from la_compiler.ir.checks import IRInputError  # noqa: E402
from la_compiler.passes.frontends.fla import substitutions as fla_frontend  # noqa: E402
from la_compiler.passes.frontends.fla.substitutions import UnsupportedArgumentError  # noqa: E402

B, T, H, K, V = 1, 8, 2, 4, 4


def _qkv(B=B, H=H, HV=H, kind="gdn", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = -0.1 * torch.rand((B, T, HV) if kind == "gdn" else (B, T, HV, K), generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def _gdn_chunk(**kw):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    shape = kw.pop("_shape", {})
    q, k, v, g, beta = _qkv(**shape)
    for name, f in kw.pop("_edit", {}).items():
        q, k, v, g, beta = f(q, k, v, g, beta)
    return lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def _gdn_recurrent(**kw):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    q, k, v, g, beta = _qkv()
    g = kw.pop("_g", g)
    return lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)


def _kda(op, **kw):
    import fla.ops.kda as kda_ops
    q, k, v, g, beta = _qkv(kind="kda")
    g = kw.pop("_g", g)
    return lambda: getattr(kda_ops, op)(q, k, v, g, beta, **kw)


def _conv(**kw):
    from fla.modules.causal_conv1d import causal_conv1d
    x, w = torch.randn(1, 5, 4), torch.randn(4, 3)
    w = kw.pop("_weight", w)
    return lambda: causal_conv1d(x, w, **kw)


def _norm_gated(**kw):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    x = torch.randn(1, 5, 4)
    g = kw.pop("_g", x)
    return lambda: rms_norm_gated(x, g, None, None, **kw)


def _norm(**kw):
    from fla.modules.norm.layernorm import rms_norm
    x = torch.randn(1, 5, 4)
    return lambda: rms_norm(x, None, None, **kw)


def _ce(logits=(6, 10), target=(6,)):
    from fla.modules.fused_cross_entropy import cross_entropy_loss
    lg, tg = torch.randn(*logits), torch.randint(0, 10, target)
    return lambda: cross_entropy_loss(lg, tg)


def _flce(x=(6, 4), target=(6,), weight=(10, 4), bias=None, wdtype=torch.float32, **kw):
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss
    xx, tg, w = torch.randn(*x), torch.randint(0, 10, target), torch.randn(*weight, dtype=wdtype)
    b = torch.randn(*bias) if bias is not None else None
    return lambda: fused_linear_cross_entropy_loss(xx, tg, w, b, **kw)


# id -> (enclosing function of the raise site in fla.py, a fixed fragment of its message, the call)
SITES = {
    "state_layout_twice": ("_pop_state_v_first", "not both",
                           lambda: _gdn_chunk(state_v_first=True, transpose_state_layout=True)),
    "unknown_keyword": ("_refuse_unknown", "is not supported by laqat (FLA would ignore or reject it)",
                        lambda: _gdn_chunk(head_first=False)),
    "cp_context": ("_refuse_set", "is not supported by laqat (got a non-default value)",
                   lambda: _gdn_chunk(cp_context=1)),
    "rank3_q": ("_check_heads", "q and k must both be [B, T, H, K]",
                lambda: _gdn_chunk(_edit={"q": lambda q, k, v, g, b: (q[0], k, v, g, b)})),
    "rank3_v": ("_check_heads", "v must be [B, T, HV, V]",
                lambda: _gdn_chunk(_edit={"v": lambda q, k, v, g, b: (q, k, v[0], g, b)})),
    "heads_not_a_multiple": ("_check_heads", "must be divisible by num_heads", lambda: _gdn_chunk(_shape={"HV": 3})),
    "cu_seqlens_batch_2": ("_check_varlen", "the batch size must be 1",
                           lambda: _gdn_chunk(_shape={"B": 2}, cu_seqlens=torch.tensor([0, 4, 8]))),
    "states_per_sequence": ("_check_varlen", "one state per sequence",
                            lambda: _gdn_chunk(cu_seqlens=torch.tensor([0, 4, 8]),
                                               initial_state=torch.zeros(1, H, K, V))),
    "neg_eigval_without_sigmoid": ("_check_beta", "requires `use_beta_sigmoid_in_kernel=True`",
                                   lambda: _gdn_chunk(allow_neg_eigval=True)),
    "per_value_beta": ("_check_beta", "one beta per head",
                       lambda: _gdn_chunk(_edit={"b": lambda q, k, v, g, b: (q, k, v, g, b[..., None].expand_as(v))})),
    "float_cu_seqlens": ("_delta_rule", "(after laqat's pre-processing",
                         lambda: _gdn_chunk(cu_seqlens=torch.tensor([0.0, 8.0]))),
    "chunk_size_8": ("chunk_gated_delta_rule", "`chunk_size` must be one of",
                     lambda: _gdn_chunk(chunk_size=8)),
    "gate_without_A_log": ("chunk_gated_delta_rule", "`A_log` must be given",
                           lambda: _gdn_chunk(use_gate_in_kernel=True)),
    "kda_gate_to_gdn": ("chunk_gated_delta_rule", "argument `g` must be [B, T, HV], got",
                        lambda: _gdn_chunk(_edit={"g": lambda q, k, v, g, b: (q, k, v, g[..., None].expand(-1, -1, -1,
                                                                                                             K), b)})),
    "recurrent_gate_without_A_log": ("fused_recurrent_gated_delta_rule", "`A_log` must be given",
                                     lambda: _gdn_recurrent(use_gate_in_kernel=True)),
    "recurrent_gate_without_g": ("fused_recurrent_gated_delta_rule", "`g` (the raw gate) must be given",
                                 lambda: _gdn_recurrent(_g=None, use_gate_in_kernel=True, A_log=torch.zeros(H))),
    "recurrent_g_rank4": ("fused_recurrent_gated_delta_rule", "argument `g` must be [B, T, HV], got",
                          lambda: _gdn_recurrent(_g=torch.zeros(B, T, H, K))),
    "recurrent_gk_rank3": ("fused_recurrent_gated_delta_rule", "argument `gk` must be [B, T, HV, K]",
                           lambda: _gdn_recurrent(gk=torch.zeros(B, T, H))),
    "kda_gate_without_A_log": ("_kda_gate", "unless `lower_bound` is set",
                               lambda: _kda("chunk_kda", use_gate_in_kernel=True)),
    "kda_chunk_size_16": ("chunk_kda", "`chunk_size` must be one of",
                          lambda: _kda("chunk_kda", chunk_size=16)),
    "kda_bf16_state": ("chunk_kda", "must be float32",
                       lambda: _kda("chunk_kda", initial_state=torch.zeros(B, H, K, V, dtype=torch.bfloat16))),
    "kda_gdn_gate": ("chunk_kda", "argument `g` must be [B, T, HV, K], got",
                     lambda: _kda("chunk_kda", _g=torch.zeros(B, T, H))),
    "kda_safe_gate_bound": ("chunk_kda", "needs `lower_bound` in [-5, 0)",
                            lambda: _kda("chunk_kda", safe_gate=True, use_gate_in_kernel=True, lower_bound=-6.0,
                                         A_log=torch.zeros(H))),
    "recurrent_kda_gdn_gate": ("fused_recurrent_kda", "argument `g` must be [B, T, HV, K], got",
                               lambda: _kda("fused_recurrent_kda", _g=torch.zeros(B, T, H))),
    "conv_without_weight": ("causal_conv1d", "argument `weight` is required by laqat", lambda: _conv(_weight=None)),
    "conv_activation": ("causal_conv1d", "argument `activation` must be one of", lambda: _conv(activation="relu")),
    "conv_backend": ("causal_conv1d", "unsupported `backend`", lambda: _conv(backend="tilelang")),
    "norm_gated_activation": ("_norm_gated", "argument `activation` must be one of",
                              lambda: _norm_gated(activation="relu")),
    "norm_gated_g_shape": ("_norm_gated", "argument `g` must have x's shape",
                           lambda: _norm_gated(_g=torch.randn(1, 5, 2))),
    "norm_gated_residual": ("_norm_gated", "argument `residual` must have x's shape",
                            lambda: _norm_gated(residual=torch.randn(1, 5, 2))),
    "norm_residual": ("_norm", "argument `residual` must have x's shape", lambda: _norm(residual=torch.randn(1, 5, 2))),
    "ce_logits_rank3": ("_check_logits", "`logits` must be [N, V]", lambda: _ce(logits=(1, 6, 10))),
    "ce_target_shape": ("_check_logits", "`target` must be [N] = ", lambda: _ce(target=(4,))),
    "flce_reduction": ("fused_linear_cross_entropy_loss", "argument `reduction` must be one of",
                       lambda: _flce(reduction="none")),
    "flce_x_rank3": ("fused_linear_cross_entropy_loss", "`x` must be [N, H]", lambda: _flce(x=(1, 6, 4))),
    "flce_target_shape": ("fused_linear_cross_entropy_loss", "`target` must be [N] = ", lambda: _flce(target=(4,))),
    "flce_weight_shape": ("fused_linear_cross_entropy_loss", "`weight` must be [V, H=", lambda: _flce(weight=(10, 3))),
    "flce_bias_shape": ("fused_linear_cross_entropy_loss", "`bias` must be [V]", lambda: _flce(bias=(3,))),
    "flce_weight_dtype": ("fused_linear_cross_entropy_loss", "must have x's dtype",
                          lambda: _flce(wdtype=torch.bfloat16)),
    "flce_num_chunks": ("fused_linear_cross_entropy_loss", "`num_chunks` must be >= 1", lambda: _flce(num_chunks=0)),
}
INDUCTOR = ("chunk_size_8", "float_cu_seqlens", "flce_reduction")  # the Inductor hand-off too (a sample)


def _compile_and_call(call, compiler, fullgraph=True):
    torch._dynamo.reset()
    torch.compile(call, backend="laqat", fullgraph=fullgraph, options={"compiler": compiler})()


@pytest.mark.parametrize("case", sorted(SITES))
def test_fla_frontend_error_reaches_the_user_as_itself(case):
    _, fragment, make = SITES[case]
    for compiler in ("eager", "inductor") if case in INDUCTOR else ("eager",):
        with pytest.raises(la_compiler.LaqatError) as info:
            _compile_and_call(make(), compiler)
        assert isinstance(info.value, UnsupportedArgumentError), type(info.value).__mro__
        assert fragment in str(info.value), str(info.value)  # the fragments name the argument


def _raise_sites():
    """(enclosing function, message) of every ``_refuse`` call in substitutions.py."""
    tree = ast.parse(inspect.getsource(fla_frontend))
    sites = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name != "_refuse":
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_refuse":
                    sites.append((fn.name, ast.unparse(node.args[-1])))
    return sites


def test_every_raise_site_has_a_case():
    """Each raise site is walked by a case: one naming the site's function with a fragment of the site's message
    text (which the error's message contains: the case asserts it)."""
    missing = [(function, message) for function, message in _raise_sites()
               if not any(f == function and fragment in message for f, fragment, _ in SITES.values())]
    assert missing == [], missing


# ---- the ops' fake implementations, called directly ---------------------------------------------
SPEC = "gdn[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=auto]"
OP_INPUTS = {  # name -> (what to change, fragment of the message)
    "rank3_q": ("q", "q must have 4 dims"),
    "float_cu_seqlens": ("cu", "cu_seqlens must be int32 or int64 offsets"),
    "int64_initial_state": ("h0", "initial_state must be a floating tensor, got torch.int64"),
}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("case", sorted(OP_INPUTS))
def test_op_input_error_reaches_the_user_as_itself(case, fullgraph, compiler):
    """Raised inside Dynamo's fake propagation of a direct ``torch.ops.laqat.delta_rule`` call: with fullgraph
    Dynamo re-raises it, without it the call runs as it is and raises the same error."""
    q, k, v, g, beta = _qkv()
    h0, cu = None, None
    what, fragment = OP_INPUTS[case]
    if what == "q":
        q = q[0]
    elif what == "cu":
        cu = torch.tensor([0.0, 8.0])
    else:
        h0 = torch.zeros(B, H, K, V, dtype=torch.int64)
    with pytest.raises(IRInputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _compile_and_call(lambda: torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, cu, 0.5, SPEC), compiler,
                          fullgraph)


def test_laqat_errors_share_one_base():
    from la_compiler.backend import BackendOptionsError
    from la_compiler.hand_off.ddp_buckets import RecurrenceSplitError
    from la_compiler.passes.verify import IRVerificationError
    for cls in (UnsupportedArgumentError, IRInputError, BackendOptionsError, RecurrenceSplitError,
                IRVerificationError):
        assert issubclass(cls, la_compiler.LaqatError), cls
    # a backend error of a class outside the family still arrives as a LaqatError (through_dynamo)
    with pytest.raises(la_compiler.LaqatError):
        torch.compile(lambda x: x + 1, backend="laqat", options={"policy": "no_such_recipe"})(torch.ones(2))
