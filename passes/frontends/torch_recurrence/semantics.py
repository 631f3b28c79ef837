"""Semantic check: does the region compute the GDN/KDA delta rule, and with which inputs?

The region's frontier tensors are assigned roles (q, k, v, g, beta, initial state) and
layouts ([B, T, H, D] or [B, H, T, D], found from the sequence dim; D last). For each
assignment the region runs on random float64 probe inputs (``probe.py``) and is compared
with the fp64 delta rule (``reference.py``); the only free parameter, the query scale, is
fitted by least squares and must be nonzero (a negative one is a readout of the negated query, ``S^T (-q)``:
the IR node reads ``-q``). A match below ``TOL`` relative L2 on
independent random inputs is a randomized identity test of the algebra (the region is a
fixed composition of polynomial, exp and masking ops; a wrong einsum string, time index,
sign or mask changes the values at random points with probability one).

Token loops are checked on their first two steps only; ``loops.py`` has proven the other
steps isomorphic to them, so the check covers every step at a cost independent of T.
When no assignment matches, the near-miss variants and two property probes (head locality,
causality) name what is wrong.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from la_compiler.passes.frontends.torch_recurrence import rules
from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, tensor_value
from la_compiler.passes.frontends.torch_recurrence.entry import (IDENTITY, RESHAPE_FUNCTIONS, RESHAPE_METHODS,
                                                                 _is_template_use)
from la_compiler.passes.frontends.torch_recurrence.loops import NotARecurrence
from la_compiler.passes.frontends.torch_recurrence.probe import ProbeError, run_nodes
from la_compiler.passes.frontends.torch_recurrence.reference import EXACT, NEAR_MISSES, Variant, delta_rule_steps
from la_compiler.passes.frontends.torch_recurrence.region import Region, _per_token

TOL = 1e-6  # float64 probes: the chunked and token orders of summation agree to ~1e-13
TOKEN_PROBE_STEPS = 2
PREFIX_STEPS = 2


def _inverse(perm):
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return tuple(inv)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a frontier tensor maps to the IR's [B, T, H, D] (or [B, T, H]): value.permute(perm)."""

    node: torch.fx.Node
    perm: tuple

    def to_ir(self, x):
        return x.permute(self.perm)


@dataclasses.dataclass
class Evidence:
    """The runs of the region an accepted assignment passed in the algebra check (loops over chunks, where they run
    the whole region): the rewrite check (``verify_mode.py``) compares them with the IR node instead of running
    the region again."""

    # (what, env, (o as the region lays it out, final state, state after the first chunk))
    runs: list = dataclasses.field(default_factory=list)
    vjp: tuple | None = None  # (env, cotangent of o in [B, T, HV, V], tokens it covers, {frontier node: gradient})


@dataclasses.dataclass
class Assignment:
    kind: str
    q: Layout
    k: Layout
    v: Layout
    g: Layout
    beta: Layout
    decay_form: str  # "log": the graph multiplies by exp(g); "exp": it multiplies by g itself
    h0: torch.fx.Node | None
    state: str  # "kv" | "vk"
    out_perm: tuple  # region output -> [B, T, HV, V]
    scale: float = 1.0
    chains: dict = dataclasses.field(default_factory=dict, repr=False)  # frontier node -> EntryChain | None
    evidence: Evidence | None = dataclasses.field(default=None, repr=False)  # loops over chunks (stress)

    def chain(self, role: str):
        """The entry chain replayed in front of the IR node for ``role`` (the query's trailing
        scalars are folded into ``scale`` instead)."""
        node = self.h0 if role == "h0" else getattr(self, role).node
        chain = self.chains.get(node) or IDENTITY
        return chain.split_query()[0] if role == "q" else chain

    def ir_input64(self, role: str, env):
        """The role's value in [B, T, H, D] on float64 probes, after its entry chain."""
        x = self.chain(role).apply64(env[self.h0 if role == "h0" else getattr(self, role).node])
        return x if role == "h0" else getattr(self, role).to_ir(x)

    @property
    def query_sign(self) -> float:
        """-1 for a readout of the negated query (``S^T (-q)``): the IR node reads ``-q`` with the scale ``|scale|``
        (its scale is positive)."""
        return -1.0 if self.scale < 0 else 1.0

    def describe(self) -> str:
        return (f"{self.kind}: q={self.q.node.name} k={self.k.node.name} v={self.v.node.name} "
                f"g={self.g.node.name}({self.decay_form}) beta={self.beta.node.name} "
                f"h0={self.h0.name if self.h0 is not None else None} state={self.state} scale={self.scale:.6g}")


