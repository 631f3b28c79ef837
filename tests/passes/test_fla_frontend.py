"""The FLA frontend: FLA's GDN/KDA ops and layers compile to laqat IR nodes with FLA's numerics.

Oracles are FLA's own torch references (tests/passes/fla_oracle.py): FLA's naive recurrences,
its gate references, ``F.conv1d`` and ``rms_norm_ref``; forward and every gradient.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fla")

import la_compiler  # noqa: E402
import la_compiler.backend  # noqa: E402,F401  (installs the FLA substitutions)
from la_compiler.passes.frontends.fla import substitutions as fla_frontend  # noqa: E402
from tests.helpers import assert_close_rel  # noqa: E402
from tests.passes.fla_oracle import conv1d_oracle, naive_fla, naive_fla_call, rms_norm_gated_oracle  # noqa: E402

TOL = 1e-5


def compile_laqat(fn):
    return torch.compile(fn, backend="laqat", fullgraph=True, options={"compiler": "eager"})


def _leaves(named):
    return {name: t.detach().clone().requires_grad_(t.is_floating_point()) for name, t in named.items()}


def _compare_call(fla_fn, kind, tensors, options, *, grads=True, against_fla_kernel=False):
    """Compiles ``fla_fn(**tensors, **options)``, compares (o, final state) and every gradient with the oracle;
    ``against_fla_kernel``: also the forward with FLA's own kernel (its fused_recurrent kernels run in
    Triton's interpreter)."""
    mine, ref = _leaves(tensors), _leaves(tensors)
    o, ht = compile_laqat(lambda **t: fla_fn(**t, **options))(**mine)
    o_ref, ht_ref = naive_fla_call(kind, **ref, **options)
    if against_fla_kernel:
        with torch.no_grad():
            o_fla, ht_fla = fla_fn(**tensors, **options)
        assert_close_rel(o.detach(), o_fla, TOL, "o vs FLA's kernel")
        if options.get("output_final_state"):
            assert_close_rel(ht.detach(), ht_fla, TOL, "final_state vs FLA's kernel")
    assert o.dtype == o_ref.dtype
    assert_close_rel(o, o_ref, TOL, "o")
    if options.get("output_final_state"):
        assert ht.dtype == torch.float32
        assert_close_rel(ht, ht_ref, TOL, "final_state")
    else:
        assert ht is None
    if not grads:
        return
    w_o = torch.randn_like(o)
    w_h = torch.randn_like(ht) if ht is not None else None
    loss = (o * w_o).sum() + ((ht * w_h).sum() if ht is not None else 0)
    loss_ref = (o_ref * w_o).sum() + ((ht_ref * w_h).sum() if ht is not None else 0)
    loss.backward()
    loss_ref.backward()
    for name in tensors:
        if mine[name].is_floating_point():
            assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")


def _inputs(kind, *, B=1, T=7, H=2, HV=2, K=8, V=8, raw=True, h0=False, vk=False, N=None):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g_shape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    # raw gates and beta logits for the in-kernel activations; else a log decay and beta in (0, 1)
    g = torch.randn(g_shape) if raw else F.logsigmoid(torch.randn(g_shape))
    beta = torch.randn(B, T, HV) if raw else torch.rand(B, T, HV)
    t = dict(q=q, k=k, v=v, g=g, beta=beta)
    if h0:
        n = N or B
        t["initial_state"] = torch.randn((n, HV, V, K) if vk else (n, HV, K, V))
    return t


def _gate_params(kind, HV=2, K=8):
    return dict(A_log=torch.randn(HV), dt_bias=torch.randn(HV if kind == "gdn" else HV * K))


# ---- op level -------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["chunk", "fused_recurrent"])
def test_gdn_op_full_preprocessing(op):
    """l2norm + gate(A_log, dt_bias) + beta sigmoid in-kernel, HV > H, V-first state, h0 and final state, scale."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    fn = chunk_gated_delta_rule if op == "chunk" else fused_recurrent_gated_delta_rule
    tensors = _inputs("gdn", HV=4, h0=True, vk=True) | _gate_params("gdn", HV=4)
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   state_v_first=True, output_final_state=True, scale=0.3)
    _compare_call(fn, "gdn", tensors, options, against_fla_kernel=op == "fused_recurrent")


def test_gdn_chunk_varlen_plain_inputs():
    """Precomputed log decay and beta, cu_seqlens with one initial state per sequence, chunk_size 32."""
    from fla.ops.gated_delta_rule import chunk_gdn

    tensors = _inputs("gdn", B=1, T=11, raw=False, h0=True, N=3)
    tensors["cu_seqlens"] = torch.tensor([0, 4, 5, 11])
    _compare_call(chunk_gdn, "gdn", tensors, dict(output_final_state=True, chunk_size=32))


def test_gdn_neg_eigval_and_default_scale():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    tensors = _inputs("gdn", raw=True)
    tensors["g"] = F.logsigmoid(tensors["g"])
    options = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    _compare_call(chunk_gated_delta_rule, "gdn", tensors, options)


def test_gdn_fused_recurrent_with_gk_is_a_kda_node():
    """fused_recurrent_gated_delta_rule with a per-key-channel decay gk is a KDA recurrence."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda.naive import naive_recurrent_kda

    t = _inputs("kda", B=2, raw=False)
    report = la_compiler.explain(lambda q, k, v, g, beta: fused_recurrent_gated_delta_rule(q, k, v, gk=g, beta=beta),
                                 **t)
    assert [m.kind for m in report.matches] == ["kda"] and report.graph_breaks == 0
    o, ht = report.output
    o_ref, _ = naive_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert ht is None
    assert_close_rel(o, o_ref, TOL, "o")


