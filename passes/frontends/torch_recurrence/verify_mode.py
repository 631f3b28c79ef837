"""The rewrite check: the IR node against the original region on random inputs, at compile time, before
the graph is touched; a mismatch refuses the rewrite (a near miss).

The IR side is ``laqat.delta_rule`` itself (its fp64 ``reference`` variant: this checks the rewrite, not a
kernel's rounding), fed as the replacement feeds it: each input after its entry chain, in [B, T, H, D], the
log of a pre-exponentiated decay, a flattened state reshaped, the fitted scale. The region side is the
region's own nodes (``probe.run_nodes``, casts to fp32 lifted to fp64). Outputs, states and the
vector-Jacobian product of every input are compared (relative L2 <= ``TOL``; with a NaN input, the finite
entries, and both must be finite at the same entries).

Default (every compile; cost bounded independently of T):

- token loops: fresh random inputs (rows of q, k, v of norm 0.7..1: not on the unit sphere); the region run
  on a prefix of ``PREFIX_STEPS`` steps from its initial state and on ``SAMPLED_SEGMENTS`` segments of
  ``SEGMENT_STEPS`` later steps, spread over the sequence and ending at the last step, each from a random
  state put in place of the one the step before carries; forward with a generic, a small and a large state,
  the vector-Jacobian product (of every input and injected state) with the generic one. A loop of at most
  ``WHOLE_STEPS`` (17) steps is checked whole.
- loops over chunks: the region cannot be cut (its intra-chunk work is vectorized over all chunks), and the
  algebra check (``semantics.py``) has already run it whole on random inputs (generic, a large state with a
  NaN, deep decays) and differentiated it: those runs are compared with the IR node on the first chunk and
  two tokens of the second (outputs; the state after the first chunk where the region returns its final
  state), the vector-Jacobian product on the same tokens (the cotangent the algebra check used).
- the IR side runs on the first ``CHECK_BATCH`` batch elements (the fp64 reference loops over the batch in
  Python); the algebra check has compared every batch element with the delta rule.

``verify=True`` (thorough): fresh random inputs, the whole region on every step, token and batch element,
read where the IR node's outputs go (the region's output and final state), two generic draws, a small, a
large state and deep decays forward, the vector-Jacobian product of all outputs with a generic and a large
state.
"""
from __future__ import annotations

import dataclasses

import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, tensor_value
from la_compiler.passes.frontends.torch_recurrence.probe import ProbeError, run_nodes
from la_compiler.passes.frontends.torch_recurrence.region import Region
from la_compiler.passes.frontends.torch_recurrence.semantics import (TOL, Assignment, _deep_decay, _draws,
                                                                   _large_state, rel_err)

