"""The decode_serving variant (a serving profile: chunked prefix + decode steps in vLLM's order) against the
fp64 decode reference: outputs, final states and the gradient of every input, on packed sequences with empty
prefixes and suffixes, grouped value heads, a cache dtype and a state codec; and the selection table's rows.
"""
import pytest
import torch

import la_compiler.kernels  # noqa: F401  (registers the variants)
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.decode.serving import decode_serving_backward, decode_serving_forward
from la_compiler.kernels.reference.decode import delta_rule_decode_reference
from la_compiler.kernels.selection import KernelSelectionError, select_kernel
from la_compiler.options import decode_options
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs


def _spec(kind, layout, state_dtype, fmt=None):
    extra = {"readout": "working", "serving": "vllm-0.33", "state_dtype": state_dtype}
    return RecurrenceSpec(kind, phase="token", state=layout, kernel="decode_serving",
                          quant=(("state", fmt),) if fmt else (), extra=tuple(sorted(extra.items())))


CASES = {
    # id: (kind, layout, state dtype, state format, h0, B, T, H, HV, K, V, prefill, valid, cu_seqlens)
    # packed: a prefix and a suffix, no prefix, no suffix (its final state is the prefix's, unrounded)
    "gdn-bf16-cache-gqa-packed": ("gdn", "vk", "bfloat16", None, True, 1, 22, 1, 2, 16, 16, [7, 0, 4], [12, 6, 4],
                                  [0, 12, 18, 22]),
    "kda-fp8-codec-fp16-cache-batch": ("kda", "kv", "float16", "fp8_e4m3/tile16", False, 2, 9, 1, 1, 16, 16, [4, 8],
                                       [9, 9], None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_serving_variant_matches_the_decode_reference(case):
    kind, layout, state_dtype, fmt, use_h0, B, T, H, HV, K, V, prefill, valid, cu = CASES[case]
    spec = _spec(kind, layout, state_dtype, fmt)
    (q, k, v, g, beta, h0), cu_t = random_inputs(kind, B=B, T=T, H=H, HV=HV, K=K, V=V, initial_state=use_h0,
                                                 cu_seqlens=cu, state_layout=layout)
    pre, val = torch.tensor(prefill, dtype=torch.int32), torch.tensor(valid, dtype=torch.int32)
    scale = K ** -0.5
    o, ht = decode_serving_forward(spec, q, k, v, g, beta, h0, cu_t, scale, prefill_lengths=pre, valid_lengths=val)
    ro, rh = delta_rule_decode_reference(q, k, v, g, beta, kind=kind, options=decode_options(spec),
                                         prefill_lengths=prefill, valid_lengths=valid, scale=scale,
                                         initial_state=h0, cu_seqlens=cu_t, state_layout=layout)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ro) < 1e-4 and rel_l2(ht, rh) < 1e-4, (rel_l2(o, ro), rel_l2(ht, rh))
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = decode_serving_backward(spec, q, k, v, g, beta, h0, cu_t, scale, do, dht, prefill_lengths=pre,
                                    valid_lengths=val)
    leaves = [x for x in (q, k, v, g, beta, h0) if x is not None]
    want = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(), leaves)
    assert (grads[5] is None) == (h0 is None)
    for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        assert rel_l2(got, ref) < 1e-4, (name, rel_l2(got, ref))


def test_selection_runs_serving_specs_on_the_serving_variant():
    spec = _spec("gdn", "vk", "auto").replace(kernel="auto")
    assert select_kernel(spec, device="cpu", dtype=torch.bfloat16, head_k=64, head_v=64).variant == "decode_serving"
    assert select_kernel(spec, device="cpu", dtype=torch.float32, head_k=64, head_v=64,
                         family="torch").variant == "decode_reference"
    plain = RecurrenceSpec("gdn", phase="token", kernel="auto", extra=(("readout", "working"),))
    choice = select_kernel(plain, device="cpu", dtype=torch.float32, head_k=8, head_v=8)
    assert choice.variant == "decode_fused" and "x.serving" in dict(choice.rejected)["decode_serving"]


def test_the_token_recurrence_kernel_refuses_a_serving_spec():
    spec = _spec("kda", "kv", "bfloat16").replace(kernel="auto")
    with pytest.raises(KernelSelectionError, match="runs on decode_serving"):
        select_kernel(spec, device="cpu", dtype=torch.float32, head_k=16, head_v=16, requested="decode_fused")