@pytest.mark.parametrize("op", ["chunk", "fused_recurrent"])
def test_kda_op_full_preprocessing(op):
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    tensors = _inputs("kda", HV=4, h0=True, vk=True) | _gate_params("kda", HV=4)
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   state_v_first=True, output_final_state=True, scale=0.4)
    _compare_call(fn, "kda", tensors, options, against_fla_kernel=op == "fused_recurrent")


@pytest.mark.parametrize("op,with_A_log", [("chunk", True), ("fused_recurrent", False)])
def test_kda_lower_bound_gate_varlen(op, with_A_log):
    """Lower-bound gate (with and without A_log), allow_neg_eigval, cu_seqlens with initial states."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    tensors = _inputs("kda", B=1, T=10, h0=True, N=2) | _gate_params("kda")
    if not with_A_log:
        del tensors["A_log"]
    tensors["cu_seqlens"] = torch.tensor([0, 3, 10])
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   allow_neg_eigval=True, lower_bound=-4.0, output_final_state=True)
    if op == "chunk":
        options["safe_gate"] = True
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    _compare_call(fn, "kda", tensors, options, against_fla_kernel=op == "fused_recurrent")


# ---- the opaque conv and norm ops -------------------------------------------------------------
def test_causal_conv1d_op_matches_conv1d_and_its_gradients():
    x, w, b, r = torch.randn(2, 7, 6), torch.randn(6, 4), torch.randn(6), torch.randn(2, 7, 6)
    mine, ref = _leaves(dict(x=x, weight=w, bias=b, residual=r)), _leaves(dict(x=x, weight=w, bias=b, residual=r))
    y, fs = torch.ops.laqat.causal_conv1d(mine["x"], mine["weight"], mine["bias"], mine["residual"], None, None,
                                          "silu", False)
    y_ref, _ = conv1d_oracle(**ref, activation="silu")
    assert fs.numel() == 0
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")


def test_causal_conv1d_op_state_and_varlen():
    """A sequence split in two with the first half's final state as the second's initial state, or
    packed with cu_seqlens, gives the outputs (and final state) of the whole sequence."""
    x, w = torch.randn(1, 9, 5), torch.randn(5, 3)
    conv = torch.ops.laqat.causal_conv1d
    y_all, fs_all = conv(x, w, None, None, None, None, "silu", True)
    y_a, fs_a = conv(x[:, :4], w, None, None, None, None, "silu", True)
    y_b, fs_b = conv(x[:, 4:], w, None, None, fs_a, None, "silu", True)
    assert_close_rel(torch.cat([y_a, y_b], 1), y_all, TOL, "split y")
    assert_close_rel(fs_b, fs_all, TOL, "split final state")
    assert_close_rel(fs_all, x[0, -3:].T.unsqueeze(0), 0.0, "final state = last W inputs")
    y_packed, fs_packed = conv(x, w, None, None, None, torch.tensor([0, 4, 9]), "silu", True)
    y_b0, _ = conv(x[:, 4:], w, None, None, None, None, "silu", True)
    assert_close_rel(y_packed, torch.cat([y_a, y_b0], 1), TOL, "packed y")
    assert_close_rel(fs_packed[0], fs_a[0], TOL, "packed final state")


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_rms_norm_gated_op_matches_fla_reference(activation):
    x, g, w = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8), torch.randn(8)
    mine, ref = _leaves(dict(x=x, g=g, weight=w)), _leaves(dict(x=x, g=g, weight=w))
    y = torch.ops.laqat.layer_norm_gated(mine["x"], mine["g"], mine["weight"], None, activation, 1e-5, True)
    y_ref = rms_norm_gated_oracle(ref["x"], ref["g"], ref["weight"], None, activation=activation, eps=1e-5)
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")


def test_layer_norm_ops_without_gate():
    from fla.modules.norm.layernorm import rms_norm_ref

    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    mine, ref = _leaves(dict(x=x, weight=w, bias=b)), _leaves(dict(x=x, weight=w, bias=b))
    y = torch.ops.laqat.layer_norm(mine["x"], mine["weight"], mine["bias"], 1e-5, True)
    y_ref = rms_norm_ref(ref["x"], ref["weight"], ref["bias"], eps=1e-5, upcast=True)
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")
    assert_close_rel(torch.ops.laqat.layer_norm(x, w, b, 1e-5, False), F.layer_norm(x, (8,), w, b, eps=1e-5),
                     TOL, "layer norm")


def test_rms_norm_with_prenorm_residual_compiles_to_the_op():
    """FLA models' fused pre-norm residual add (``norm(x, residual, prenorm=True)``)."""
    from fla.modules.norm.layernorm import rms_norm, rms_norm_ref

    x, r, w = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(8)
    mine, ref = _leaves(dict(x=x, r=r, w=w)), _leaves(dict(x=x, r=r, w=w))
    y, res = compile_laqat(lambda x, r, w: rms_norm(x, w, None, residual=r, prenorm=True))(**mine)
    y_ref, res_ref = rms_norm_ref(ref["x"], ref["w"], None, residual=ref["r"], prenorm=True, upcast=True)
    assert_close_rel(y, y_ref, TOL, "y")
    assert_close_rel(res, res_ref, TOL, "residual out")
    dy, dres = torch.randn_like(y), torch.randn_like(res)
    ((y * dy).sum() + (res * dres).sum()).backward()
    ((y_ref * dy).sum() + (res_ref * dres).sum()).backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")


