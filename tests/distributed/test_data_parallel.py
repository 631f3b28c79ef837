"""laqat under ``DistributedDataParallel`` and FSDP2 (``fully_shard``): two gloo processes on the CPU.

Each rank trains on one sequence of a two-sequence batch. Two models, one per frontend: ``TorchGDNNet`` (GDN
token loops written in torch: the graph frontend) and ``FlaNet`` (FLA's ``GatedDeltaNet`` layer and a
``chunk_kda`` call: the FLA call substitution), with exact numerics and with the ``state_fp8`` recipe. In every
case each recurrence becomes one laqat node named as in the model, and the loss and every gradient (all-reduced
by DDP; reduce-scattered by FSDP2 and gathered with ``full_tensor()``) equal the same compiled step on the whole
batch in one process; with exact numerics also the uncompiled model (FLA's kernels replaced by FLA's torch
references). fp32, relative L2 <= 1e-5: the data-parallel run and the one-process run compute every
per-sequence value with the same kernels, and differ only in how the batch sums are associated (per-rank
partial sums, then the reduction over ranks), an error of a few fp32 ulps.

- DDP: ``torch.compile(DDP(model))`` with a bucket cap so small that DDPOptimizer cuts the graph at every
  parameter read (a dozen graph pieces or more), and ``DDP(torch.compile(model))``. laqat compiles the same
  pieces and meets the same graph breaks (those of DDP's own forward) as Dynamo's ``eager`` backend. A policy
  naming ``layers.1`` exactly applies to that layer alone, given as an option or attached to the model (the
  names are the model's, not DDP's ``module.*``).
  A recurrence that a bucket boundary cuts (``GatedTorchGDNNet`` reads a parameter inside it) is refused with
  ``RecurrenceSplitError``; in one bucket, or with DDPOptimizer off, it is rewritten and equals the one-process
  step.
- FSDP2: ``fully_shard`` on each layer and on the root, then ``torch.compile(model)``; and each layer compiled
  (``layer.compile``) before it is sharded. The laqat nodes read plain tensors (FSDP2 all-gathers the
  parameters before the forward), never DTensors.
- FLA's blocks (``FlaBlocksNet``) under ``backend="laqat"``: each block call is a block region under DDP without
  its graph splitting and under FSDP2 sharding the root alone, and trains bit for bit as without regions; DDP's
  graph splitting and blocks sharded by FSDP2 keep FLA's forward.

The rewritten graphs run eagerly (``LAQAT_DISTRIBUTED_HAND_OFF=inductor`` runs every case through Inductor
instead: minutes with a cold Inductor cache).
All cases run in one pair of processes (the module fixture); each test asserts on its part.
"""
import contextlib
import functools

import pytest
import torch
import torch._dynamo.testing

pytest.importorskip("fla")
pytestmark = [
    pytest.mark.xdist_group("distributed"),  # one worker runs the module fixture once (make test: --dist loadgroup)
    pytest.mark.filterwarnings("ignore:policy 'state_fp8'.*matched no quantizer"),  # its KDA rule, GDN-only model
]

from tests.distributed import steps  # noqa: E402
from tests.distributed.ranks import run_ranks  # noqa: E402
from tests.helpers import assert_close_rel, rel_l2  # noqa: E402

TOL = 1e-5
TINY_BUCKET_MB = 1e-6  # every parameter read fills a bucket: one graph piece per parameter read
ONE_BUCKET_MB = 25.0  # DDP's default
MODELS_AND_POLICIES = [("TorchGDNNet", "exact"), ("TorchGDNNet", "state_fp8"), ("FlaNet", "exact"),
                       ("FlaNet", "state_fp8")]