def _layouts(node, seq_len: int, rank: int):
    v = tensor_value(node)
    out = []
    for td in range(v.dim()):
        if v.shape[td] != seq_len:
            continue
        others = [d for d in range(v.dim()) if d != td]
        if rank == 4 and others[-1] != 3:
            continue
        out.append(Layout(node, (others[0], td, *others[1:])))
    return out


def _shape(layout: Layout):
    v = tensor_value(layout.node)
    return tuple(v.shape[d] for d in layout.perm)


def candidate_assignments(flow: Dataflow, region: Region, seq_len: int):
    """Every shape-consistent role assignment of the frontier (lazy)."""
    per_token3, per_token4 = [], []
    # the initial state is the input that flows into the state entering the first step (by the
    # dataflow: with T = K = V a head-first q has the state's shape too)
    states = initial_state_inputs(region)
    for n in region.frontier:
        v = tensor_value(n)
        if v is None or not v.dtype.is_floating_point:
            raise NotARecurrence(f"the recurrence reads {n.name}, which is not a floating tensor", nodes=[n.name])
        if n in states:
            continue
        if _per_token(v, seq_len - 1, seq_len) and v.dim() in (3, 4):
            (per_token3 if v.dim() == 3 else per_token4).append(n)
        else:
            raise NotARecurrence(f"the recurrence reads {n.name} of shape {tuple(v.shape)}, which is no q, k, v, g, "
                                 f"beta or state", nodes=[n.name])
    if len(states) > 1:
        raise NotARecurrence(f"{len(states)} inputs flow into the initial state "
                             f"({', '.join(s.name for s in states)}); at most one initial state", nodes=[s.name for s in states])
    h0 = states[0] if states else None
    counts = (len(per_token3), len(per_token4))
    kinds = {(2, 3): "gdn", (1, 4): "kda"}
    if counts not in kinds:
        raise _RoleCountError(counts, per_token3, per_token4, h0)
    kind = kinds[counts]
    out = []
    # likely first: q is the one input that never reaches the state (it only reads it)
    reaches = {n: flow.reaches(n, region.body.states[0], limit=512) for n in per_token4}
    per_token4.sort(key=lambda n: reaches[n])
    for roles4 in itertools.permutations(per_token4):
        for roles3 in itertools.permutations(per_token3):
            if kind == "gdn":
                (q, k, v), (g, beta) = roles4, roles3
            else:
                (q, k, v, g), (beta,) = roles4, roles3
            out.extend(_enumerate(region, seq_len, kind, q, k, v, g, beta, h0))
    return out


def initial_state_inputs(region: Region) -> list:
    """The frontier tensors the state entering the first step is computed from (``h0``,
    ``h0.clone()``, ``zeros + h0``; a tensor lending only its dtype or shape does not count)."""

    init = region.body.init
    frontier = set(region.frontier)
    seen, stack, found = {init}, [init], []
    while stack:
        n = stack.pop()
        if n in frontier:
            found.append(n)
            continue
        if n not in region.nodes:
            continue
        for a in n.all_input_nodes:
            if a not in seen and not _is_template_use(n, a):
                seen.add(a)
                stack.append(a)
    return sorted(found, key=region.frontier.index)