def test_bf16_prenorm_residual_saves_the_sum_in_the_residuals_dtype():
    """laqat::layer_norm_residual keeps x + residual in the residual's dtype (FLA's res_out), not the fp32 sum the
    norm reads; y and every gradient against fp64 autograd of the same formula, at bf16's accuracy."""
    from fla.modules.norm.layernorm import rms_norm

    x, r, w = (torch.randn(2, 6, 16) * 2).bfloat16(), (torch.randn(2, 6, 16) * 3).bfloat16(), torch.randn(16)
    mine = _leaves(dict(x=x, r=r, w=w))
    ref = _leaves(dict(x=x.double(), r=r.double(), w=w.double()))
    packed, graph_ops = [], []

    def backend(gm, example_inputs):
        graph_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y, res = torch.compile(lambda x, r, w: rms_norm(x, w, None, residual=r, prenorm=True), backend=backend,
                               fullgraph=True)(**mine)
    assert "laqat.layer_norm_residual" in graph_ops, graph_ops
    assert y.dtype == res.dtype == torch.bfloat16
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in packed), "the fp32 sum is saved"
    assert any(t.untyped_storage().data_ptr() == res.untyped_storage().data_ptr() for t in packed)
    total = ref["x"] + ref["r"]
    y_ref = total * torch.rsqrt(total.square().mean(-1, keepdim=True) + 1e-5) * ref["w"]
    assert_close_rel(y, y_ref, 1e-2, "y")
    assert_close_rel(res, total, 1e-2, "residual out")
    dy, dres = torch.randn(y.shape, dtype=torch.float64), torch.randn(res.shape, dtype=torch.float64)
    ((y.double() * dy).sum() + (res.double() * dres).sum()).backward()
    ((y_ref * dy).sum() + (total * dres).sum()).backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, 2e-2, f"d{name}")


def test_layer_norm_gated_op():
    x, g, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)
    y = torch.ops.laqat.layer_norm_gated(x, g, w, b, "silu", 1e-5, False)
    y_ref = F.layer_norm(x, (8,), w, b, eps=1e-5) * F.silu(g)
    assert_close_rel(y, y_ref, TOL, "y")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softplus_gate_saves_its_output_not_the_raw_gate(kind, dtype):
    """laqat::softplus_gate (use_gate_in_kernel's -exp(A_log) softplus(g + dt_bias)) keeps its fp32 output and A_log,
    not the raw gate: values and the gradients of g, A_log and dt_bias against fp64 autograd of the formula, with
    gates deep in softplus's tails (u from -30 to 30)."""
    from la_compiler.passes.frontends.fla.preprocess import gdn_gate, kda_gate

    HV, K = 3, 4
    shape = (2, 7, HV) if kind == "gdn" else (2, 7, HV, K)
    g = (torch.linspace(-30, 30, 2 * 7 * HV * (1 if kind == "gdn" else K)).view(shape)
         + torch.randn(shape)).to(dtype)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV if kind == "gdn" else HV * K)
    mine = _leaves(dict(g=g, A_log=A_log, dt_bias=dt_bias))
    ref = _leaves(dict(g=g.double(), A_log=A_log.double(), dt_bias=dt_bias.double()))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = gdn_gate(**mine) if kind == "gdn" else kda_gate(**mine, lower_bound=None)
    assert out.dtype == torch.float32
    assert all(t.untyped_storage().data_ptr() != mine["g"].untyped_storage().data_ptr() for t in packed)
    assert any(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for t in packed)
    bias = ref["dt_bias"].view(HV) if kind == "gdn" else ref["dt_bias"].view(HV, K)
    a = ref["A_log"].exp() if kind == "gdn" else ref["A_log"].exp().view(HV, 1)
    out_ref = -a * F.softplus(ref["g"] + bias)
    assert_close_rel(out, out_ref, 1e-6, "out")
    dout = torch.randn(shape, dtype=torch.float64)
    (out.double() * dout).sum().backward()
    (out_ref * dout).sum().backward()
    for name in mine:
        assert mine[name].grad.dtype == mine[name].dtype, name
        assert_close_rel(mine[name].grad, ref[name].grad, 1e-5 if dtype == torch.float32 else 1e-2, f"d{name}")


# ---- the loss ops, the gated-MLP activations, l2norm --------------------------------------------
N_TOKENS, VOCAB, HIDDEN = 12, 40, 16
CE_OPTIONS = {  # FLA's kernels run in Triton's interpreter except with softcapping (libdevice tanh)
    "defaults": dict(label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, logit_softcapping=None),
    "smoothing-scale-zloss": dict(label_smoothing=0.1, logit_scale=0.7, lse_square_scale=1e-3,
                                  logit_softcapping=None),
    "softcapping": dict(label_smoothing=0.05, logit_scale=1.3, lse_square_scale=0.0, logit_softcapping=2.0),
}


def _targets(n=N_TOKENS, vocab=VOCAB, ignore_index=-100):
    target = torch.randint(0, vocab, (n,))
    target[[2, 7]] = ignore_index
    return target


def laid_out(values, layout):
    """``values`` (2-D or 1-D) contiguous, as a transposed view of its storage, or sliced from a larger buffer."""
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        if values.dim() == 1:
            return torch.stack([values, torch.zeros_like(values)], -1)[:, 0]
        return values.t().contiguous().t()
    buffer = torch.zeros(values.shape[0] + 1, *[d + 3 for d in values.shape[1:]], dtype=values.dtype)
    view = buffer[1:][(slice(None),) + tuple(slice(0, d) for d in values.shape[1:])]
    view.copy_(values)
    return view


