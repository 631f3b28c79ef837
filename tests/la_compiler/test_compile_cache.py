"""laqat's compiled graphs in Inductor's FX graph cache and AOTAutograd's cache (la_compiler/hand_off/cache_key.py):
a second process with the same TORCHINDUCTOR_CACHE_DIR hits both caches, bypasses neither and computes the first's
loss and gradients bit for bit; other laqat sources miss the entries the first wrote, and the fingerprint that keys
them follows the policy and the tuning options."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import la_compiler
from la_compiler.hand_off.cache_key import (LaqatCacheKey, compile_fingerprint, hash_files, source_files)
from la_compiler.options import TuningOptions

ROOT = Path(__file__).parents[2]


def _run(prefix: Path, cache_dir: Path, *compiles: str) -> tuple[dict, dict]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1")
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env.pop("TORCH_COMPILE_FORCE_DISABLE_CACHES", None)
    subprocess.run([sys.executable, "-m", "tests.la_compiler.compile_cache_run", str(prefix), *compiles],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads(prefix.with_suffix(".json").read_text()), torch.load(prefix.with_suffix(".pt"))


def test_a_second_process_hits_both_caches_and_other_sources_do_not(tmp_path):
    cache_dir = tmp_path / "inductor"
    first, first_tensors = _run(tmp_path / "first", cache_dir, "exact")
    assert first["exact"] == {"inductor": {"fxgraph_cache_miss": 2},
                              "aot_autograd": {"autograd_cache_miss": 1, "autograd_cache_saved": 1}}

    second, second_tensors = _run(tmp_path / "second", cache_dir, "exact", "exact:edited")
    assert second["exact"] == {"inductor": {"fxgraph_cache_hit": 2}, "aot_autograd": {"autograd_cache_hit": 1}}
    for name, expected in first_tensors["exact"].items():
        assert torch.equal(second_tensors["exact"][name], expected), name
    assert second["exact:edited"] == first["exact"]  # compiled from scratch, not from the first process's entries


def test_the_sources_cover_laqat_and_their_hash_follows_their_contents(tmp_path):
    names = [name for name, _ in source_files()]
    for expected in ("la_compiler/ir/delta_rule.py", "la_compiler.kernels/registry.py",
                     "la_compiler.passes/pipeline.py", "la_compiler/hand_off/cache_key.py"):
        assert expected in names
    source = tmp_path / "op.py"
    source.write_text("x = 1\n")
    before = hash_files([("op.py", source)])
    source.write_text("x = 2\n")
    assert hash_files([("op.py", source)]) != before
    assert hash_files([("other.py", source)]) != hash_files([("op.py", source)])


def test_the_fingerprint_follows_the_policy_and_the_tuning():
    exact, fp8 = la_compiler.load_policy("exact"), la_compiler.load_policy("state_fp8")
    tuning = TuningOptions()
    assert compile_fingerprint(exact, tuning) == compile_fingerprint(la_compiler.load_policy("exact"), tuning)
    assert compile_fingerprint(exact, tuning) != compile_fingerprint(fp8, tuning)
    assert compile_fingerprint(exact, tuning) != compile_fingerprint(exact, TuningOptions(keep_residual="all"))


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append(graph)

    def uuid(self):
        return "user pass 1"


@pytest.mark.parametrize("inner", [None, "custom", "callable"])
def test_a_user_pass_still_runs_and_keys_the_cache(inner):
    """A user's post-grad post pass runs; its uuid joins laqat's, and one without a uuid makes Inductor bypass its
    cache (uuid None), as without laqat."""
    user = {"custom": _UserPass(), "callable": lambda graph: None, None: None}[inner]
    key = LaqatCacheKey("abc", user)
    graph = torch.fx.Graph()
    key(graph)
    if inner == "custom":
        assert user.graphs == [graph]
    assert key.uuid() == {None: ("laqat", "abc"), "custom": ("laqat", "abc", "user pass 1"), "callable": None}[inner]