def _enumerate(region, seq_len, kind, q, k, v, g, beta, h0):
    """Assignments of these role nodes over every layout, state layout and decay form."""
    out = []
    for lq, lk, lv, lg, lb in itertools.product(*(
            _layouts(x, seq_len, r) for x, r in ((q, 4), (k, 4), (v, 4), (g, 4 if kind == "kda" else 3),
                                                 (beta, 3)))):
        sq, sk, sv, sg, sb = map(_shape, (lq, lk, lv, lg, lb))
        B, T, H, K = sq
        HV, V = sv[2], sv[3]
        if sk != sq or sv[:2] != (B, T) or HV % H or sb != (B, T, HV):
            continue
        if sg != ((B, T, HV) if kind == "gdn" else (B, T, HV, K)):
            continue
        for state in _state_layouts(h0, region, B, HV, K, V):
            for out_perm in _out_perms(region, seq_len, (B, T, HV, V)):
                for form in ("log", "exp"):
                    out.append(Assignment(kind, lq, lk, lv, lg, lb, form, h0, state, out_perm,
                                          chains=region.chains))
    return out


class _RoleCountError(NotARecurrence):
    def __init__(self, counts, p3, p4, h0):
        super().__init__(f"the recurrence reads {counts[0]} per-token [B, T, H] and {counts[1]} per-token "
                         f"[B, T, H, D] tensors; GDN needs 2 + 3 (g, beta; q, k, v), KDA 1 + 4",
                         nodes=[n.name for n in p3 + p4])
        self.p3, self.p4, self.h0 = p3, p4, h0


def _state_layouts(h0, region: Region, B, HV, K, V):
    shapes = []
    for n in (h0, region.final_state):
        if n is not None:
            shapes.append(tuple(tensor_value(n).shape))
    if region.chunk == 1 and region.body.states[0] is not None:
        shapes.append(tuple(tensor_value(region.body.states[0]).shape))
    out = []
    for name, shape in (("kv", (B, HV, K, V)), ("vk", (B, HV, V, K))):
        # [B, HV, K, V], or flattened over batch and heads ([B*HV, K, V]: per-step bmm spellings)
        if all(s in (shape, (B * HV, *shape[2:])) for s in shapes):
            out.append(name)
    return out


def _out_perms(region: Region, seq_len, want):
    v = tensor_value(region.output)
    if v.dim() != 4:
        return []
    tdims = [region.body.o_time_dim] if region.chunk == 1 else [d for d in range(4) if v.shape[d] == seq_len]
    out = []
    for td in tdims:
        others = [d for d in range(4) if d != td]
        if others[-1] != 3:
            continue
        perm = (others[0], td, others[1], 3)
        if tuple(v.shape[d] for d in perm) == want:
            out.append(perm)
    return out


# ---- probing --------------------------------------------------------------------------------
def _draws(region: Region, g_node, form, gen, device):
    env = {}
    for n in region.frontier:
        v = tensor_value(n)
        shape = tuple(v.shape)
        if n is g_node:
            u = torch.rand(shape, generator=gen, dtype=torch.float64)
            x = (-0.4 + 0.38 * u) if form == "log" else (0.65 + 0.33 * u)
        elif v.dim() == 3 and _per_token(v, region.seq_len - 1, region.seq_len):
            x = 0.1 + 0.8 * torch.rand(shape, generator=gen, dtype=torch.float64)
        elif _per_token(v, region.seq_len - 1, region.seq_len):
            # rows of norm 0.7..1: not on the unit sphere (a key renormalization the region does is then seen),
            # and |1 - beta |k|^2| <= 1 for beta in (0, 2) (long probes stay bounded)
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            norms = 0.7 + 0.3 * torch.rand((*shape[:-1], 1), generator=gen, dtype=torch.float64)
            x = x / x.norm(dim=-1, keepdim=True) * norms
        else:
            x = 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
        chain = region.chains.get(n)
        if chain is not None and chain.factor != 1.0:
            x = x / chain.factor  # the draw is the value after the entry chain's scalars
        env[n] = x.to(device)
    return env


