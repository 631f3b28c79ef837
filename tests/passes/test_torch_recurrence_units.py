"""Building blocks of the torch frontend on small Dynamo graphs: time slices, mutation edges,
loop discovery and the step isomorphism."""
import operator

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow
from la_compiler.passes.frontends.torch_recurrence.loops import NotARecurrence, analyze_loop, find_loops
from la_compiler.passes.frontends.torch_recurrence.slices import time_slices


def _graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    (gm,) = graphs
    return gm


def test_time_slices_of_every_spelling():
    def fn(x):
        return x[:, 2], x[..., 1, :], x[:, :, 3, -1, None], x[:, 1:2], x.select(2, 0), x.unbind(1)[3]

    gm = _graph(fn, torch.randn(2, 5, 4, 3))
    found = sorted((s.dim, s.index, s.keepdim) for n in gm.graph.nodes for s in time_slices(n))
    # x[:, :, 3, -1, None] reads index 3 of dim 2 and index 2 (= -1) of dim 3
    assert found == sorted([(1, 2, False), (2, 1, False), (2, 3, False), (3, 2, False), (1, 1, True),
                            (2, 0, False), (1, 3, False)])


def test_setitem_is_a_dependency_of_later_readers():
    def fn(x):
        o = torch.zeros(3, 4)
        o[0] = x[0]
        o[1] = x[1] * 2
        return o.sum(0)

    gm = _graph(fn, torch.randn(3, 4))
    flow = Dataflow(gm)
    writes = [n for n in gm.graph.nodes if n.target is operator.setitem]
    total = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum")
    assert len(writes) == 2
    assert flow.graph.has_edge(writes[0], writes[1]) and flow.graph.has_edge(writes[1], total)
    assert flow.reaches(writes[0], total)


def _scan(x, w, carry_two=False):
    s = torch.zeros(2, 3, 4, 4)
    acc = torch.zeros(2, 3, 4)
    outs = []
    for t in range(x.shape[1]):
        s = s * 0.5 + x[:, t, :, :, None] * w[:, t, :, None, :]
        if carry_two:
            acc = acc + x[:, t]
        outs.append(s.sum(-1) + acc)
    return torch.stack(outs, 1), s


def test_loop_discovery_finds_steps_state_and_outputs():
    gm = _graph(_scan, torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4))
    flow = Dataflow(gm)
    (loop,) = find_loops(flow)
    assert (loop.first, loop.last) == (0, 4)
    body = analyze_loop(flow, loop)
    assert body.steps == 5 and body.o_collector is not None and body.o_time_dim == 1
    assert body.final_state is body.states[-1]
    assert all(s is not None for s in body.states)


def test_loop_with_two_carried_values_is_refused():
    gm = _graph(lambda x, w: _scan(x, w, carry_two=True), torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4))
    flow = Dataflow(gm)
    (loop,) = find_loops(flow)
    try:
        analyze_loop(flow, loop)
    except NotARecurrence as e:
        assert "2 loop-carried values" in e.reason
    else:
        raise AssertionError("a loop carrying two values was accepted")


def test_steps_that_differ_are_not_isomorphic():
    def fn(x):
        s = torch.zeros(2, 3, 4, 4)
        for t in range(x.shape[1]):
            s = s * 0.5 + x[:, t, :, :, None] * x[:, t, :, None, :]
            if t == 2:
                s = s.tanh()  # step 2 does something else
        return s

    gm = _graph(fn, torch.randn(2, 5, 3, 4))
    flow = Dataflow(gm)
    (loop,) = find_loops(flow)
    try:
        analyze_loop(flow, loop)
    except NotARecurrence as e:
        assert "not isomorphic" in e.reason
    else:
        raise AssertionError("a loop whose steps differ was accepted")


def _loop_spans(gm):
    from la_compiler.passes.frontends.torch_recurrence import _span
    return [_span(lp) for lp in find_loops(Dataflow(gm))]


def test_in_place_chains_become_functional_only_where_that_is_exact():
    from la_compiler.passes.frontends.torch_recurrence.inplace import functionalize_inplace

    def fresh(x, y):
        S = x.clone()
        for t in range(3):
            S.mul_(0.5)
            S.add_(y[:, t])
        return S

    def input_mutated(x, y):
        S = x
        for t in range(3):
            S.mul_(0.5)
            S.add_(y[:, t])
        return S

    def view_read_after_a_write(x, y):
        S = x.clone()
        first = S[0]
        for t in range(3):
            S.mul_(0.5)
            S.add_(y[:, t])
        return S, first * 1.0

    x, y = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 3, 4, 4)
    for fn, expected in ((fresh, 6), (input_mutated, 0), (view_read_after_a_write, 0)):
        gm = _graph(fn, x.clone(), y)
        want = fn(x.clone(), y)
        assert functionalize_inplace(gm, _loop_spans(gm)) == expected, fn.__name__
        gm.recompile()
        got = gm(x.clone(), y)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