# (engine, model, policy, how): every case the ranks run; policy "plain_eager" is Dynamo's eager backend.
# DDP: "tiny-buckets" torch.compile(DDP(model)) with TINY_BUCKET_MB, "one-bucket" with ONE_BUCKET_MB,
# "compiled-inside" DDP(torch.compile(model)) with TINY_BUCKET_MB, "no-ddp-optimizer" TINY_BUCKET_MB with
# torch._dynamo.config.optimize_ddp = False (no graph split), "tiny-buckets-attached-policy" the policy attached to
# the model (la_compiler.attach_policy) instead of given as an option. FSDP2: "root" fully_shard on each layer and
# the root, then torch.compile(model); "layers" each layer compiled, then sharded.
CASES = [("ddp", model, policy, "tiny-buckets") for model, policy in MODELS_AND_POLICIES] + [
    ("ddp", "TorchGDNNet", "layer1_state_fp8", "tiny-buckets"),
    ("ddp", "TorchGDNNet", "layer1_state_fp8", "tiny-buckets-attached-policy"),
    ("ddp", "TorchGDNNet", "exact", "compiled-inside"),
    ("ddp", "GatedTorchGDNNet", "exact", "tiny-buckets"),
    ("ddp", "GatedTorchGDNNet", "exact", "one-bucket"),
    ("ddp", "GatedTorchGDNNet", "exact", "no-ddp-optimizer"),
    ("ddp", "TorchGDNNet", "plain_eager", "tiny-buckets"),
    ("ddp", "FlaNet", "plain_eager", "tiny-buckets"),
] + [("fsdp", model, policy, "root") for model, policy in MODELS_AND_POLICIES] + [
    ("fsdp", "TorchGDNNet", "exact", "layers"),
    ("fsdp", "TorchGDNNet", "plain_eager", "root"),
    ("fsdp", "FlaNet", "plain_eager", "root"),
] + [
    # FLA's blocks under the user's own backend="laqat" (block regions: passes/frontends/fla/block_regions.py):
    # "<how>:laqat", and "<how>:laqat-regions-off" with LAQAT_FLA_BLOCK_REGIONS=off; FSDP2 "root-only" shards the
    # root alone (the blocks stay plain modules)
    ("ddp" if how in ("no-ddp-optimizer", "tiny-buckets") else "fsdp", "FlaBlocksNet", "exact", f"{how}:{backend}")
    for how, backends in (("no-ddp-optimizer", ("laqat", "laqat-regions-off")), ("tiny-buckets", ("laqat",)),
                          ("root-only", ("laqat", "laqat-regions-off")), ("root", ("laqat",)))
    for backend in backends
]
MATCHES = {
    "TorchGDNNet": [("layers.0", "torch", "gdn"), ("layers.1", "torch", "gdn")],
    "GatedTorchGDNNet": [("layers.0", "torch", "gdn"), ("layers.1", "torch", "gdn")],
    "FlaNet": [("layers.0.attn", "fla", "gdn"), ("layers.1", "fla", "kda")],
    "FlaBlocksNet": [(f"layers.{i}.attn", "fla", "kda") for i in range(3)],
}
STATE_FP8 = "q.state=fp8_e4m3/tile64"


@contextlib.contextmanager
def _first_bucket_at_most(bucket_mb):
    """DDP, and DDPOptimizer when it compiles, refuse a first bucket larger than the others."""
    import torch.distributed as dist

    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = min(saved, int(bucket_mb * 2 ** 20))
    try:
        yield
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved


def _ddp_step(rank, world_size, model, batch, backend, how, options):
    from torch.nn.parallel import DistributedDataParallel

    bucket_mb = ONE_BUCKET_MB if how == "one-bucket" else TINY_BUCKET_MB
    inside = how == "compiled-inside"
    no_split = contextlib.nullcontext()
    if how == "no-ddp-optimizer":
        no_split = torch._dynamo.config.patch(optimize_ddp=False)
    with _first_bucket_at_most(bucket_mb), no_split:
        ddp = DistributedDataParallel(torch.compile(model, backend=backend) if inside else model,
                                      bucket_cap_mb=bucket_mb)
        return steps.step(model, ddp, batch, backend=backend, world_size=world_size, compile_model=not inside,
                          options=options)


def _fsdp_step(rank, world_size, model, batch, backend, how, mesh, options):
    from torch.distributed.fsdp import fully_shard

    if how != "root-only":
        for layer in model.layers:
            if how == "layers":
                layer.compile(backend=backend)
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return steps.step(model, model, batch, backend=backend, world_size=world_size, compile_model=how != "layers",
                      full_grad=lambda grad: grad.full_tensor(), options=options)


