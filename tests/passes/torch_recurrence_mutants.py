"""Random small programs near the delta rule: mutations of a correct token-loop GDN step.

``STEP`` is the correct step, one statement a line. ``mutant(rng)`` applies one to three
mutations (an op inserted after a statement, a token swapped, a statement removed) and returns
``(name, source)``; ``step_mutant(rng)`` makes the steps differ (a constant or schedule indexed by t,
a literal from t, a mask from positions, a read of another token than the step's own);
``build(source)`` compiles it into a function ``(q, k, v, g, beta, h0) -> (o, S)``. Most mutants are not the delta rule (the frontend must
leave them alone), some are invalid Python or fail on their shapes (the property test skips
them), some are the delta rule in another spelling (``x * 1.0``, ``x.contiguous()``, a
redundant clone): those the frontend may rewrite, and then must compute exactly what eager does.
"""
import linecache
import random

import torch  # noqa: F401  (used by the generated source)
import torch.nn.functional as F  # noqa: F401

STEP = [
    "d = g[:, t].exp()[..., None, None]",
    "S = S * d",
    "kt = k[:, t]",
    "read = (S * kt[..., None]).sum(-2)",
    "u = (v[:, t] - read) * beta[:, t, :, None]",
    "S = S + kt[..., None] * u[..., None, :]",
    "ot = (S * q[:, t, ..., None]).sum(-2) * scale",
    "o[:, t] = ot",
]
TEMPLATE = '''def fn(q, k, v, g, beta, h0):
    scale = q.shape[-1] ** -0.5
    S = h0.clone()
    o = torch.zeros_like(v)
    T = q.shape[1]
    sched = torch.ones(T)
    sched[2:] = 0.5
    keep = (torch.arange(T) < T - 1).float()
    for t in range(T):
{body}
    return o, S
'''
# f(X) inserted as ``X = f(X)`` after a statement that assigns X: the same values ...
INSERTS_SAME = [
    "{x} * 1.0", "{x} + 0.0", "{x}.contiguous()", "{x}.clone()", "({x} * 2.0) * 0.5", "{x}.float()",
    "{x}.reshape({x}.shape)", "-(-{x})", "{x} / 1.0", "{x}.to(torch.float32)", "({x} + {x}) * 0.5",
    "{x}.unsqueeze(0).squeeze(0)", "{x}.view({x}.shape)",
]
# ... and not the delta rule (or not on every input, or not its gradient)
INSERTS_OTHER = [
    "{x}.clamp(-1e3, 1e3)", "torch.tanh({x})", "{x}.abs()", "torch.where({x} > 1e3, {x} * 0.5, {x})",
    "{x}.detach()", "{x}.bfloat16().float()", "{x}.half().float()", "torch.nan_to_num({x})", "{x} * 2.0",
    "{x} + 0.1", "-{x}", "{x} + 1e-3 * torch.randn_like({x})", "torch.relu({x} + 1e3) - 1e3",
    "{x}.double().float()", "{x} * ({x} > -1e4)", "torch.sigmoid({x})", "{x}.round()",
    "F.dropout({x}, 0.1, True)", "{x}.to(torch.bfloat16).to(torch.float32)",
]
# ... and steps that differ: a constant or schedule indexed by t, a literal from t, a mask from positions (most of
# them agree with the delta rule on the first two steps)
INSERTS_STEP = [
    "{x} * sched[t]", "{x} * keep[t]", "{x} * (t + 1)", "{x} / max(t, 1)", "{x} * float(t < 2)",
    "{x} * (1.0 if t != 2 else 0.5)", "{x} + 0.0 * t", "{x} * sched[min(t, 1)]", "{x}.roll(t, -1)",
]
SWAPS_STEP = [  # reads of another token than the step's own
    ("k[:, t]", "k[:, max(t - 1, 0)]"), ("v[:, t]", "v[:, t // 2]"), ("q[:, t,", "q[:, min(t, 1),"),
    ("beta[:, t,", "beta[:, 0,"), ("g[:, t]", "g[:, (t + 1) % T]"),
]
SWAPS_SAME = [  # (old, new): another spelling of the same step
    ("g[:, t].exp()", "torch.exp(g[:, t])"), ("S * d", "d * S"),
    ("(S * kt[..., None]).sum(-2)", "torch.einsum('bhkv,bhk->bhv', S, kt)"),
    ("kt[..., None] * u[..., None, :]", "torch.einsum('bhk,bhv->bhkv', kt, u)"),
    ("(S * q[:, t, ..., None]).sum(-2)", "(q[:, t].unsqueeze(-2) @ S).squeeze(-2)"),
    ("(v[:, t] - read) * beta[:, t, :, None]", "beta[:, t, :, None] * v[:, t] - beta[:, t, :, None] * read"),
]
SWAPS_OTHER = [  # a different step
    ("v[:, t] - read", "v[:, t] + read"), ("v[:, t] - read", "read - v[:, t]"), ("S * d", "S + d"),
    ("S * d", "S * d * d"), ("beta[:, t, :, None]", "g[:, t, :, None]"), ("kt[..., None] * u", "u[..., None] * u"),
    ("q[:, t, ..., None]", "kt[..., None]"), ("g[:, t].exp()", "g[:, t].sigmoid()"), ("g[:, t].exp()", "g[:, t]"),
    (".sum(-2)", ".sum(-1)"), ("k[:, t]", "k[:, t - 1]"), ("k[:, t]", "k[:, 0]"), ("* scale", "* 0.5"),
    ("* scale", ""), ("(S * q", "(d * S * q"), ("S = S + kt", "S = S.detach() + kt"),
]
ASSIGNED = ("d", "S", "kt", "read", "u", "ot")