class Probe:
    """Runs the region on probe inputs and returns (o [B, T', HV, V] in region layout order, S). A loop over
    chunks also keeps, in ``first_state``, the state its first step carries to the second (the state after the
    first chunk), for the rewrite check."""

    def __init__(self, flow: Dataflow, region: Region):
        self.flow, self.region = flow, region
        body = region.body
        self.token = region.chunk == 1
        self.first_state = None
        ordered = region.ordered(flow)
        if self.token:
            m = min(TOKEN_PROBE_STEPS, body.steps)
            self.steps = m
            window_nodes = set(n for w in body.windows[:m] for n in w if n is not None)
            first = flow.pos[body.windows[0][0]]
            self.nodes = [n for n in ordered if flow.pos[n] < first or n in window_nodes]
        else:
            self.steps = region.seq_len
            self.nodes = [n for n in ordered if n is not region.output] + [region.output]

    def __call__(self, env, grad: bool = False, lift: bool = True):
        body, region = self.region.body, self.region
        out = run_nodes(self.nodes, env, grad=grad, lift=lift)
        if self.token:
            if body.o_buffer is not None:
                o = out[body.o_buffer].narrow(body.o_time_dim, 0, self.steps).clone()
            else:
                items = [out[body.windows[w][body.o_offset]] for w in range(self.steps)]
                name = getattr(body.o_collector.target, "__name__", "")
                o = torch.stack(items, body.o_time_dim) if name == "stack" else torch.cat(items, body.o_time_dim)
            state = out[body.states[0]]
        else:
            o = out[region.output]
            state = out[region.final_state] if region.final_state is not None else None
            self.first_state = out.get(body.states[0]) if body.states[0] is not None else None
        return o, state


def _reference(a: Assignment, env, steps, variant: Variant, scale=1.0):
    q, k, v, g, beta = (a.ir_input64(role, env)[:, :steps] for role in ("q", "k", "v", "g", "beta"))
    HV = v.shape[2]
    q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
    decay = g.exp() if a.decay_form == "log" else g
    B, K, V = q.shape[0], q.shape[-1], v.shape[-1]
    if a.h0 is not None:
        h0 = a.ir_input64("h0", env)
        h0 = h0.reshape(B, HV, *h0.shape[-2:])  # a flattened [B*HV, K, V] state
        h0 = h0 if a.state == "kv" else h0.transpose(-1, -2)
    else:
        h0 = torch.zeros(B, HV, K, V, dtype=torch.float64, device=q.device)
    o, S = delta_rule_steps(q * scale, k, v, decay, beta, h0, variant)
    return o, (S if a.state == "kv" else S.transpose(-1, -2))


def rel_err(x, y) -> float:
    d = y.norm().item()
    return (x - y).norm().item() / (d if d > 0 else 1.0)


def _compare(a: Assignment, env, got, steps, variant: Variant, token: bool):
    """(relative error, fitted scale). A loop over chunks is first checked on its first two
    tokens (the outputs are causal), so that only a plausible assignment pays for all T."""
    if not token and steps > PREFIX_STEPS:
        o_prefix = got[0].permute(a.out_perm)[:, :PREFIX_STEPS].permute(_inverse(a.out_perm))
        err, _ = _compare(a, env, (o_prefix, None), PREFIX_STEPS, variant, token)
        if not err <= TOL:
            return err, 0.0
    o_got, s_got = got
    o_got = o_got.permute(a.out_perm)
    o_ref, s_ref = _reference(a, env, steps, variant)
    denom = (o_ref * o_ref).sum().item()
    if denom == 0:
        return math.inf, 0.0
    c = (o_got * o_ref).sum().item() / denom
    err = rel_err(o_got, c * o_ref) if c != 0 else math.inf  # c < 0: a negated query (``S^T (-q)``)
    if s_got is not None:
        if token:
            _, s_ref = _reference(a, env, 1, variant)
        err = max(err, rel_err(s_got.reshape(s_ref.shape), s_ref))
    return err, c


