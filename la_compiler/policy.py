"""The policy table (placeholder interface; the full ModelOpt-vocabulary loader is issue 4).

Contract used by the annotate pass:
    load_policy(None | Policy | dict | path | recipe name) -> Policy
    Policy.resolve(module: str, kind: str) -> Resolution
    Policy.unmatched_rules(seen: list[tuple[str, str]]) -> list[str]   # (module, kind) pairs
"""
from __future__ import annotations

import dataclasses


class PolicyError(ValueError):
    """A policy config that is not valid; the message names the key and the allowed values."""


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What a policy decides for one recurrence site."""

    quant: tuple[tuple[str, str], ...] = ()  # (site, canonical format string)
    acc: tuple[tuple[str, str], ...] = ()
    solve: str = "exact"
    degree: int | None = None
    chunk: int = 64
    phase: str = "none"
    extra: tuple[tuple[str, str], ...] = ()
    backend: str | None = None  # an explicitly requested kernel variant
    rules: tuple[str, ...] = ()  # human-readable: which rules applied


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str = "exact"

    @staticmethod
    def exact() -> "Policy":
        return Policy()

    def resolve(self, module: str, kind: str) -> Resolution:
        return Resolution(rules=("default: exact, no quantization",))

    def unmatched_rules(self, seen) -> list[str]:
        return []


def load_policy(policy) -> Policy:
    if policy is None:
        return Policy.exact()
    if isinstance(policy, Policy):
        return policy
    raise PolicyError(f"options['policy']: policy tables are not supported yet, got {type(policy).__name__}")
