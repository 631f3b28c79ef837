"""The GDN/KDA variants FLA supports, as transformers' hybrid models spell them: beta in [0, 2]
(OLMo-Hybrid ``allow_neg_eigval``) and the sigmoid lower-bound gate (Bailing-hybrid
``kda_safe_gate``, GLM5-next ``linear_lower_bound``). The scalar that the region's entry
chain applies to an input is replayed in front of the IR node; outputs, final states and every
gradient equal eager."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import la_compiler
from la_compiler.ir.delta_rule import DELTA_RULE
from tests.passes import torch_recurrence_gates as gates
from tests.helpers import assert_close_rel
from tests.passes.test_torch_recurrence import _check, _inputs

TOL = 1e-5


def _call(fn, q, k, v, g, beta, h0):
    return fn(q, k, v, g, beta, h0)


@pytest.mark.parametrize("name,kind,shape", [
    ("olmo_neg_eigval_chunked", "gdn", dict(T=7)),
    ("olmo_neg_eigval_token", "gdn", dict()),
    ("safe_gate_fla_chunk_kda", "kda", dict(T=8)),
    ("safe_gate_bf16_fla_chunk_kda", "kda", dict(T=8)),
    ("safe_gate_token_kda", "kda", dict(H=1, HV=2)),
    ("scaled_values_with_state", "gdn", dict()),
    ("scale_after_pad", "gdn", dict(T=7)),
    ("neg_eigval_in_the_loop", "gdn", dict()),
])
def test_variant_is_rewritten_and_equals_eager(name, kind, shape):
    _check(getattr(gates, name), kind, _inputs(kind, **shape), _call)


@pytest.mark.parametrize("name", ["gdn_bmm_flat_state", "gdn_head_first", "gdn_clone_inplace"])
def test_completeness_spellings(name):
    """Every per-step contraction a bmm over flattened B*H with a [B*H, K, V] state; inputs
    head-first with T = K = V, where every input has the state's shape; in-place methods on a
    fresh clone read through their result."""
    from tests.passes import torch_recurrence_spellings as spellings
    if name == "gdn_head_first":
        t = _inputs("gdn", T=4, K=4, V=4)
        t = {n: x if n == "h0" else x.transpose(1, 2).contiguous() for n, x in t.items()}
    else:
        t = _inputs("gdn")
    _check(getattr(spellings, name), "gdn", t, _call)


def test_in_place_state_updates():
    """``S.mul_(decay)``, ``S.add_(k u^T)`` on a fresh clone (inference code): rewritten, equal."""
    from tests.passes import torch_recurrence_spellings as spellings
    t = _inputs("gdn")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = spellings.gdn_inplace_state(**t)
        report = la_compiler.explain(spellings.gdn_inplace_state, **t, policy={
            "linear_attention": [{"module_name": "*", "cfg": {"backend": "reference"}}]})
    assert [(m.frontend, m.kind) for m in report.matches] == [("torch", "gdn")], report.near_misses
    for got, w, what in zip(report.output, want, ("o", "state")):
        assert_close_rel(got, w, TOL, what)


def test_replayed_scalar_runs_in_the_dtype_the_model_used():
    """A bf16 gate scaled in bf16 and then cast to fp32 by the function: the IR node's g is the
    same bf16 product cast to fp32 (mul before the cast, as in the region), bit for bit."""
    def fn(q, k, v, g, beta, h0):
        gate = (gates.LOWER_BOUND * torch.sigmoid(g.bfloat16())).float()
        return gates.spellings.gdn_unbind_cat(q, k, v, gate, beta, h0)

    t = _inputs("gdn")
    seen = {}

    def backend(gm, example_inputs):
        from la_compiler.passes.frontends.torch_recurrence import rewrite_torch_recurrences
        from la_compiler.record import GraphRecord
        assert rewrite_torch_recurrences(gm, GraphRecord(0)) == 1
        (ir,) = [n for n in gm.graph.nodes if n.target is DELTA_RULE]
        seen["g_chain"] = []
        x = ir.args[3]
        while x.op != "placeholder" and x.target is not torch.sigmoid:
            seen["g_chain"].append((x.target, x.meta["example_value"].dtype))
            x = x.args[0]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(**t)
    # the chain walked back from the IR input: cast to fp32 last, the multiplication in bf16
    targets = [(getattr(t_, "__name__", t_), d) for t_, d in seen["g_chain"]]
    assert ("to", torch.float32) in targets and ("mul", torch.bfloat16) in targets, targets
    assert targets.index(("to", torch.float32)) < targets.index(("mul", torch.bfloat16)), targets


def test_inconsistently_scaled_beta_is_a_near_miss():
    """beta doubled on the value side only: no single beta makes it the delta rule."""
    t = _inputs("gdn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = la_compiler.explain(gates.half_scaled_beta, **t)
    assert report.matches == []
    (reason,) = [n.reason for n in report.near_misses if n.frontend == "torch"]
    assert reason.endswith("beta enters the region scaled or cast differently on different uses"), reason
    for got, want in zip(report.output, gates.half_scaled_beta(**t)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- the three transformers families, config-built, their default linear-attention settings ----
SCRIPT = Path(__file__).with_name("torch_recurrence_hybrid_models.py")


def test_hybrid_models_train_step_matches_eager():
    """OLMo-Hybrid (GDN, beta in [0, 2]), Bailing-hybrid and GLM5-next (KDA, lower-bound gate):
    one laqat node per linear-attention layer; loss and every parameter gradient equal eager.
    T = 20 with chunk size 8 (passed through the models' kwargs) keeps the trace small; GLM5-next
    with one hyper-connection stream (its stream mixing sums cancel over tokens, not under test)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[2]))
    run = subprocess.run([sys.executable, str(SCRIPT), "olmo_hybrid,bailing_hybrid,glm5_next", "eager", "20", "8", "1"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["family"] for r in results] == ["olmo_hybrid", "bailing_hybrid", "glm5_next"]
    for r in results:
        kind = "gdn" if r["family"] == "olmo_hybrid" else "kda"
        assert [m[:2] for m in r["matches"]] == [[kind, "torch"]] * r["linear_layers"], r["matches"]
        assert r["near_misses"] == [], r["near_misses"]
        assert abs(r["loss_laqat"] - r["loss_eager"]) <= TOL * abs(r["loss_eager"]), r
        assert r["grad_names_laqat"] == r["grad_names"] and r["grad_names"]
        bad = {n: e for n, e in r["errors"].items() if not e <= TOL}
        assert not bad, (r["family"], bad)
