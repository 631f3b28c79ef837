"""Checkpoints of a QAT/QAD run: the weights with the attached policy, the optimizer, the step.

    save_checkpoint(path, model, step=100, optimizer=opt, train_config={...}, model_config={...})
    state = read_checkpoint(path)                     # torch.load(weights_only=True): plain data only
    policy = restore_weights(model, state)            # weights and the checkpoint's policy into ``model``

The policy travels in ``model.state_dict()`` (``la_compiler.attach_policy`` stores it as a buffer,
``laqat_policy``), so a checkpoint is plain tensors, numbers and strings: ``torch.load`` with torch's default
``weights_only=True`` reads it and runs nothing.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

import la_compiler
from la_compiler.policy.attach import POLICY_KEY

FORMAT = "laqat-qat-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the run; the message names the file and what differs."""


def save_checkpoint(path: str | Path, model: torch.nn.Module, *, step: int, optimizer=None,
                    train_config: dict | None = None, model_config: dict | None = None, extra: dict | None = None):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "step": step, "model": model.state_dict(),
             "optimizer": None if optimizer is None else optimizer.state_dict(),
             "train_config": train_config, "model_config": model_config, "extra": extra or {}}
    partial = path.with_suffix(path.suffix + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a run killed while saving leaves the previous checkpoint intact
    return path


def read_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: no such file")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: not a {FORMAT} checkpoint")
    return state


def restore_weights(model: torch.nn.Module, state: dict, expected_policy=None):
    """Loads the checkpoint's weights, and its policy if it has one, into ``model``; returns the policy now
    attached. With ``expected_policy``, a checkpoint trained under another policy is an error."""
    stored = la_compiler.policy_of(state["model"])
    if expected_policy is not None and stored is not None:
        expected = la_compiler.load_policy(expected_policy)
        if stored.to_dict() != expected.to_dict():
            raise CheckpointError(f"the checkpoint was trained under policy {stored.name!r}, the run asks for "
                                  f"{expected.name!r} (--policy); leave --policy out to resume under the stored one")
    la_compiler.load_state_dict(model, state["model"])
    return la_compiler.policy_of(model)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the attached policy: what copies weights from one compiled instance into another
    (each instance keeps its own policy)."""
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] != POLICY_KEY}
