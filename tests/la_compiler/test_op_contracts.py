"""Every laqat custom op passes ``torch.library.opcheck`` with all five test utils (schema, autograd registration,
fake tensor, AOTDispatcher static and dynamic): the fakes state the real ops' output shapes, strides and dtypes,
the autograd formulas hold under AOTAutograd, and two calls of the same inputs return the same outputs (the
chunk kernels' residual included: every element of it written).

Inputs come contiguous, as views transposed from head-first storage ([B, H, T, D] -> [B, T, H, D]) and as
slices (offset in T, narrowed in D), fp32 and bf16, with and without an initial state / cu_seqlens, GDN and KDA,
through every kernel variant that runs on the CPU (fused_recurrent, chunk, reference; decode_reference and
decode_fused for the phased ops), exact and with a quantized state. Every op registered under ``laqat::`` has
cases here: a new op without them fails ``test_every_laqat_op_has_cases``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import la_compiler
import la_compiler.backend  # noqa: F401  (registers every op the backend can put in a graph)
import la_compiler.ir.delta_rule  # noqa: F401
import la_compiler.ir.log_decay  # noqa: F401
import la_compiler.ir.delta_rule_phased  # noqa: F401
import la_compiler.kernels.decode.serving_inputs  # noqa: F401
import la_compiler.kernels.decode.serving_kda_inputs  # noqa: F401
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.fla import conv_op, norm_op  # noqa: F401

TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
              "test_aot_dispatch_dynamic")
SCALE = 0.25
K = V = 16
CHUNK = 8
STATE_FP8 = (("state", "fp8_e4m3/tile16"),)


def laqat_ops() -> list[str]:
    """Every op registered in the laqat namespace."""
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("laqat::"))


def opcheck(name: str, args: tuple):
    torch.library.opcheck(getattr(torch.ops.laqat, name).default, args, test_utils=TEST_UTILS)


def test_the_test_utils_are_all_of_opchecks():
    from torch.testing._internal.optests.generate_tests import ALL_TEST_UTILS, DEFAULT_TEST_UTILS

    assert set(TEST_UTILS) == set(ALL_TEST_UTILS) >= set(DEFAULT_TEST_UTILS)


# ---- inputs in a layout ------------------------------------------------------------------------
def laid_out(values: torch.Tensor, layout: str, *, time_dim: int | None = 1, grad: bool = False) -> torch.Tensor:
    """``values`` as a tensor of the same shape and contents in ``layout``: contiguous; a view transposed from
    storage with ``time_dim`` and the dim after it swapped (head-first [B, H, T, D] storage seen as [B, T, H, D]);
    or a slice (one element off in ``time_dim`` and the last dim narrowed). A leaf where ``grad``."""
    if layout == "contiguous":
        out = values.clone()
    elif layout == "transposed" and values.dim() == 1:  # every other element of a buffer twice as long
        out = torch.stack([values, torch.full_like(values, float("nan"))], -1)[:, 0]
    elif layout == "transposed":
        d = time_dim if time_dim is not None else values.dim() - 2
        out = values.transpose(d, d + 1).contiguous().transpose(d, d + 1)
    elif layout == "sliced":
        shape = list(values.shape)
        shape[-1] += 3
        index = [slice(None)] * values.dim()
        index[-1] = slice(1, values.shape[-1] + 1)
        if time_dim is not None and time_dim != values.dim() - 1:
            shape[time_dim] += 2
            index[time_dim] = slice(1, values.shape[time_dim] + 1)
        out = values.new_full(shape, float("nan"))[tuple(index)]
        out.copy_(values)
    else:
        raise ValueError(layout)
    assert out.shape == values.shape, layout
    assert (layout == "contiguous") != (not out.is_contiguous() or out.storage_offset() > 0), layout  # 1-D: offset
    return out.requires_grad_(grad)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str = "gdn"
    kernel: str = "chunk"
    layout: str = "contiguous"
    dtype: torch.dtype = torch.float32
    h0: bool = False
    varlen: bool = False
    quant: tuple = ()
    keep: str = "intra"  # the tuning option t.keep_residual
    heads: tuple = (1, 1)  # (H, HV); the transposed layout takes (2, 2): a dim of one is not transposed
    batch: int = 1  # without cu_seqlens
    raw_gate: bool = False  # the phased ops: g is KDA's raw gate, A_log and dt_bias follow the spec

    def spec(self, **changes) -> str:
        return RecurrenceSpec(kind=self.kind, kernel=self.kernel, chunk=CHUNK, quant=self.quant,
                              **changes).replace(tuning={"keep_residual": self.keep}).to_string()

    def __str__(self):
        bits = [self.kind, self.kernel, self.layout, str(self.dtype).split(".")[-1]]
        bits += ["h0"] * self.h0 + ["varlen"] * self.varlen + ["state_fp8"] * bool(self.quant)
        bits += [f"keep_{self.keep}"] * (self.keep != "intra")
        bits += [f"heads{self.heads[0]}x{self.heads[1]}"] * (self.heads != (1, 1)) + [f"B{self.batch}"] * (self.batch > 1)
        bits += ["raw_gate"] * self.raw_gate
        return "-".join(bits)


T = 9  # two chunks of CHUNK
CU_SEQLENS = [0, 3, T]


def recurrence_inputs(case: Case, grad: bool):
    """(q, k, v, g, beta, initial_state, cu_seqlens) of ``case``, in its layout and dtype."""
    H, HV = (2, 2) if case.layout == "transposed" else case.heads
    B, cu = (1, torch.tensor(CU_SEQLENS)) if case.varlen else (case.batch, None)
    N = B if cu is None else cu.numel() - 1
    g_shape = (B, T, HV, K) if case.kind == "kda" else (B, T, HV)
    values = [torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1), torch.randn(B, T, HV, V),
              F.logsigmoid(torch.randn(g_shape)) * 0.5, torch.rand(B, T, HV).sigmoid()]
    tensors = [laid_out(x.to(case.dtype), case.layout, grad=grad) for x in values]
    h0 = laid_out(torch.randn(N, HV, K, V).to(case.dtype), case.layout, time_dim=2, grad=grad) if case.h0 else None
    return (*tensors, h0, cu)


def cotangents(case: Case, q, v, cu):
    """do [B, T, HV, V] in the case's layout (Inductor hands strided gradients), dht fp32 [N, HV, K, V]."""
    N = q.shape[0] if cu is None else cu.numel() - 1
    return (laid_out(torch.randn(v.shape).to(q.dtype), case.layout),
            laid_out(torch.randn(N, v.shape[2], K, V), case.layout, time_dim=2))