@pytest.mark.parametrize("options", list(CE_OPTIONS), ids=str)
def test_cross_entropy_op_matches_fla_kernel_and_torch(options):
    """Per-token loss (with the z-loss), z-loss and the logits' gradient (ignored targets: 0), against
    ``F.cross_entropy`` and, where it runs in the interpreter, FLA's own Triton kernel."""
    from fla.modules.fused_cross_entropy import cross_entropy_loss

    from tests.passes.fla_oracle import cross_entropy_oracle

    opts = CE_OPTIONS[options]
    logits, target = torch.randn(N_TOKENS, VOCAB) * 3, _targets()
    mine, ref, fla = (logits.clone().requires_grad_(True) for _ in range(3))
    loss, z_loss, lse = torch.ops.laqat.cross_entropy(mine, target, *opts.values(), -100)
    loss_ref, z_loss_ref = cross_entropy_oracle(ref, target, **opts)
    w = torch.rand(N_TOKENS)
    (dlogits,) = torch.autograd.grad((loss * w).sum(), mine)
    (dlogits_ref,) = torch.autograd.grad((loss_ref * w).sum(), ref)
    assert loss.dtype == z_loss.dtype == lse.dtype == torch.float32
    assert_close_rel(loss, loss_ref, TOL, "loss")
    assert_close_rel(z_loss, z_loss_ref, TOL, "z_loss")
    assert_close_rel(dlogits, dlogits_ref, TOL, "dlogits")
    assert (loss[[2, 7]] == 0).all() and (dlogits[[2, 7]] == 0).all()
    if opts["logit_softcapping"] is None:
        loss_fla, z_loss_fla = cross_entropy_loss(fla, target, **opts)
        (dlogits_fla,) = torch.autograd.grad((loss_fla * w).sum(), fla)
        assert_close_rel(loss, loss_fla, TOL, "loss vs FLA's kernel")
        assert_close_rel(z_loss, z_loss_fla, TOL, "z_loss vs FLA's kernel")
        assert_close_rel(dlogits, dlogits_fla, TOL, "dlogits vs FLA's kernel")


def test_cross_entropy_op_bf16_logits_as_fla_kernel():
    """bf16 logits: fp32 loss, bf16 gradient rounded where FLA's kernel rounds it."""
    from fla.modules.fused_cross_entropy import cross_entropy_loss

    logits, target = (torch.randn(N_TOKENS, VOCAB) * 3).bfloat16(), _targets()
    mine, fla = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    loss = torch.ops.laqat.cross_entropy(mine, target, 0.1, 0.7, 0.0, None, -100)[0]
    loss_fla = cross_entropy_loss(fla, target, label_smoothing=0.1, logit_scale=0.7)[0]
    (dlogits,), (dlogits_fla,) = torch.autograd.grad(loss.sum(), mine), torch.autograd.grad(loss_fla.sum(), fla)
    assert loss.dtype == torch.float32 and dlogits.dtype == torch.bfloat16
    assert_close_rel(loss, loss_fla, TOL, "loss")
    assert_close_rel(dlogits, dlogits_fla, 1e-2, "dlogits")


LCE_OPTIONS = {
    "defaults": dict(),
    "sum-l2warp-chunks-bias": dict(bias=True, reduction="sum", use_l2warp=True, l2_penalty_factor=1e-2,
                                   label_smoothing=0.1, logit_scale=0.8, num_chunks=3),
    "softcapping": dict(logit_softcapping=2.5, num_chunks=2),
}


def _lce_op_args(x, target, weight, bias, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0,
                 logit_softcapping=None, num_chunks=8, reduction="mean", use_l2warp=False, l2_penalty_factor=1e-4,
                 accumulate_grad_in_fp32=True):
    return (x, target, weight, bias, ignore_index, label_smoothing, logit_scale, logit_softcapping, num_chunks,
            reduction, use_l2warp, l2_penalty_factor, accumulate_grad_in_fp32)


@pytest.mark.parametrize("options", list(LCE_OPTIONS), ids=str)
def test_fused_linear_cross_entropy_op_matches_fla_and_torch(options):
    """Loss and the gradients of x, weight and bias (scaled by the loss's gradient) against the LM head +
    ``F.cross_entropy`` + FLA's ``l2_warp`` and, without softcapping, FLA's own function (its kernels in
    the interpreter). V < H * num_chunks: several token chunks."""
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    from tests.passes.fla_oracle import fused_linear_cross_entropy_oracle

    opts = dict(LCE_OPTIONS[options])
    has_bias = opts.pop("bias", False)
    tensors = dict(x=torch.randn(N_TOKENS, HIDDEN), weight=torch.randn(VOCAB, HIDDEN) / 2)
    if has_bias:
        tensors["bias"] = torch.randn(VOCAB)
    target = _targets()
    mine, ref, fla = _leaves(tensors), _leaves(tensors), _leaves(tensors)
    loss = torch.ops.laqat.fused_linear_cross_entropy(
        *_lce_op_args(mine["x"], target, mine["weight"], mine.get("bias"), **opts))[0]
    loss_ref = fused_linear_cross_entropy_oracle(ref["x"], target, ref["weight"], ref.get("bias"), **opts)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert_close_rel(loss, loss_ref, TOL, "loss")
    (loss * 1.7).backward()
    (loss_ref * 1.7).backward()
    for name in tensors:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")
    if opts.get("logit_softcapping") is None:
        loss_fla = fused_linear_cross_entropy_loss(fla["x"], target, fla["weight"], fla.get("bias"), **opts)
        (loss_fla * 1.7).backward()
        assert_close_rel(loss, loss_fla, TOL, "loss vs FLA")
        for name in tensors:
            assert_close_rel(mine[name].grad, fla[name].grad, TOL, f"d{name} vs FLA")


