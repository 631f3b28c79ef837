"""Dynamic shapes: ``dynamic=True``, ``mark_dynamic`` and automatic dynamic shapes (a second length) for FLA calls
and torch loops compile and compute what a static compile computes; a recompile that rewrites fewer recurrences
than an earlier compile of the same function did, under a policy that changes numerics, warns.

FLA calls keep their lengths symbolic (one compile for every T, number of sequences and cu_seqlens values); an
unrolled torch loop is specialized to its trip count by Dynamo, and the torch frontend pins the sizes its graph
reads to their values (each length is its own compile, each rewritten), except a size the user marked dynamic with
``mark_dynamic`` (pinning it would fail the compile): then the loop is left as it is, with the reason."""
import warnings

import pytest
import torch

import la_compiler
from la_compiler.policy.file_format import NothingQuantizedWarning
from tests.helpers import rel_l2
from tests.passes.test_torch_recurrence import _inputs as torch_inputs
from tests.passes.torch_recurrence_step_dependent import gdn_step_dependent

pytest.importorskip("fla")

TOL = 1e-5


def _record():
    return la_compiler.backend.last_record()


def _fla_inputs(T, B=1, H=2, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.1 * torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _fla_gdn(q, k, v, g, beta, cu_seqlens=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)


CALLS = [(8, None), (13, None), (13, [0, 5, 13]), (13, [0, 9, 13]), (17, [0, 3, 10, 17])]


@pytest.mark.parametrize("how, compiler", [("dynamic=True", "eager"), ("dynamic=True", "inductor"),
                                           ("mark_dynamic", "eager"), ("automatic", "eager")])
def test_fla_call_with_symbolic_lengths_and_offsets(how, compiler):
    """A symbolic default scale, T, number of sequences and cu_seqlens values: correct results (against FLA's naive
    recurrence), and with dynamic=True one compile without and one with cu_seqlens."""
    from tests.passes.fla_oracle import naive_fla_call
    torch._dynamo.reset()
    compiled = torch.compile(_fla_gdn, backend="laqat", options={"compiler": compiler},
                             **({"dynamic": True} if how == "dynamic=True" else {}))
    first = len(_record().graphs)
    for T, cu in CALLS:
        t = _fla_inputs(T)
        if how == "mark_dynamic":
            for x in t.values():
                torch._dynamo.mark_dynamic(x, 1)
        cu = torch.tensor(cu) if cu is not None else None
        o, ht = compiled(**t, cu_seqlens=cu)
        o_ref, ht_ref = naive_fla_call("gdn", **t, output_final_state=True, cu_seqlens=cu)
        assert rel_l2(o, o_ref) <= TOL and rel_l2(ht, ht_ref) <= TOL, (how, T, cu)
    graphs = _record().graphs[first:]
    assert all(len(g.matches) == 1 for g in graphs), [(g.matches, g.near_misses) for g in graphs]
    if how == "dynamic=True":
        assert len(graphs) == 2, len(graphs)


def test_fla_call_with_a_symbolic_length_under_a_quantizing_policy():
    """dynamic=True under state_fp8: the same numerics as a static compile of each length."""
    options = {"compiler": "eager", "policy": "state_fp8"}
    torch._dynamo.reset()
    dynamic = torch.compile(_fla_gdn, backend="laqat", options=options, dynamic=True)
    for T in (70, 90):
        t = _fla_inputs(T)
        got = dynamic(**t)
        torch._dynamo.reset()
        want = torch.compile(_fla_gdn, backend="laqat", options=options)(**t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), T
        assert "q.state=" in str(_record().graphs[-1].matches[0].spec)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_torch_loop_is_rewritten_at_every_length(dynamic):
    """A second length (automatic dynamic shapes make it symbolic) and dynamic=True: every compile rewrites the
    loop and quantizes it as a static compile of that length does; no warning."""
    fn = gdn_step_dependent("")
    options = {"compiler": "eager", "policy": "state_fp8"}
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="laqat", options=options, dynamic=dynamic)
    first = len(_record().graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        got = {T: compiled(**torch_inputs("gdn", T=T)) for T in (6, 8)}
    assert [len(g.matches) for g in _record().graphs[first:]] == [1, 1], _record().graphs[first:]
    for T, (o, S) in got.items():
        torch._dynamo.reset()
        o_static, S_static = torch.compile(fn, backend="laqat", options=options)(**torch_inputs("gdn", T=T))
        assert torch.equal(o, o_static) and torch.equal(S, S_static), T


def _gdn_with_flag(q, k, v, g, beta, h0, clamp):
    B, T, H, K = q.shape
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * u[..., None, :]
        if clamp:
            S = S.clamp(-1e3, 1e3)
        o[:, t] = (S * q[:, t, ..., None]).sum(-2) * K ** -0.5
    return o, S


def test_a_recompile_that_rewrites_less_is_not_silent():
    torch._dynamo.reset()
    compiled = torch.compile(_gdn_with_flag, backend="laqat", options={"compiler": "eager", "policy": "state_fp8"})
    t = torch_inputs("gdn", T=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        compiled(**t, clamp=False)
    with pytest.warns(NothingQuantizedWarning, match=r"rewrote 0 recurrence\(s\) where an earlier compile of it "
                                                      r"rewrote 1.*`clamp`"):
        compiled(**t, clamp=True)
    assert any("where an earlier compile of it rewrote 1" in n for n in _record().graphs[-1].notes)


# ---- torch loops at a second length: every spelling whose sizes reach the region symbolic ----------------------
REFERENCE = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]}
STATE_FP8_REFERENCE = {  # state_fp8's state quantizer on the fp64 reference (fast on the CPU)
    "version": "laqat.policy/1", "name": "state_fp8_reference",
    "quant_cfg": [{"quantizer_name": "*", "enable": False},
                  {"quantizer_name": "*_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic",
                                                                  "axis": [0, 1]}}],
    "linear_attention": [{"module_name": "*", "cfg": {"backend": "reference", "state": {"block_v": 16}}}],
}
QUANTIZED_SPEC = ("gdn[src=torch; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=reference; "
                  "q.state=fp8_e4m3/tile16]")