# ---- the delta rule ops ------------------------------------------------------------------------
# each kernel variant that runs on the CPU, across kinds, layouts, dtypes, initial states, cu_seqlens, grouped heads
# and a quantized state; every dimension takes each of its values at least once per variant
BF16 = torch.bfloat16
DELTA_RULE_CASES = [
    Case("gdn", "fused_recurrent", heads=(1, 2), batch=2),
    Case("kda", "fused_recurrent", "transposed", h0=True),
    Case("gdn", "fused_recurrent", "sliced", BF16, varlen=True),
    Case("kda", "fused_recurrent", "contiguous", BF16, h0=True, varlen=True),
    Case("gdn", "chunk", heads=(1, 2)),
    Case("kda", "chunk"),  # issue 21: its residual differed between identical calls (unwritten elements)
    Case("gdn", "chunk", "transposed", h0=True),
    Case("kda", "chunk", "sliced", h0=True, varlen=True),
    Case("gdn", "chunk", "sliced", BF16, h0=True, varlen=True, quant=STATE_FP8),
    Case("kda", "chunk", "contiguous", h0=True, quant=STATE_FP8),
    Case("gdn", "chunk", "contiguous", BF16, h0=True, varlen=True, keep="all"),
    Case("kda", "chunk", "sliced", BF16, varlen=True, keep="all"),
    Case("gdn", "chunk", "contiguous", h0=True, keep="none"),
    Case("gdn", "reference", "transposed", h0=True),
    Case("kda", "reference", "sliced", BF16, varlen=True, heads=(1, 2)),
    Case("kda", "reference", "contiguous", h0=True, varlen=True, quant=STATE_FP8),
    Case("gdn", "reference", "sliced", BF16, quant=STATE_FP8, batch=2),
]
# the backward op, the forward-only op and the composite: fewer (the training op's opcheck runs their kernels)
BACKWARD_CASES = [DELTA_RULE_CASES[i] for i in (1, 4, 7, 11, 14)]
EVAL_CASES = [DELTA_RULE_CASES[i] for i in (2, 6, 8, 15)]
COMPOSITE_CASES = [DELTA_RULE_CASES[i] for i in (3, 13, 15)]