def test_fused_linear_cross_entropy_op_bf16_as_fla():
    """bf16 x / weight, fp32 and bf16 gradient accumulation: FLA's rounding points."""
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    x, weight = torch.randn(N_TOKENS, HIDDEN).bfloat16(), (torch.randn(VOCAB, HIDDEN) / 2).bfloat16()
    target = _targets()
    for fp32_grads in (True, False):
        mine, fla = _leaves(dict(x=x, w=weight)), _leaves(dict(x=x, w=weight))
        loss = torch.ops.laqat.fused_linear_cross_entropy(
            *_lce_op_args(mine["x"], target, mine["w"], None, num_chunks=3, accumulate_grad_in_fp32=fp32_grads))[0]
        loss_fla = fused_linear_cross_entropy_loss(fla["x"], target, fla["w"], num_chunks=3,
                                                   accumulate_grad_in_fp32=fp32_grads)
        loss.backward()
        loss_fla.backward()
        assert_close_rel(loss, loss_fla, 1e-5, "loss")
        for name in mine:
            assert mine[name].grad.dtype == torch.bfloat16
            assert_close_rel(mine[name].grad, fla[name].grad, 1e-2, f"d{name}")


OPCHECK_CASES = [("contiguous", torch.float32), ("transposed", torch.bfloat16), ("sliced", torch.float32),
                 ("sliced", torch.bfloat16)]
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")


def _opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.laqat, name).default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("layout,dtype", OPCHECK_CASES, ids=lambda v: str(v).split(".")[-1])
def test_loss_ops_opcheck(layout, dtype):
    """The fakes state what the real ops return (contiguous, fp32 losses, gradients in the inputs' dtypes),
    and the autograd registrations hold under AOTAutograd, for strided inputs."""
    lay = lambda t, grad=True: laid_out(t.to(dtype), layout).requires_grad_(grad)  # noqa: E731
    target = laid_out(_targets(), layout)
    logits = lay(torch.randn(N_TOKENS, VOCAB))
    for opts in (CE_OPTIONS["smoothing-scale-zloss"], CE_OPTIONS["softcapping"]):
        _opcheck("cross_entropy", (logits, target, *opts.values(), -100))
    lse = torch.logsumexp(logits.detach().float(), -1)
    dloss = laid_out(torch.rand(N_TOKENS), layout)
    _opcheck("cross_entropy_backward", (dloss, logits.detach(), target, lse, *CE_OPTIONS["softcapping"].values(),
                                        -100))
    x, weight, bias = lay(torch.randn(N_TOKENS, HIDDEN)), lay(torch.randn(VOCAB, HIDDEN)), lay(torch.randn(VOCAB))
    _opcheck("fused_linear_cross_entropy", _lce_op_args(x, target, weight, bias, num_chunks=3, use_l2warp=True))
    _opcheck("fused_linear_cross_entropy", _lce_op_args(x, target, weight, None, reduction="sum",
                                                        logit_softcapping=3.0))


def test_fused_losses_compile_to_the_ops():
    """FLA's loss modules (their forward methods substituted while compiling) and functions, eager and
    compiled: the same loss and gradients as the torch oracle; z-loss returned, every reduction."""
    from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss

    from tests.passes.fla_oracle import fused_cross_entropy_oracle_forward, fused_linear_cross_entropy_oracle

    logits, target = torch.randn(3, 4, VOCAB), _targets().view(3, 4)
    x, weight = torch.randn(3, 4, HIDDEN), torch.randn(VOCAB, HIDDEN)

    def losses(logits, x, weight):
        out = []
        for reduction in ("mean", "sum", "none"):
            ce = FusedCrossEntropyLoss(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3,
                                       inplace_backward=True, return_z_loss=True)
            out.append(ce(logits.flatten(0, 1), target.flatten()))
        lce = FusedLinearCrossEntropyLoss(use_l2warp=True, l2_penalty_factor=1e-2, logit_scale=0.9)
        out.append(lce(x, target, weight))
        return out

    def losses_ref(logits, x, weight):
        out = []
        for reduction in ("mean", "sum", "none"):
            ce = FusedCrossEntropyLoss(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3,
                                       return_z_loss=True)
            out.append(fused_cross_entropy_oracle_forward(ce, logits.flatten(0, 1), target.flatten()))
        out.append(fused_linear_cross_entropy_oracle(x, target, weight, use_l2warp=True, l2_penalty_factor=1e-2,
                                                     logit_scale=0.9))
        return out

    mine = _leaves(dict(logits=logits, x=x, weight=weight))
    ref = _leaves(dict(logits=logits, x=x, weight=weight))
    from la_compiler.explainer import NothingMatchedWarning

    with pytest.warns(NothingMatchedWarning):  # no recurrence in a loss
        report = la_compiler.explain(losses, *mine.values())
    assert report.graph_breaks == 0 and len(report.graphs) == 1
    got, want = report.output, losses_ref(*ref.values())
    for i, ((loss, z_loss), (loss_ref, z_loss_ref)) in enumerate(zip(got[:3], want[:3])):
        assert_close_rel(loss, loss_ref, TOL, f"ce loss {i}")
        assert_close_rel(z_loss, z_loss_ref, TOL, f"ce z_loss {i}")
    assert_close_rel(got[3], want[3], TOL, "linear ce loss")
    total = sum(l.sum() for l, _ in got[:3]) + got[3]
    total_ref = sum(l.sum() for l, _ in want[:3]) + want[3]
    total.backward()
    total_ref.backward()
    for name in mine:
        assert_close_rel(mine[name].grad, ref[name].grad, TOL, f"d{name}")
    calls = [line.split("=", 1)[1].split("(")[0].strip() for line in report.graphs[0].readable.splitlines()
             if not line.lstrip().startswith("#") and "torch.ops.laqat." in line]
    assert calls == ["torch.ops.laqat.cross_entropy"] * 3 + ["torch.ops.laqat.fused_linear_cross_entropy"]