def _ir_inputs_scaled_values(q, k, v, g, beta, h0):
    return q, k, v * 0.5, g, beta, h0


def _ir_inputs_scale_after_pad(q, k, v, g, beta, h0):
    return q, k, v, g, beta.sigmoid() * 2.0, h0


def _ir_inputs_preexp(q, k, v, g, beta, h0):
    return q, k, v, g.exp().log(), beta, None


# name -> (the IR node's inputs as the replacement feeds them, the two lengths, the inputs' other sizes); short
# lengths: Dynamo's symbolic trace of an unrolled loop costs seconds per step
LOOPS = {
    "scaled_values_with_state": (_ir_inputs_scaled_values, (6, 9), {}),  # x.unbind(1) items of a symbolic length
    "scale_after_pad": (_ir_inputs_scale_after_pad, (5, 6), {}),  # F.pad by an amount computed from T
    "gdn_list_stack_matmul_preexp": (_ir_inputs_preexp, (3, 4), dict(initial_state=False)),  # zeros(B, H, K, V)
}


def _loop(name):
    from tests.passes import torch_recurrence_gates as gates, torch_recurrence_spellings as spellings
    return getattr(gates, name, None) or getattr(spellings, name)


def _with_grads(tensors):
    return {n: x.clone().requires_grad_() if x is not None else None for n, x in tensors.items()}


def _outputs_and_grads(fn, tensors, cotangents):
    leaves = _with_grads(tensors)
    outs = fn(**leaves)[:2]
    sum((o * c).sum() for o, c in zip(outs, cotangents)).backward()
    return [o.detach() for o in outs], {n: x.grad for n, x in leaves.items() if x is not None}


