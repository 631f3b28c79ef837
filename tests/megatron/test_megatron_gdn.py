"""Megatron-Core 0.19.2's GatedDeltaNet (and a KDA test layer built from it) under laqat, one process.

Megatron runs its recurrence two ways; laqat finds both, one node per layer, named by Megatron's module
path (``decoder.layers.<i>.self_attention``), without Megatron hooks or patches of Megatron's code:

- FLA's ``chunk_gated_delta_rule`` on pre-normalized, repeat-interleaved q/k (the default): the FLA frontend's
  substitution. Oracle: the same model run eagerly with FLA's torch references for the three FLA kernels
  Megatron calls (l2norm, causal_conv1d, and the recurrence as FLA's naive token-by-token recurrence:
  tests/megatron/megatron_oracle.py), since FLA's kernels cannot run on the CPU.
- its torch fallback ``torch_chunk_gated_delta_rule`` (``deterministic_mode=True``, the row-by-row
  triangular loop): the torch frontend. Oracle: the same model run eagerly, Megatron's own fallback.

Each test compares the per-token loss and every parameter's gradient with its oracle (fp32, relative L2
<= 1e-5) on a fresh random batch. The torch fallback runs on T = 72 tokens (two chunks of 64, the second
padded: the torch frontend rewrites a chunk loop of two chunks or more); FLA's call on T = 32 (any length
reaches the node; the FP8 tests set the policy's ``chunk_size`` to 16 so that the state is rounded between
chunks).
"""
import importlib.util
import warnings

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("fla") is None:
    pytest.skip("megatron-core (and FLA) are not installed: `make test` installs megatron-core==0.19.2",
                allow_module_level=True)

# One pytest worker runs every Megatron test (`make test` distributes with --dist loadgroup): Megatron takes
# about 8 CPU seconds to import, and a module fixture would run once per worker.
pytestmark = pytest.mark.xdist_group("megatron")

import la_compiler  # noqa: E402
from la_compiler.backend import last_record  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402

TOL = 1e-5
FP8_MOVES = 3e-7  # the FP8 state moves the per-token losses by more than this (tests/models' bound)
T_TORCH = 72  # the torch fallback: two chunks of 64
T = 32  # FLA's call
FP8_STATE = {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}
CHUNK_16 = {"module_name": "*", "cfg": {"chunk_size": 16, "state": {"block_v": 64}}}


@pytest.fixture(scope="module")
def megatron():
    from tests.megatron.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        from tests.megatron import megatron_models

        yield megatron_models


def _run(model, fn, ids, pos, labels, **kwargs):
    """Per-token loss and every parameter's gradient of ``loss.sum()``."""
    for p in model.parameters():
        p.grad = None
    loss = fn(ids, pos, None, labels=labels, **kwargs)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _eager(model, data, **kwargs):
    from tests.megatron.megatron_oracle import eager_megatron

    with eager_megatron(model):
        return _run(model, model, *data, **kwargs)


def _check(got, expected, tol=TOL):
    (loss, grads), (ref_loss, ref_grads) = got, expected
    errors = {"loss": rel_l2(loss, ref_loss)}
    assert sorted(grads) == sorted(ref_grads), "the same parameters get gradients"
    errors.update({name: rel_l2(grads[name], ref_grads[name]) for name in ref_grads})
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative L2 above {tol}: {bad}"


def _compile(model, **kwargs):
    """``torch.compile(model, backend="laqat", ...)`` and the laqat records of the graphs it compiles."""
    start = len(last_record().graphs)
    compiled = torch.compile(model, backend="laqat", **kwargs)
    return compiled, lambda: last_record().graphs[start:]


def _matches(graphs):
    return sorted((m.module, m.frontend, m.kind) for g in graphs for m in g.matches)


def _layers(n, frontend, kind="gdn"):
    return [(f"decoder.layers.{i}.self_attention", frontend, kind) for i in range(n)]


