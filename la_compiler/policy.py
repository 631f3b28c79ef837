"""The policy table: a user's config (YAML, JSON, dict or a shipped recipe) -> a frozen,
validated ``Policy`` that decides the numerics of every GDN/KDA recurrence.

The vocabulary is ModelOpt's (docs/policy.md has the full reference):

    quant_cfg:                     # ordered; for each quantizer, later entries win
      - {quantizer_name: "*", enable: false}
      - {quantizer_name: "*gdn_state_quantizer", cfg: {num_bits: [4, 3], type: dynamic, axis: [0, 1]}}
    linear_attention:              # ordered; for each module, the last matching rule wins (whole cfg)
      - {module_name: "*layers.3.*", cfg: {chunk_size: 64, state: {block_v: 32}}}

A quantizer's name is its module's fully qualified name plus one of ``quantizer_sites(kind)``,
e.g. ``model.layers.3.attn.gdn_state_quantizer`` or
``model.layers.3.attn.linear_attn_sites.wy_key.lhs_quantizer``; globs are ``fnmatch``'s.

Contract used by the annotate pass:
    load_policy(None | Policy | dict | path | recipe name) -> Policy
    Policy.resolve(module, kind) -> Resolution
    Policy.unmatched_rules(seen: [(module, kind)]) -> list[str]

Everything that does not depend on the model is checked when a policy is loaded (``from_dict``, hence files,
recipes and attached policies): keys, values and combinations, and each ``quant_cfg`` entry's cfg at every quant
site its glob can reach in some model (``reachable_sites``). A glob that can reach no laqat quantizer is an
``UnmatchedPolicyRuleWarning`` at load time, with the closest quantizer names. What depends on the modules a rule
meets (a ``state.block_v`` that another rule sets, a backend that cannot run a node) is checked at compile time.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from la_compiler.errors import warn_at_caller
from la_compiler.options import DecodeOptions, DecodeOptionsError
from la_compiler.policy_schema import (LINEAR_ATTENTION_KEYS, LinearAttentionCfg, PolicyError,
                                       UnmatchedPolicyRuleWarning, check_bool, check_mapping, check_str, prefixed)
from la_compiler.quant import QuantConfig, QuantConfigError
from la_compiler.recipes import recipe_names, recipe_path
from la_compiler.spec import GEMM_SITES, KINDS
from la_compiler.suggest import did_you_mean

logger = logging.getLogger(__name__)

__all__ = ["Policy", "PolicyError", "QuantRule", "ModuleRule", "Resolution", "load_policy", "quantizer_sites"]

POLICY_VERSION = "laqat.policy/1"
TOP_KEYS = ("version", "name", "description", "quant_cfg", "linear_attention", "algorithm")
QUANT_RULE_KEYS = ("quantizer_name", "cfg", "enable")
MODULE_RULE_KEYS = ("module_name", "cfg")


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


def _glob_suggestions(glob: str) -> list[str]:
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


# The scale grouping each site's kernels and references implement (docs/numerics.md, "Where the rounding happens").
_SITE_GROUPS = {"state": ("tile", "block"), "w": ("row", "block")}
_OPERAND_GROUPS = ("row", "block")


# ---- rules ----------------------------------------------------------------------------------

class _FrozenCfg(tuple):
    """A ModelOpt quantizer cfg, normalised (lists -> tuples, block_sizes keys -> ints) and
    immutable; ``dict(...)`` gives it back."""

    @staticmethod
    def of(cfg: Mapping) -> "_FrozenCfg":
        return _FrozenCfg(sorted((k, _freeze(k, v)) for k, v in cfg.items()))


def _freeze(key: str, value):
    if key == "block_sizes" and isinstance(value, Mapping):
        items = (((int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k), _freeze("", v))
                 for k, v in value.items())  # JSON spells the axis keys as strings
        return _FrozenCfg(sorted(items, key=str))
    if isinstance(value, Mapping):
        return _FrozenCfg(sorted((k, _freeze(k, v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze("", v) for v in value)
    return value


def _thaw(value, *, for_json: bool):
    if isinstance(value, _FrozenCfg):
        return {k: _thaw(v, for_json=for_json) for k, v in value}
    if isinstance(value, tuple):
        items = [_thaw(v, for_json=for_json) for v in value]
        return items if for_json else tuple(items)
    return value


@dataclasses.dataclass(frozen=True)
class QuantRule:
    """One ``quant_cfg`` entry: ``cfg`` replaces a matching quantizer's cfg (and enables it
    unless ``enable`` says otherwise); ``enable`` alone switches it on or off."""

    quantizer_name: str
    cfg: _FrozenCfg | None = None
    enable: bool | None = None

    def __post_init__(self):
        check_str(self.quantizer_name, "quantizer_name")
        if self.cfg is None and self.enable is None:
            raise PolicyError("cfg: an entry needs 'cfg' or 'enable' (or both)")
        if self.enable is not None:
            check_bool(self.enable, "enable")
        if self.cfg is not None:
            if not isinstance(self.cfg, _FrozenCfg):
                if not isinstance(self.cfg, Mapping):
                    raise PolicyError(f"cfg: must be a mapping of ModelOpt quantizer attributes, got {self.cfg!r}")
                object.__setattr__(self, "cfg", _FrozenCfg.of(self.cfg))
            inner = dict(self.cfg).get("enable")
            if inner is not None and self.enable is not None and inner != self.enable:
                raise PolicyError(f"enable: {self.enable!r} contradicts cfg.enable={inner!r}")

    @property
    def enables(self) -> bool:
        """What this entry does to a matching quantizer's on/off switch."""
        if self.enable is not None:
            return self.enable
        return dict(self.cfg).get("enable", True)

    def quant_cfg(self) -> dict:
        """The cfg as ``QuantConfig.from_modelopt`` takes it (tuples, int block keys), without ``enable``."""
        return {k: v for k, v in _thaw(self.cfg, for_json=False).items() if k != "enable"}

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"quantizer_name": self.quantizer_name}
        if self.cfg is not None:
            out["cfg"] = _thaw(self.cfg, for_json=True)
        if self.enable is not None:
            out["enable"] = self.enable
        return out


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """One ``linear_attention`` policy: modules matching ``module_name`` get ``cfg``."""

    module_name: str
    cfg: LinearAttentionCfg = LinearAttentionCfg()

    def __post_init__(self):
        check_str(self.module_name, "module_name")
        if not isinstance(self.cfg, LinearAttentionCfg):
            raise PolicyError(f"cfg: must be a LinearAttentionCfg, got {self.cfg!r}")

    def to_dict(self) -> dict:
        return {"module_name": self.module_name, "cfg": self.cfg.to_dict()}