def _insert(lines, rng, pool=None):
    spots = [i for i, line in enumerate(lines) if line.split(" = ")[0].strip() in ASSIGNED]
    i = rng.choice(spots)
    x = lines[i].split(" = ")[0].strip()
    f = rng.choice(pool or rng.choice((INSERTS_SAME, INSERTS_OTHER)))
    return lines[:i + 1] + [f"{x} = {f.format(x=x)}"] + lines[i + 1:], f"insert {f.format(x=x)!r}"


def _swap(lines, rng, pool=None):
    old, new = rng.choice(pool or rng.choice((SWAPS_SAME, SWAPS_OTHER)))
    for i, line in enumerate(lines):
        if old in line:
            return lines[:i] + [line.replace(old, new, 1)] + lines[i + 1:], f"swap {old!r} -> {new!r}"
    return lines, "swap (no-op)"


def _remove(lines, rng):
    i = rng.randrange(len(lines))
    return lines[:i] + lines[i + 1:], f"remove {lines[i]!r}"


def step_mutant(rng: random.Random):
    """A mutant whose steps differ (``INSERTS_STEP`` or ``SWAPS_STEP``), sometimes with one more mutation."""
    lines = list(STEP)
    if rng.random() < 0.6:
        lines, what = _insert(lines, rng, INSERTS_STEP)
    else:
        lines, what = _swap(lines, rng, SWAPS_STEP)
    what = [what]
    if rng.random() < 0.3:
        lines, w = rng.choice((_insert, _swap))(lines, rng)
        what.append(w)
    body = "\n".join(" " * 8 + line for line in lines)
    return "; ".join(what), TEMPLATE.format(body=body)


def mutant(rng: random.Random):
    lines, what = list(STEP), []
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        op = rng.choices((_insert, _swap, _remove), weights=(5, 3, 1))[0]
        lines, w = op(lines, rng)
        what.append(w)
    body = "\n".join(" " * 8 + line for line in lines)
    return "; ".join(what), TEMPLATE.format(body=body)


_COUNT = [0]


def build(source: str):
    """The generated function; its source is registered with linecache (stack traces name it)."""
    _COUNT[0] += 1
    filename = f"<laqat-mutant-{_COUNT[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch, "F": F}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["fn"]


def seeded(n: int, seed: int = 0, steps: bool = False):
    """``n`` mutants; ``steps``: mutants whose steps differ (``step_mutant``)."""
    rng = random.Random(seed)
    return [(step_mutant if steps else mutant)(rng) for _ in range(n)]