def solve(flow: Dataflow, region: Region, seed: int = 0) -> Assignment:
    """The role assignment under which the region is the delta rule; raises NotARecurrence
    with the most specific reason otherwise."""
    try:
        assignments = candidate_assignments(flow, region, region.seq_len)
    except _RoleCountError as e:
        raise NotARecurrence(_diagnose_counts(flow, region, e) or e.reason, nodes=e.nodes) from None
    if not assignments:
        raise NotARecurrence("no assignment of q, k, v, g, beta to the recurrence's inputs has consistent shapes "
                             f"(inputs: {', '.join(f'{n.name}{tuple(tensor_value(n).shape)}' for n in region.frontier)})",
                             nodes=[n.name for n in region.frontier])
    probe = Probe(flow, region)
    device = tensor_value(region.frontier[0]).device if region.frontier else "cpu"
    groups = {}
    for a in assignments:
        groups.setdefault((a.g.node, a.decay_form), []).append(a)
    # one region run per (g, form): try first the input that meets an exp or a cumsum soon (a log-decay)
    groups = dict(sorted(groups.items(), key=lambda item: not _feeds_exp(region, item[0][0])))
    best = (math.inf, None)
    results, stressed = [], None
    for (g_node, form), members in groups.items():
        gen = torch.Generator().manual_seed(seed)
        env = _draws(region, g_node, form, gen, device)
        try:
            got = probe(env)
        except ProbeError as e:
            raise NotARecurrence(f"the region does not run on probe inputs: {e}") from None
        first_state = probe.first_state
        results.append((env, got, members))
        for a in members:
            err, c = _compare(a, env, got, probe.steps, EXACT, probe.token)
            if err <= TOL:
                a.scale = _snap_scale(c, tensor_value(a.q.node).shape[a.q.perm[3]])
                # a decay multiplied in directly that is not provably positive is checked at run time (replace.py)
                why = stress(region, probe, a, env, gen, (*got, first_state))
                if why is None:
                    return a
                stressed = stressed or f"{why} (under {a.describe()})"
                continue
            best = min(best, (err, a.describe()), key=lambda t: t[0])
    if stressed:
        raise NotARecurrence(stressed)
    for variant in NEAR_MISSES:
        for env, got, members in results:
            for a in members:
                if _compare(a, env, got, probe.steps, variant, probe.token)[0] <= TOL:
                    raise NotARecurrence(f"{variant.reason} (under {a.describe()})")
    prop = _property_probes(region, probe, results)
    if prop:
        raise NotARecurrence(prop)
    mixed = [n.name for n, chain in region.chains.items() if chain is None]
    hint = f"; {', '.join(mixed)} enters the region scaled or cast differently on different uses" if mixed else ""
    raise NotARecurrence(f"the region does not compute the GDN/KDA delta rule: best relative error {best[0]:.2e} "
                         f"over {len(assignments)} role assignments ({best[1]}){hint}")


POSITIVE = {"exp", "sigmoid", "softplus"}


def positive(node, depth: int = 8) -> bool:
    """Whether ``node`` is, through layout ops, the result of exp / sigmoid / softplus (a pre-exponentiated
    decay the IR can take the log of exactly; any other decay's log is taken by ``laqat::log_decay``, which
    checks it positive at run time)."""

    for _ in range(depth):
        if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
            return False
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if name in POSITIVE:
            return True
        if not (rules.is_layout(node) or name in RESHAPE_METHODS or node.target in RESHAPE_FUNCTIONS
                or name == "getitem"):
            return False
        node = node.args[0]
    return False


def _feeds_exp(region: Region, node, depth: int = 6) -> bool:
    frontier, seen = [node], {node}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in region.nodes and u not in seen:
                    if getattr(u.target, "__name__", u.target) in ("exp", "cumsum"):
                        return True
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def _snap_scale(c: float, head_k: int) -> float:
    for nice in (head_k ** -0.5, 1.0):
        if abs(abs(c) - nice) <= 1e-9 * nice:
            return math.copysign(nice, c)
    return c