# ---- what a policy decides for one recurrence -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Resolution:
    """What a policy decides for one recurrence site (the spec fields the annotate pass writes)."""

    quant: tuple[tuple[str, str], ...] = ()  # (site, canonical format string)
    acc: tuple[tuple[str, str], ...] = ()  # (gemm site, "fp16:16")
    solve: str = "exact"
    degree: int | None = None
    chunk: int = 64
    phase: str = "none"
    extra: tuple[tuple[str, str], ...] = ()
    numerics: tuple[tuple[str, str], ...] = ()  # the spec's n.<name> fields (NumericsOptions off their defaults)
    backend: str | None = None  # an explicitly requested kernel variant
    rules: tuple[str, ...] = ()  # human-readable: which rules applied
    backend_key: str | None = None  # the policy key that requested ``backend``, for error messages
    implementation: str | None = None  # "triton" | "torch": the kernel family the policy asks for
    implementation_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
    """A validated, immutable policy table. Build it with ``from_dict`` / ``from_file`` /
    ``load_policy``; ``to_dict`` gives a versioned dict that ``from_dict`` reads back equal."""

    quant_cfg: tuple[QuantRule, ...] = ()
    linear_attention: tuple[ModuleRule, ...] = ()
    name: str = "custom"
    description: str = ""

    def __post_init__(self):
        for field in ("quant_cfg", "linear_attention"):
            items = getattr(self, field)
            if isinstance(items, list):
                object.__setattr__(self, field, tuple(items))
        for i, rule in enumerate(self.quant_cfg):
            if not isinstance(rule, QuantRule):
                raise PolicyError(f"quant_cfg[{i}]: must be a QuantRule, got {rule!r}")
            if rule.cfg is not None:
                _check_rule_cfg(i, rule)
        for i, rule in enumerate(self.linear_attention):
            if not isinstance(rule, ModuleRule):
                raise PolicyError(f"linear_attention[{i}]: must be a ModuleRule, got {rule!r}")

    @staticmethod
    def exact() -> "Policy":
        return Policy(name="exact")

    @property
    def changes_numerics(self) -> bool:
        """True when some rule enables a quantizer or sets a linear-attention option: a compile that rewrites
        nothing then silently applies none of it."""
        return any(rule.enables and rule.cfg is not None for rule in self.quant_cfg) or bool(self.linear_attention)

    # ---- loading ---------------------------------------------------------------------------
    @staticmethod
    def from_dict(config: Mapping, *, name: str | None = None) -> "Policy":
        check_mapping(config, "policy", TOP_KEYS)
        version = config.get("version", POLICY_VERSION)
        if version != POLICY_VERSION:
            if _schema_number(version) > _schema_number(POLICY_VERSION):
                raise PolicyError(f"version: {version!r} was written by a newer laqat; this laqat reads policies of "
                                  f"version {POLICY_VERSION!r} (upgrade laqat to read it)")
            raise PolicyError(f"version: this laqat reads policies of version {POLICY_VERSION!r}, got {version!r}")
        if config.get("algorithm") is not None:
            raise PolicyError(f"algorithm: laqat scales are dynamic (no calibration): must be null/None, "
                              f"got {config['algorithm']!r}")
        quant = _list(config.get("quant_cfg", []), "quant_cfg")
        modules = _list(config.get("linear_attention", []), "linear_attention")
        policy = Policy(
            quant_cfg=tuple(_quant_rule(f"quant_cfg[{i}]", e) for i, e in enumerate(quant)),
            linear_attention=tuple(_module_rule(f"linear_attention[{i}]", e) for i, e in enumerate(modules)),
            name=check_str(name or config.get("name", "custom"), "name"),
            description=_description(config.get("description", "")),
        )
        for message in policy.unreachable_rules():
            warn_at_caller(message, UnmatchedPolicyRuleWarning)
        return policy

    @staticmethod
    def from_file(path: str | os.PathLike) -> "Policy":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PolicyError(f"policy file {str(path)!r}: cannot read it ({e.strerror})") from None
        if path.suffix == ".json":
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                raise PolicyError(f"policy file {str(path)!r}: not valid JSON ({e})") from None
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                config = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise PolicyError(f"policy file {str(path)!r}: not valid YAML ({e})") from None
        else:
            raise PolicyError(f"policy file {str(path)!r}: the suffix must be .yaml, .yml or .json")
        if config is None:  # an empty file: a policy must say what it wants, even exact numerics
            raise PolicyError(f"policy file {str(path)!r}: the file is empty; write at least "
                              f"`version: {POLICY_VERSION}` (an empty quant_cfg means exact numerics)")
        try:
            named = isinstance(config, Mapping) and "name" in config
            policy = Policy.from_dict(config, name=None if named else path.stem)
        except PolicyError as e:
            raise PolicyError(f"policy file {str(path)!r}: {e}") from None
        logger.debug("policy %r loaded from %s", policy.name, path)
        return policy

    def to_dict(self) -> dict:
        out = {"version": POLICY_VERSION, "name": self.name}
        if self.description:
            out["description"] = self.description
        out["quant_cfg"] = [r.to_dict() for r in self.quant_cfg]
        out["linear_attention"] = [r.to_dict() for r in self.linear_attention]
        return out

    def to_yaml(self) -> str:
        """The policy as a YAML file, keys at their defaults left out (``Policy.from_file`` reads it back equal):
        what ``print(policy)`` shows, e.g. ``print(la_compiler.policy_of(model))``."""
        import yaml

        out = self.to_dict()
        default = LinearAttentionCfg().to_dict()
        for rule in out["linear_attention"]:
            rule["cfg"] = _without_defaults(rule["cfg"], default)
        return yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=120)

    __str__ = to_yaml

    # ---- resolution ------------------------------------------------------------------------
    def module_rule(self, module: str) -> tuple[int, ModuleRule] | None:
        """The last ``linear_attention`` rule matching ``module`` and its index."""
        found = None
        for i, rule in enumerate(self.linear_attention):
            if fnmatch.fnmatchcase(module, rule.module_name):
                found = (i, rule)
        return found

    def quantizer(self, name: str) -> tuple[int | None, QuantRule | None, bool]:
        """(index of the entry whose cfg applies, that entry, enabled) for one quantizer name."""
        cfg_at, cfg_rule, enabled = None, None, False
        for i, rule in enumerate(self.quant_cfg):
            if fnmatch.fnmatchcase(name, rule.quantizer_name):
                if rule.cfg is not None:
                    cfg_at, cfg_rule = i, rule
                enabled = rule.enables
        return cfg_at, cfg_rule, enabled

    def resolve(self, module: str, kind: str) -> Resolution:
        if kind not in KINDS:
            raise PolicyError(f"kind must be one of {KINDS}, got {kind!r}")
        where = f"module {module or '<top>'!r}"
        matched = self.module_rule(module)
        la_key = f"linear_attention[{matched[0]}].cfg" if matched else None
        la = matched[1].cfg if matched else LinearAttentionCfg()
        rules = []
        if matched:
            rules.append(f"linear_attention[{matched[0]}] (module_name {matched[1].module_name!r}) "
                         f"sets the execution policy")

        quant = {}
        for qname, site in quantizer_sites(kind).items():
            full = quantizer_name(module, qname)
            at, rule, enabled = self.quantizer(full)
            if not enabled:
                continue
            if rule is None:
                raise PolicyError(f"quant_cfg: quantizer {full!r} is enabled but no quant_cfg entry gives it a cfg")
            fmt = _site_format(at, rule, site, la.state.block_v, la_key)
            quant[site] = fmt
            rules.append(f"quant_cfg[{at}] ({rule.quantizer_name!r}) -> {site}={fmt}")

        if la.decode.state_codec == "hadamard32":
            quant["state"] = _hadamard_state(quant.get("state"), la, la_key, where)
        if la.serving is not None:
            prefixed(f"{la_key}.", la.serving.check_kind, kind)
        w_alias = quant.pop("state_read.lhs", None)  # W is state_read's lhs: one rounding, spelt "w" in the spec
        if w_alias is not None and quant.setdefault("w", w_alias) != w_alias:
            raise PolicyError(f"quant_cfg: {where}: the {kind}_w_quantizer and linear_attn_sites.state_read."
                              f"lhs_quantizer round the same operand (W) but are set to {quant['w']} and {w_alias}")

        acc = {site: a.canonical() for site, a in la.matmul if a.canonical() is not None}
        decode = _decode_options(la, quant.get("state"), la_key, where)
        if not rules:
            rules.append("no policy rule matched: exact numerics, no quantization")
        return Resolution(
            quant=tuple(sorted(quant.items())), acc=tuple(sorted(acc.items())),
            solve=la.solve.method, degree=la.solve.degree, chunk=la.chunk_size,
            phase="none" if decode is None else decode.mode, extra=() if decode is None else decode.spec_extra(),
            numerics=la.numerics.spec_items(),
            backend=la.requested_backend, rules=tuple(rules),
            backend_key=f"{la_key}.backend" if la.requested_backend else None,
            implementation=la.implementation[1] if la.implementation else None,
            implementation_key=f"{la_key}.{la.implementation[0]}" if la.implementation else None,
        )

    def unreachable_rules(self) -> list[str]:
        """Messages for the ``quant_cfg`` entries whose glob can match no laqat quantizer of any model (a typo, or
        a ModelOpt rule for other layers), with the closest globs that would."""
        out = []
        for i, rule in enumerate(self.quant_cfg):
            if not reachable_quantizers(rule.quantizer_name):
                close = _glob_suggestions(rule.quantizer_name)
                hint = (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else
                        f"; laqat's quantizers are <module>.<quantizer> with <quantizer> one of "
                        f"{sorted({q for q in all_quantizers() if not q.startswith('linear_attn_sites.')})} or "
                        f"linear_attn_sites.<site>.lhs_quantizer / rhs_quantizer")
                out.append(f"policy {self.name!r}: quant_cfg[{i}] (quantizer_name {rule.quantizer_name!r}) matches "
                           f"no laqat quantizer of any model{hint}")
        return out

    def unmatched_rules(self, seen, *, reachable_only: bool = False) -> list[str]:
        """Messages for the rules that matched no quantizer / module of the (module, kind) pairs seen;
        ``reachable_only``: leave out the quant_cfg entries that can reach no quantizer of any model
        (``unreachable_rules``)."""
        seen = list(seen)
        names = [quantizer_name(m, q) for m, kind in seen for q in quantizer_sites(kind)]
        out = []
        for i, rule in enumerate(self.quant_cfg):
            if reachable_only and not reachable_quantizers(rule.quantizer_name):
                continue
            if not any(fnmatch.fnmatchcase(n, rule.quantizer_name) for n in names):
                out.append(f"policy {self.name!r}: quant_cfg[{i}] (quantizer_name {rule.quantizer_name!r}) "
                           f"matched no quantizer in this graph")
        for i, rule in enumerate(self.linear_attention):
            if not any(fnmatch.fnmatchcase(m, rule.module_name) for m, _ in seen):
                out.append(f"policy {self.name!r}: linear_attention[{i}] (module_name {rule.module_name!r}) "
                           f"matched no module in this graph")
        return out