def _train_compiled(model, prefill, valid):
    """One training step of ``model`` compiled with vllm_kda_state_bf16 under the default options (Inductor compiles
    the rest of the graph) in a decode phase: (the laqat graph, the loss, each parameter's gradient by name)."""
    import la_compiler
    from tests.la_compiler.test_phase import _counting_backend

    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = []
    compiled = torch.compile(model, backend=_counting_backend(calls, {"policy": "vllm_kda_state_bf16"}))
    with la_compiler.phase(prefill, sequence_lengths=valid):
        loss = compiled(tokens).square().mean()
        loss.backward()
    return calls[0].graph, tokens, loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_the_eager_reference_trains_alike(model, tokens, loss, grads, spec, prefill, valid):
    """The eager model with the fp64 decode reference of ``spec`` in the recurrence's place: the same loss (1e-5) and
    every parameter's gradient (relative L2 1e-4)."""
    options = decode_options(RecurrenceSpec.parse(spec))

    def reference_op(q, k, v, g, beta, h0, cu, scale, spec):
        o, ht = delta_rule_decode_reference(q, k, v, g, beta, kind="kda", options=options, prefill_lengths=prefill,
                                            valid_lengths=valid, scale=scale)
        return o.float(), ht.float()

    model.zero_grad()
    real = torch.ops.laqat.delta_rule
    try:
        torch.ops.laqat.delta_rule = reference_op
        ref_loss = model(tokens).square().mean()
        ref_loss.backward()
    finally:
        torch.ops.laqat.delta_rule = real
    assert abs(loss - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for name, p in model.named_parameters():
        assert rel_l2(grads[name], p.grad) < 1e-4, (name, rel_l2(grads[name], p.grad))


def test_a_model_compiled_with_the_recipe_trains_on_the_serving_variant():
    """The recipe through the backend (annotate, phase pass, laqat::delta_rule_phased): the spec runs on
    decode_serving; loss and gradients equal those of the eager model with the fp64 reference in its place."""
    from la_compiler.ir.delta_rule_phased import is_delta_rule_phased
    from tests.la_compiler.test_phase import TinyKDA

    torch.manual_seed(0)
    model = TinyKDA(head_dim=16, value_dim=16)
    prefill, valid = [3, 6], [9, 7]
    graph, tokens, loss, grads = _train_compiled(model, prefill, valid)
    specs = [n.args[10] for n in graph.nodes if is_delta_rule_phased(n)]
    assert len(specs) == 1 and "kernel=decode_serving" in specs[0]
    assert "x.serving=vllm-0.33" in specs[0] and "x.state_dtype=bfloat16" in specs[0]
    _assert_the_eager_reference_trains_alike(model, tokens, loss, grads, specs[0], prefill, valid)


@pytest.mark.parametrize("kind,layout,state_dtype,fmt,io", [
    ("gdn", "kv", "bfloat16", None, torch.bfloat16), ("gdn", "vk", "float16", None, torch.float16),
    ("kda", "vk", "float32", None, torch.float32), ("kda", "kv", "float16", "fp8_e4m3/tile16", torch.float32)])
def test_the_kernels_take_the_states_v_first_in_the_caches_dtype_where_no_codec_rounds_first(kind, layout,
                                                                                           state_dtype, fmt, io):
    """What the launchers hand the decode kernels (tests/serving/test_sm90_layouts.py: why): V-first states, a kv
    spec's transposed around them, in a 16-bit cache's dtype unless a codec rounds before the cache."""
    from la_compiler.kernels.decode import suffix

    params, transposed = suffix.kernel_params(_spec(kind, layout, state_dtype, fmt), torch.bfloat16)
    assert params.vfirst and params.state == "vk" and transposed == (layout == "kv")
    assert suffix.state_io_dtype(params) == io


def test_a_raw_kda_gate_is_the_gate_formula_ahead_of_the_recurrence():
    """A node that takes KDA's gate raw (``gate=(A_log, dt_bias)``) computes -exp(A_log) * softplus(g + dt_bias)
    itself: its outputs, final states and the gradients of the raw gate, A_log and dt_bias against the fp64 decode
    reference fed that formula in fp64 (softplus on both sides of its threshold)."""
    kind, layout, B, T, HV, K = "kda", "vk", 1, 13, 2, 16
    spec = _spec(kind, layout, "bfloat16")
    (q, k, v, _, beta, h0), cu = random_inputs(kind, B=B, T=T, H=1, HV=HV, K=K, V=K, initial_state=True,
                                               cu_seqlens=[0, 9, 13], state_layout=layout)
    raw = (torch.randn(B, T, HV, K) * 4).requires_grad_()
    with torch.no_grad():
        raw[0, 0, 0, :2] = 25.0  # past softplus's threshold of 20
    A_log = torch.rand(HV).mul(3).log().requires_grad_()
    dt_bias = torch.rand(HV * K).requires_grad_()
    pre, val = torch.tensor([5, 2], dtype=torch.int32), torch.tensor([9, 4], dtype=torch.int32)
    scale = K ** -0.5
    o, ht = decode_serving_forward(spec, q, k, v, raw, beta, h0, cu, scale, prefill_lengths=pre, valid_lengths=val,
                                   gate=(A_log, dt_bias))
    leaves = [q, k, v, raw, beta, h0, A_log, dt_bias]
    wide = [x.detach().double().requires_grad_() for x in leaves]
    log_decay = -wide[6].exp().view(HV, 1) * torch.nn.functional.softplus(wide[3] + wide[7].view(HV, K))
    ro, rh = delta_rule_decode_reference(*wide[:3], log_decay, wide[4], kind=kind, options=decode_options(spec),
                                         prefill_lengths=pre.tolist(), valid_lengths=val.tolist(), scale=scale,
                                         initial_state=wide[5], cu_seqlens=cu, state_layout=layout)
    assert rel_l2(o, ro) < 1e-4 and rel_l2(ht, rh) < 1e-4, (rel_l2(o, ro), rel_l2(ht, rh))
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = decode_serving_backward(spec, q, k, v, raw, beta, h0, cu, scale, do, dht, prefill_lengths=pre,
                                    valid_lengths=val, gate=(A_log, dt_bias))
    want = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(), wide)
    assert len(grads) == 8
    for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), grads, want):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        assert rel_l2(got, ref) < 1e-4, (name, rel_l2(got, ref))


