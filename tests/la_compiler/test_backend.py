import functools
import subprocess
import sys

import pytest
import torch

import la_compiler
from la_compiler.backend import BackendOptionsError, laqat_backend
from la_compiler.explainer import NothingMatchedWarning
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from la_compiler.record import CompileRecord
from tests.helpers import assert_close_rel
from tests.ir_inputs import random_inputs


def _call(kind, kernel="auto", state="kv"):
    spec = RecurrenceSpec(kind=kind, kernel=kernel, state=state).to_string()

    def fn(q, k, v, g, beta, h0, cu):
        o, ht = torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, cu, 0.5, spec)
        return o, ht
    return fn


def test_entry_point_in_a_fresh_process():
    code = ("import sys, torch\n"
            "f = torch.compile(lambda x: x * 2, backend='laqat')\n"
            "assert f(torch.ones(2)).tolist() == [2.0, 2.0]\n"
            "print('la_compiler' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("options, message", [
    ({"colour": 1}, r"unknown laqat option\(s\) \['colour'\]"),
    ({"compiler": "tvm"}, r"options\['compiler'\] must be one of"),
    ({"verify": "yes"}, r"options\['verify'\] must be a bool"),
])
def test_bad_options_are_named(options, message):
    fn = torch.compile(lambda x: x + 1, backend="laqat", options=options)
    with pytest.raises(BackendOptionsError, match=message):  # as itself, not wrapped by Dynamo
        fn(torch.ones(2))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_ir_op_through_the_backend_matches_fp64_reference(kind, compiler):
    (q, k, v, g, beta, h0), cu = random_inputs(kind, T=5, H=1, HV=2, initial_state=True)
    fn = torch.compile(_call(kind), backend="laqat", fullgraph=True, options={"compiler": compiler})
    o, ht = fn(q, k, v, g, beta, h0, None)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = torch.autograd.grad((o, ht), (q, k, v, g, beta, h0), (do, dht))
    ro, rht = delta_rule_reference(q, k, v, g, beta, kind=kind, scale=0.5, initial_state=h0)
    rgrads = torch.autograd.grad((ro, rht), (q, k, v, g, beta, h0), (do.double(), dht.double()))
    assert_close_rel(o, ro, 1e-6, "o")
    assert_close_rel(ht, rht, 1e-6, "final state")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, rgrads):
        assert_close_rel(a, b, 1e-6, name)


def test_explain_reports_the_node_and_the_graph():
    (q, k, v, g, beta, _), _ = random_inputs("kda", T=4)
    report = la_compiler.explain(_call("kda"), q, k, v, g, beta, None, None)
    (match,) = report.matches
    assert (match.kind, match.frontend, match.module) == ("kda", "user", "")
    spec = RecurrenceSpec.parse(match.spec)
    assert spec.kernel == match.kernel and spec.kernel != "auto"
    text = str(report)
    assert "KDA at <top>" in text and "torch.ops.laqat.delta_rule" in text and match.spec in text


def test_explain_warns_when_nothing_matched():
    with pytest.warns(NothingMatchedWarning):
        report = la_compiler.explain(lambda x: x.cumsum(0), torch.randn(4))
    assert report.matches == []


def test_module_names_come_from_the_module_stack():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            return _call("gdn")(q, k, v, g, beta, None, None)[0]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(), Attn()])

        def forward(self, *xs):
            return self.layers[1](*xs) + self.layers[0](*xs)

    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=3)
    report = la_compiler.explain(Model(), q, k, v, g, beta)
    assert sorted(m.module for m in report.matches) == ["layers.0", "layers.1"]


def test_explain_counts_graph_breaks():
    def fn(x):
        y = x * 2
        print("a graph break")
        return y + 1

    with pytest.warns(NothingMatchedWarning):
        report = la_compiler.explain(fn, torch.randn(3))
    assert report.graph_breaks == 1 and len(report.graphs) == 2
    assert "1 graph break(s)" in str(report)


@pytest.mark.parametrize("kind,kernel,kept", [("gdn", "chunk", True), ("kda", "chunk", True),
                                              ("gdn", "fused_recurrent", False)])