@pytest.mark.parametrize("hidden_act,fuse_swiglu", [("swish", False), ("powlu", False), ("swish", True),
                                                   ("powlu", True)])
def test_gated_mlp_activations_compile(hidden_act, fuse_swiglu):
    """GatedMLP's SwiGLU / PowGLU: FLA's autograd.Functions around substituted launchers become torch ops, the
    fused *_linear dispatchers one laqat::glu_linear each; output and every gradient as the torch oracles of
    FLA's formulas; no graph break."""
    from fla.modules import GatedMLP

    from tests.passes.fla_oracle import naive_fla

    mlp = GatedMLP(hidden_size=16, intermediate_size=24, hidden_act=hidden_act, fuse_swiglu=fuse_swiglu)
    x = torch.randn(2, 5, 16) * 2
    x_mine, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    from la_compiler.explainer import NothingMatchedWarning

    with pytest.warns(NothingMatchedWarning):  # no recurrence in an MLP
        report = la_compiler.explain(mlp, x)
    assert report.graph_breaks == 0
    laqat_calls = [line for line in report.graphs[0].readable.splitlines()
                   if "torch.ops.laqat." in line and not line.lstrip().startswith("#")]
    assert len(laqat_calls) == fuse_swiglu and all("laqat.glu_linear" in line for line in laqat_calls), laqat_calls
    y = compile_laqat(mlp)(x_mine)
    with naive_fla():
        y_ref = mlp(x_ref)
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x_mine, *mlp.parameters()])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, *mlp.parameters()])
    for name, g, g_ref in zip(["x"] + [n for n, _ in mlp.named_parameters()], grads, grads_ref):
        assert_close_rel(g, g_ref, TOL, f"d{name}")


@pytest.mark.parametrize("hidden_act,fuse_swiglu", [("swish", True), ("powlu", True), ("swish", False)])
def test_gated_mlp_under_autocast(hidden_act, fuse_swiglu):
    """fp32 weights under ``torch.autocast`` to bf16, the backward outside it: the fused down projection computes in
    the autocast dtype as FLA's ``F.linear`` does (its weight cast before laqat::glu_linear, the op's backward in one
    dtype). Output and every gradient as the torch oracles of FLA's formulas in the same autocast (bf16 rounding)."""
    from fla.modules import GatedMLP

    from tests.passes.fla_oracle import naive_fla

    torch.manual_seed(0)
    mlp = GatedMLP(hidden_size=16, intermediate_size=24, hidden_act=hidden_act, fuse_swiglu=fuse_swiglu)
    x = torch.randn(2, 5, 16) * 2
    x_mine, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compile_laqat(mlp)(x_mine)
        with naive_fla():
            y_ref = mlp(x_ref)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert_close_rel(y.float(), y_ref.float(), 2e-2, "y")
    dy = torch.randn(y.shape)
    grads = torch.autograd.grad((y * dy).sum(), [x_mine, *mlp.parameters()])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, *mlp.parameters()])
    for name, g, g_ref in zip(["x"] + [n for n, _ in mlp.named_parameters()], grads, grads_ref):
        assert g.dtype == torch.float32, name
        assert_close_rel(g, g_ref, 2e-2, f"d{name}")


def test_l2norm_compiles_to_laqat_l2_norm():
    """FLA's l2norm module function becomes laqat::l2_norm: values and gradient against the fp32 formula."""
    from fla.modules.l2norm import l2norm

    from tests.passes.fla_oracle import fla_l2norm

    x = torch.randn(2, 5, 3, 8)
    mine, ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fn = lambda x: l2norm(x, eps=1e-5) * 2 + l2norm(x.bfloat16(), output_dtype=torch.float32)  # noqa: E731
    y = compile_laqat(fn)(mine)
    y_ref = (ref / torch.sqrt((ref * ref).sum(-1, keepdim=True) + 1e-5)) * 2 + fla_l2norm(ref.bfloat16())
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert_close_rel(mine.grad, ref.grad, 1e-2, "dx")  # the bf16 branch's gradient is bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_saves_its_output_not_its_input(dtype):
    """laqat::l2_norm keeps y and the inverse norms for the backward, not x (what FLA's L2NormFunction keeps, and
    what a recurrence with use_qk_l2norm_in_kernel saves anyway as its q and k); the gradient from the stored y
    against autograd through FLA's fp32 formula: exact in fp32, y's rounding in bf16."""
    from fla.modules.l2norm import l2norm

    from tests.passes.fla_oracle import fla_l2norm

    x = (torch.randn(2, 6, 3, 16) * 3).to(dtype)
    mine, ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    graph_ops = []

    def backend(gm, example_inputs):
        graph_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = torch.compile(l2norm, backend=backend, fullgraph=True)(mine)
    assert graph_ops == ["laqat.l2_norm", "<built-in function getitem>"], graph_ops
    assert all(t.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr() for t in packed)
    assert any(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in packed)
    y_ref = fla_l2norm(ref)
    assert_close_rel(y, y_ref.to(dtype), 1e-6, "y")
    dy = torch.randn_like(y, dtype=torch.float32)
    (y.float() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert_close_rel(mine.grad, ref.grad, 1e-6 if dtype == torch.float32 else 2e-2, "dx")


# ---- layers and models ------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return x + self.attn(x)[0]


class Model(torch.nn.Module):
    def __init__(self, *attns):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(a) for a in attns)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _gdn(**kw):
    from fla.layers import GatedDeltaNet

    return GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, expand_v=1.0, **kw)


