"""The phase context, the phased IR op and its plumbing through the laqat backend.

Oracle: the fp64 decode reference (kernels/reference/decode.py) called directly with the
same lengths; recompiles are counted with a counting backend and Dynamo's counters.
"""
import pytest
import torch
import yaml
import torch.nn.functional as F
from torch import nn

import la_compiler
from la_compiler.backend import laqat_backend
from la_compiler.ir.delta_rule_phased import is_delta_rule_phased
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.common.decode_phase import PhaseLengthsMissing
from la_compiler.kernels.reference.decode import delta_rule_decode_reference
from la_compiler.options import decode_options
from la_compiler.phase import PhaseError
from tests.helpers import rel_l2
from tests.ir_inputs import random_inputs

FP8_TOKEN = {"version": "laqat.policy/1", "name": "decode_fp8_ref", "quant_cfg": [
    {"quantizer_name": "*", "enable": False},
    {"quantizer_name": "*kda_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}}],
    "linear_attention": [{"module_name": "*", "cfg": {"state": {"block_v": 16},
                                                      "decode": {"mode": "token", "readout": "stored",
                                                                 "implementation": "torch"}}}]}


def test_phase_context_validation_and_nesting():
    assert la_compiler.phase.current() is None
    with la_compiler.phase([3], sequence_lengths=[7]) as outer:
        with la_compiler.phase([1, 2]) as inner:
            assert la_compiler.phase.current() is inner
            assert inner.resolve([5, 6]) == ([1, 2], [5, 6])
        assert la_compiler.phase.current() is outer
        assert outer.resolve([8, 9]) == ([3, 3], [7, 7])
        with pytest.raises(PhaseError, match="sequence_lengths\\[0\\]=7 exceeds the 6 tokens"):
            outer.resolve([6])
    assert la_compiler.phase.current() is None
    for bad, match in (([-1], "prefill_lengths\\[0\\]"), ([], "non-empty"), (["a"], "prefill_lengths\\[0\\]")):
        with pytest.raises(PhaseError, match=match):
            with la_compiler.phase(bad):
                pass
    with pytest.raises(PhaseError, match="prefill_lengths\\[0\\]=5 exceeds sequence_lengths\\[0\\]=4"):
        with la_compiler.phase([5], [4]):
            pass
    with la_compiler.phase([0], sequence_lengths=[8, 6]) as p:
        assert p.resolve([8, 8]) == ([0, 0], [8, 6])
    with pytest.raises(PhaseError, match="2 entries but sequence_lengths has 3"):
        with la_compiler.phase([1, 2], [3, 4, 5]):
            pass
    with pytest.raises(PhaseError, match="3 sequences"):
        with la_compiler.phase([1, 2]) as p:
            p.resolve([4, 4, 4])


def _spec(**extra):
    return RecurrenceSpec("kda", src="user", phase="token", kernel="decode_reference",
                          quant=(("state", "fp8_e4m3/tile16"),), extra=tuple(sorted(extra.items()))).to_string()


def test_phased_op_packed_against_reference_and_lengths_saved_for_backward():
    cu = [0, 4, 9]
    (q, k, v, g, beta, h0), cu_t = random_inputs("kda", B=1, T=9, H=2, K=4, V=16, initial_state=True, cu_seqlens=cu)
    spec = _spec(readout="working")
    with la_compiler.phase([2, 0], sequence_lengths=[4, 3]):
        prefill, valid = torch.ops.laqat.phase_lengths(q, cu_t)
        o, ht = torch.ops.laqat.delta_rule_phased(q, k, v, g, beta, h0, cu_t, prefill, valid, 0.5, spec)
    assert prefill.tolist() == [2, 0] and valid.tolist() == [4, 3] and prefill.dtype == torch.int32
    with la_compiler.phase([1], [1]):  # a different phase when backward runs: must not matter
        (o.square().sum() + ht.sum()).backward()
    leaves = [q, k, v, g, beta, h0]
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    opts = decode_options(RecurrenceSpec.parse(spec))
    ro, rh = delta_rule_decode_reference(q, k, v, g, beta, kind="kda", options=opts, prefill_lengths=[2, 0],
                                         valid_lengths=[4, 3], scale=0.5, initial_state=h0, cu_seqlens=cu_t)
    (ro.square().sum() + rh.sum()).backward()
    assert rel_l2(o, ro) < 1e-6 and rel_l2(ht, rh) < 1e-6
    for i, (a, x) in enumerate(zip(got, leaves)):
        assert rel_l2(a, x.grad) < 1e-6, i


def test_phased_spec_needs_the_phased_op_and_an_active_phase():
    (q, k, v, g, beta, _), _ = random_inputs("kda", B=1, T=4, H=1, K=4, V=16, requires_grad=False)
    with pytest.raises(PhaseLengthsMissing, match="delta_rule_phased"):
        with la_compiler.phase([2]):
            torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 0.5, _spec())
    with pytest.raises(PhaseError, match="outside a phase context"):
        torch.ops.laqat.phase_lengths(q, None)


class TinyKDA(nn.Module):
    """Embedding -> one KDA recurrence (the laqat op written by hand) -> LM head."""

    def __init__(self, vocab=16, hidden=16, heads=2, head_dim=4, value_dim=16):
        super().__init__()
        self.h, self.d, self.dv = heads, head_dim, value_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, heads * (2 * head_dim + value_dim))
        self.gate = nn.Linear(hidden, heads * head_dim)
        self.beta = nn.Linear(hidden, heads)
        self.head = nn.Linear(heads * value_dim, vocab)

    def forward(self, tokens):
        B, T = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(B, T, self.h, -1).split([self.d, self.d, self.dv], dim=-1)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = F.logsigmoid(self.gate(x)).view(B, T, self.h, self.d) * 0.5
        beta = self.beta(x).sigmoid()
        o, _ = torch.ops.laqat.delta_rule(q, k, v.contiguous(), g, beta, None, None, self.d ** -0.5, "kda[src=user]")
        return self.head(o.reshape(B, T, -1))