def _forward_args(case: Case, grad: bool):
    q, k, v, g, beta, h0, cu = recurrence_inputs(case, grad)
    return (q, k, v, g, beta, h0, cu, SCALE, case.spec())


@pytest.mark.parametrize("case", DELTA_RULE_CASES, ids=str)
def test_delta_rule_train(case):
    opcheck("delta_rule_train", _forward_args(case, grad=True))


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=str)
def test_delta_rule_backward(case):
    """From the residual its training forward keeps (empty for variants that keep none)."""
    args = _forward_args(case, grad=False)
    q, k, v, g, beta, h0, cu, scale, spec = args
    _, _, residual = torch.ops.laqat.delta_rule_train(*args)
    do, dht = cotangents(case, q, v, cu)
    opcheck("delta_rule_backward", (do, dht, residual, q, k, v, g, beta, h0, cu, scale, spec))


@pytest.mark.parametrize("case", EVAL_CASES, ids=str)
def test_delta_rule_eval(case):
    opcheck("delta_rule_eval", _forward_args(case, grad=False))


@pytest.mark.parametrize("case", COMPOSITE_CASES, ids=str)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
def test_delta_rule(case, grad):
    """The composite (delta_rule_train where a gradient flows, else delta_rule_eval)."""
    opcheck("delta_rule", _forward_args(case, grad=grad))


ROUNDED_PAIRS = (("key_interaction.lhs", "fp8_e4m3/row"), ("key_interaction.rhs", "fp8_e4m3/row"))


@pytest.mark.parametrize("kind,mode,dtype,varlen,quant,pairs", [
    ("gdn", "intra", torch.float32, False, (), "auto"),
    ("gdn", "all", BF16, True, (), "auto"),
    ("kda", "intra", torch.float32, False, (), "whole_rows"),  # the exact pairs kernel's two paths
    ("kda", "intra", torch.float32, True, (), "by_columns"),
    ("kda", "intra", torch.float32, False, ROUNDED_PAIRS, "auto"),  # the rounded pairs kernel
    ("kda", "all", BF16, True, STATE_FP8, "auto"),
], ids=lambda x: str(x).split(".")[-1] if not isinstance(x, tuple) else ("quant" if x else "exact"))
def test_chunk_residual_every_element_written(monkeypatch, kind, mode, dtype, varlen, quant, pairs):
    """The training forward writes every element of the residual it returns (the op's output): none of a
    NaN-filled buffer stays NaN, alignment padding, KDA's P above the diagonal and a varlen batch's unused chunk
    states (t.keep_residual=all) included. Before, opcheck's AOT check saw the buffer differ between
    identical calls by up to 5e28 (uninitialised memory)."""
    from la_compiler.kernels.chunk import forms as chunk_forms
    from la_compiler.kernels.chunk.params import ChunkParams
    from la_compiler.kernels.chunk.fwd import chunk_fwd
    from la_compiler.kernels.chunk.residual import residual_gaps, residual_layout
    from la_compiler.options import TuningOptions

    if pairs != "auto":  # whole row blocks as one product, or the diagonal block column by column
        monkeypatch.setattr(chunk_forms, "DIAG_DOT_MAX_RANGE", 1e9 if pairs == "whole_rows" else 0.0)
    case = Case(kind, varlen=varlen, dtype=dtype, quant=quant, heads=(1, 2))
    q, k, v, g, beta, h0, cu = recurrence_inputs(case, grad=False)
    p = ChunkParams.from_spec(RecurrenceSpec.parse(case.spec()))
    parts, size = residual_layout(p, q, v, cu, mode)
    assert residual_gaps(parts, size) or kind == "kda", "GDN's G (B T HV elements) leaves padding here"
    residual = torch.full((size,), float("nan"))
    chunk_fwd(p, q, k, v, g, beta, SCALE, h0, cu, save_to=residual, tuning=TuningOptions(keep_residual=mode))
    assert not residual.isnan().any(), [part.name for part in parts
                                        if residual[part.offset: part.offset + part.fp32_elements()].isnan().any()]
    for part in parts:  # 16-bit parts: their own elements too, and no half of an fp32 element left over
        view = residual[part.offset: part.offset + part.fp32_elements()].view(part.dtype)
        assert not view.isnan().any(), part.name