# ---- helpers ---------------------------------------------------------------------------------

def _without_defaults(cfg: dict, default: dict) -> dict:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            value = _without_defaults(value, default[key])
            if value:
                out[key] = value
        elif value != default.get(key, object()):
            out[key] = value
    return out


def _schema_number(version) -> int:
    """N of "laqat.policy/N"; -1 for anything else."""
    prefix = POLICY_VERSION.rsplit("/", 1)[0] + "/"
    if isinstance(version, str) and version.startswith(prefix) and version[len(prefix):].isdigit():
        return int(version[len(prefix):])
    return -1


def _list(value, key: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise PolicyError(f"{key}: must be a list of entries, got {type(value).__name__} {value!r}")
    return list(value)


def _description(value) -> str:
    if not isinstance(value, str):
        raise PolicyError(f"description: must be a string, got {type(value).__name__}")
    return value


def _quant_rule(key: str, entry) -> QuantRule:
    check_mapping(entry, key, QUANT_RULE_KEYS)
    if "quantizer_name" not in entry:
        raise PolicyError(f"{key}.quantizer_name: required (a glob over quantizer names, e.g. '*gdn_state_quantizer')")
    cfg = entry.get("cfg")
    if cfg is not None and not isinstance(cfg, Mapping):
        raise PolicyError(f"{key}.cfg: must be a mapping of ModelOpt quantizer attributes, "
                          f"got {type(cfg).__name__} {cfg!r}")
    return prefixed(f"{key}.", QuantRule, entry["quantizer_name"], None if cfg is None else _FrozenCfg.of(cfg),
                    entry.get("enable"))


def _module_rule(key: str, entry) -> ModuleRule:
    check_mapping(entry, key, MODULE_RULE_KEYS)
    if "module_name" not in entry:
        raise PolicyError(f"{key}.module_name: required (a glob over module names, e.g. 'model.layers.*.attn')")
    cfg = check_mapping(entry.get("cfg") or {}, f"{key}.cfg", LINEAR_ATTENTION_KEYS)
    return prefixed(f"{key}.", ModuleRule, entry["module_name"],
                    prefixed(f"{key}.cfg.", LinearAttentionCfg.from_dict, cfg))


def _check_rule_cfg(i: int, rule: QuantRule) -> None:
    """The cfg at every quant site the glob can reach in some model (a ``state.block_v`` other than 64 is checked
    when the rule meets a module)."""
    for site in sorted(reachable_sites(rule.quantizer_name)):
        _site_format(i, rule, site, 64, None)


def _site_format(i: int, rule: QuantRule, site: str, block_v: int, la_key: str | None) -> str:
    """The canonical format string of a quant_cfg entry's cfg at one site."""
    key = f"quant_cfg[{i}].cfg (quantizer_name {rule.quantizer_name!r}, site {site!r})"
    try:
        cfg = QuantConfig.from_modelopt(rule.quant_cfg(), site, state_block_v=block_v)
    except QuantConfigError as e:
        hint = f" (state.block_v={block_v} from {la_key})" if la_key and site == "state" else ""
        raise PolicyError(f"{key}: {e}{hint}") from None
    allowed = _SITE_GROUPS.get(site, _OPERAND_GROUPS)
    if cfg.group not in allowed:
        how = {"tile": "axis (0, 1): one scale per [K x BV] state tile", "row": "axis (0, 1, 2): one scale per row",
               "block": "block_sizes {-1: N}"}
        raise PolicyError(f"{key}: the {site} site takes scale groups {list(allowed)} "
                          f"({'; '.join(how[g] for g in allowed)}), got {cfg.to_string()!r}")
    return cfg.to_string()


def _hadamard_state(state: str | None, la: LinearAttentionCfg, la_key: str, where: str) -> str:
    """decode.state_codec='hadamard32': the INT8 state quantizer's format becomes int8_h32/tile<BV>."""
    key = f"{la_key}.decode.state_codec"
    if state is None:
        raise PolicyError(f"{key}: 'hadamard32' is a codec of the INT8 state quantizer, but {where} has no "
                          f"enabled state quantizer")
    cfg = QuantConfig.parse(state)
    if cfg.format not in ("int8", "int8_h32"):
        raise PolicyError(f"{key}: 'hadamard32' is an INT8 codec: the state quantizer needs num_bits=8, "
                          f"got {state} for {where}")
    return QuantConfig("int8_h32", "tile", block_v=la.state.block_v, ste=cfg.ste).to_string()


def _decode_options(la: LinearAttentionCfg, state: str | None, la_key: str | None,
                    where: str) -> DecodeOptions | None:
    """The decode options of a rule's ``decode`` and ``serving`` keys with the state quantizer's format as the codec
    (None: no decode phase). What they refuse in combination with the quantizer is a ``PolicyError`` at the key."""
    d, serving = la.decode, la.serving
    if d.mode == "none":
        return None
    try:
        return DecodeOptions(mode=d.mode, state_codec=state, readout=d.readout, decay_log_step=d.decay_log_step,
                             window=1 if d.replay is None else d.replay.window,
                             factor_qdq=d.replay is not None and d.replay.factor_qdq,
                             serving=None if serving is None else serving.profile,
                             state_dtype="float32" if serving is None else serving.state_dtype)
    except DecodeOptionsError as e:
        key = "quant_cfg" if e.field == "state_codec" else f"{la_key}.{DecodeOptions.policy_key(e.field)}"
        quantizer = "no enabled state quantizer" if state is None else f"state quantizer {state}"
        raise PolicyError(f"{key}: {e.reason} ({where}: {quantizer})") from None


def load_recipe(name: str) -> Policy:
    """The shipped recipe ``name`` (``la_compiler/recipes/<name>.yaml``) as a validated ``Policy``."""
    return Policy.from_file(recipe_path(name))


def load_policy(policy, *, key: str = "options['policy']") -> Policy:
    """None (exact) | Policy | dict | path to .yaml/.json | shipped recipe name -> Policy. ``key`` names the
    argument in error messages."""
    if policy is None:
        return Policy.exact()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    if isinstance(policy, (str, os.PathLike)):
        text = os.fspath(policy)
        if text in recipe_names():
            return Policy.from_file(recipe_path(text))
        if Path(text).suffix in (".yaml", ".yml", ".json") or os.sep in text:
            return Policy.from_file(text)
        raise PolicyError(f"{key}: {text!r} is neither a recipe name nor a .yaml/.json file; "
                          f"recipes: {recipe_names()}{did_you_mean(text, recipe_names())}")
    raise PolicyError(f"{key}: must be None, a Policy, a dict, a path or a recipe name, "
                      f"got {type(policy).__name__}")
