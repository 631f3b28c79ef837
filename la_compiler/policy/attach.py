"""A policy attached to the model: it travels with the weights, and ``torch.compile(model, backend="laqat")``
uses it when no ``policy`` option is given.

    la_compiler.attach_policy(model, "state_fp8")                     # -> model
    la_compiler.policy_of(model)                                      # -> Policy | None
    torch.save(model.state_dict(), "ckpt.pt")
    la_compiler.load_state_dict(fresh_model, torch.load("ckpt.pt"))  # a fresh instance: weights and policy

Where the policy lives (docs/qat.md says why):

- a persistent buffer ``laqat_policy`` of the module it is attached to: a uint8 tensor holding the JSON of
  ``Policy.to_dict()`` (versioned, plain data). So it is in ``state_dict()`` under that key, goes through
  ``torch.save`` / ``torch.load(weights_only=True)`` as a tensor, and nothing runs at load but JSON parsing
  and the policy's validation. A buffer, not a submodule: module names, which the policy's globs match,
  stay the same.
- load hooks on that module: ``load_state_dict`` of a checkpoint with a policy replaces the attached one
  (whatever its length); a checkpoint without one leaves the attached policy in place.
- on a transformers model, also ``model.config.laqat_policy`` (a plain dict, so it is in ``config.json``):
  ``save_pretrained`` leaves the buffer out of the weight files and ``from_pretrained`` finds the policy in
  the config.

A fresh instance has neither buffer nor hooks: ``model.load_state_dict(sd)`` (strict) of a checkpoint with a
policy then fails naming the key ``laqat_policy``, ``strict=False`` lists it in ``unexpected_keys`` and drops
it. ``la_compiler.load_state_dict`` attaches the checkpoint's policy first.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Mapping

import torch

from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.resolution import Policy, load_policy

__all__ = ["attach_policy", "policy_of", "load_state_dict", "POLICY_KEY"]

POLICY_KEY = "laqat_policy"  # the buffer's name, hence the state-dict key; also the transformers config key


def attach_policy(model: torch.nn.Module, policy) -> torch.nn.Module:
    """Stores ``policy`` (a recipe name, a .yaml/.json path, a dict or a ``Policy``) in ``model`` and returns
    ``model``. ``None`` removes an attached policy."""
    module = _module_of(model, "attach_policy")
    if policy is None:
        module._buffers.pop(POLICY_KEY, None)
        config = _transformers_config(module)
        if config is not None and hasattr(config, POLICY_KEY):
            delattr(config, POLICY_KEY)
        return model
    _store(module, load_policy(policy, key="attach_policy(model, policy)"))
    _install_load_hooks(module)
    return model


def policy_of(model_or_state_dict) -> Policy | None:
    """The policy attached to a module (its buffer, or a transformers model's ``config.laqat_policy``), or the
    policy stored in a state dict; ``None`` if there is none."""
    if isinstance(model_or_state_dict, Mapping):
        stored = model_or_state_dict.get(POLICY_KEY)
        return None if stored is None else _decode(stored, f"state_dict[{POLICY_KEY!r}]")
    found = _attached(_module_of(model_or_state_dict, "policy_of"))
    return None if found is None else found[0]


def load_state_dict(model: torch.nn.Module, state_dict: Mapping, strict: bool = True, assign: bool = False):
    """``model.load_state_dict(state_dict, strict, assign)`` for a model that may not have a policy attached
    yet (a fresh instance): the state dict's policy, if it holds one, is attached first. Returns what torch's
    ``load_state_dict`` returns."""
    module = _module_of(model, "load_state_dict")
    policy = policy_of(state_dict)
    if policy is not None:
        attach_policy(module, policy)
    return module.load_state_dict(state_dict, strict=strict, assign=assign)


def attached_policy_source(module: torch.nn.Module | None) -> tuple[Policy, str] | None:
    """(the policy attached to ``module``, where it was found) for the backend and ``explain``."""
    return None if module is None else _attached(module)


# ---- storage ------------------------------------------------------------------------------------

def _module_of(model, caller: str) -> torch.nn.Module:
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):  # torch.compile(model): the model inside
        return model._orig_mod
    if not isinstance(model, torch.nn.Module):
        raise PolicyError(f"{caller}(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def _attached(module: torch.nn.Module) -> tuple[Policy, str] | None:
    name = type(module).__name__
    stored = module._buffers.get(POLICY_KEY)
    if stored is not None:
        return _decode(stored, f"{name}.{POLICY_KEY}"), f"attached to {name}"
    config = _transformers_config(module)
    entry = getattr(config, POLICY_KEY, None) if config is not None else None
    if entry is not None:
        where = f"{name}.config.{POLICY_KEY}"
        return _from_dict(entry, where), f"attached to {name} (config.{POLICY_KEY})"
    return None


def stored_object(module: torch.nn.Module):
    """The object holding the attached policy (the buffer, else the config entry): replaced whenever it changes."""
    stored = module._buffers.get(POLICY_KEY)
    if stored is None:
        config = _transformers_config(module)
        stored = getattr(config, POLICY_KEY, None) if config is not None else None
    return stored


def _store(module: torch.nn.Module, policy: Policy) -> None:
    if module._buffers.get(POLICY_KEY) is not None and policy_of(module) == policy:
        return  # the same policy (a checkpoint of this run loaded): the same buffer object (policy/guard.py)
    encoded = _encode(policy, _device_of(module))
    module.register_buffer(POLICY_KEY, encoded, persistent=True)
    config = _transformers_config(module)
    if config is not None:
        setattr(config, POLICY_KEY, _as_json_data(policy))
        # the config carries the policy: the weight files stay what transformers expects of the architecture
        ignored = getattr(module, "_keys_to_ignore_on_save", None)
        module._keys_to_ignore_on_save = {*(ignored or ()), POLICY_KEY}


def _encode(policy: Policy, device: torch.device) -> torch.Tensor:
    text = json.dumps(policy.to_dict(), separators=(",", ":"))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8, device=device)


def _as_json_data(policy: Policy) -> dict:
    """``to_dict()`` as JSON gives it back: integer keys (NVFP4's ``block_sizes: {-1: 16, ...}``) as strings, which
    ``from_dict`` reads, so that a writer that sorts keys (transformers' config.json) can."""
    return json.loads(json.dumps(policy.to_dict()))


def _decode(stored, where: str) -> Policy:
    if not isinstance(stored, torch.Tensor) or stored.dtype != torch.uint8 or stored.dim() != 1:
        got = f"{stored.dtype} tensor of shape {tuple(stored.shape)}" if isinstance(stored, torch.Tensor) \
            else type(stored).__name__
        raise PolicyError(f"{where}: must be a 1-D uint8 tensor holding a policy's JSON, got {got}")
    try:
        config = json.loads(bytes(stored.cpu().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PolicyError(f"{where}: not a policy's JSON ({e})") from None
    return _from_dict(config, where)


def _from_dict(config, where: str) -> Policy:
    if not isinstance(config, Mapping):
        raise PolicyError(f"{where}: must be a policy dict, got {type(config).__name__}")
    try:
        return Policy.from_dict(config)
    except PolicyError as e:
        raise PolicyError(f"{where}: {e}") from None


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _transformers_config(module: torch.nn.Module):
    """A transformers model's config (saved as config.json by save_pretrained), else None."""
    transformers = sys.modules.get("transformers")  # a model of it exists only where it was imported
    base = getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)
    config = getattr(module, "config", None)
    return config if base is not None and isinstance(config, base) else None


# ---- load hooks ---------------------------------------------------------------------------------

def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """A checkpoint's policy replaces the attached one; a checkpoint without one keeps it. ``state_dict`` is
    load_state_dict's own copy, so the entry written here is not the caller's."""
    key = prefix + POLICY_KEY
    if key in state_dict:
        _store(module, _decode(state_dict[key], f"state_dict[{key!r}]"))
    if POLICY_KEY in module._buffers:
        state_dict[key] = module._buffers[POLICY_KEY]  # the buffer's own bytes: same shape, nothing missing


def _install_load_hooks(module: torch.nn.Module) -> None:
    if not any(getattr(h, "hook", None) is _load_pre_hook for h in module._load_state_dict_pre_hooks.values()):
        module.register_load_state_dict_pre_hook(_load_pre_hook)