@contextlib.contextmanager
def _environment(name, value):
    import os

    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _worker(rank, world_size):
    import la_compiler.backend  # installs the FLA substitutions
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for engine, model_name, policy, case in CASES:
        torch._dynamo.reset()
        model = steps.new_model(model_name)
        batch = steps.rank_slice(steps.global_batch(model, world_size), rank)
        how, _, users_backend = case.partition(":")
        options, regions = None, None
        if users_backend:  # torch.compile(..., backend="laqat", options=...), as the user writes it
            backend, options = "laqat", {"compiler": steps.HAND_OFF}
            regions = "off" if users_backend.endswith("regions-off") else None
        elif policy == "plain_eager":
            backend = torch._dynamo.testing.CompileCounterWithBackend("eager")
        elif how.endswith("attached-policy"):
            la_compiler.attach_policy(model, steps.POLICIES[policy])
            backend = steps.LaqatBackend({"compiler": steps.HAND_OFF})
        else:
            backend = steps.LaqatBackend(steps.laqat_options(policy))
        with _environment("LAQAT_FLA_BLOCK_REGIONS", regions):
            if engine == "ddp":
                result = _ddp_step(rank, world_size, model, batch, backend, how, options)
            else:
                result = _fsdp_step(rank, world_size, model, batch, backend, how, mesh, options)
        if policy == "plain_eager":
            result.graphs = backend.frame_count
        results[engine, model_name, policy, case] = result
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, timeout=600)


@functools.cache
def _single(model_name, policy):
    return steps.single_process(model_name, policy)


@functools.cache
def _eager(model_name):
    return steps.eager(model_name)


def _assert_same_step(got, expected, tol, what):
    assert got.error is None, got.error
    assert_close_rel(got.loss, expected.loss, tol, f"{what}: loss")
    assert sorted(got.grads) == sorted(expected.grads)
    for name, grad in expected.grads.items():
        assert_close_rel(got.grads[name], grad, tol, f"{what}: d{name}")


def _assert_equals_single_process(ranks, key):
    _, model_name, policy, _ = key
    got = ranks[0][key]
    assert got.error is None, got.error
    single = _single(model_name, policy)
    assert [m[:3] for m in single.matches] == MATCHES[model_name]
    _assert_same_step(got, single, TOL, f"{key} vs one process")
    _assert_same_step(ranks[1][key], got, 0.0, f"{key}: rank 1 vs rank 0")
    eager = _eager(model_name)
    if policy == "exact":
        _assert_same_step(got, eager, TOL, f"{key} vs eager")
    else:  # the policy moved the numbers: the equality above is not that of two exact runs
        assert rel_l2(got.loss, eager.loss) > TOL
        assert max(rel_l2(got.grads[n], g) for n, g in eager.grads.items()) > 100 * TOL
    return got


def _assert_no_graph_and_no_break_added(ranks, engine, how):
    """The same run under Dynamo's eager backend: the same graphs (DDPOptimizer's pieces), the same graph
    breaks. (The FLA substitution is installed process-wide once laqat is imported, so the eager backend
    traces FLA's calls as laqat ops too instead of breaking at them.)"""
    for model_name, policy in MODELS_AND_POLICIES:
        plain = ranks[0][engine, model_name, "plain_eager", how]
        assert plain.error is None, plain.error
        got = ranks[0][engine, model_name, policy, how]
        assert got.breaks == plain.breaks, (model_name, policy, got.breaks, plain.breaks)
        assert got.graphs == plain.graphs, (model_name, policy)
        assert got.break_lines == [], got.break_lines  # laqat's record: no graph laqat compiled ended at a break
    return plain


# ---- DDP ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name,policy", MODELS_AND_POLICIES)
def test_ddp_step_equals_single_process(ranks, model_name, policy):
    got = _assert_equals_single_process(ranks, ("ddp", model_name, policy, "tiny-buckets"))
    assert got.graphs > 4  # DDPOptimizer did cut the graph
    assert [m[:3] for m in got.matches] == MATCHES[model_name]  # the model's names, not DDP's module.*
    assert all((STATE_FP8 in m[3]) == (policy == "state_fp8") for m in got.matches), got.matches


@pytest.mark.parametrize("how", ["tiny-buckets", "tiny-buckets-attached-policy"])
def test_ddp_policy_names_the_models_modules(ranks, how):
    """A policy rule naming ``layers.1`` exactly (no glob) applies to that layer under DDP, and only to it; also
    as the policy attached to the model."""
    got = _assert_equals_single_process(ranks, ("ddp", "TorchGDNNet", "layer1_state_fp8", how))
    assert [(m[0], STATE_FP8 in m[3]) for m in got.matches] == [("layers.0", False), ("layers.1", True)]


def test_ddp_around_a_compiled_model(ranks):
    """``DDP(torch.compile(model))``: DDPOptimizer cuts the graph as well; the same step, the same names."""
    got = _assert_equals_single_process(ranks, ("ddp", "TorchGDNNet", "exact", "compiled-inside"))
    assert got.graphs > 4
    assert [m[:3] for m in got.matches] == MATCHES["TorchGDNNet"]