def _property_probes(region: Region, probe: Probe, results) -> str | None:
    """Head locality and causality, on the first probe inputs."""
    if not results:
        return None
    env, got, members = results[0]
    a = members[0]
    o_perm = a.out_perm
    base = got[0].permute(o_perm)
    seq = probe.steps
    # causality: change every per-token input at one token; no earlier output may move
    for t_changed in sorted({1, seq // 2, seq - 1}):
        if t_changed <= 0 or t_changed >= seq:
            continue
        env2 = dict(env)
        for lay in (a.q, a.k, a.v, a.g, a.beta):
            x = env[lay.node].clone()
            xi = x.permute(lay.perm)
            xi[:, t_changed] = xi[:, t_changed] * 1.5 + 0.1
            env2[lay.node] = x
        try:
            moved = probe(env2)[0].permute(o_perm)
        except ProbeError:
            return None
        if rel_err(moved[:, :t_changed], base[:, :t_changed]) > TOL:
            return (f"non-causal: outputs before token {t_changed} change when only token {t_changed}'s inputs "
                    f"change (a mask lets a token see later ones)")
    # head locality: change the last head of every per-token input
    HV = base.shape[2]
    env3 = dict(env)
    for lay in (a.q, a.k, a.v, a.g, a.beta):
        x = env[lay.node].clone()
        xi = x.permute(lay.perm)
        xi[:, :, -1] = xi[:, :, -1] * 1.5 + 0.1
        env3[lay.node] = x
    H = tensor_value(a.q.node).shape[a.q.perm[2]]
    untouched = HV - HV // H
    if untouched > 0:
        moved = probe(env3)[0].permute(o_perm)
        if rel_err(moved[:, :, :untouched], base[:, :, :untouched]) > TOL:
            return "a step reads another head: outputs of other heads change when only the last head's inputs change"
    return None


def _diagnose_counts(flow: Dataflow, region: Region, e: _RoleCountError) -> str | None:
    """GDN-shaped but one [B, T, H] input short: is it the beta or the decay that is missing?"""
    if (len(e.p3), len(e.p4)) == (1, 3):
        (x,) = e.p3
        candidates = [a for perm in itertools.permutations(e.p4)
                      for a in _enumerate(region, region.seq_len, "gdn", *perm, x, x, e.h0)]
        probe = Probe(flow, region)
        device = tensor_value(x).device
        for variant in NEAR_MISSES:
            if not (variant.beta_one or variant.no_decay):
                continue
            for a in candidates:
                env = _draws(region, x, a.decay_form, torch.Generator().manual_seed(0), device)
                try:
                    got = probe(env)
                except ProbeError:
                    return None
                if _compare(a, env, got, probe.steps, variant, probe.token)[0] <= TOL:
                    return f"{variant.reason} (under {a.describe()})"
        return ("missing beta or decay: the recurrence reads q, k, v and only one per-token [B, T, H] tensor "
                f"({x.name}); GDN needs both g and beta")
    if (len(e.p3), len(e.p4)) == (0, 3):
        return "missing beta and decay: the recurrence reads q, k, v only (plain linear attention or DeltaNet)"
    return None


# ---- stress: what small generic probes cannot see ---------------------------------------------
DEEP_DECAY_SUM = 80.0  # per-chunk sums of g near -80: exp of them (or of their negation) is near fp32's range


def stress(region: Region, probe: Probe, a: Assignment, env: dict, gen, got=None) -> str | None:
    """Checks an assignment that matched at the generic probes once more, with its fitted scale:
    with a large state and a NaN input (the delta rule propagates the NaN: nothing may make it
    finite; elsewhere the values agree), with log-decay sums near fp32's exponent range, and the
    vector-Jacobian product of the region against the delta rule's (so that a detach or a
    no-grad island fails). None when all hold; then a loop over chunks keeps the region's runs in
    ``a.evidence`` (``got``: its outputs on ``env`` and ``first_state``) for the rewrite check."""
    evidence = None if probe.token else Evidence(runs=[("generic inputs", env, got)] if got is not None else [])
    large = _large_state(a, env, gen)
    x = large[a.v.node].clone()
    x.permute(a.v.perm)[0, 0, 0, 0] = float("nan")  # batch 0, token 0, head 0
    large[a.v.node] = x
    for what, changed in (("a large state (v ~1e1-1e4, h0 ~1e2-1e5, beta in (0, 2)) and a NaN in v", large),
                          ("log-decay sums near -80", _deep_decay(region, a, env, gen))):
        why = _agrees(probe, a, changed, what, evidence)
        if why:
            return why
    why = _native_dtypes(probe, a, env) or _vjp(probe, a, env, evidence)
    if why is None:
        a.evidence = evidence
    return why


NATIVE_TOL = 2e-5  # the region in fp32 against the fp64 delta rule: <= 3e-7 measured (tests); an fp16 round trip ~3e-4


def _native_dtypes(probe: Probe, a: Assignment, env: dict) -> str | None:
    """The region run in its own dtypes (its fp32 casts and factories not lifted to fp64) against the fp64 delta
    rule on the same inputs: an fp32 rounding trick (``(S + 1.5 * 2**23) - 1.5 * 2**23``), a round trip through
    a narrower dtype, a cancellation that fp64 hides. An output stored in a narrower buffer is compared through
    the state only (its one rounding is the IR's output cast)."""
    native = {}
    for n, x in env.items():
        v = tensor_value(n)
        native[n] = x.to(v.dtype) if v is not None and v.dtype.is_floating_point else x
    try:
        o_got, s_got = probe(native, lift=False)
    except ProbeError as e:
        return f"the region does not run on probe inputs in its own dtypes: {e}"
    # the reference reads what the IR node would: each input after its entry chain, replayed in its dtypes
    ref_env, plain = {}, dataclasses.replace(a, chains={})
    for role in ("q", "k", "v", "g", "beta", "h0"):
        node = a.h0 if role == "h0" else getattr(a, role).node
        if node is not None:
            ref_env[node] = a.chain(role).apply_native(native[node]).double()
    o_ref, s_ref = _reference(plain, ref_env, probe.steps, EXACT, scale=a.scale)
    pairs = []
    if o_got.dtype.is_floating_point and torch.finfo(o_got.dtype).bits >= 32:
        pairs.append(("output", o_got.double().permute(a.out_perm), o_ref, o_got.dtype))
    if s_got is not None:
        if probe.token:
            _, s_ref = _reference(plain, ref_env, 1, EXACT, scale=a.scale)
        pairs.append(("state", s_got.double().reshape(s_ref.shape), s_ref, s_got.dtype))
    for what, got, ref, dtype in pairs:
        err = rel_err(got, ref)
        if not err <= NATIVE_TOL:
            return (f"the region matches the delta rule in float64 but not in its own dtypes: its {what} differs by "
                    f"{err:.2e} (relative) in {str(dtype).replace('torch.', '')} (a rounding trick, a round trip "
                    f"through a narrower dtype or a cancellation that float64 hides)")
    return None


def _agrees(probe: Probe, a: Assignment, env: dict, what: str, evidence: Evidence | None = None) -> str | None:
    try:
        o_got, s_got = probe(env)
    except ProbeError as e:
        return f"the region does not run on probe inputs with {what}: {e}"
    if evidence is not None:
        evidence.runs.append((what, env, (o_got, s_got, probe.first_state)))
    o_got = o_got.permute(a.out_perm)
    o_ref, s_ref = _reference(a, env, probe.steps, EXACT, scale=a.scale)
    pairs = [(o_got, o_ref)]
    if s_got is not None:
        if probe.token:
            _, s_ref = _reference(a, env, 1, EXACT, scale=a.scale)
        pairs.append((s_got.reshape(s_ref.shape), s_ref))
    for got, ref in pairs:
        if (~torch.isfinite(ref) & torch.isfinite(got)).any():
            return (f"the region hides non-finite values: with {what}, the delta rule's output is NaN where the "
                    f"region's is finite (nan_to_num, a where or a clamp on the data?)")
        both = torch.isfinite(ref) & torch.isfinite(got)
        err = rel_err(got[both], ref[both]) if both.any() else 0.0
        if not err <= TOL:
            return (f"the region matches the delta rule on small inputs but not with {what}: relative error "
                    f"{err:.2e} (a value-dependent op, e.g. a clamp or a threshold?)")
    return None


def _large_state(a: Assignment, env: dict, gen) -> dict:
    """v and h0 scaled element by element, log-uniformly, by 1e1..1e4 and 1e2..1e5 (so that a
    threshold anywhere in that range is crossed by some entries), and beta over all of (0, 2)
    (thresholds on beta; allow_neg_eigval)."""
    env = dict(env)

    def spread(x, lo, hi):
        u = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device)
        return x * 10.0 ** (lo + (hi - lo) * u)

    env[a.v.node] = spread(env[a.v.node], 1, 4)
    if a.h0 is not None:
        env[a.h0] = spread(env[a.h0], 2, 5)
    x = env[a.beta.node]
    beta = 1e-3 + 1.998 * torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    chain = a.chains.get(a.beta.node)
    env[a.beta.node] = beta / chain.factor if chain is not None and chain.factor != 1.0 else beta
    return env


def _deep_decay(region: Region, a: Assignment, env: dict, gen) -> dict:
    env = dict(env)
    x = env[a.g.node]
    u = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    g = -(DEEP_DECAY_SUM / max(region.chunk, 16)) * (0.7 + 0.6 * u)
    if a.decay_form == "exp":
        g = g.exp()
    chain = region.chains.get(a.g.node)
    env[a.g.node] = g / chain.factor if chain is not None and chain.factor != 1.0 else g
    return env


def _vjp(probe: Probe, a: Assignment, env: dict, evidence: Evidence | None = None) -> str | None:
    """The region's vector-Jacobian product against the delta rule's, for every input."""
    with torch.enable_grad():  # the graph may be traced under no_grad
        return _vjp_enabled(probe, a, env, evidence)


def _vjp_enabled(probe: Probe, a: Assignment, env: dict, evidence: Evidence | None) -> str | None:
    leaves = {n: x.detach().clone().requires_grad_() for n, x in env.items()}
    try:
        with torch.enable_grad():
            o_got, s_got = probe({n: x.clone() for n, x in leaves.items()}, grad=True)
    except (ProbeError, RuntimeError) as e:
        return f"the region's gradient cannot be probed: {e}"
    if not o_got.requires_grad:
        return "the region's output does not depend differentiably on its inputs (a detach or a no-grad island?)"
    gen = torch.Generator().manual_seed(7)
    o_got = o_got.permute(a.out_perm)
    co = torch.randn(o_got.shape, generator=gen, dtype=torch.float64).to(o_got.device)
    # a loop over chunks: the cotangent covers the first chunk and two tokens of the next (the
    # state's gradient across a chunk boundary), so that the token-by-token reference runs on
    # that prefix only (it is causal); the region's gradient beyond it must then be zero
    steps = probe.steps if probe.token else min(probe.steps, probe.region.chunk + 2)
    co[:, steps:] = 0
    ref_leaves = {n: x.detach().clone().requires_grad_() for n, x in env.items()}
    with torch.enable_grad():
        o_ref, s_ref = _reference(a, ref_leaves, steps, EXACT, scale=a.scale)
        loss_got, loss_ref = (o_got * co).sum(), (o_ref * co[:, :steps]).sum()
        if probe.token and s_got is not None and s_got.requires_grad:
            if probe.token:
                _, s_ref = _reference(a, ref_leaves, 1, EXACT, scale=a.scale)
            cs = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64).to(s_ref.device)
            loss_got = loss_got + (s_got.reshape(s_ref.shape) * cs).sum()
            loss_ref = loss_ref + (s_ref * cs).sum()
        nodes = list(env)
        g_got = torch.autograd.grad(loss_got, [leaves[n] for n in nodes], allow_unused=True)
        g_ref = torch.autograd.grad(loss_ref, [ref_leaves[n] for n in nodes], allow_unused=True)
    roles = {a.q.node: "q", a.k.node: "k", a.v.node: "v", a.g.node: "g", a.beta.node: "beta", a.h0: "h0"}
    for n, x, y in zip(nodes, g_got, g_ref):
        x = torch.zeros_like(env[n]) if x is None else x
        y = torch.zeros_like(env[n]) if y is None else y
        err = rel_err(x, y)
        if not err <= TOL:
            return (f"the region's gradient differs from the delta rule's: d{roles.get(n, n.name)} ({n.name}) relative "
                    f"error {err:.2e} (a detach, a no-grad island or a custom backward?)")
    if evidence is not None:
        evidence.vjp = (env, co, steps, {n: x for n, x in zip(nodes, g_got)})
    return None