def test_ir_op_keeps_the_variants_residual_only_where_a_gradient_flows(kind, kernel, kept):
    """laqat::delta_rule resolves to delta_rule_train (o, final state and the residual the kernel variant keeps for
    its backward: the chunk kernels' T, A_qk and G or P; nothing for the fused recurrent kernels) where an input
    needs a gradient, to delta_rule_eval under no_grad; traced for autograd, the backward op takes the residual."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from la_compiler.kernels.chunk.params import ChunkParams
    from la_compiler.kernels.chunk.residual import residual_size

    (q, k, v, g, beta, h0), _ = random_inputs(kind, T=5, H=1, HV=2, K=8, V=8, initial_state=True)
    spec = RecurrenceSpec(kind=kind, kernel=kernel, chunk=8)
    o, ht, residual = torch.ops.laqat.delta_rule_train(q, k, v, g, beta, h0, None, 0.5, spec.to_string())
    assert residual.dtype == torch.float32 and (residual.numel() > 0) == kept
    assert kind == "kda" or torch.isfinite(residual).all()  # (KDA's P: blocks above the diagonal are not written)
    if kept:
        assert residual.numel() == residual_size(ChunkParams.from_spec(spec), q, v, None)
    call = _call(kind, kernel=kernel)

    def step(q, k, v, g, beta, h0):
        o, ht = call(q, k, v, g, beta, h0, None)
        return torch.autograd.grad((o, ht), (q, k, v, g, beta, h0), (torch.ones_like(o), torch.ones_like(ht)))

    ops = {n.target.name() for n in make_fx(step, tracing_mode="fake")(q, k, v, g, beta, h0).graph.nodes
           if n.op == "call_function" and hasattr(n.target, "name")}
    assert {"laqat::delta_rule_train", "laqat::delta_rule_backward"} <= ops and "laqat::delta_rule_eval" not in ops
    with torch.no_grad():
        ops = {n.target.name() for n in make_fx(call, tracing_mode="fake")(q, k, v, g, beta, h0, None).graph.nodes
               if n.op == "call_function" and hasattr(n.target, "name")}
    assert "laqat::delta_rule_eval" in ops and "laqat::delta_rule_train" not in ops


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_activation_checkpointing_recomputes_the_residual(kind):
    """Under torch.utils.checkpoint (eager and compiled with laqat) the forward runs again in the backward and keeps
    a fresh residual: every gradient equals the one without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    xs, _ = random_inputs(kind, T=11, H=1, HV=2, K=8, V=8, initial_state=True)
    call = _call(kind, kernel="chunk")

    def loss(*xs):
        o, ht = call(*xs, None)
        return (o * o).sum() + ht.sum()

    want = torch.autograd.grad(loss(*xs), xs)
    compiled = torch.compile(lambda *xs: checkpoint(loss, *xs, use_reentrant=False), backend="laqat", fullgraph=True,
                             options={"compiler": "inductor"})
    for run in (lambda *xs: checkpoint(loss, *xs, use_reentrant=False), compiled):
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), torch.autograd.grad(run(*xs), xs), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_keeping_everything_through_the_compiled_op(kind):
    """options={"tuning": {"keep_residual": "all"}} through the op compiled by laqat (Inductor checks every output's
    size against the fake's), varlen: the spec carries t.keep_residual=all, the residual's varlen bound is the
    same at trace and run time, and every gradient equals the compiled default's, bit for bit."""
    xs, cu = random_inputs(kind, T=13, H=1, HV=2, K=8, V=8, initial_state=True, cu_seqlens=[0, 5, 13])
    call = _call(kind, kernel="chunk")

    def loss(*xs):
        o, ht = call(*xs, cu)
        return (o * o).sum() + ht.sum()

    def compiled_grads(options):
        torch._dynamo.reset()  # a fresh compilation for each
        record = CompileRecord()
        compiled = torch.compile(loss, backend=functools.partial(laqat_backend, options=options, _record=record),
                                 fullgraph=True)
        grads = torch.autograd.grad(compiled(*xs), xs)
        return grads, [m.spec for g in record.graphs for m in g.matches]

    want, specs = compiled_grads({"compiler": "inductor"})
    assert specs and not any("t.keep_residual" in spec for spec in specs)
    got, specs = compiled_grads({"compiler": "inductor", "tuning": {"keep_residual": "all"}})
    assert specs and all(spec.endswith("t.keep_residual=all]") for spec in specs)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