# ---- the phased ops (need an active phase context) ---------------------------------------------
PHASED_CASES = [
    Case("kda", "decode_reference", "transposed", h0=True, varlen=True, quant=STATE_FP8),
    Case("gdn", "decode_reference", "sliced", BF16, quant=STATE_FP8),
    Case("gdn", "decode_fused", "contiguous", h0=True, quant=STATE_FP8),
    Case("kda", "decode_fused", "sliced", BF16, varlen=True, quant=STATE_FP8),
    Case("gdn", "decode_serving", "transposed", BF16, h0=True, varlen=True),  # vLLM 0.33, bf16 state cache
    Case("kda", "decode_serving", "contiguous", h0=True, quant=STATE_FP8),
    Case("kda", "decode_serving", "sliced", BF16, varlen=True, raw_gate=True),  # vLLM's gate computed in the node
]
SERVING = (("serving", "vllm-0.33"), ("state_dtype", "bfloat16"))  # decode_serving's spec options
PREFILL = {False: ([3], [8]), True: ([2, 4], [3, 5])}  # (prefill lengths, valid lengths) by varlen


def _phased_args(case: Case, grad: bool):
    q, k, v, g, beta, h0, cu = recurrence_inputs(case, grad)
    prefill, valid = torch.ops.laqat.phase_lengths(q, cu)
    serving = SERVING if case.kernel == "decode_serving" else ()
    spec = case.spec(phase="token", extra=tuple(sorted((("readout", "working"),) + serving)))
    if not case.raw_gate:
        return (q, k, v, g, beta, h0, cu, prefill, valid, SCALE, spec)
    HV = v.shape[2]
    raw = laid_out((torch.randn(g.shape) * 4).to(case.dtype), case.layout, grad=grad)
    A_log = torch.rand(HV).mul(3).log().requires_grad_(grad)
    dt_bias = torch.rand(HV * K).requires_grad_(grad)
    return (q, k, v, raw, beta, h0, cu, prefill, valid, SCALE, spec, A_log, dt_bias)


@pytest.mark.parametrize("case", PHASED_CASES, ids=str)
def test_phase_lengths(case):
    q, *_, cu = recurrence_inputs(case, grad=False)
    with la_compiler.phase(*PREFILL[case.varlen]):
        opcheck("phase_lengths", (q, cu))


@pytest.mark.parametrize("case", PHASED_CASES, ids=str)
def test_delta_rule_phased_train(case):
    with la_compiler.phase(*PREFILL[case.varlen]):
        opcheck("delta_rule_phased_train", _phased_args(case, grad=True))


@pytest.mark.parametrize("case", PHASED_CASES, ids=str)
def test_delta_rule_phased_eval(case):
    with la_compiler.phase(*PREFILL[case.varlen]):
        opcheck("delta_rule_phased_eval", _phased_args(case, grad=False))


@pytest.mark.parametrize("case", PHASED_CASES, ids=str)
def test_delta_rule_phased_backward(case):
    """From the residual its training forward keeps (the decode suffix's checkpoints; empty for the reference)."""
    with la_compiler.phase(*PREFILL[case.varlen]):
        args = _phased_args(case, grad=False)
        q, k, v, g, beta, h0, cu, prefill, valid, scale, spec, *gate = args
        _, _, residual = torch.ops.laqat.delta_rule_phased_train(*args)
        do, dht = cotangents(case, q, v, cu)
        opcheck("delta_rule_phased_backward",
                (do, dht, residual, q, k, v, g, beta, h0, cu, prefill, valid, scale, spec, *gate))


@pytest.mark.parametrize("case", PHASED_CASES[::2], ids=str)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
def test_delta_rule_phased(case, grad):
    """The composite (delta_rule_phased_train where a gradient flows, else delta_rule_phased_eval)."""
    with la_compiler.phase(*PREFILL[case.varlen]):
        opcheck("delta_rule_phased", _phased_args(case, grad=grad))