def _counting_backend(calls, options):
    def backend(gm, example_inputs):
        calls.append(gm)
        return laqat_backend(gm, example_inputs, options=options)
    return backend


def test_lengths_change_without_recompile_and_match_eager_reference():
    model = TinyKDA()
    calls = []
    compiled = torch.compile(model, backend=_counting_backend(calls, {"policy": FP8_TOKEN, "compiler": "eager"}))
    tokens = torch.randint(0, 16, (2, 8))
    torch._dynamo.utils.counters.clear()
    outs = {}
    for prefill, valid in (([4], None), ([0, 3], [8, 6]), ([8], None), ([2, 5], [5, 7])):
        with la_compiler.phase(prefill, valid):
            outs[str((prefill, valid))] = compiled(tokens)
    assert len(calls) == 1, f"{len(calls)} graphs compiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    phased = [n for n in calls[0].graph.nodes if is_delta_rule_phased(n)]
    assert len(phased) == 1 and "phase=token" in phased[0].args[-1] and "kernel=decode_reference" in phased[0].args[-1]
    # Different lengths give different outputs (the lengths reach the kernel) ...
    a, b = outs[str(([4], None))], outs[str(([0, 3], [8, 6]))]
    assert rel_l2(a, b) > 1e-4
    # ... and the compiled result equals the eager model with the reference run by hand.
    spec = phased[0].args[-1]
    eager_out = _eager_with_reference(model, tokens, spec, [2, 5], [5, 7])
    assert rel_l2(outs[str(([2, 5], [5, 7]))], eager_out) < 1e-5


def _eager_with_reference(model, tokens, spec, prefill, valid):
    opts = decode_options(RecurrenceSpec.parse(spec))

    def fake_op(q, k, v, g, beta, h0, cu, scale, _spec):
        o, ht = delta_rule_decode_reference(q, k, v, g, beta, kind="kda", options=opts, prefill_lengths=prefill,
                                            valid_lengths=valid, scale=scale)
        return o.float(), ht.float()

    real = torch.ops.laqat.delta_rule
    try:
        torch.ops.laqat.delta_rule = fake_op
        return model(tokens)
    finally:
        torch.ops.laqat.delta_rule = real


