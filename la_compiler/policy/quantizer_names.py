"""The quantizers a policy names, and which of them a ``quantizer_name`` glob can reach in some model.

A quantizer's name is its module's fully qualified name plus one of ``quantizer_sites(kind)``, e.g.
``model.layers.3.attn.gdn_state_quantizer`` or ``model.layers.3.attn.linear_attn_sites.wy_key.lhs_quantizer``;
globs are ``fnmatch``'s.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools

from la_compiler.ir.spec import GEMM_SITES, KINDS


def quantizer_sites(kind: str) -> dict[str, str]:
    """The quantizers of one ``kind`` recurrence: quantizer name -> spec quant site."""
    sites = {f"{kind}_state_quantizer": "state", f"{kind}_w_quantizer": "w"}
    sites.update({f"linear_attn_sites.{s}.{side}_quantizer": f"{s}.{side}"
                  for s in GEMM_SITES for side in ("lhs", "rhs")})
    return sites


def quantizer_name(module: str, quantizer: str) -> str:
    return f"{module}.{quantizer}" if module else quantizer


def all_quantizers() -> dict[str, str]:
    """Every laqat quantizer of either kind: quantizer name -> spec quant site."""
    return {q: site for kind in KINDS for q, site in quantizer_sites(kind).items()}


def reachable_quantizers(glob: str) -> dict[str, str]:
    """The quantizers (name -> site) that the glob matches in some model: ``<quantizer>`` at the top, or
    ``<module>.<quantizer>`` for a module name that the glob's own text spells before the quantizer part (its
    wildcards filled in). A module name is dot-separated, with no empty part, no ``linear_attn_sites`` part and
    none ending in ``_quantizer`` (those are quantizer names' own parts): ``*linear_attn_sites.*`` reaches the
    GEMM operands only, ``*gdn*`` the GDN state and W."""
    return dict(_reachable(glob))


@functools.lru_cache(maxsize=512)
def _reachable(glob: str) -> tuple[tuple[str, str], ...]:
    modules = ("", *sorted(_module_witnesses(glob)))
    return tuple((q, site) for q, site in all_quantizers().items()
                 if any(fnmatch.fnmatchcase(quantizer_name(m, q), glob) for m in modules))


def reachable_sites(glob: str) -> set[str]:
    return set(reachable_quantizers(glob).values())


def _glob_tokens(glob: str) -> list[str]:
    """fnmatch's tokens: ``*``, ``?``, a ``[...]`` set, or one literal character (an unclosed ``[`` is literal)."""
    tokens, i = [], 0
    while i < len(glob):
        if glob[i] == "[":
            j = i + 1
            if j < len(glob) and glob[j] == "!":
                j += 1
            if j < len(glob) and glob[j] == "]":
                j += 1
            j = glob.find("]", j)
            if j >= 0:
                tokens.append(glob[i:j + 1])
                i = j + 1
                continue
        tokens.append(glob[i])
        i += 1
    return tokens


def _module_witnesses(glob: str) -> set[str]:
    """Module names that the part of ``glob`` before its quantizer part spells: the tokens before a literal dot, or
    up to a ``*`` at the start or right after a dot (which then also begins the quantizer part), with ``*`` as
    nothing (``x`` where nothing leaves an empty part), ``?`` and sets as one character they accept."""
    tokens = _glob_tokens(glob)
    heads = set()
    for j, token in enumerate(tokens):
        if token == ".":
            heads.add(tuple(tokens[:j]))
        elif token == "*" and (j == 0 or tokens[j - 1] == "."):
            heads.add(tuple(tokens[:j + 1]))
    out = set()
    for head in heads:
        for star in ("", "x"):  # "x" only where nothing leaves an empty part
            name = "".join(star if t == "*" else _one_char(t) if t == "?" or len(t) > 1 else t for t in head)
            parts = name.split(".")
            if name and all(parts):
                if not any("linear_attn_sites" in p or p.endswith("_quantizer") for p in parts):
                    out.add(name)
                break
    return out


def _one_char(token: str) -> str:
    """A character that ``?`` or a ``[...]`` set accepts."""
    return next((c for c in "xa0_" if fnmatch.fnmatchcase(c, token)), "x")


def glob_suggestions(glob: str) -> list[str]:
    """The globs closest to ``glob`` that do reach a quantizer: its last dot-separated parts replaced by the
    quantizer name they resemble most (``*gdn_state_quantiser`` -> ``*gdn_state_quantizer``)."""
    scored = []
    parts = glob.split(".")
    for q in all_quantizers():
        n = q.count(".") + 1
        head, tail = ".".join(parts[:-n]), ".".join(parts[-n:])
        literal = tail.lstrip("*?")
        ratio = difflib.SequenceMatcher(None, literal, q).ratio()
        candidate = (f"{head}." if head else "") + tail[:len(tail) - len(literal)] + q
        if ratio >= 0.8 and reachable_quantizers(candidate):
            scored.append((-ratio, candidate))
    scored.sort()
    return [c for r, c in scored if r <= scored[0][0] + 0.01][:2]