# ---- FLA's convolution and norms (kernels/fla/conv_op.py, norm_op.py) -------------
@dataclasses.dataclass(frozen=True)
class FlaCase:
    layout: str = "contiguous"
    dtype: torch.dtype = torch.float32
    optional: bool = True  # bias, residual, initial state / weight, bias
    varlen: bool = False

    def __str__(self):
        return "-".join([self.layout, str(self.dtype).split(".")[-1]] + ["optional"] * self.optional
                        + ["varlen"] * self.varlen)


FLA_CASES = [
    FlaCase("contiguous", torch.float32, optional=True),
    FlaCase("transposed", torch.bfloat16, optional=False),
    FlaCase("sliced", torch.float32, optional=True, varlen=True),
]
D, W = 8, 4


def _conv_args(case: FlaCase, grad: bool):
    B, T = (1, 10) if case.varlen else (2, 7)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32) if case.varlen else None
    N = B if cu is None else cu.numel() - 1
    lay = lambda x, **kw: laid_out(x.to(case.dtype), case.layout, grad=grad, **kw)  # noqa: E731
    x = lay(torch.randn(B, T, D))  # transposed: [B, D, T] storage, what a Conv1d's input is
    weight = lay(torch.randn(D, W), time_dim=None)
    bias = lay(torch.randn(D), time_dim=None) if case.optional else None
    residual = lay(torch.randn(B, T, D)) if case.optional else None
    h0 = lay(torch.randn(N, D, W), time_dim=None) if case.optional else None
    return x, weight, bias, residual, h0, cu


def _options(case: FlaCase, *choices):
    """One of ``choices`` per case (each is taken by some case)."""
    return choices[FLA_CASES.index(case) % len(choices)]


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_causal_conv1d(case):
    x, weight, bias, residual, h0, cu = _conv_args(case, grad=True)
    activation, final = _options(case, ("silu", True), (None, False))
    opcheck("causal_conv1d", (x, weight, bias, residual, h0, cu, activation, final))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_causal_conv1d_backward(case):
    x, weight, bias, residual, h0, cu = _conv_args(case, grad=False)
    dy = laid_out(torch.randn(x.shape).to(case.dtype), case.layout)
    N = x.shape[0] if cu is None else cu.numel() - 1
    activation, dht = _options(case, ("silu", laid_out(torch.randn(N, D, W).to(case.dtype), case.layout, time_dim=None)),
                               (None, None))
    opcheck("causal_conv1d_backward", (dy, dht, x, weight, bias, residual, h0, cu, activation))


def _norm_args(case: FlaCase, grad: bool):
    lay = lambda x, **kw: laid_out(x.to(case.dtype), case.layout, grad=grad, **kw)  # noqa: E731
    shape = (2, 5, 2, D)  # [B, T, H, D]: the output norm of a layer, per head
    x, gate = lay(torch.randn(shape)), lay(torch.randn(shape))
    weight = lay(torch.randn(D), time_dim=None) if case.optional else None
    bias = lay(torch.randn(D), time_dim=None) if case.optional else None
    return x, gate, weight, bias


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_layer_norm_gated(case):
    x, gate, weight, bias = _norm_args(case, grad=True)
    activation, rms = _options(case, ("swish", True), ("sigmoid", False), ("silu", False))
    opcheck("layer_norm_gated", (x, gate, weight, bias, activation, 1e-5, rms))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_layer_norm_gated_backward(case):
    x, gate, weight, bias = _norm_args(case, grad=False)
    dy = laid_out(torch.randn(x.shape).to(case.dtype), case.layout)
    activation, rms = _options(case, ("silu", True), ("sigmoid", False))
    opcheck("layer_norm_gated_backward", (dy, x, gate, weight, bias, activation, 1e-5, rms))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_layer_norm(case):
    x, _, weight, bias = _norm_args(case, grad=True)
    opcheck("layer_norm", (x, weight, bias, 1e-5, _options(case, True, False)))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_layer_norm_backward(case):
    x, _, weight, bias = _norm_args(case, grad=False)
    dy = laid_out(torch.randn(x.shape).to(case.dtype), case.layout)
    opcheck("layer_norm_backward", (dy, x, weight, bias, 1e-5, _options(case, False, True)))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_layer_norm_residual(case):
    x, _, weight, bias = _norm_args(case, grad=True)
    residual = laid_out(torch.randn(x.shape).to(_options(case, torch.float32, case.dtype)), case.layout, grad=True)
    opcheck("layer_norm_residual", (x, residual, weight, bias, 1e-5, _options(case, True, False)))