def _recipe(implementation=None):
    """The shipped FP8 decode recipe; `implementation` picks the kernel family (never the numerics)."""
    from la_compiler.recipes import recipe_path

    policy = yaml.safe_load(recipe_path("decode_token_state_fp8").read_text())
    if implementation is not None:
        policy["linear_attention"][0]["cfg"]["decode"]["implementation"] = implementation
    return policy


def _train(policy, steps, lr=3e-2):
    torch.manual_seed(0)
    model = TinyKDA()
    calls = []
    compiled = torch.compile(model, backend=_counting_backend(calls, {"policy": policy, "compiler": "eager"}))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    tokens = torch.randint(0, 16, (2, 9))
    losses, grads = [], []
    for step in range(steps):
        prefill = [2 + step % 3, 1 + step % 4]
        with la_compiler.phase(prefill, sequence_lengths=[8, 7]):
            logits = compiled(tokens[:, :-1])
            mask = torch.zeros(2, 8, dtype=torch.bool)  # the loss on valid suffix tokens only
            for n, (p, L) in enumerate(zip(prefill, [8, 7])):
                mask[n, p:L] = True
            loss = F.cross_entropy(logits[mask], tokens[:, 1:][mask])
            opt.zero_grad()
            loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    assert len(calls) == 1, f"{len(calls)} graphs compiled"
    specs = [n.args[-1] for n in calls[0].graph.nodes if is_delta_rule_phased(n)]
    assert len(specs) == 1 and "phase=token" in specs[0] and "q.state=fp8_e4m3/tile64" in specs[0]
    return losses, grads, specs[0]


def test_tiny_model_trains_under_phase_with_fp8_decode_recipe():
    losses, _, spec = _train(_recipe(implementation="torch"), steps=8)
    assert "kernel=decode_reference" in spec
    assert losses[-1] < 0.8 * losses[0], losses


def test_recipe_default_kernel_is_the_fused_one_and_trains_alike():
    """As shipped, the recipe runs decode_fused (the interpreter here): the same loss and gradients."""
    losses, grads, spec = _train(_recipe(), steps=1)
    ref_losses, ref_grads, _ = _train(_recipe(implementation="torch"), steps=1)
    assert "kernel=decode_fused" in spec
    assert abs(losses[0] - ref_losses[0]) < 1e-5
    for a, b in zip(grads[0], ref_grads[0]):
        assert rel_l2(a, b) < 1e-4


def test_activation_checkpoint_recompute_sees_the_phase():
    model = TinyKDA()
    compiled = torch.compile(model, backend=_counting_backend([], {"policy": FP8_TOKEN, "compiler": "eager"}))
    tokens = torch.randint(0, 16, (1, 6))
    with la_compiler.phase([3]):
        out = torch.utils.checkpoint.checkpoint(compiled, tokens, use_reentrant=False)
        out.square().sum().backward()
    ckpt = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with la_compiler.phase([3]):
        compiled(tokens).square().sum().backward()
    for a, p in zip(ckpt, model.parameters()):
        assert rel_l2(a, p.grad) < 1e-6


def test_aot_partitioner_saves_the_lengths_and_never_recompiles():
    """AOTAutograd with the min-cut partitioner (what Inductor uses): the backward must use the
    forward's lengths, not re-run phase_lengths under whatever phase is active then."""
    spec = _spec(readout="stored")

    def step(q, k, v, g, beta):
        prefill, valid = torch.ops.laqat.phase_lengths(q, None)
        o, ht = torch.ops.laqat.delta_rule_phased(q, k, v, g, beta, None, None, prefill, valid, 0.5, spec)
        return (o * o).sum() + ht.sum()

    compiled = torch.compile(step, backend="aot_eager_decomp_partition")
    inputs, _ = random_inputs("kda", B=2, T=5, H=1, K=4, V=16)
    torch._dynamo.utils.counters.clear()
    for prefill in ([2], [0, 4], [5, 1]):
        with la_compiler.phase(prefill):
            loss = compiled(*inputs[:5])
        with la_compiler.phase([3]):  # a different phase when backward runs
            got = torch.autograd.grad(loss, inputs[:5])
        with la_compiler.phase(prefill):
            want = torch.autograd.grad(step(*inputs[:5]), inputs[:5])
        for a, b in zip(got, want):
            assert rel_l2(a, b) < 1e-6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