def test_fla_path_fullgraph_inductor(megatron):
    """Megatron's default path, ``torch.compile(model, backend="laqat", fullgraph=True)`` (Inductor): one graph
    (Megatron's warnings and its jit_fuser ``torch.compile`` points included), one FLA-frontend node, the
    tp_group deprecation warning still issued (while Dynamo traces). One layer: the per-layer names of the
    FLA path are checked by the per-layer policy test."""
    model = megatron.tiny_gpt(megatron.tiny_config(layers=1))
    data = megatron.batch(1, T, seed=10)
    expected = _eager(model, data)
    compiled, graphs = _compile(model, fullgraph=True, options={"compiler": "inductor"})  # the CPU's default: eager
    # Inductor's own kernels compile as scalar C++ without a worker pool (tests/conftest.py, for every test)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(model, compiled, *data)
    _check(got, expected)
    assert len(graphs()) == 1 and not graphs()[0].graph_break
    assert _matches(graphs()) == _layers(1, "fla")
    assert any("tp_group is None" in str(w.message) and w.category is DeprecationWarning for w in caught), \
        "Megatron's deprecation warning is issued after the graph, not dropped"
    assert "_apply_gated_norm" in graphs()[0].readable, "the jit_fuser method is inlined into the graph"
    import sys

    # la_compiler.backend was imported (at collection) before megatron.core: the frontend installed itself
    # when megatron.core was imported, and importlib.util.find_spec calls in between did not consume the hook
    assert len(sys.modules["la_compiler.passes.frontends.megatron"].SUBSTITUTED) == 2


def test_torch_fallback_deterministic_mode(megatron):
    """``deterministic_mode=True``: Megatron's ``torch_chunk_gated_delta_rule`` (63-step triangular loop) is
    matched by the torch frontend, one node, in one graph. One layer (Dynamo unrolls the loop once per layer):
    Megatron's per-layer names are checked by the per-layer policy test, the torch frontend's per-layer matches
    by tests/distributed (two torch-loop layers) and tests/passes' hybrid models (two linear layers each)."""
    model = megatron.tiny_gpt(megatron.tiny_config(layers=1, deterministic=True))
    data = megatron.batch(1, T_TORCH, seed=11)
    expected = _eager(model, data)
    compiled, graphs = _compile(model, fullgraph=True, options={"compiler": "eager"})
    _check(_run(model, compiled, *data), expected)
    assert _matches(graphs()) == _layers(1, "torch")
    assert not [n for g in graphs() for n in g.near_misses]


def test_packed_sequences_reach_the_node_as_cu_seqlens(megatron):
    """Packed sequences (``PackedSeqParams`` in THD format): Megatron passes ``cu_seqlens`` to FLA's call; the
    node gets it, and the oracle runs FLA's naive recurrence per sequence. Megatron's ``_resolve_cu_seqlens``
    reads the boundaries in Python (``.item()``, ``.any()``): Dynamo breaks the graph there, not at laqat."""
    model = megatron.tiny_gpt(megatron.tiny_config(layers=1))
    data = megatron.batch(1, T, seed=12)
    packed = megatron.packed([0, 9, 21, T])
    expected = _eager(model, data, packed_seq_params=packed)
    unpacked = _eager(model, data)
    assert rel_l2(expected[0], unpacked[0]) > 1e-3, "the boundaries change the oracle's loss"
    compiled, graphs = _compile(model, options={"compiler": "eager"})
    _check(_run(model, compiled, *data, packed_seq_params=packed), expected)
    assert _matches(graphs()) == _layers(1, "fla")
    breaks = [g.graph_break for g in graphs() if g.graph_break]
    assert breaks and all("megatron/core" in b for b in breaks), breaks