PREFIX_STEPS = 8
SAMPLED_SEGMENTS = 3
SEGMENT_STEPS = 2
# token loops this short are checked on every step: the sampled segments need a step between them (the state
# that step carries is replaced by a random one)
WHOLE_STEPS = PREFIX_STEPS + SAMPLED_SEGMENTS * (SEGMENT_STEPS + 1)
CHECK_BATCH = 1  # the default check compares this many batch elements (the algebra check saw all of them)
SEED = 1  # the algebra check draws with seed 0: independent inputs


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps ``start`` .. ``stop - 1`` of a token loop; ``start > 0``: from a random state put in place of the
    state step ``start - 1`` carries."""

    start: int
    stop: int


def segments(steps: int) -> list[Segment]:
    """The steps of a token loop the default check runs: a prefix, and later segments spread over the rest, the
    last ending at the last step; a step the check does not run lies between two segments."""
    if steps <= WHOLE_STEPS:
        return [Segment(0, steps)]
    lo, hi = PREFIX_STEPS + 1, steps - SEGMENT_STEPS
    starts = [lo + (hi - lo) * j // (SAMPLED_SEGMENTS - 1) for j in range(SAMPLED_SEGMENTS)]
    return [Segment(0, PREFIX_STEPS)] + [Segment(t, t + SEGMENT_STEPS) for t in starts]


def check_rewrite(flow: Dataflow, region: Region, a: Assignment, spec: RecurrenceSpec, *,
                  thorough: bool = False) -> str | None:
    """None when the IR node reproduces the region; else the mismatch, for the near-miss report."""
    check = _Check(flow, region, a, spec, "verify" if thorough else "check", thorough)
    try:
        if thorough:
            return check.whole()
        if region.chunk == 1:
            return check.token_segments()
        return check.chunk_evidence()
    except ProbeError as e:
        return f"{check.label}: the original region does not run on random inputs: {e}"
    finally:
        a.evidence = None  # the algebra check's runs are not needed any more


class _Check:
    def __init__(self, flow: Dataflow, region: Region, a: Assignment, spec: RecurrenceSpec, label: str,
                 thorough: bool):
        self.flow, self.region, self.a, self.label = flow, region, a, label
        self.spec = spec.replace(kernel="reference").to_string()
        self.device = tensor_value(region.frontier[0]).device
        self.batch = tensor_value(a.v.node).shape[a.v.perm[0]]
        self.heads = tensor_value(a.v.node).shape[a.v.perm[2]]
        # the IR side (fp64, token by token in Python: its cost grows with the batch) on the first batch elements;
        # the region runs on all of them (its cost barely does)
        self.nb = self.batch if thorough else min(self.batch, CHECK_BATCH)

    # ---- the IR side ----------------------------------------------------------------------------
    def ir_inputs(self, env):
        """q, k, v, g, beta in [B, T, H, D] as the replacement feeds them (entry chains, a negated query, log of a
        decay)."""
        a = self.a
        q, k, v, g, beta = (a.ir_input64(role, env) for role in ("q", "k", "v", "g", "beta"))
        q = q * a.query_sign
        if a.decay_form == "exp":
            g = g.log()
        return q, k, v, g, beta

    def ir_state(self, x):
        """A state of the region (or a flattened [B*HV, K, V] one) as the IR node lays it out, first ``nb``
        batch elements."""
        if x is None:
            return None
        return (x if x.dim() == 4 else x.reshape(-1, self.heads, *x.shape[-2:]))[:self.nb]

    def ir(self, inputs, start: int, stop: int, h0):
        """The IR node on tokens start .. stop - 1 of the first ``nb`` batch elements from state h0:
        (o [nb, L, HV, V], final state)."""
        q, k, v, g, beta = (x[:self.nb, start:stop].contiguous() for x in inputs)
        scale = abs(float(self.a.scale))  # a negated query is negated in ir_inputs
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, self.ir_state(h0), None, scale, self.spec)

    def region_part(self, node, x):
        """A frontier tensor (or its gradient) of the region, in the IR's layout, first ``nb`` batch elements;
        None for a tensor that is no input of the IR node."""
        a = self.a
        for lay in (a.q, a.k, a.v, a.g, a.beta):
            if node is lay.node:
                return lay.to_ir(x)[:self.nb]
        return self.ir_state(x) if node is a.h0 or node in self.region.body.states else None

    def h0(self, env):
        return self.a.ir_input64("h0", env) if self.a.h0 is not None else None

    # ---- comparisons ------------------------------------------------------------------------------
    def mismatch(self, where: str, errors: dict) -> str | None:
        bad = {k: e for k, e in errors.items() if not e <= TOL}
        if not bad:
            return None
        return (f"{self.label}: the IR node differs from the original region on random inputs ({where}: "
                + ", ".join(f"{k} relative L2 {e:.2e}" for k, e in bad.items()) + f" > {TOL:g})")

    # ---- token loops: a prefix and sampled segments ----------------------------------------------------
    def token_segments(self) -> str | None:
        region, body = self.region, self.region.body
        segs = segments(body.steps)
        first = self.flow.pos[body.windows[0][0]]
        live = set(region.ordered(self.flow))
        pre = [n for n in region.ordered(self.flow) if self.flow.pos[n] < first]
        nodes = list(pre)
        for s in segs:
            nodes += [n for t in range(s.start, s.stop) for n in body.windows[t] if n is not None and n in live]
        gen = torch.Generator().manual_seed(SEED)
        base = _draws(region, self.a.g.node, self.a.decay_form, gen, self.device)
        injected = {s: 0.3 * torch.randn(tuple(tensor_value(body.states[s.start - 1]).shape), generator=gen,
                                         dtype=torch.float64).to(self.device) for s in segs if s.start}
        for what, env, states, vjp in (
                ("generic inputs", base, injected, True),
                ("a small state", _scaled(self.a, base, gen, -6, -3), _spread(injected, gen, -5, -2), False),
                ("a large state", _large_state(self.a, base, gen), _spread(injected, gen, 2, 5), False)):
            why = self.compare_segments(nodes, segs, env, states, what, vjp)
            if why:
                return why
        return None

    def compare_segments(self, nodes, segs, env, injected, what, vjp: bool) -> str | None:
        body, a = self.region.body, self.a
        leaves = {**env, **{body.states[s.start - 1]: x for s, x in injected.items()}}
        if vjp:
            leaves = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
        with torch.set_grad_enabled(vjp):
            out = run_nodes(nodes, {n: x.clone() for n, x in leaves.items()} if vjp else leaves, grad=vjp)
            inputs = self.ir_inputs(leaves)
            got, ref = [], []
            for s in segs:
                h0 = leaves[body.states[s.start - 1]] if s.start else self.h0(leaves)
                o_ir, s_ir = self.ir(inputs, s.start, s.stop, h0)
                o_got = self.segment_output(out, s).permute(a.out_perm)[:self.nb]
                got.append(o_got)
                ref.append(o_ir)
                errors = {"o": _rel(o_got, o_ir)}
                last = body.states[s.stop - 1]
                if last is not None:
                    got.append(self.ir_state(out[last]))
                    ref.append(s_ir)
                    errors["state"] = _rel(got[-1], s_ir)
                why = self.mismatch(f"{_steps(s, body.steps)}, {what}", errors)
                if why:
                    return why
            if not vjp:
                return None
            where = ", ".join(_steps(s, body.steps) for s in segs)
            return self.compare_vjp(leaves, got, ref, f"{where}, {what}")

    def segment_output(self, out, s: Segment):
        body = self.region.body
        if body.o_buffer is not None:
            return out[body.o_buffer].narrow(body.o_time_dim, s.start, s.stop - s.start)
        items = [out[body.windows[t][body.o_offset]] for t in range(s.start, s.stop)]
        name = getattr(body.o_collector.target, "__name__", "")
        return torch.stack(items, body.o_time_dim) if name == "stack" else torch.cat(items, body.o_time_dim)

    def compare_vjp(self, leaves: dict, got: list, ref: list, where: str) -> str | None:
        gen = torch.Generator().manual_seed(SEED + 6)
        co = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.device) for r in ref]
        nodes = list(leaves)
        with torch.enable_grad():
            g_got = torch.autograd.grad(sum((x * c).sum() for x, c in zip(got, co)), [leaves[n] for n in nodes],
                                        allow_unused=True)
            g_ref = torch.autograd.grad(sum((x * c).sum() for x, c in zip(ref, co)), [leaves[n] for n in nodes],
                                        allow_unused=True)
        return self.mismatch(f"vector-Jacobian product, {where}", self.grad_errors(nodes, leaves, g_got, g_ref))

    def grad_errors(self, nodes, leaves, g_got, g_ref) -> dict:
        errors = {}
        for n, x, y in zip(nodes, g_got, g_ref):
            x = torch.zeros_like(leaves[n]) if x is None else x
            y = torch.zeros_like(leaves[n]) if y is None else y
            errors[f"d{self.role(n)}"] = rel_err(x, y)
        return errors

    def role(self, n) -> str:
        a = self.a
        roles = {a.q.node: "q", a.k.node: "k", a.v.node: "v", a.g.node: "g", a.beta.node: "beta", a.h0: "h0"}
        if n in roles:
            return roles[n]
        states = self.region.body.states
        return f"(the state entering step {states.index(n) + 1})" if n in states else f"({n.name})"

    # ---- loops over chunks: the algebra check's runs ------------------------------------------------
    def chunk_evidence(self) -> str | None:
        a, region = self.a, self.region
        evidence = a.evidence
        if evidence is None:  # no runs kept (a caller that skipped the algebra check): the whole region
            return self.whole()
        T, C = region.seq_len, region.chunk
        first = min(C, T)  # the first chunk, then two tokens of the second: the state crosses a chunk boundary
        stop = min(T, C + 2)
        with torch.no_grad():
            for what, env, (o_got, _, s_first) in evidence.runs:
                inputs = self.ir_inputs(env)
                o_ir, s_ir = self.ir(inputs, 0, first, self.h0(env))
                if stop > first:
                    o_ir = torch.cat([o_ir, self.ir(inputs, first, stop, s_ir)[0]], 1)
                errors = {"o": _rel(o_got.permute(a.out_perm)[:self.nb, :stop], o_ir)}
                if s_first is not None and region.final_state is not None:
                    # the state the first step carries is the final state's kind (the same step's value)
                    errors["state after the first chunk"] = _rel(self.ir_state(s_first), s_ir)
                why = self.mismatch(f"tokens 0-{stop - 1}, {what}", errors)
                if why:
                    return why
        if evidence.vjp is None:
            return None
        # the region's gradient came from a cotangent on every batch element; the algebra check found it equal to
        # the delta rule's, whose batch elements are independent: its first ones are those of their cotangents
        env, co, steps, g_got = evidence.vjp
        leaves = {n: x.detach().clone().requires_grad_() for n, x in env.items()}
        nodes = [n for n in env if self.region_part(n, env[n]) is not None]
        with torch.enable_grad():
            o_ir, _ = self.ir(self.ir_inputs(leaves), 0, steps, self.h0(leaves))
            g_ref = torch.autograd.grad((o_ir * co[:self.nb, :steps]).sum(), [leaves[n] for n in nodes],
                                        allow_unused=True)
        errors = {}
        for n, y in zip(nodes, g_ref):
            x = g_got.get(n)
            x, y = (torch.zeros_like(env[n]) if t is None else t for t in (x, y))
            errors[f"d{self.role(n)}"] = rel_err(self.region_part(n, x), self.region_part(n, y))
        return self.mismatch(f"vector-Jacobian product of tokens 0-{steps - 1}, generic inputs", errors)

    # ---- verify=True: the whole region ---------------------------------------------------------------
    def whole(self) -> str | None:
        region, body, a = self.region, self.region.body, self.a
        nodes = region.ordered(self.flow)
        last = region.final_state if region.final_state is not None else \
            (body.states[-1] if region.chunk == 1 else None)
        runs = []
        for seed in (SEED, SEED + 1):
            gen = torch.Generator().manual_seed(seed)
            runs.append((f"generic inputs (seed {seed})", _draws(region, a.g.node, a.decay_form, gen, self.device),
                         seed == SEED))
        gen = torch.Generator().manual_seed(SEED + 2)
        base = runs[0][1]
        runs += [("a small state", _scaled(a, base, gen, -6, -3), False),
                 ("a large state", _large_state(a, base, gen), True),
                 ("deep decays", _deep_decay(region, a, base, gen), False)]
        for what, env, vjp in runs:
            leaves = {n: x.detach().clone().requires_grad_() for n, x in env.items()} if vjp else env
            with torch.set_grad_enabled(vjp):
                out = run_nodes(nodes, {n: x.clone() for n, x in leaves.items()} if vjp else leaves, grad=vjp)
                o_got = out[region.output].permute(a.out_perm)
                o_ir, s_ir = self.ir(self.ir_inputs(leaves), 0, region.seq_len, self.h0(leaves))
                got, ref = [o_got], [o_ir]
                errors = {"o": _rel(o_got, o_ir)}
                if last is not None and out.get(last) is not None:
                    got.append(self.ir_state(out[last]))
                    ref.append(s_ir)
                    errors["final_state"] = _rel(got[1], s_ir)
                where = f"all {region.seq_len} tokens, {what}"
                why = self.mismatch(where, errors)
                if why:
                    return why
                if vjp:
                    why = self.compare_vjp(leaves, got, ref, where)
                    if why:
                        return why
        return None


def _steps(s: Segment, steps: int) -> str:
    where = f"step {s.start}" if s.stop == s.start + 1 else f"steps {s.start}-{s.stop - 1}"
    return f"{where} of {steps}" + (" from a random state" if s.start else "")


def _rel(got, ref) -> float:
    """Relative L2 over the entries finite in both; infinite where one is finite and the other is not (a NaN
    input: the rewrite would hide or add a non-finite value)."""
    got, ref = got.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    if (finite != torch.isfinite(got)).any():
        return float("inf")
    return rel_err(got[finite], ref[finite]) if finite.any() else 0.0


def _spread(states: dict, gen, lo: float, hi: float) -> dict:
    """Each state scaled element by element, log-uniformly, by 10**lo .. 10**hi."""
    return {s: x * 10.0 ** (lo + (hi - lo) * torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device))
            for s, x in states.items()}


def _scaled(a: Assignment, env: dict, gen, lo: float, hi: float) -> dict:
    """v and the initial state scaled element by element, log-uniformly, by 10**lo .. 10**hi."""
    env = dict(env)
    for node in (a.v.node, a.h0):
        if node is not None:
            env[node] = _spread({node: env[node]}, gen, lo, hi)[node]
    return env
