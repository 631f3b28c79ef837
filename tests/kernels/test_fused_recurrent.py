"""The fused recurrent kernels against the fp64 reference (forward and every gradient), and what a spec
fixes of them: the constexpr flags, shown by ``laqat source``."""
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from la_compiler.kernels import sources
from la_compiler.kernels.common import cache
from la_compiler.kernels.common.errors import KernelParamsError
from la_compiler.kernels.recurrent import fused_recurrent
from la_compiler.kernels.recurrent.fused_recurrent import fused_recurrent_bwd, fused_recurrent_fwd
from la_compiler.kernels.recurrent.params import FusedRecurrentParams
from la_compiler.kernels.reference.recurrent import delta_rule_reference
from tests.helpers import assert_close_rel

EXACT_FP32 = 1e-5
# bf16 inputs: FLA's relative-error ratios (docs/numerics.md, "How close is close")
BF16_TOL = {"o": 5e-3, "ht": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 8e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    state: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    cu_seqlens: tuple | None = None
    initial_state: bool = True
    final_state_grad: bool = True
    dtype: torch.dtype = torch.float32
    block_v: int | None = None  # None: the launcher's default
    checkpoint_interval: int = 64


CASES = [
    # two value blocks in forward and backward; 4-token checkpoints, the last chunk partial
    Case("gdn", "kv", B=2, T=7, H=1, HV=2, K=16, V=16, block_v=8, checkpoint_interval=4),
    Case("gdn", "vk", B=1, T=13, H=2, HV=4, K=16, V=8, cu_seqlens=(0, 5, 13), checkpoint_interval=4),
    Case("kda", "kv", B=1, T=13, H=2, HV=2, K=16, V=16, initial_state=False, final_state_grad=False),
    # head dims that are not powers of two (masked tails), grouped heads, varlen with a 1-token and an empty sequence
    Case("kda", "vk", B=1, T=13, H=1, HV=2, K=12, V=10, cu_seqlens=(0, 1, 1, 9, 13), block_v=4, checkpoint_interval=4),
    Case("gdn", "kv", B=1, T=9, H=1, HV=2, K=16, V=16, dtype=torch.bfloat16, block_v=8),
]


def make_inputs(c: Case):
    q = torch.randn(c.B, c.T, c.H, c.K)
    k = F.normalize(torch.randn(c.B, c.T, c.H, c.K), dim=-1)
    v = torch.randn(c.B, c.T, c.HV, c.V)
    g_shape = (c.B, c.T, c.HV) if c.kind == "gdn" else (c.B, c.T, c.HV, c.K)
    g = 0.5 * F.logsigmoid(torch.randn(g_shape))
    beta = torch.rand(c.B, c.T, c.HV).sigmoid()
    cu = None if c.cu_seqlens is None else torch.tensor(c.cu_seqlens, dtype=torch.int32)
    N = c.B if cu is None else len(c.cu_seqlens) - 1
    state_shape = (N, c.HV, c.K, c.V) if c.state == "kv" else (N, c.HV, c.V, c.K)
    h0 = torch.randn(state_shape) if c.initial_state else None
    return [x.to(c.dtype) for x in (q, k, v, g, beta)], h0, cu, state_shape


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c.kind}-{c.state}-T{c.T}-HV{c.HV}-{str(c.dtype)[6:]}"
                         f"{'-varlen' if c.cu_seqlens else ''}{'-h0' if c.initial_state else ''}")
def test_fused_recurrent_matches_reference(c):
    (q, k, v, g, beta), h0, cu, state_shape = make_inputs(c)
    params = FusedRecurrentParams(c.kind, c.state)
    scale = 0.7 * c.K**-0.5

    o, ht = fused_recurrent_fwd(params, q, k, v, g, beta, scale, h0, cu, block_v=c.block_v)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0_ref = None if h0 is None else h0.double().requires_grad_(True)
    ro, rht = delta_rule_reference(*leaves, kind=c.kind, scale=scale, initial_state=h0_ref, cu_seqlens=cu,
                                   state_layout=c.state)
    tol = (lambda name: EXACT_FP32) if c.dtype == torch.float32 else BF16_TOL.get
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    assert_close_rel(o, ro, tol("o"), "o")
    assert_close_rel(ht, rht, tol("ht"), "final state")

    do = torch.randn_like(o)
    dht = torch.randn(state_shape) if c.final_state_grad else None
    grads = fused_recurrent_bwd(params, q, k, v, g, beta, scale, do, dht, h0, cu,
                                block_v=c.block_v, checkpoint_interval=c.checkpoint_interval)
    outs, seeds = [ro], [do.double()]
    if dht is not None:
        outs, seeds = outs + [rht], seeds + [dht.double()]
    wrt = leaves + ([h0_ref] if h0_ref is not None else [])
    ref_grads = torch.autograd.grad(outs, wrt, seeds)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, got, ref in zip(names, grads, ref_grads):
        assert got.dtype == (torch.float32 if name == "dh0" else c.dtype), name
        assert_close_rel(got, ref, tol(name), name)
    if h0 is None:
        assert grads[5] is None


