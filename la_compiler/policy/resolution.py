"""The policy's resolution: a validated ``Policy`` (its rules parsed by ``la_compiler.policy.file_format``) ->
the numerics of each GDN/KDA recurrence it meets.

``Policy.resolve(module, kind)`` matches the ``linear_attention`` rule and the ``quant_cfg`` entries to one module's
quantizers (``la_compiler.policy.quantizer_names``) and builds the spec fields of its recurrence: each quant site's
QuantConfig, the accumulators, the solve, the chunk, the decode options and the requested kernel.

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
import fnmatch
import logging
import os
from pathlib import Path
from typing import Mapping

from la_compiler.errors import warn_at_caller
from la_compiler.ir.spec import KINDS
from la_compiler.options import SERVING_RELEASES, DecodeOptions, DecodeOptionsError, serving_summary
from la_compiler.policy.file_format import (POLICY_VERSION, LinearAttentionCfg, ModuleRule, PolicyError, QuantRule,
                                            UnmatchedPolicyRuleWarning, parse_policy, policy_yaml, prefixed,
                                            read_policy_file)
from la_compiler.policy.quantizer_names import (all_quantizers, glob_suggestions, quantizer_name, quantizer_sites,
                                                reachable_quantizers, reachable_sites)
from la_compiler.quant import QuantConfig, QuantConfigError
from la_compiler.recipes import recipe_names, recipe_path
from la_compiler.suggest import did_you_mean

logger = logging.getLogger(__name__)

__all__ = ["Policy", "Resolution", "load_policy", "load_recipe"]


# The scale grouping each site's kernels and references implement (docs/numerics.md, "Where the rounding happens").
_SITE_GROUPS = {"state": ("tile", "block"), "w": ("row", "block")}
_OPERAND_GROUPS = ("row", "block")


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
        policy = Policy(**parse_policy(config, name=name))
        for message in policy.unreachable_rules():
            warn_at_caller(message, UnmatchedPolicyRuleWarning)
        return policy

    @staticmethod
    def from_file(path: str | os.PathLike) -> "Policy":
        path = Path(path)
        config = read_policy_file(path)
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
        return policy_yaml(self.to_dict())

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
        forward = None
        if la.serving is not None:
            prefixed(f"{la_key}.", la.serving.check_kind, kind)
            forward = _serving_forward(la, kind, quant.get("state"), la_key, rules)
        w_alias = quant.pop("state_read.lhs", None)  # W is state_read's lhs: one rounding, spelt "w" in the spec
        if w_alias is not None and quant.setdefault("w", w_alias) != w_alias:
            raise PolicyError(f"quant_cfg: {where}: the {kind}_w_quantizer and linear_attn_sites.state_read."
                              f"lhs_quantizer round the same operand (W) but are set to {quant['w']} and {w_alias}")

        acc = {site: a.canonical() for site, a in la.matmul if a.canonical() is not None}
        decode = _decode_options(la, quant.get("state"), la_key, where, forward)
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
                close = glob_suggestions(rule.quantizer_name)
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


def _serving_forward(la: LinearAttentionCfg, kind: str, state: str | None, la_key: str, rules: list) -> str:
    """``serving.forward`` resolved to ``server`` or ``laqat`` (``auto``: the server's kernels where its package is
    importable at the profile's release and the state has no codec, else laqat's); the rule that says what the
    profile reproduces and which forward runs goes into ``rules``. ``server`` where the server's kernels cannot run
    is a PolicyError at the key."""
    from la_compiler.kernels.decode.server_forward import unavailable  # imports no server package until called

    serving, key = la.serving, f"{la_key}.serving.forward"
    why_not = ("the state quantizer's format ({}) is laqat's to apply: the server's kernels round to the cache "
               "dtype only".format(state) if state is not None else unavailable(serving.profile))
    if serving.forward == "server" and why_not:
        raise PolicyError(f"{key}: 'server' runs {serving.engine} {SERVING_RELEASES[serving.profile]}'s own kernels, "
                          f"but {why_not}; use serving.forward: laqat (laqat's reproduction) or auto")
    forward = "laqat" if serving.forward == "laqat" or why_not else "server"
    said = {"server": f"the server's kernels ({serving.engine} {SERVING_RELEASES[serving.profile]}) for the prefix, "
                      f"laqat's decode kernels (laid out as its packed decode) for the decode steps, laqat's backward",
            "laqat": "laqat's reproduction, laqat's backward"}[forward]
    if serving.forward == "auto":
        said += f" (auto: {why_not})" if why_not else " (auto: the server's package is importable)"
    rules.append(f"{la_key}.serving -> " + serving_summary(serving.profile, kind, serving.state_dtype, said))
    return forward


def _decode_options(la: LinearAttentionCfg, state: str | None, la_key: str | None,
                    where: str, forward: str | None = None) -> DecodeOptions | None:
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
                             state_dtype="float32" if serving is None else serving.state_dtype,
                             forward=forward or "laqat")
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