# ---- FLA's cross-entropy ops (kernels/fla/cross_entropy_op.py, linear_cross_entropy_op.py) ------
def _registered_or_skip(name: str):
    if name not in laqat_ops():  # added alongside these cases; a checkout without them has nothing to check
        pytest.skip(f"laqat::{name} is not registered in this checkout")


def _ce_args(case: FlaCase, grad: bool, N=6, Vocab=12):
    logits = laid_out(torch.randn(N, Vocab).to(case.dtype) * 3, case.layout, time_dim=None, grad=grad)
    target = torch.randint(0, Vocab, (N,))
    target[1] = -100  # ignored
    smoothing, softcap = _options(case, (0.1, None), (0.0, 30.0), (0.05, 10.0))
    return logits, target, smoothing, 1.0 if case.optional else 0.5, 1e-4, softcap, -100


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_cross_entropy(case):
    _registered_or_skip("cross_entropy")
    opcheck("cross_entropy", _ce_args(case, grad=True))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_cross_entropy_backward(case):
    _registered_or_skip("cross_entropy_backward")
    logits, target, *options = _ce_args(case, grad=False)
    _, _, lse = torch.ops.laqat.cross_entropy(logits, target, *options)
    dloss = laid_out(torch.randn(target.shape), case.layout, time_dim=None)
    opcheck("cross_entropy_backward", (dloss, logits, target, lse, *options))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_fused_linear_cross_entropy(case):
    _registered_or_skip("fused_linear_cross_entropy")
    N, Hd, Vocab = 6, 8, 12
    lay = lambda x: laid_out(x.to(case.dtype), case.layout, time_dim=None, grad=True)  # noqa: E731
    x, weight = lay(torch.randn(N, Hd)), lay(torch.randn(Vocab, Hd) * 0.3)
    bias = lay(torch.randn(Vocab)) if case.optional else None
    target = torch.randint(0, Vocab, (N,))
    target[2] = -100
    reduction, l2warp, fp32_acc = _options(case, ("mean", False, True), ("sum", True, False), ("mean", True, True))
    opcheck("fused_linear_cross_entropy", (x, target, weight, bias, -100, 0.1, 1.0, None, 2, reduction, l2warp,
                                           1e-4, fp32_acc))


# ---- FLA's fused gated MLP (kernels/fla/glu_linear_op.py) ------------------------------------------------------
def _glu_args(case: FlaCase, grad: bool, O=6):
    lay = lambda x, **kw: laid_out(x.to(case.dtype), case.layout, grad=grad, **kw)  # noqa: E731
    x, y = lay(torch.randn(2, 5, D) * 2), lay(torch.randn(2, 5, D))
    weight = lay(torch.randn(O, D) * 0.3, time_dim=None)
    bias = lay(torch.randn(O), time_dim=None) if case.optional else None
    return x, y, weight, bias


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_glu_linear(case):
    x, y, weight, bias = _glu_args(case, grad=True)
    opcheck("glu_linear", (x, y, weight, bias, *_options(case, ("swiglu", 1.0), ("powglu", 3.0), ("powglu", 2.0))))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_glu_linear_backward(case):
    x, y, weight, bias = _glu_args(case, grad=False)
    dout = laid_out(torch.randn(2, 5, weight.shape[0]).to(case.dtype), case.layout).contiguous()
    activation = _options(case, ("powglu", 3.0), ("swiglu", 1.0))
    opcheck("glu_linear_backward", (dout, x, y, weight, bias is not None, *activation))


# ---- FLA's l2 norm (kernels/fla/l2_norm_op.py) -----------------------------------------------------------------
@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_l2_norm(case):
    x = laid_out((torch.randn(2, 5, D) * 3).to(case.dtype), case.layout, grad=True)
    opcheck("l2_norm", (x, 1e-6, _options(case, None, torch.float32)))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_l2_norm_backward(case):
    x = laid_out((torch.randn(2, 5, D) * 3).to(case.dtype), case.layout)
    y, rstd = torch.ops.laqat.l2_norm(x, 1e-6, _options(case, None, torch.float32))
    dy = laid_out(torch.randn(2, 5, D).to(y.dtype), case.layout)
    opcheck("l2_norm_backward", (dy, y, rstd, 1e-6, x.dtype))