def test_ir_op_runs_the_fused_recurrent_kernel_forward_and_backward():
    import la_compiler.ir.delta_rule  # noqa: F401  (registers torch.ops.laqat)

    c = Case("kda", "kv", B=1, T=7, H=1, HV=2, K=8, V=8, cu_seqlens=(0, 3, 7))
    (q, k, v, g, beta), h0, cu, state_shape = make_inputs(c)
    spec = "kda[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=fused_recurrent]"
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = torch.ops.laqat.delta_rule(*leaves, cu, 0.4, spec)
    w_o, w_h = torch.randn_like(o), torch.randn_like(ht)
    ((o * w_o).sum() + (ht * w_h).sum()).backward()

    ref_leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    ro, rht = delta_rule_reference(*ref_leaves[:5], kind="kda", scale=0.4, initial_state=ref_leaves[5],
                                   cu_seqlens=cu)
    ((ro * w_o.double()).sum() + (rht * w_h.double()).sum()).backward()
    assert_close_rel(o, ro, EXACT_FP32, "o")
    assert_close_rel(ht, rht, EXACT_FP32, "final state")
    for name, x, r in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], leaves, ref_leaves):
        assert_close_rel(x.grad, r.grad, EXACT_FP32, name)


SPEC = "{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=fused_recurrent]"
KERNEL_FILE = Path(fused_recurrent.__file__)


def test_spec_fixes_the_constexpr_flags_of_the_package_kernels(tmp_path, monkeypatch):
    """One module for every spec, the package's own file (nothing generated, nothing cached); what a spec
    fixes are the IS_KDA / STATE_V_FIRST constexpr values its launches pass."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    assert KERNEL_FILE.parts[-2:] == ("recurrent", "fused_recurrent.py")
    for kind in ("gdn", "kda"):
        for state in ("kv", "vk"):
            spec = SPEC.format(kind=kind, state=state)
            assert sources.kernel_modules_for_spec(spec) == {"forward and backward": fused_recurrent}
            assert sources.constexprs_of_spec(spec) == {"IS_KDA": kind == "kda", "STATE_V_FIRST": state == "vk"}
            assert FusedRecurrentParams.from_spec(spec).constexprs() == sources.constexprs_of_spec(spec)
    # a spec field the kernels do not depend on (src, chunk) fixes the same values
    gdn_kv = SPEC.format(kind="gdn", state="kv")
    assert sources.constexprs_of_spec(gdn_kv.replace("src=user", "src=fla").replace("chunk=64", "chunk=32")) == \
        sources.constexprs_of_spec(gdn_kv)
    assert sources.path_of(gdn_kv) == KERNEL_FILE
    assert sources.source_of(gdn_kv) == KERNEL_FILE.read_text()
    for kernel in (fused_recurrent.fused_recurrent_fwd_kernel, fused_recurrent.fused_recurrent_bwd_kernel):
        assert inspect.getsourcefile(kernel.fn) == str(KERNEL_FILE)
        assert {"IS_KDA", "STATE_V_FIRST"} <= set(inspect.signature(kernel.fn).parameters)
    assert list(tmp_path.iterdir()) == []


def test_laqat_source_prints_the_kernel_file_and_its_constexpr_values(capsys):
    from la_compiler.cli import main

    spec = SPEC.format(kind="kda", state="vk")
    assert main(["source", spec, "--paths"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"forward and backward: {KERNEL_FILE}",
                                                   "constexpr: IS_KDA=True, STATE_V_FIRST=True"]
    assert main(["source", SPEC.format(kind="gdn", state="kv")]) == 0
    out = capsys.readouterr().out
    header, flags = out.splitlines()[:2]
    assert header == f"# ---- forward and backward: {KERNEL_FILE}"
    assert flags.startswith("# specialized by the spec with tl.constexpr IS_KDA=False, STATE_V_FIRST=False")
    assert KERNEL_FILE.read_text() in out
    assert "def fused_recurrent_fwd_kernel(" in out and "def fused_recurrent_bwd_kernel(" in out
    assert main(["source", spec.replace("]", "; q.state=fp8_e4m3/tile64]")]) == 2
    assert "exact numerics only" in capsys.readouterr().err


def test_params_are_validated():
    with pytest.raises(KernelParamsError, match="kind"):
        FusedRecurrentParams("gla", "kv")
    with pytest.raises(KernelParamsError, match="state layout"):
        FusedRecurrentParams("gdn", "kk")


def test_non_exact_spec_is_refused():
    spec = "gdn[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=fused_recurrent; " \
           "q.state=fp8_e4m3/tile64]"
    with pytest.raises(KernelParamsError, match="exact numerics only"):
        FusedRecurrentParams.from_spec(spec)


@pytest.mark.parametrize("bad, match", [
    ("g", r"GDN g must be"),
    ("beta", r"beta must be"),
    ("h0", r"initial_state must be"),
    ("hv", r"multiple of H"),
    ("cu_batch", r"cu_seqlens needs batch size 1"),
])
def test_bad_inputs_name_the_argument(bad, match):
    (q, k, v, g, beta), h0, cu, _ = make_inputs(Case("gdn", "kv", B=2, T=3, H=2, HV=2, K=4, V=4))
    if bad == "g":
        g = g[..., None].expand(-1, -1, -1, 4)
    elif bad == "beta":
        beta = beta[:, :2]
    elif bad == "h0":
        h0 = h0.transpose(-1, -2)[..., :3]
    elif bad == "hv":
        v, beta, g = v[:, :, :1].repeat(1, 1, 3, 1), beta[:, :, :1].repeat(1, 1, 3), g[:, :, :1].repeat(1, 1, 3)
    elif bad == "cu_batch":
        cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        fused_recurrent_fwd(FusedRecurrentParams("gdn", "kv"), q, k, v, g, beta, 0.5, h0, cu)
