"""A policy attached to a tiny transformers model (Qwen3.5, tests/models/transformers_models.py) through
``save_pretrained`` / ``from_pretrained`` and ``state_dict`` / ``torch.save``; run in its own process (FLA
hidden, as run_transformers_model.py explains).

    python tests/models/run_policy_round_trip.py

Prints one JSON line:

- ``saved``: the ``laqat_policy`` entry of config.json and whether the weight files hold a ``laqat_policy`` key;
- ``from_pretrained``: the reloaded model's policy, whether every weight is equal, and one compiled step of it
  (``backend="laqat"``, no policy option, eager hand-off): the policy's source, the specs, the loss and whether
  the loss and every gradient equal those of the original model compiled with ``options={"policy": ...}``
  bit for bit; the eager (uncompiled) loss, from which the policy moves it;
- ``state_dict``: the policy and weights after ``torch.save`` / ``torch.load(weights_only=True)`` and
  ``la_compiler.load_state_dict`` into a fresh instance built from a config without a policy;
- ``nvfp4_equal``: whether ``prefill_operands_nvfp4`` (integer keys in its cfg) comes back equal from config.json;
- ``newer``: the error ``policy_of`` raises for a config.json whose policy has a newer schema version.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.models.run_transformers_model import batch, build, grads_of  # noqa: E402  (hides FLA first)

import torch  # noqa: E402
import transformers  # noqa: E402

import la_compiler  # noqa: E402
from la_compiler.backend import last_record  # noqa: E402
from la_compiler.policy.attach import POLICY_KEY  # noqa: E402
from la_compiler.policy.file_format import PolicyError  # noqa: E402
from la_compiler.policy.resolution import load_policy  # noqa: E402
from tests.models.transformers_models import BY_NAME  # noqa: E402

CASE = BY_NAME["qwen3_5"]
POLICY = "state_fp8"


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    weights = [k for k in sa if k != POLICY_KEY]
    return weights == [k for k in sb if k != POLICY_KEY] and all(torch.equal(sa[k], sb[k]) for k in weights)


def compiled_step(model: torch.nn.Module, options: dict) -> tuple[dict, torch.Tensor, dict]:
    torch._dynamo.reset()
    n = len(last_record().graphs)
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend="laqat", fullgraph=True, options=options)(**batch()).loss
    loss.backward()
    graphs = last_record().graphs[n:]
    info = {"policy_sources": sorted({f"{g.policy} ({g.policy_source})" for g in graphs}),
            "specs": [m.spec for g in graphs for m in g.matches], "loss": loss.item()}
    return info, loss.detach(), grads_of(model)


def main() -> dict:
    out: dict = {}
    model = la_compiler.attach_policy(build(CASE), POLICY)
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp, "saved")
        model.save_pretrained(saved)
        from safetensors import safe_open

        with safe_open(str(saved / "model.safetensors"), "pt") as weights:
            keys = list(weights.keys())
        out["saved"] = {"config_entry": json.loads((saved / "config.json").read_text()).get(POLICY_KEY),
                        "weights_hold_the_policy": POLICY_KEY in keys, "weights": len(keys)}

        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved)
        info, loss, grads = compiled_step(reloaded, {"compiler": "eager"})
        want_info, want_loss, want_grads = compiled_step(model, {"compiler": "eager", "policy": POLICY})
        with torch.no_grad():
            eager_loss = reloaded(**batch()).loss.item()
        out["from_pretrained"] = {
            "class": type(reloaded).__name__, "policy": la_compiler.policy_of(reloaded).to_dict(),
            "same_weights": same_weights(reloaded, model), **info, "option_specs": want_info["specs"],
            "loss_equal": torch.equal(loss, want_loss), "grads_equal": sorted(grads) == sorted(want_grads) and all(
                torch.equal(grads[k], want_grads[k]) for k in grads), "eager_loss": eager_loss}

        torch.save(model.state_dict(), Path(tmp, "ckpt.pt"))
        state = torch.load(Path(tmp, "ckpt.pt"), weights_only=True)
        fresh = getattr(transformers, CASE.model_class)(getattr(transformers, CASE.config_class)(**CASE.overrides))
        before = la_compiler.policy_of(fresh)
        la_compiler.load_state_dict(fresh, state)
        out["state_dict"] = {"before": None if before is None else before.to_dict(),
                             "policy": la_compiler.policy_of(fresh).to_dict(),
                             "config_entry": getattr(fresh.config, POLICY_KEY, None),
                             "same_weights": same_weights(fresh, model)}

        nvfp4 = Path(tmp, "nvfp4")  # block_sizes {-1: 16, ...}: integer keys in a config that is written sorted
        la_compiler.attach_policy(build(CASE), "prefill_operands_nvfp4").save_pretrained(nvfp4)
        out["nvfp4_equal"] = la_compiler.policy_of(transformers.AutoModelForCausalLM.from_pretrained(nvfp4)) \
            == load_policy("prefill_operands_nvfp4")

        config = json.loads((saved / "config.json").read_text())
        config[POLICY_KEY]["version"] = "laqat.policy/2"
        (saved / "config.json").write_text(json.dumps(config))
        try:
            la_compiler.policy_of(transformers.AutoModelForCausalLM.from_pretrained(saved))
            out["newer"] = None
        except PolicyError as e:
            out["newer"] = str(e)
    out["expected_policy"] = load_policy(POLICY).to_dict()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
