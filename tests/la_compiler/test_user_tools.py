"""What a user reaches for, through the user's path: shipped recipes compile without a warning on GDN-only,
KDA-only and hybrid models; laqat's warnings point at the user's line and become errors with the documented
filter; ``TORCH_LOGS="+la_compiler"`` prints every rewrite and near miss of a training run, ``TORCH_LOGS=
"la_compiler"`` the summary; ``print(la_compiler.policy_of(model))`` shows the attached policy."""
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import la_compiler
from la_compiler.policy.resolution import Policy, load_policy
from la_compiler.recipes import SERVES, recipe_names

ROOT = Path(__file__).parents[2]
KDA_ONLY = {"vllm_kda_state_bf16"}  # vLLM's Kimi-K3 profile: a GDN layer is an error (test_serving_policy)


def test_the_warning_classes_are_public():
    assert issubclass(la_compiler.UnmatchedPolicyRuleWarning, la_compiler.PolicyWarning)
    assert issubclass(la_compiler.NothingQuantizedWarning, la_compiler.PolicyWarning)
    assert issubclass(la_compiler.PolicyWarning, UserWarning)
    from la_compiler.passes.annotate import NothingQuantizedWarning, UnmatchedPolicyRuleWarning

    assert (UnmatchedPolicyRuleWarning, NothingQuantizedWarning) == (la_compiler.UnmatchedPolicyRuleWarning,
                                                                     la_compiler.NothingQuantizedWarning)


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_meets_all_its_rules_on_gdn_only_kda_only_and_hybrid_models(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", la_compiler.PolicyWarning)
        policy = load_policy(name)
    for kinds in (("gdn",), ("kda",), ("gdn", "kda")):
        if name in KDA_ONLY and "gdn" in kinds:
            continue
        layers = [(f"model.layers.{i}.attn", kind) for i, kind in enumerate(kinds)]
        assert policy.unmatched_rules(layers) == [], (name, kinds)
    assert name in SERVES and SERVES[name]


def _tiny(layers):
    pytest.importorskip("fla")
    from la_compiler.tiny_models import TinyConfig, TinyHybridLM

    torch.manual_seed(0)
    return TinyHybridLM(TinyConfig(layers=layers))


@pytest.mark.parametrize("layers", [("gdn",), ("kda",), ("gdn", "kda")], ids="-".join)
def test_a_shipped_recipe_trains_without_a_warning(layers):
    """The user's path: attach the recipe, compile, one training step; any laqat warning fails."""
    model = la_compiler.attach_policy(_tiny(layers), "state_fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error", la_compiler.PolicyWarning)
        step = torch.compile(model.loss, backend="laqat", options={"compiler": "eager"})
        step(torch.randint(0, 64, (1, 9))).backward()
    matches = la_compiler.backend.last_record().graphs[-1].matches
    assert [m.kind for m in matches] == list(layers) and all("q.state=fp8_e4m3/tile64" in m.spec for m in matches)


def test_an_unmatched_user_rule_warns_at_the_users_line_and_the_filter_makes_it_an_error():
    policy = {"name": "mine", "quant_cfg": [{"quantizer_name": "*kda_state_quantizer",
                                             "cfg": {"num_bits": 8, "type": "dynamic", "axis": [0, 1]}}]}
    model = _tiny(("gdn",))
    compiled = torch.compile(model, backend="laqat", options={"policy": policy, "compiler": "eager"})
    tokens = torch.randint(0, 64, (1, 5))
    with pytest.warns(la_compiler.UnmatchedPolicyRuleWarning,
                      match=r"policy 'mine': quant_cfg\[0\] \(quantizer_name '\*kda_state_quantizer'\) matched no "
                            r"quantizer in this graph \(this graph's sites: gdn at layers.0.attn\)") as record:
        compiled(tokens)
    assert [w.filename for w in record if w.category is la_compiler.UnmatchedPolicyRuleWarning] == [__file__]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", la_compiler.PolicyWarning)
        with pytest.raises(la_compiler.UnmatchedPolicyRuleWarning):  # as itself, not Dynamo's wrapper
            torch.compile(model, backend="laqat", options={"policy": policy, "compiler": "eager"})(tokens)


def test_print_shows_the_attached_policy_as_a_file_would_hold_it():
    model = la_compiler.attach_policy(torch.nn.Linear(2, 2), "state_fp8")
    text = str(la_compiler.policy_of(model))
    assert text.startswith("version: laqat.policy/1\nname: state_fp8\n") and "'*_state_quantizer'" in text
    assert Policy.from_dict(yaml.safe_load(text)) == load_policy("state_fp8")


_LOGGED_RUN = textwrap.dedent('''
    import os, sys
    import torch
    import la_compiler  # noqa: F401

    def delta_rule(q, k, v, g, beta):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 1.0, "gdn[src=user]")[0]

    def not_a_delta_rule(q, k, v, g, beta):  # adds a bias the delta rule does not have: a near miss
        S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u) + 0.5
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        return o

    def inputs():
        q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
        return q, k, v, -torch.rand(1, 4, 2), torch.rand(1, 4, 2)

    options = {"policy": "state_fp8", "compiler": "eager"}
    for step in range(2):  # a training run: compile once, step twice
        fn = torch.compile(delta_rule, backend="laqat", options=options)
        fn(*inputs()).square().sum().backward()
    torch.compile(not_a_delta_rule, backend="laqat", options={"compiler": "eager"})(*inputs())
    print("----", file=sys.stderr, flush=True)
    os.environ["TORCH_LOGS"] = "la_compiler"  # what `TORCH_LOGS=la_compiler` at start-up sets
    torch._logging._internal._init_logs()
    torch._dynamo.reset()
    torch.compile(delta_rule, backend="laqat", options=options)(*inputs())
''')


def test_torch_logs_shows_each_rewrite_and_near_miss_and_the_summary():
    env = dict(os.environ, TORCH_LOGS="+la_compiler", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _LOGGED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    verbose, summary = run.stderr.split("----\n")
    assert verbose.count("la_compiler/backend.py") >= 3 and "Traceback" not in verbose, verbose
    rewrites = [line for line in verbose.splitlines() if "rewrote gdn at <top> (frontend user)" in line]
    assert len(rewrites) == 1, verbose  # compiled once: later steps reuse the graph
    assert "gdn[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=" in rewrites[0]
    assert "q.state=fp8_e4m3/tile64] -> kernel " in rewrites[0]
    assert "near miss (torch frontend) at <top>: the region does not compute the GDN/KDA delta rule" in verbose
    assert ("graph 0: 1 recurrence(s) rewritten (gdn at <top>), 0 near miss(es); policy state_fp8 (option); hand-off "
            "eager (options['compiler'])") in verbose
    assert ("graph 1: 0 recurrence(s) rewritten (none), 1 near miss(es); policy exact (default exact); hand-off eager "
            "(options['compiler'])") in verbose
    assert "rewrote" not in summary and "graph 2: 1 recurrence(s) rewritten (gdn at <top>)" in summary, summary
