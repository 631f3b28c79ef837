"""Triton QDQ device functions (through small launchers) against the torch references, bit for bit."""
import pytest
import torch

from la_compiler.kernels.common import qdq as K
from la_compiler.quant import fake_quant
from la_compiler.quant import formats as F
from tests.qdq_values import mismatches, oracle_qdq_fp8, random_finite, random_near, special_values

# numpy (the interpreter) warns about the inf/NaN arithmetic these tests feed it on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def _with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.tensor([NAN, -NAN, INF, -INF])])


def _scales(n: int, gen) -> torch.Tensor:
    """Power-of-two scales (ties survive x/s), arbitrary ones, 1, and the odd infinite / tiny scale."""
    s = torch.exp2(torch.randint(-10, 10, (n,), generator=gen).float())
    half = n // 2
    s[:half] *= 1 + torch.rand(half, generator=gen)
    s[half: half + n // 8] = 1.0
    s[-3:] = torch.tensor([INF, 1e-40, 3.0e38])
    return s


def _elementwise_inputs(gen, n_random: int):
    special = _with_nonfinite(special_values())
    x = torch.cat([special, special * 3.0, random_near(n_random, -24, 12, gen), random_finite(n_random // 8, gen)])
    s = _scales(x.numel(), gen)
    s[: 2 * special.numel()] = 1.0  # the special classes land exactly in E4M3 units
    return x, s


# E4M3 rounding: the arithmetic form everywhere, the GPU's conversion where the kernels take it (sm_89 and later)
E4M3_FORMS = [False] + [True] * K.hardware_fp8_cast()


@pytest.mark.parametrize("hardware_cast", E4M3_FORMS, ids=lambda hw: "conversion" if hw else "arithmetic")
def test_fp8_elementwise_matches_reference_over_a_million_values(hardware_cast):
    gen = torch.Generator().manual_seed(10)
    x, s = _elementwise_inputs(gen, 1_000_000)
    assert x.numel() >= 1_000_000
    got = K.qdq_elementwise(x.to(DEVICE), s.to(DEVICE), "fp8_e4m3", hardware_cast=hardware_cast)
    assert mismatches(got, F.qdq_fp8_e4m3(x, s)) == 0
    assert mismatches(got, oracle_qdq_fp8(x, s)) == 0


@pytest.mark.parametrize("fmt, ref", [("int8", F.qdq_int8), ("e2m1", F.qdq_e2m1)])
def test_int8_and_e2m1_elementwise_match_reference(fmt, ref):
    gen = torch.Generator().manual_seed(11)
    x, s = _elementwise_inputs(gen, 300_000)
    qmax = 127.0 if fmt == "int8" else 6.0
    ties = torch.arange(-2 * qmax, 2 * qmax + 1) / 2  # every half step, in scaled units
    grid_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    extra = torch.cat([ties, torch.nextafter(ties, torch.full_like(ties, INF)), grid_ties, -grid_ties])
    x = torch.cat([extra, x])
    s = torch.cat([torch.ones_like(extra), s])
    got = K.qdq_elementwise(x.to(DEVICE), s.to(DEVICE), fmt)
    assert mismatches(got, ref(x, s)) == 0


def test_log_grid_elementwise_matches_reference():
    gen = torch.Generator().manual_seed(12)
    step = 0.03125
    ties = (torch.arange(-400, 400) + 0.5) * step
    x = _with_nonfinite(torch.cat([ties, -random_near(200_000, -12, 6, gen), random_finite(20_000, gen)]))
    got = K.qdq_elementwise(x.to(DEVICE), None, "log_grid", step=step)
    assert mismatches(got, F.qdq_log_grid(x, step)) == 0
    got = K.qdq_elementwise(x.to(DEVICE), None, "log_grid", step=0.1)
    assert mismatches(got, F.qdq_log_grid(x, 0.1)) == 0


def _state(gen, n: int, k: int, v: int, max_exp: int) -> torch.Tensor:
    x = torch.randn(n, k, v, generator=gen) * torch.exp2(torch.randint(-max_exp, max_exp, (n, 1, 1), generator=gen).float())
    x[0] = 0.0  # all-zero tiles
    x[1, :, :5] = -0.0
    x[2, 1, 3] = NAN  # NaN is elementwise
    x[3, 2, 70 % v] = INF  # an infinite amax poisons its tile
    x[4] = torch.randn(k, v, generator=gen) * 1e-42  # amax/448 underflows: the zero guard
    x[5, 0, 0] = 448.0 * 2.0**-20  # ties relative to the tile scale
    return x


@pytest.mark.parametrize("fmt, block_v, v", [("fp8_e4m3", 64, 80), ("int8", 32, 80), ("fp8_e4m3", 16, 16),
                                             ("int8_h32", 64, 96), ("int8_h32", 32, 64)])
def test_tile_kernel_matches_fake_quant(fmt, block_v, v):
    gen = torch.Generator().manual_seed(13)
    # The Hadamard codec's fp16 scale overflows (NaN group) above amax 127 * 65504: stay below it.
    x = _state(gen, 12, 5, v, max_exp=16 if fmt == "int8_h32" else 30)
    got = K.qdq_tile(x.to(DEVICE), fmt, block_v)
    expected = fake_quant(x, f"{fmt}/tile{block_v}")
    assert mismatches(got, expected) == 0
    assert torch.isnan(expected[3]).any() and not torch.isnan(expected[6:]).any()  # the test is not vacuous


@pytest.mark.parametrize("block_rows, block_cols", [(64, 64), (16, 32)])
def test_nvfp4_kernel_matches_fake_quant(block_rows, block_cols):
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(37, 96, generator=gen) * torch.exp2(torch.randint(-12, 4, (37, 6), generator=gen).float()).repeat_interleave(16, 1)
    x[3, :16] = 0.0
    x[4, 16:32] = 1e-7  # a block whose scale falls below 1e-5 and becomes 1
    x[5, 5] = NAN
    got = K.qdq_nvfp4(x.to(DEVICE), block_rows, block_cols)
    assert mismatches(got, fake_quant(x, "nvfp4/block16")) == 0
    x[6, 7] = -INF
    got = K.qdq_nvfp4(x.to(DEVICE), block_rows, block_cols)
    assert torch.isnan(got).all() and mismatches(got, fake_quant(x, "nvfp4/block16")) == 0


def _quotient_inputs(gen, n: int):
    """x over every binade and class; scales over every binade, at the edges of ``quotient``'s rescaling
    (2^-60, 2^100), subnormal, huge, infinite."""
    x = torch.cat([random_near(n, -40, 40, gen), random_finite(n // 4, gen), _with_nonfinite(special_values())])
    s = torch.cat([random_near(n, -126, 127, gen).abs(), random_finite(x.numel() - n, gen).abs()])
    edges = torch.tensor([2.0**-60, 2.0**100, 1e-40, 1e-45, INF, 1.0, 3.0e38])
    edges = torch.cat([edges, torch.nextafter(edges, torch.zeros_like(edges)), torch.nextafter(edges, edges * 2)])
    pick = torch.randint(0, s.numel(), (s.numel() // 10,), generator=gen)
    s[pick] = edges[torch.randint(0, edges.numel(), pick.shape, generator=gen)]
    return x, s


@pytest.mark.parametrize("division", ["fma", "rn"])
def test_quotient_is_correctly_rounded(division):
    """x / scale bit for bit against IEEE division wherever a format can see it (2^-40 <= |x / s| <= 2^100,
    zeros, Inf, NaN); beyond 2^100 and below 2^-40 (the FMA form's q0, or a residual that underflowed) on the
    same side of every format's clamp and rounding-to-zero threshold, with the sign of x / s. Both forms: the
    FMA one the kernels take (``qdq.FMA_DIVISION``) and ``tl.div_rn``."""
    gen = torch.Generator().manual_seed(16)
    x, s = _quotient_inputs(gen, 400_000)
    got = K.qdq_elementwise(x.to(DEVICE), s.to(DEVICE), "quotient", fma=division == "fma").cpu()
    ref = x / s
    a = ref.abs()
    seen = ((a >= 2.0**-40) & (a <= 2.0**100)) | (a == 0) | torch.isinf(ref) | torch.isnan(ref)
    assert mismatches(got[seen], ref[seen]) == 0
    far = ~seen
    assert far.sum() > 100  # both tails are exercised
    assert (torch.sign(got[far]) == torch.sign(ref[far])).all()
    assert ((a[far] > 1) == (got[far].abs() > 2.0**99)).all() and (got[far & (a < 1)].abs() < 2.0**-30).all()


def test_launchers_reject_bad_shapes():
    with pytest.raises(ValueError, match="multiples of 32"):
        K.qdq_tile(torch.randn(2, 4, 48, device=DEVICE), "int8_h32", 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        K.qdq_nvfp4(torch.randn(4, 24, device=DEVICE))


def test_hardware_fp8_cast_choice(monkeypatch):
    """The GPU's E4M3 conversion is never taken under the interpreter (its cast is wrong at binade edges), and a
    launcher refuses to force it there; the kernels' quotients take the FMA form."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.hardware_fp8_cast() is False
    with pytest.raises(ValueError, match="hardware_cast=True needs a GPU"):
        K.qdq_elementwise(torch.ones(4), torch.ones(4), "fp8_e4m3", hardware_cast=True)
    assert K.FMA_DIVISION.value is True