def test_ddp_adds_no_graph_and_no_graph_break(ranks):
    plain = _assert_no_graph_and_no_break_added(ranks, "ddp", "tiny-buckets")
    # DDP's own forward breaks (Dynamo skips its internals), under any backend
    assert plain.breaks and all("DistributedDataParallel" in r or "Logger" in r for r in plain.breaks), plain.breaks


def test_ddp_refuses_a_recurrence_cut_by_a_bucket_boundary(ranks):
    got = ranks[0]["ddp", "GatedTorchGDNNet", "exact", "tiny-buckets"]
    assert got.error is not None and got.error[0] == "RecurrenceSplitError", got.error
    assert "ValueError" in got.error[2]  # la_compiler.RecurrenceSplitError, as itself (not Dynamo's wrapper)
    message = got.error[1]
    assert "module 'layers.0'" in message and "gate = self.gate_proj(x).sigmoid()" in message, message
    assert "bucket_cap_mb" in message and "optimize_ddp" in message


@pytest.mark.parametrize("how", ["one-bucket", "no-ddp-optimizer"])
def test_ddp_rewrites_that_recurrence_in_an_unsplit_graph(ranks, how):
    """The error's remedies: a bucket cap that holds the model, or DDPOptimizer off."""
    got = _assert_equals_single_process(ranks, ("ddp", "GatedTorchGDNNet", "exact", how))
    assert got.graphs == 1
    assert [m[:3] for m in got.matches] == MATCHES["GatedTorchGDNNet"]


# ---- FSDP2 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name,policy", MODELS_AND_POLICIES)
def test_fsdp2_step_equals_single_process(ranks, model_name, policy):
    got = _assert_equals_single_process(ranks, ("fsdp", model_name, policy, "root"))
    assert [m[:3] for m in got.matches] == MATCHES[model_name]
    assert all((STATE_FP8 in m[3]) == (policy == "state_fp8") for m in got.matches), got.matches
    assert got.node_input_types == {"FakeTensor"}, got.node_input_types  # not DTensor


def test_fsdp2_layers_compiled_before_sharding(ranks):
    """Each layer compiled on its own: its recurrence is named relative to the layer (the compiled module)."""
    got = _assert_equals_single_process(ranks, ("fsdp", "TorchGDNNet", "exact", "layers"))
    assert got.matches and all(m[:3] == ("", "torch", "gdn") for m in got.matches), got.matches
    assert got.node_input_types == {"FakeTensor"}, got.node_input_types


def test_fsdp2_adds_no_graph_and_no_graph_break(ranks):
    _assert_no_graph_and_no_break_added(ranks, "fsdp", "root")


# ---- FLA's blocks traced once ---------------------------------------------------------------------------------
REGIONS_NOTE = "FLA block calls traced as one region each"  # explain's note, after the count


def _regions_noted(result) -> bool:
    return any(REGIONS_NOTE in note for note in result.notes)


@pytest.mark.parametrize("engine,how", [("ddp", "no-ddp-optimizer"), ("fsdp", "root-only")])
def test_block_regions_under_data_parallel_train_as_without_them(ranks, engine, how):
    """``torch.compile(model, backend="laqat")`` over FLA's blocks under DDP without its graph splitting, and under
    FSDP2 sharding the root alone: each block call is a region (where this torch's Dynamo reuses regions), and the
    step equals the one-process step, the uncompiled model, and bit for bit the same run without regions."""
    from la_compiler.passes.frontends.fla.block_regions import dynamo_reuses_regions

    got = _assert_equals_single_process(ranks, (engine, "FlaBlocksNet", "exact", f"{how}:laqat"))
    assert [m[:3] for m in got.matches] == MATCHES["FlaBlocksNet"]
    assert any(note.startswith(f"3 {REGIONS_NOTE}") for note in got.notes) == dynamo_reuses_regions(), got.notes
    off = ranks[0][engine, "FlaBlocksNet", "exact", f"{how}:laqat-regions-off"]
    assert off.error is None, off.error
    assert not _regions_noted(off), off.notes
    _assert_same_step(got, off, 0.0, f"{engine} {how}: regions vs none")


@pytest.mark.parametrize("engine,how", [("ddp", "tiny-buckets"), ("fsdp", "root")])
def test_block_regions_stay_out_of_ddps_graph_splitting_and_of_blocks_sharded_by_fsdp2(ranks, engine, how):
    got = _assert_equals_single_process(ranks, (engine, "FlaBlocksNet", "exact", f"{how}:laqat"))
    assert [m[:3] for m in got.matches] == MATCHES["FlaBlocksNet"]
    assert not _regions_noted(got), got.notes
