"""Module names hold after graph breaks, so per-layer policies apply to the layers they name; a policy that
applies nowhere warns at compile time; explain says where each graph break is; selection by cost."""
import types
import warnings

import pytest
import torch

import la_compiler
import la_compiler.backend
from la_compiler.kernels.recurrent.variant import FUSED_RECURRENT_MAX_TOKENS_ON_CUDA
from la_compiler.kernels.selection import select_kernel
from la_compiler.passes.annotate import NothingQuantizedWarning, UnmatchedPolicyRuleWarning
from la_compiler.ir.spec import RecurrenceSpec
from tests.helpers import assert_close_rel, rel_l2

pytest.importorskip("fla")

from la_compiler.tiny_models import TinyConfig, TinyHybridLM  # noqa: E402

LAYER_1_STATE_FP8 = {"quant_cfg": [{"quantizer_name": "*layers.1.*gdn_state_quantizer",
                                    "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}}],
                     "linear_attention": [{"module_name": "*", "cfg": {"chunk_size": 16, "state": {"block_v": 16}}}]}


def _breaking_forward(self, x):
    x = x + self.attn(self.norm(x))[0]
    torch._dynamo.graph_break()
    return x + self.mlp(self.mlp_norm(x))


def _model(graph_break: bool):
    torch.manual_seed(0)
    model = TinyHybridLM(TinyConfig(layers=("gdn", "gdn"), head_dim=16))
    if graph_break:
        for block in model.layers:
            block.forward = types.MethodType(_breaking_forward, block)
    return model


def _graph_count() -> int:
    return len(la_compiler.backend.last_record().graphs)


def _sites(since: int):
    """(module, quantized?) of every site compiled since the record held ``since`` graphs."""
    return sorted((m.module, RecurrenceSpec.parse(m.spec).quant != ())
                  for g in la_compiler.backend.last_record().graphs[since:] for m in g.matches)


def test_per_layer_policy_applies_to_its_layer_after_a_graph_break():
    """Dynamo traces the resumed block graph once and reuses it for the next block: without per-module
    versions, layers.1 would run with layers.0's (exact) numerics, silently."""
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    start = _graph_count()
    whole = torch.compile(_model(False), backend="laqat", fullgraph=True,
                          options={"policy": LAYER_1_STATE_FP8, "compiler": "eager"})
    expected = whole(tokens)
    assert _sites(start) == [("layers.0.attn", False), ("layers.1.attn", True)]
    exact = torch.compile(_model(False), backend="laqat", fullgraph=True, options={"compiler": "eager"})(tokens)
    assert rel_l2(expected, exact) > 1e-5  # the FP8 state shows in the logits

    model = _model(True)
    start = _graph_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedPolicyRuleWarning)  # each graph's rules match its own layer
        compiled = torch.compile(model, backend="laqat", options={"policy": LAYER_1_STATE_FP8, "compiler": "inductor"})
        out = compiled(tokens)
    assert _sites(start) == [("layers.0.attn", False), ("layers.1.attn", True)]
    assert_close_rel(out, expected, 1e-6, "logits with a graph break in every block")
    out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_explain_lists_each_graph_break_with_its_line():
    report = la_compiler.explain(_model(True), torch.randint(0, 64, (1, 6)))
    assert report.graph_breaks >= 1 and report.graph_break_reasons
    assert all("test_names_and_warnings.py" in r and "graph_break" in r for r in report.graph_break_reasons)
    assert "Graph breaks" in str(report)
    assert [m.module for m in report.matches] == ["layers.0.attn", "layers.1.attn"]


def _not_a_delta_rule(q, k, v, g, beta):
    """A token loop that clamps nothing but adds a bias the delta rule does not have: a near miss."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u) + 0.5
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o


def test_a_quantizing_policy_that_rewrites_nothing_warns_at_compile_time():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 4, 2), torch.rand(1, 4, 2)
    compiled = torch.compile(_not_a_delta_rule, backend="laqat", options={"policy": "state_fp8", "compiler": "eager"})
    with pytest.warns(NothingQuantizedWarning, match=r"policy 'state_fp8' changes numerics, but laqat rewrote no"):
        out = compiled(q, k, v, g, beta)
    assert_close_rel(out, _not_a_delta_rule(q, k, v, g, beta), 1e-6, "untouched region")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)  # the exact policy asks for nothing
        torch.compile(_not_a_delta_rule, backend="laqat", options={"compiler": "eager"})(q, k, v, g, beta)


@pytest.mark.parametrize("seq_len, expected", [(16, "fused_recurrent"), (FUSED_RECURRENT_MAX_TOKENS_ON_CUDA,
                                                                          "fused_recurrent"),
                                               (4096, "chunk"), (None, "chunk")])
def test_exact_gdn_on_cuda_where_fla_refuses_goes_to_the_faster_kernel(monkeypatch, seq_len, expected):
    from la_compiler.kernels.fla import chunk_variant as fla_chunk_variant

    monkeypatch.setattr(fla_chunk_variant, "gdn_backward_blocker", lambda: "FLA's GDN chunk backward refuses (test)")
    choice = select_kernel(RecurrenceSpec(kind="gdn"), device="cuda", dtype=torch.bfloat16, head_k=128,
                           head_v=128, seq_len=seq_len)
    assert choice.variant == expected, choice.explain()
    if expected == "chunk":
        assert "chunk kernels are faster beyond 64 tokens" in choice.explain()


def test_exact_kda_training_on_cuda_goes_to_laqat_chunk_kernels(monkeypatch):
    from la_compiler.kernels.fla import chunk_variant as fla_chunk_variant

    monkeypatch.setattr(fla_chunk_variant, "_fla_available", lambda: True)
    choice = select_kernel(RecurrenceSpec(kind="kda"), device="cuda", dtype=torch.bfloat16, head_k=128, head_v=128,
                           seq_len=4096)
    assert choice.variant == "chunk" and "0.72x FLA's" in choice.explain(), choice.explain()


def _create_func_module(func):
    """A stand-in of Hugging Face kernels' function module (transformers >= 5.25 wraps its kernel functions, e.g.
    ``torch_chunk_gated_delta_rule``, in one): a global ``nn.Module`` whose forward calls the function."""
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func


def _user_gdn(q, k, v, g, beta):
    return torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 0.25, "gdn[src=user]")[0]


WRAPPED_GDN = _create_func_module(_user_gdn)()


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q, k, v, g, beta):
        return WRAPPED_GDN(self.proj(q), k, v, g, beta)


@pytest.mark.parametrize("skipped", [True, False], ids=["function_module_skipped", "without_the_skip"])
def test_a_function_module_outside_the_model_does_not_name_the_site(monkeypatch, skipped):
    """A site traced inside a global function module is named after the model's layer that calls it, so that
    per-layer rules apply to it; without the skip it would be named by the global's path."""
    from la_compiler.passes import module_names
    from tests.ir_inputs import random_inputs

    assert module_names.is_function_module(type(WRAPPED_GDN))
    if not skipped:
        monkeypatch.setattr(module_names, "is_function_module", lambda module_type: False)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Layer(), _Layer()])})
    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=5, H=1, K=16, V=4, requires_grad=False)

    def forward(q, k, v, g, beta):
        return sum(layer(q, k, v, g, beta) for layer in model["layers"])

    start = _graph_count()
    torch.compile(forward, backend="laqat", options={"compiler": "eager"})(q, k, v, g, beta)
    names = [name for name, _ in _sites(start)]
    assert (names == ["layers.0", "layers.1"]) == skipped, names  # without: the global's (empty) path, no layer