def _ir_oracle(name):
    """The fp64 reference op on the IR node's inputs, under the quantized spec (no Dynamo, no frontend)."""
    def call(q, k, v, g, beta, h0):
        ir = LOOPS[name][0](q, k, v, g, beta, h0)
        return torch.ops.laqat.delta_rule(*ir, None, q.shape[-1] ** -0.5, QUANTIZED_SPEC)
    return call


# each spelling where its sizes reached the analysis symbolic (automatic: the second length; dynamic=True: both),
# under both policies where that costs seconds
CASES = [("scaled_values_with_state", None, "exact"), ("scaled_values_with_state", None, "state_fp8"),
         ("scaled_values_with_state", True, "state_fp8"), ("scale_after_pad", None, "exact"),
         ("scale_after_pad", None, "state_fp8"), ("gdn_list_stack_matmul_preexp", True, "exact"),
         ("gdn_list_stack_matmul_preexp", True, "state_fp8")]


@pytest.mark.parametrize("name, dynamic, policy", CASES,
                         ids=[f"{n}-{'dynamic=True' if d else 'automatic'}-{p}" for n, d, p in CASES])
def test_torch_loop_at_a_second_length_equals_its_oracle(name, dynamic, policy):
    """Each length rewritten, with the policy's quantization; output, final state and every input gradient equal
    the uncompiled function (exact) or the fp64 reference op under the quantized spec (state_fp8)."""
    fn, (_, lengths, shape) = _loop(name), LOOPS[name]
    options = {"compiler": "eager", "policy": REFERENCE if policy == "exact" else STATE_FP8_REFERENCE}
    oracle, tol = (fn, 1e-5) if policy == "exact" else (_ir_oracle(name), 1e-6)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="laqat", options=options, dynamic=dynamic)
    first = len(_record().graphs)
    for T in lengths:
        t = torch_inputs("gdn", **dict(shape, T=T), seed=T)
        cotangents = [torch.randn_like(x) for x in fn(**t)[:2]]
        got, got_grads = _outputs_and_grads(compiled, t, cotangents)
        want, want_grads = _outputs_and_grads(oracle, t, cotangents)
        for what, a, b in [("o", got[0], want[0]), ("state", got[1], want[1])] + \
                [(f"d{n}", got_grads[n], want_grads[n]) for n in got_grads]:
            assert rel_l2(a, b) <= tol, (T, what, rel_l2(a, b))
    specs = [[str(m.spec) for m in g.matches] for g in _record().graphs[first:]]
    assert len(specs) == 2 and all(len(s) == 1 for s in specs), [(g.matches, g.near_misses)
                                                                for g in _record().graphs[first:]]
    if policy == "state_fp8":
        assert specs == [[QUANTIZED_SPEC]] * 2, specs


def test_a_loop_over_a_batch_marked_dynamic_is_left_alone_and_says_why():
    """mark_dynamic on the batch: pinning it would fail the compile (ConstraintViolationError); the loop is left as
    it is, equal to eager, with the reason; maybe_mark_dynamic lets the loop be rewritten."""
    fn = gdn_step_dependent("")
    t = torch_inputs("gdn")
    for x in t.values():
        torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(fn, policy=REFERENCE, **t)
    assert report.matches == []
    (reason,) = [m.reason for m in report.near_misses if m.frontend == "torch"]
    assert "marked dynamic with torch._dynamo.mark_dynamic" in reason and "size()[0]" in reason, reason
    for got, want in zip(report.output, fn(**t)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    t = torch_inputs("gdn")
    for x in t.values():
        torch._dynamo.maybe_mark_dynamic(x, 0)
    torch._dynamo.reset()
    report = la_compiler.explain(fn, policy=REFERENCE, **t)
    assert [m.frontend for m in report.matches] == ["torch"], report.near_misses
    for got, want in zip(report.output, fn(**t)):
        assert rel_l2(got, want) <= TOL