def _kda(**kw):
    from fla.layers import KimiDeltaAttention

    return KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, expand_v=1.0, **kw)


def _check_model(model, *, kinds, train: bool, compiler="eager"):
    """One compilation (through ``explain``, which reports graph breaks): one laqat node per layer
    call, named by the layer's module path, outputs and all gradients as the eager oracle."""
    model.train(train)
    x = torch.randn(2, 10, 32)
    x_mine, x_ref = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    with torch.set_grad_enabled(train):
        report = la_compiler.explain(model, x_mine, compiler=compiler)
        with naive_fla():
            y_ref = model(x_ref)
    assert report.graph_breaks == 0 and len(report.graphs) == 1  # what fullgraph=True demands
    assert [(m.kind, m.frontend, m.module) for m in report.matches] == [
        (kind, "fla", f"layers.{i}.attn") for i, kind in enumerate(kinds)]
    y = report.output
    assert_close_rel(y, y_ref, TOL, "y")
    if not train:
        return
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x_mine, *model.parameters()])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, *model.parameters()])
    names = ["x"] + [n for n, _ in model.named_parameters()]
    for name, gr, gr_ref in zip(names, grads, grads_ref):
        assert_close_rel(gr, gr_ref, TOL, f"d{name}")


def test_gdn_layer_chunk_mode_short_conv_grouped_heads():
    _check_model(Model(_gdn(num_v_heads=4, use_short_conv=True)), kinds=["gdn"], train=True)


def test_kda_layer_chunk_mode_short_conv_grouped_heads():
    _check_model(Model(_kda(num_v_heads=4, use_short_conv=True, allow_neg_eigval=True)), kinds=["kda"], train=True)


def test_gdn_layer_varlen_training():
    """Packed sequences (cu_seqlens) through the short convolutions and the recurrence of a layer."""
    layer = _gdn(num_v_heads=4, use_short_conv=True).train()
    x, cu_seqlens = torch.randn(1, 11, 32), torch.tensor([0, 4, 11])
    x_mine, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    report = la_compiler.explain(layer, x_mine, cu_seqlens=cu_seqlens)
    assert [(m.kind, m.module) for m in report.matches] == [("gdn", "")] and report.graph_breaks == 0
    with naive_fla():
        y_ref = layer(x_ref, cu_seqlens=cu_seqlens)[0]
    y = report.output[0]
    assert_close_rel(y, y_ref, TOL, "y")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x_mine, *layer.parameters()])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, *layer.parameters()])
    for name, gr, gr_ref in zip(["x"] + [n for n, _ in layer.named_parameters()], grads, grads_ref):
        assert_close_rel(gr, gr_ref, TOL, f"d{name}")


def test_gdn_and_kda_layers_eval_fused_recurrent_mode():
    """Under no_grad in eval with T <= 64 FLA's layers call fused_recurrent_*; no short conv; GDN's
    ungated output norm (use_gate=False)."""
    model = Model(_gdn(use_short_conv=False, use_gate=False),
                  _kda(use_short_conv=False, safe_gate=True, lower_bound=-5.0))
    _check_model(model, kinds=["gdn", "kda"], train=False)


@pytest.mark.parametrize("family,compiler", [("gdn", "eager"), ("kda", "inductor")])
def test_fla_causal_lm_compiles_fullgraph(family, compiler):
    """FLA's own models (pre-norm residual RMSNorm, fused SwiGLU MLP, wrapped forward), fullgraph, under each
    hand-off."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

    config, model_class = (GatedDeltaNetConfig, GatedDeltaNetForCausalLM) if family == "gdn" else (
        KDAConfig, KDAForCausalLM)
    model = model_class(config(hidden_size=32, num_hidden_layers=2, head_dim=8, num_heads=2, expand_v=1,
                               vocab_size=64, intermediate_size=64)).eval()
    tokens = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        # use_cache=False: FLA's Cache object is torch.compiler.disable'd (decode is not a training graph)
        options = {"compiler": compiler}
        logits = torch.compile(model, backend="laqat", fullgraph=True, options=options)(tokens, use_cache=False).logits
        with naive_fla():
            logits_ref = model(tokens, use_cache=False).logits
    assert_close_rel(logits, logits_ref, TOL, "logits")
    record = la_compiler.backend.last_record().graphs[-1]
    assert [(m.kind, m.module) for m in record.matches] == [(family, "model.layers.0.attn"),
                                                           (family, "model.layers.1.attn")]


# ---- refusals ---------------------------------------------------------------------------------
def _expect_refusal(fn, *args, match, fullgraph=True):
    compiled = torch.compile(fn, backend="laqat", fullgraph=fullgraph, options={"compiler": "eager"})
    with pytest.raises(fla_frontend.UnsupportedArgumentError, match=rf"laqat FLA frontend, .*{match}") as info:
        compiled(*args)
    return info


@pytest.mark.parametrize("fullgraph", [True, False])
def test_refuses_cp_context_at_compile_time_without_fallback(fullgraph):
    """Never a silent fall back to FLA's original function: with and without fullgraph."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t = _inputs("gdn", raw=False)
    cp_context = object()  # any non-None context
    _expect_refusal(lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, cp_context=cp_context),
                    t["q"], t["k"], t["v"], t["g"], t["beta"], match="`cp_context`", fullgraph=fullgraph)