@pytest.mark.parametrize("kind,kernel,gate,message", [
    ("kda", "decode_fused", "A_log", r"A_log \(a raw gate\) is given, but kernel variant 'decode_fused' of a kda node"),
    ("gdn", "decode_serving", "A_log", r"kernel variant 'decode_serving' of a gdn node takes its log-decay computed"),
    ("kda", "decode_serving", "dt_bias", r"dt_bias is given without A_log"),
    ("kda", "decode_serving", "short A_log", r"a raw KDA gate needs g \[B, T, HV, K\], A_log of HV"),
])
def test_the_phased_op_refuses_a_raw_gate_where_no_variant_computes_it(kind, kernel, gate, message):
    import la_compiler
    import la_compiler.ir.delta_rule_phased  # noqa: F401  (registers the phased ops)
    from la_compiler.ir.checks import IRInputError

    (q, k, v, g, beta, _), _ = random_inputs(kind, T=6, H=1, HV=2, K=16, V=16, requires_grad=False)
    extra = {"readout": "working", "state_dtype": "bfloat16"} | ({"serving": "vllm-0.33"} if kernel == "decode_serving"
                                                                 else {})
    spec = RecurrenceSpec(kind, phase="token", kernel=kernel, extra=tuple(sorted(extra.items()))).to_string()
    A_log, dt_bias = torch.zeros(2), torch.zeros(2 * 16)
    gate = {"A_log": (A_log, None), "dt_bias": (None, dt_bias), "short A_log": (torch.zeros(1), dt_bias)}[gate]
    with la_compiler.phase(prefill_lengths=[3]), pytest.raises(IRInputError, match=message):
        prefill, valid = torch.ops.laqat.phase_lengths(q, None)
        torch.ops.laqat.delta_rule_phased(q, k, v, g, beta, None, None, prefill, valid, 0.25, spec, *gate)


class _SoftplusGateKDA(torch.nn.Module):
    """Embedding -> one KDA recurrence whose inputs are the server's formulas written in torch (the l2 norm, the
    softplus gate per key channel with A_log and dt_bias, beta's sigmoid) -> LM head."""

    def __init__(self, vocab=16, hidden=16, heads=2, head_dim=16):
        super().__init__()
        self.h, self.d = heads, head_dim
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, heads * 3 * head_dim)
        self.gate = torch.nn.Linear(hidden, heads * head_dim)
        self.beta = torch.nn.Linear(hidden, heads)
        self.A_log = torch.nn.Parameter(torch.rand(heads).mul(3).log())
        self.dt_bias = torch.nn.Parameter(torch.rand(heads * head_dim))
        self.head = torch.nn.Linear(heads * head_dim, vocab)

    def forward(self, tokens):
        B, T = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(B, T, self.h, -1).split([self.d] * 3, dim=-1)
        q, k = (t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + 1e-6) for t in (q, k))
        g = -self.A_log.view(self.h, 1).exp() * torch.nn.functional.softplus(
            (self.gate(x) * 4 + self.dt_bias).view(B, T, self.h, self.d))
        beta = self.beta(x).sigmoid()
        o, _ = torch.ops.laqat.delta_rule(q, k, v.contiguous(), g, beta, None, None, self.d ** -0.5, "kda[src=user]")
        return self.head(o.reshape(B, T, -1))


def test_a_kda_model_with_the_servers_gate_trains_through_inductor_on_the_raw_gate():
    """The default hand-off (Inductor) in training: the serving pass hands the node the raw gate with A_log and
    dt_bias (no gate op left in the graph), and the loss and every parameter's gradient (A_log's and dt_bias's
    through the node) equal the eager model's with the fp64 decode reference in the recurrence's place."""
    from la_compiler.ir.delta_rule_phased import is_delta_rule_phased

    torch.manual_seed(0)
    model = _SoftplusGateKDA()
    prefill, valid = [3, 6], [9, 7]
    graph, tokens, loss, grads = _train_compiled(model, prefill, valid)
    nodes = [n for n in graph.nodes if is_delta_rule_phased(n)]
    assert len(nodes) == 1 and len(nodes[0].args) == 13, nodes
    A_log, dt_bias = nodes[0].args[11:]
    assert A_log is not None and dt_bias is not None
    assert not any("serving_kda_gate" in str(n.target) for n in graph.nodes)
    _assert_the_eager_reference_trains_alike(model, tokens, loss, grads, nodes[0].args[10], prefill, valid)