def test_per_layer_state_fp8_by_megatron_module_name(megatron):
    """A policy naming Megatron's modules: the FP8 state on ``decoder.layers.1`` only; it moves the per-token
    losses, and an AdamW step lowers the loss."""
    policy = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "decoder.layers.1.self_attention.gdn_state_quantizer", "cfg": FP8_STATE}],
              "linear_attention": [CHUNK_16]}
    model = megatron.tiny_gpt(megatron.tiny_config())
    data = megatron.batch(1, T, seed=13)
    exact_loss, _ = _eager(model, data)
    compiled, graphs = _compile(model, options={"policy": policy, "compiler": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, _ = _run(model, compiled, *data)
    assert rel_l2(loss, exact_loss) > FP8_MOVES, "the FP8 state moves the per-token losses"
    optimizer.step()
    with torch.no_grad():
        after = compiled(*data[:2], None, labels=data[2])
    specs = {m.module: m.spec for g in graphs() for m in g.matches}
    assert "q.state=fp8_e4m3/tile64" in specs["decoder.layers.1.self_attention"]
    assert "q.state" not in specs["decoder.layers.0.self_attention"]
    assert after.mean() < loss.mean(), (after.mean().item(), loss.mean().item())


def _decode_reference(spec, prefill, valid):
    """laqat's fp64 decode-phase reference as a Megatron recurrence (kernels/reference/decode.py)."""
    from la_compiler.options import decode_options
    from la_compiler.kernels.reference.decode import delta_rule_decode_reference
    from la_compiler.ir.spec import RecurrenceSpec

    options = decode_options(RecurrenceSpec.parse(spec))

    def rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             cu_seqlens=None):
        assert initial_state is None and not use_qk_l2norm_in_kernel
        o, _ = delta_rule_decode_reference(q, k, v, g, beta, kind=spec.split("[")[0], options=options,
                                           prefill_lengths=prefill, valid_lengths=valid, cu_seqlens=cu_seqlens)
        return o.to(v.dtype), None

    return rule


PREFIX = 20


def test_decode_phase_token_mode_fp8_state(megatron):
    """``la_compiler.phase`` on the Megatron layer with the shipped ``decode_token_state_fp8`` recipe: the
    prefix runs the exact recurrence, the suffix decodes token by token from an FP8 state; the lengths
    change between calls without a recompile. Oracle: the eager Megatron model whose recurrence is laqat's
    fp64 decode reference with the node's spec. No Megatron hook: the node is found in the graph."""
    from tests.megatron.megatron_oracle import eager_megatron

    model = megatron.tiny_gpt(megatron.tiny_config(layers=1))
    data = megatron.batch(1, T, seed=14)
    compiled, graphs = _compile(model, options={"policy": "decode_token_state_fp8", "compiler": "eager"})
    with la_compiler.phase(prefill_lengths=[PREFIX], sequence_lengths=[T]):
        got = _run(model, compiled, *data)
    with la_compiler.phase(prefill_lengths=[8], sequence_lengths=[28]):
        other = compiled(*data[:2], None, labels=data[2]).detach()
    assert len(graphs()) == 1, ("new lengths, no recompile", [g.graph_break for g in graphs()])
    (match,) = [m for g in graphs() for m in g.matches]
    assert match.module == "decoder.layers.0.self_attention" and match.frontend == "fla"
    assert "phase=token" in match.spec and "q.state=fp8_e4m3/tile64" in match.spec
    with eager_megatron(model, recurrence=_decode_reference(match.spec, [PREFIX], [T])):
        expected = _run(model, model, *data)
    _check(got, expected)
    exact_loss, _ = _eager(model, data)
    assert rel_l2(got[0][:, PREFIX:], exact_loss[:, PREFIX:]) > FP8_MOVES, "the decoded suffix sees the FP8 state"
    assert rel_l2(got[0][:, :PREFIX], exact_loss[:, :PREFIX]) <= TOL, "the prefix is exact"
    assert rel_l2(other, got[0]) > FP8_MOVES


@pytest.mark.parametrize("deterministic", [False, True], ids=["fla_chunk_kda", "torch_naive_chunk_kda"])
def test_kda_test_layer(megatron, deterministic):
    """Megatron-Core 0.19.2 has no KDA layer: the test layer is Megatron's GatedDeltaNet with KDA's per-key-channel
    gate (megatron_models.KimiDeltaAttentionTestLayer), run through FLA's ``chunk_kda`` or, in deterministic
    mode, FLA's torch ``naive_chunk_kda`` in chunks of 16 (T a multiple of the chunk, two chunks or more for the
    torch frontend: 32). One layer, one KDA node."""
    length = 2 * megatron.NAIVE_KDA_CHUNK if deterministic else T
    model = megatron.tiny_gpt(megatron.tiny_config(layers=1, deterministic=deterministic), kda=True)
    data = megatron.batch(1, length, seed=15)
    expected = _eager(model, data)
    compiled, graphs = _compile(model, fullgraph=True, options={"compiler": "eager"})
    _check(_run(model, compiled, *data), expected)
    assert _matches(graphs()) == _layers(1, "torch" if deterministic else "fla", "kda")


def test_traceable_column_parallel_linear_equals_megatrons(megatron):
    """The Megatron frontend's stand-in for ``LinearWithGradAccumulationAndAsyncCommunication`` (what a
    column-parallel linear applies under ``torch.compile``) computes Megatron's values bit for bit: forward,
    input, weight and bias gradients, with the input-gradient all-reduce on (over a group of one)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    from la_compiler.passes.frontends.megatron import _LinearAllReduceDgrad

    group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(16)
    x, w, b, dy = (torch.randn(*shape, generator=generator) for shape in ((7, 2, 24), (40, 24), (40,), (7, 2, 40)))
    results = []
    for apply in (lambda *a: LinearWithGradAccumulationAndAsyncCommunication.apply(*a[:3], False, True, False,
                                                                                    None, 0, group, 1),
                  lambda *a: _LinearAllReduceDgrad.apply(*a[:3], True, group)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = apply(*leaves)
        y.backward(dy)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for name, megatrons, ours in zip(("output", "dx", "dw", "db"), *results):
        assert torch.equal(megatrons, ours), name