def test_refuses_unsupported_arguments():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    t = _inputs("kda", raw=False)
    q, k, v, g, beta = t["q"], t["k"], t["v"], t["g"], t["beta"]
    _expect_refusal(lambda: chunk_kda(q, k, v, g, beta, return_intermediate_states=True),
                    match="`return_intermediate_states`")
    _expect_refusal(lambda: fused_recurrent_kda(q, k, v, g, beta, ssm_state_indices=torch.arange(2)),
                    match="`ssm_state_indices`")
    _expect_refusal(lambda: fused_recurrent_gated_delta_rule(q, k, v, gv=torch.zeros_like(v), beta=beta),
                    match="`gv`")
    _expect_refusal(lambda: fused_recurrent_kda(q, k, v, g, beta.unsqueeze(-1).expand_as(v)),
                    match="`beta`")
    _expect_refusal(lambda: chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True), match="`A_log`")


def test_refuses_unsupported_conv_and_norm_arguments():
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    x, w = torch.randn(1, 5, 4), torch.randn(4, 3)
    _expect_refusal(lambda: causal_conv1d(x, w, activation="relu"), match="`activation`")
    _expect_refusal(lambda: rms_norm_gated(x, x, None, None, activation="relu"), match="`activation`")
    _expect_refusal(lambda: rms_norm_gated(x, x[..., :2], None, None), match="`g`")


def test_refuses_unsupported_loss_arguments():
    from fla.modules.fused_cross_entropy import cross_entropy_loss
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    logits, target, x, w = torch.randn(6, 10), torch.randint(0, 10, (6,)), torch.randn(6, 4), torch.randn(10, 4)
    group = object()  # any process group
    _expect_refusal(lambda: cross_entropy_loss(logits, target, process_group=group), match="`process_group`")
    _expect_refusal(lambda: cross_entropy_loss(logits, target[:4]), match="`target`")
    _expect_refusal(lambda: fused_linear_cross_entropy_loss(x, target, w, process_group=group),
                    match="`process_group`")
    _expect_refusal(lambda: fused_linear_cross_entropy_loss(x, target, w, reduction="none"), match="`reduction`")
    _expect_refusal(lambda: fused_linear_cross_entropy_loss(x, target, w.bfloat16()), match="`weight`")


def test_substitutes_every_fla_alias():
    import fla.layers.gated_deltanet as gdn_layer
    import fla.layers.kda as kda_layer
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.modules.convolution as conv_alias
    import fla.modules.mlp as mlp
    import fla.modules.norm.fused_norm_gate as gated_norms
    import fla.modules.norm.layernorm as norms
    import fla.ops as ops
    import fla.ops.gated_delta_rule as gdn_ops

    import fla.modules.activations.ops as activations
    import fla.modules.fused_cross_entropy as cross_entropy
    import fla.modules.fused_linear_cross_entropy as linear_cross_entropy
    import fla.modules.l2norm as l2norm
    from fla.models.modeling_utils import FLAPreTrainedModel

    for fn in (ops.chunk_gated_delta_rule, gdn_ops.chunk_gdn, gdn_ops.fused_recurrent_gdn,
               gdn_layer.chunk_gated_delta_rule, gdn_layer.fused_recurrent_gated_delta_rule,
               gdn_layer.causal_conv1d, conv_alias.causal_conv1d, conv_ops.causal_conv1d, kda_layer.chunk_kda,
               kda_layer.fused_recurrent_kda, gated_norms.rms_norm_gated, norms.rms_norm, mlp.swiglu_linear,
               mlp.powglu_linear, activations.swiglu_fwd, activations.swiglu_fwdbwd, activations.powglu_fwd,
               activations.powglu_fwdbwd, l2norm.l2norm, l2norm.l2_norm, cross_entropy.cross_entropy_loss,
               linear_cross_entropy.fused_linear_cross_entropy_loss):
        assert fn in fla_frontend.SUBSTITUTED, fn
    for cls, name in ((cross_entropy.FusedCrossEntropyLoss, "forward"),
                      (linear_cross_entropy.FusedLinearCrossEntropyLoss, "forward"),
                      (FLAPreTrainedModel, "_compute_logits_and_loss")):
        method = cls.__dict__[name]
        assert method.__laqat_original__ in fla_frontend.SUBSTITUTED, (cls, name)
        assert not getattr(method, "_torchdynamo_disable", False), (cls, name)  # FLA's mark stays on the original


def test_method_substitutions_leave_eager_calls_to_fla():
    """Outside torch.compile the substituted methods run FLA's originals (here: FLA's GPU-only assertion)."""
    from fla.modules import FusedCrossEntropyLoss

    with pytest.raises(AssertionError, match="Only support CUDA"):
        FusedCrossEntropyLoss()(torch.randn(3, 5), torch.tensor([0, 1, 2]))
