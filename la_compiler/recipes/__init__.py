"""Shipped policy recipes (``<name>.yaml`` beside this file), loadable by name:

    torch.compile(model, backend="laqat", options={"policy": "state_fp8"})
    la_compiler.policy.load_recipe("state_fp8")  # -> Policy
"""
from __future__ import annotations

from pathlib import Path

from la_compiler.policy_schema import PolicyError

_DIR = Path(__file__).parent


def recipe_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    path = _DIR / f"{name}.yaml"
    if name not in recipe_names():
        raise PolicyError(f"recipe {name!r} does not exist; recipes: {recipe_names()}")
    return path