# ---- FLA's softplus gates (kernels/fla/softplus_gate_op.py) -----------------------------------------------------
def _gate_args(case: FlaCase, grad: bool):
    kda = FLA_CASES.index(case) % 2 == 1
    shape = (2, 5, 3, 4) if kda else (2, 5, 3)
    g = laid_out((torch.randn(shape) * 3).to(case.dtype), case.layout, grad=grad)
    A_log = laid_out(torch.randn(3), "contiguous", time_dim=None, grad=grad)
    dt_bias = laid_out(torch.randn(12 if kda else 3), "contiguous", time_dim=None, grad=grad) if case.optional else None
    return g, A_log, dt_bias


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_softplus_gate(case):
    opcheck("softplus_gate", _gate_args(case, grad=True))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_softplus_gate_backward(case):
    g, A_log, dt_bias = _gate_args(case, grad=False)
    out = torch.ops.laqat.softplus_gate(g, A_log, dt_bias)
    dout = laid_out(torch.randn(out.shape), case.layout)
    opcheck("softplus_gate_backward", (dout, out, A_log, dt_bias is not None, g.dtype))


# ---- a GDN serving profile's pre-processing (kernels/decode/serving_inputs.py) ----------------------------------
def _prefix(B=2, T=5):
    return (torch.arange(T) < 3).to(torch.int8).expand(B, T).contiguous()


def test_serving_prefix():
    x = torch.randn(2, 9, 3, 4)
    for cu in (None, torch.tensor([0, 5, 18])):
        lengths = (torch.tensor([3, 0]), torch.tensor([5, 9])) if cu is None else (torch.tensor([3, 6]),
                                                                                   torch.tensor([5, 13]))
        opcheck("serving_prefix", (x, cu, *lengths))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_serving_l2norm(case):
    x = laid_out((torch.randn(2, 5, 3, D) * 3).to(case.dtype), case.layout, grad=True)
    opcheck("serving_l2norm", (x, _prefix()))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_serving_gdn_gate(case):
    a = laid_out((torch.randn(2, 5, 3) * 8).to(case.dtype), case.layout, grad=True)
    A_log = laid_out(torch.randn(3), "contiguous", time_dim=None, grad=True)
    dt_bias = laid_out(torch.randn(3), "contiguous", time_dim=None, grad=True) if case.optional else None
    opcheck("serving_gdn_gate", (a, A_log, dt_bias, _prefix()))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_serving_sigmoid(case):
    opcheck("serving_sigmoid", (laid_out((torch.randn(2, 5, 3) * 3).to(case.dtype), case.layout, grad=True),))


# ---- a KDA serving profile's pre-processing (kernels/decode/serving_kda_inputs.py) ----------------------------------
@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_serving_kda_l2norm(case):
    x = laid_out((torch.randn(2, 5, 3, D) * 3).to(case.dtype), case.layout, grad=True)
    opcheck("serving_kda_l2norm", (x, _prefix()))


@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_serving_kda_gate(case):
    g = laid_out((torch.randn(2, 5, 3, 4) * 8).to(case.dtype), case.layout, grad=True)
    A_log = laid_out(torch.randn(3), "contiguous", time_dim=None, grad=True)
    dt_bias = laid_out(torch.randn(12), case.layout, time_dim=None, grad=True) if case.optional else None
    opcheck("serving_kda_gate", (g, A_log, dt_bias))


# ---- the log of a decay passed in exponentiated (la_compiler/ir/log_decay.py) ------------------------------------
@pytest.mark.parametrize("case", FLA_CASES, ids=str)
def test_log_decay(case):
    decay = laid_out((0.05 + 0.9 * torch.rand(2, 5, 3)).to(case.dtype), case.layout, grad=True)
    opcheck("log_decay", (decay, "d"))


def test_every_laqat_op_has_cases():
    """Every op registered under laqat:: has an opcheck test in this file (a new op needs its cases here)."""
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert set(laqat_ops()) <= tested, sorted(set(laqat_ops()) - tested)
    assert len(laqat_ops()) >= 13
