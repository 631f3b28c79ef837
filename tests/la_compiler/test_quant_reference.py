"""QuantConfig (parsing, validation, ModelOpt vocabulary) and the torch QDQ references."""
import math

import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.quant import QuantConfig, QuantConfigError, fake_quant, group_amax, quant_scale
from la_compiler.quant import formats as F
from tests.qdq_values import (
    mismatches, oracle_qdq_fp8, oracle_round_e4m3, random_finite, random_near, special_values,
)

CANONICAL = [
    "fp8_e4m3/tile64", "fp8_e4m3/tile16", "int8/tile128", "int8/block32", "fp8_e4m3/block16",
    "nvfp4/block16", "int8_h32/tile64", "int8_h32/tile32", "fp8_e4m3/row", "int8/row",
    "fp8_e4m3/tensor", "fp8_e4m3/axis:0,1,2", "int8/axis:-1", "log_grid:0.03125",
    "fp8_e4m3/tile64/clip", "nvfp4/block16/clip", "int8/block16/clip",
]


# ---- QuantConfig -----------------------------------------------------------------------
@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_string_round_trips_and_fits_in_a_spec(text):
    cfg = QuantConfig.parse(text)
    assert cfg.to_string() == text and str(cfg) == text
    assert QuantConfig.parse(cfg.to_string()) == cfg
    spec = RecurrenceSpec(kind="gdn", quant=(("state", text),))
    assert RecurrenceSpec.parse(spec.to_string()).quant_map["state"] == text


def test_parsed_fields():
    assert QuantConfig.parse("fp8_e4m3/tile64") == QuantConfig("fp8_e4m3", "tile", block_v=64)
    assert QuantConfig.parse("int8/block32") == QuantConfig("int8", "block", block_size=32)
    assert QuantConfig.parse("fp8_e4m3/axis:0,1,2").axis == (0, 1, 2)
    assert QuantConfig.parse("log_grid:0.03125") == QuantConfig("log_grid", step=0.03125)
    assert QuantConfig.parse("nvfp4/block16/clip").ste == "clipped"
    assert QuantConfig.parse("log_grid:1e-3").to_string() == "log_grid:0.001"


@pytest.mark.parametrize(
    "text, message",
    [
        ("fp8/tile64", "format must be one of"),
        ("fp8_e4m3", "must read '<format>/<group>[/clip]'"),
        ("fp8_e4m3/tile48", "block_v (tile width) must be one of (16, 32, 64, 128), got 48"),
        ("fp8_e4m3/block64", "block_size for format 'fp8_e4m3' must be one of (16, 32), got 64"),
        ("nvfp4/block32", "block_size for format 'nvfp4' must be one of (16,), got 32"),
        ("nvfp4/tile64", "group for format 'nvfp4' must be one of ('block',)"),
        ("int8_h32/tile16", "must be a multiple of 32"),
        ("int8_h32/row", "group for format 'int8_h32' must be one of ('tile',)"),
        ("int8_h32/tile64/clip", "ste 'clipped' is only for formats"),
        ("log_grid:0", "step of 'log_grid' must be a finite float > 0, got 0.0"),
        ("log_grid:-0.5", "must be a finite float > 0"),
        ("log_grid", "log grid must read 'log_grid:<step>'"),
        ("log_grid:abc", "log grid must read"),
        ("log_grid:0.1/clip", "ste 'clipped' is only for formats"),
        ("fp8_e4m3/col", "group must be one of tensor, row, axis:<i,j,..>, tile<BV>, block<N>, got 'col'"),
        ("fp8_e4m3/axis:0,0", "axis must be a non-empty tuple of distinct ints"),
        ("fp8_e4m3/tile64/extra", "must read '<format>/<group>[/clip]'"),
    ],
)
def test_bad_strings_name_the_problem(text, message):
    with pytest.raises(QuantConfigError) as err:
        QuantConfig.parse(text)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(format="fp4"), "quant format must be one of"),
        (dict(format="fp8_e4m3", group="tile"), "block_v (tile width) must be one of"),
        (dict(format="fp8_e4m3", group="row", block_v=64), "block_v is only for group 'tile'"),
        (dict(format="fp8_e4m3", group="row", axis=(0,)), "axis is only for group 'axis'"),
        (dict(format="fp8_e4m3", group="row", step=0.1), "step is only for format 'log_grid'"),
        (dict(format="fp8_e4m3", group="row", ste="none"), "ste must be one of ('identity', 'clipped')"),
        (dict(format="log_grid", group="row", step=0.1), "group must be None for format 'log_grid'"),
        (dict(format="log_grid", step=float("inf")), "must be a finite float > 0"),
        (dict(format="int8", group="block", block_size=16, block_v=64), "block_v is only for group 'tile'"),
    ],
)
def test_bad_fields_name_the_key(kwargs, message):
    with pytest.raises(QuantConfigError) as err:
        QuantConfig(**kwargs)
    assert message in str(err.value)


def test_quant_config_error_is_a_value_error():
    assert issubclass(QuantConfigError, ValueError)


# ModelOpt quant_cfg entries from the seeds (PR texts) and ModelOpt's own NVFP4 / block configs.
SEED_STATE_FP8 = {"num_bits": (4, 3), "type": "dynamic", "axis": (0, 1)}
SEED_W_FP8 = {"num_bits": (4, 3), "type": "dynamic", "axis": (0, 1, 2)}
MODELOPT_NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
                  "axis": None, "enable": True}


@pytest.mark.parametrize(
    "cfg, site, expected",
    [
        (SEED_STATE_FP8, "state", "fp8_e4m3/tile64"),
        (SEED_W_FP8, "w", "fp8_e4m3/row"),
        (SEED_W_FP8, "key_interaction.lhs", "fp8_e4m3/row"),
        (SEED_W_FP8, None, "fp8_e4m3/axis:0,1,2"),
        (SEED_STATE_FP8, None, "fp8_e4m3/axis:0,1"),
        (SEED_STATE_FP8, "w", "fp8_e4m3/axis:0,1"),
        (MODELOPT_NVFP4, "output_value.rhs", "nvfp4/block16"),
        ({"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic"}}, "state", "int8/block32"),
        ({"num_bits": 8, "type": "dynamic", "axis": (0, 1)}, "state", "int8/tile64"),
        ({"num_bits": 8, "type": "dynamic", "axis": (0, 1), "rotate": True}, "state", "int8_h32/tile64"),
        ({"num_bits": "e4m3", "type": "dynamic"}, "w", "fp8_e4m3/tensor"),
        ({"num_bits": [4, 3], "type": "dynamic", "axis": 0}, "w", "fp8_e4m3/axis:0"),
        ({"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}}, "w", "fp8_e4m3/row"),
        ({**SEED_W_FP8, "pass_through_bwd": False}, "w", "fp8_e4m3/row/clip"),
        ({**SEED_W_FP8, "pass_through_bwd": True, "narrow_range": True, "fake_quant": True}, "w", "fp8_e4m3/row"),
    ],
)
def test_from_modelopt(cfg, site, expected):
    assert QuantConfig.from_modelopt(cfg, site).to_string() == expected


def test_from_modelopt_state_block_v_and_disabled():
    assert QuantConfig.from_modelopt(SEED_STATE_FP8, "state", state_block_v=32).to_string() == "fp8_e4m3/tile32"
    assert QuantConfig.from_modelopt({"enable": False}, "state") is None
    assert QuantConfig.from_modelopt({**SEED_STATE_FP8, "enable": False}, "state") is None


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({**SEED_W_FP8, "axes": (0,)}, "quant cfg key 'axes' is not known"),
        ({**SEED_W_FP8, "num_bit": 8}, "quant cfg key 'num_bit' is not known; known keys: ('enable', 'num_bits'"),
        ({**SEED_W_FP8, "num_bit": 8}, "(did you mean 'num_bits'?)"),
        ({"num_bits": "e4m4", "type": "dynamic"}, "got 'e4m4' (did you mean 'e4m3'?)"),
        ({**SEED_W_FP8, "type": "dynamc"}, "got 'dynamc' (did you mean 'dynamic'?)"),
        ({"num_bits": (5, 2), "type": "dynamic"}, "quant cfg key 'num_bits' must be (4, 3)"),
        ({"num_bits": 4, "type": "dynamic"}, "quant cfg key 'num_bits'"),
        ({"num_bits": (4, 3), "axis": None}, "quant cfg key 'type' must be 'dynamic'"),
        ({"num_bits": (4, 3), "type": "calibrated"},
         "quant cfg key 'type' must be one of ('static', 'dynamic'), got 'calibrated'"),
        ({"type": "dynamic"}, "quant cfg key 'num_bits' is required"),
        ({**SEED_W_FP8, "enable": "yes"}, "quant cfg key 'enable' must be True or False"),
        ({**SEED_W_FP8, "fake_quant": False}, "quant cfg key 'fake_quant' must be one of (True,)"),
        ({**SEED_W_FP8, "unsigned": True}, "quant cfg key 'unsigned'"),
        ({**SEED_W_FP8, "bias": {-1: None}}, "quant cfg key 'bias'"),
        ({**SEED_W_FP8, "rotate": True}, "quant cfg key 'rotate' is only supported with num_bits=8"),
        ({"num_bits": 8, "type": "dynamic", "rotate": True}, "a state codec"),  # with site="w" below
        ({"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}, "(NVFP4)"),
        ({"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
         "quant cfg key 'block_sizes.scale_bits'"),
        ({"num_bits": (4, 3), "axis": 0, "block_sizes": {-1: 16, "type": "dynamic"}}, "'axis' and 'block_sizes'"),
        ({"num_bits": (4, 3), "block_sizes": {-2: 16, "type": "dynamic"}}, "block the last axis only"),
        ({"num_bits": (4, 3), "block_sizes": {-1: 64, "type": "dynamic"}}, "must be one of (16, 32) or None"),
        ({"num_bits": (4, 3), "block_sizes": {-1: 16, "type": "dynamic", "scale_block_sizes": {-1: 16}}},
         "scale_block_sizes"),
        ({"num_bits": (4, 3), "block_sizes": {-1: 16, "kind": "dynamic"}}, "'block_sizes.kind' is not known"),
        ({**SEED_W_FP8, "axis": "0"}, "quant cfg key 'axis' must be None, an int or a tuple of ints"),
    ],
)
def test_from_modelopt_errors_name_the_key(cfg, message):
    with pytest.raises(QuantConfigError) as err:
        QuantConfig.from_modelopt(cfg, "w")
    assert message in str(err.value)


# ---- FP8 E4M3: the reference against an oracle built from the format's definition ------
def test_oracle_grid_is_the_e4m3fn_grid():
    from tests.qdq_values import e4m3_grid

    all_bytes = torch.arange(0, 256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite_nonneg = all_bytes[torch.isfinite(all_bytes) & (all_bytes >= 0) & ~torch.signbit(all_bytes)]
    assert torch.equal(finite_nonneg.double().sort().values, e4m3_grid())


def test_fp8_reference_matches_oracle_on_every_value_class():
    gen = torch.Generator().manual_seed(1)
    v = torch.cat([special_values(), random_near(2_000_000, -12, 10, gen), random_finite(1_000_000, gen)])
    v = v.clamp(-448, 448)  # in E4M3 units; the scaled path is below
    got = F.qdq_fp8_e4m3(v, torch.tensor(1.0))
    assert mismatches(got, oracle_round_e4m3(v).float()) == 0
    assert mismatches(got, v.to(torch.float8_e4m3fn).float()) == 0  # the cast itself


def test_fp8_reference_with_scales_matches_oracle():
    gen = torch.Generator().manual_seed(2)
    n = 1_000_000
    x = torch.cat([special_values(), random_near(n, -20, 20, gen), random_finite(n // 4, gen)])
    s = torch.exp2(torch.randint(-8, 8, x.shape, generator=gen).float()) * (1 + torch.rand(x.shape, generator=gen))
    s[: len(s) // 3] = torch.exp2(torch.randint(-8, 8, (len(s) // 3,), generator=gen).float())  # exact ties survive
    assert mismatches(F.qdq_fp8_e4m3(x, s), oracle_qdq_fp8(x, s)) == 0


def test_fp8_hand_values():
    s1 = torch.tensor(1.0)
    x = torch.tensor([448.0, 17.0, 19.0, 232.0, 2.0**-10, 3 * 2.0**-10, 500.0, -1e30, float("inf"), -0.0, -2.0**-12])
    expected = torch.tensor([448.0, 16.0, 20.0, 224.0, 0.0, 2.0**-8, 448.0, -448.0, 448.0, -0.0, -0.0])
    assert mismatches(F.qdq_fp8_e4m3(x, s1), expected) == 0


def test_fp8_dynamic_scale_is_amax_over_448():
    x = torch.tensor([[3.0, -1.0, 0.5, 0.1]])
    s = torch.tensor(3.0) / 448
    expected = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert mismatches(fake_quant(x, "fp8_e4m3/row"), expected) == 0
    assert fake_quant(x, "fp8_e4m3/row")[0, 0] == 3.0  # amax maps to 448 and back


# ---- INT8, NVFP4, Hadamard-32, log grid: hand-computed values ------------------------
def test_int8_hand_values():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, 254.0, 5.0, 7.0, 1.0],
                      [-0.5, 0.5, 1.5, 126.49, 3.0, -5.0, 0.0, -1.0]])
    # As a state [K=2, V=8], tile16 is one short tile: amax 254 -> s = 2; x/s rounds half to even.
    one_tile = torch.tensor([[128.0, 2.0, 4.0, -2.0, 254.0, 4.0, 8.0, 0.0],
                             [-0.0, 0.0, 2.0, 126.0, 4.0, -4.0, 0.0, -0.0]])
    assert mismatches(fake_quant(x, "int8/tile16"), one_tile) == 0
    assert mismatches(fake_quant(x, "int8/axis:0")[0], one_tile[0]) == 0  # row 0 alone: also s = 2
    # Rows of 4: [127, 2.5, 3.5, -2.5] has s = 1, [254, 5, 7, 1] has s = 2.
    got = fake_quant(x.reshape(2, 2, 4), "int8/row").reshape(2, 8)
    assert mismatches(got[0], torch.tensor([127.0, 2.0, 4.0, -2.0, 254.0, 4.0, 8.0, 0.0])) == 0
    saturating = F.qdq_int8(torch.tensor([200.0, -1e9, float("-inf"), float("inf")]), 1.0)
    assert mismatches(saturating, torch.tensor([127.0, -127.0, -127.0, 127.0])) == 0


def test_nvfp4_hand_values():
    # Global amax 2688 = 6 * 448 -> gs = 1.
    b1 = torch.tensor([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.3, -2.9, 0.1, -6, 4.5, 0.76, 1.3, 0]) * 448
    q1 = torch.tensor([6, 4, 4, 2, 2, 1, 1, 0, 0.5, -3, 0, -6, 4, 1, 1.5, 0]) * 448  # s_b = e4m3(448) = 448
    b2 = torch.zeros(16); b2[:4] = torch.tensor([6.0, 0.25, 0.26, 5.01])  # s_b = e4m3(1) = 1
    q2 = torch.zeros(16); q2[:4] = torch.tensor([6.0, 0.0, 0.5, 6.0])
    b3 = torch.full((16,), 3e-5)  # t = 5e-6 -> e4m3 0 -> s_b = 0 < 1e-5 -> 1 -> 3e-5 rounds to 0
    q3 = torch.zeros(16)
    b4 = torch.zeros(16); b4[:2] = torch.tensor([0.8, 0.2])  # t = 0.1333 -> e4m3 0.140625 = s_b
    q4 = torch.zeros(16); q4[:2] = torch.tensor([6 * 0.140625, 1.5 * 0.140625])
    b5 = torch.zeros(16); b5[:2] = torch.tensor([102.0, 90.0])  # t = 17 -> e4m3 16 (tie to even)
    q5 = torch.zeros(16); q5[:2] = torch.tensor([96.0, 96.0])  # 102/16 = 6.375 -> 6; 90/16 = 5.625 -> 6
    x = torch.stack([b1, b2, b3, b4, b5]).reshape(1, 80)
    expected = torch.stack([q1, q2, q3, q4, q5]).reshape(1, 80)
    assert mismatches(fake_quant(x, "nvfp4/block16"), expected) == 0
    assert quant_scale(x, "nvfp4/block16")[0, ::16].tolist() == [448.0, 1.0, 1.0, 0.140625, 16.0]


def test_nvfp4_e2m1_thresholds():
    v = torch.tensor([0.25, 0.2500001, 0.75, 0.7499999, 1.25, 1.2500001, 1.75, 1.7499999, 2.5, 2.5000002,
                      3.5, 3.4999998, 5.0, 5.0000005, 7.0, float("inf"), -0.1, -3.5])
    q = torch.tensor([0.0, 0.5, 1.0, 0.5, 1.0, 1.5, 2.0, 1.5, 2.0, 3.0, 4.0, 3.0, 4.0, 6.0, 6.0, 6.0, -0.0, -4.0])
    assert mismatches(F.round_e2m1(v), q) == 0


def test_round_half_away():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 126.5, -0.2])
    assert mismatches(F.round_half_away(v), torch.tensor([1.0, 2.0, 3.0, -1.0, -3.0, 0.0, 127.0, -0.0])) == 0


def test_hadamard32_is_sylvester_orthonormal():
    h = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(5):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, 64, dtype=torch.float64)
    expected = (x.reshape(5, 2, 32) @ h.T / math.sqrt(32)).reshape(5, 64)
    assert torch.allclose(F.hadamard32(x.float()).double(), expected, atol=1e-6, rtol=0)
    assert torch.allclose(F.hadamard32(F.hadamard32(x.float())).double(), x, atol=1e-6, rtol=0)


def test_int8_h32_hand_values():
    # One key row, one 32-group: a unit impulse. Rotated: all 32 values are 1/sqrt(32) = 0.1767767.
    # s = 0.1767767/127 = 0.00139194; fp16 -> 1460 * 2^-20 = 0.00139236450195. y/s16 = 126.96 -> 127.
    # Dequantized: 127 * s16 = 0.176830291748 everywhere; rotating back gives impulse * sqrt(32) * that.
    x = torch.zeros(1, 32); x[0, 0] = 1.0
    s16 = 1460 * 2.0**-20
    expected = torch.zeros(1, 32); expected[0, 0] = math.sqrt(32) * 127 * s16  # 1.0003030...
    got = fake_quant(x, "int8_h32/tile32")
    assert abs(got[0, 0].item() - expected[0, 0].item()) < 2e-7
    assert torch.equal(got[0, 1:], torch.zeros(31))
    assert F.h32_scale(torch.tensor(1 / math.sqrt(32))).item() == s16
    assert F.h32_scale(torch.tensor(0.0)).item() == torch.tensor(6e-8).half().float().item()  # floor, not 0


def test_int8_h32_fp16_scale_overflow_gives_nan_group():
    x = torch.randn(1, 2, 64)
    x[0, 0, :32] *= 1e7  # amax > 127 * 65504: fp16(s) = inf, the group turns NaN (loudly)
    got = fake_quant(x, "int8_h32/tile64")
    assert torch.isnan(got[0, 0, :32]).all() and torch.isfinite(got[0, 0, 32:]).all() and torch.isfinite(got[0, 1]).all()


def test_int8_h32_groups_are_per_key_row_and_32_values():
    x = torch.randn(2, 4, 96)
    x[0, 1, 32:64] *= 1000.0  # one loud group: only its own scale changes
    got = fake_quant(x, "int8_h32/tile64")
    quiet = x.clone(); quiet[0, 1, 32:64] = 0.0
    got_quiet = fake_quant(quiet, "int8_h32/tile64")
    keep = torch.ones_like(x, dtype=torch.bool); keep[0, 1, 32:64] = False
    assert torch.equal(got[keep], got_quiet[keep])
    assert ((got - x).norm() / x.norm()).item() < 0.01


def test_log_grid_hand_values():
    g = torch.tensor([-0.125, -0.375, 0.3, -1.0, -0.0, float("-inf")])
    expected = torch.tensor([-0.0, -0.5, 0.25, -1.0, -0.0, float("-inf")])
    assert mismatches(fake_quant(g, "log_grid:0.25"), expected) == 0


# ---- scale groups ------------------------------------------------------------------------
def test_group_amax_matches_explicit_slices():
    x = torch.randn(2, 3, 4, 80)
    amax = group_amax(x, QuantConfig.parse("fp8_e4m3/tile64"))
    for n in range(2):
        for h in range(3):
            assert torch.all(amax[n, h, :, :64] == x[n, h, :, :64].abs().max())
            assert torch.all(amax[n, h, :, 64:] == x[n, h, :, 64:].abs().max())  # the short last tile
    amax = group_amax(x, QuantConfig.parse("int8/block32"))
    assert torch.all(amax[..., 64:] == x[..., 64:].abs().amax(-1, keepdim=True))
    assert torch.all(amax[..., 32:64] == x[..., 32:64].abs().amax(-1, keepdim=True))
    assert torch.all(group_amax(x, QuantConfig.parse("int8/row")) == x.abs().amax(-1, keepdim=True))
    assert torch.all(group_amax(x, QuantConfig.parse("int8/tensor")) == x.abs().max())
    assert torch.all(group_amax(x, QuantConfig.parse("int8/axis:0,-1")) == x.abs().amax((1, 2), keepdim=True))
    with pytest.raises(QuantConfigError, match="axis 4 is out of range"):
        group_amax(x, QuantConfig.parse("int8/axis:4"))


def test_tile_scales_are_independent_per_sequence_and_head():
    x = torch.randn(2, 2, 8, 64)
    x[1, 0] *= 100.0
    got = fake_quant(x, "fp8_e4m3/tile64")
    for n, h in [(0, 0), (0, 1), (1, 1)]:
        assert torch.equal(got[n, h], fake_quant(x[n, h], "fp8_e4m3/tile64"))
    assert quant_scale(x, "fp8_e4m3/tile64")[1, 0, 0, 0] == x[1, 0].abs().max() / 448


# ---- NaN / Inf / zeros -------------------------------------------------------------------
@pytest.mark.parametrize("cfg", ["fp8_e4m3/tile16", "int8/tile16", "fp8_e4m3/row", "int8/block16"])
def test_nan_stays_elementwise_and_inf_poisons_its_group(cfg):
    x = torch.randn(2, 4, 32)
    ref = fake_quant(x, cfg)
    xn = x.clone(); xn[0, 1, 3] = float("nan")
    got = fake_quant(xn, cfg)
    assert torch.isnan(got[0, 1, 3]) and torch.isnan(got).sum() == 1
    xz = x.clone(); xz[0, 1, 3] = 0.0  # NaN is ignored by amax exactly like a 0
    keep = ~torch.isnan(got)
    assert torch.equal(got[keep], fake_quant(xz, cfg)[keep])
    xi = x.clone(); xi[1, 2, 20] = float("inf")
    got = fake_quant(xi, cfg)
    group = group_amax(xi, QuantConfig.parse(cfg)) == float("inf")
    assert group.any() and torch.isnan(got[group]).all()
    assert torch.equal(got[~group], ref[~group])


def test_nan_inf_nvfp4_and_h32():
    x = torch.randn(2, 64)
    xn = x.clone(); xn[0, 5] = float("nan")
    got = fake_quant(xn, "nvfp4/block16")
    assert torch.isnan(got).sum() == 1 and torch.isnan(got[0, 5])
    xi = x.clone(); xi[1, 40] = float("-inf")
    assert torch.isnan(fake_quant(xi, "nvfp4/block16")).all()  # the global scale is infinite
    got = fake_quant(xn, "int8_h32/tile64")
    assert torch.isnan(got[0, :32]).all() and not torch.isnan(got[0, 32:]).any() and not torch.isnan(got[1]).any()
    got = fake_quant(xi, "int8_h32/tile64")
    assert torch.isnan(got[1, 32:]).all() and not torch.isnan(got[1, :32]).any()
    assert torch.isnan(fake_quant(torch.tensor([float("nan"), 1.0]), "log_grid:0.5")[0])


@pytest.mark.parametrize("cfg", ["fp8_e4m3/tile64", "int8/tile64", "nvfp4/block16", "int8_h32/tile64", "fp8_e4m3/tensor"])
def test_all_zero_groups_give_zeros_with_sign(cfg):
    x = torch.zeros(2, 3, 64)
    x[1] = torch.randn(3, 64)
    x[0, 0, :5] = -0.0
    got = fake_quant(x, cfg)
    assert torch.isfinite(got).all()
    assert torch.equal(got[0], torch.zeros(3, 64))
    if cfg != "int8_h32/tile64":  # the Hadamard codec sums signs away
        assert torch.signbit(got[0, 0, :5]).all()


def test_tiny_amax_does_not_divide_by_zero():
    x = torch.tensor([[1e-44, -1e-45, 0.0, 3e-44]])  # amax/448 underflows to 0 -> scale 1
    got = fake_quant(x, "fp8_e4m3/row")
    assert torch.isfinite(got).all() and torch.equal(got.abs(), torch.zeros_like(x))


# ---- dtypes and STE ----------------------------------------------------------------------
def test_dtypes_round_in_fp32_and_return_input_dtype():
    x = torch.randn(3, 64, dtype=torch.float64)
    got = fake_quant(x, "fp8_e4m3/row")
    assert got.dtype == torch.float64
    assert torch.equal(got, fake_quant(x.float(), "fp8_e4m3/row").double())
    xb = torch.randn(3, 64, dtype=torch.bfloat16)
    assert fake_quant(xb, "int8/block32").dtype == torch.bfloat16
    with pytest.raises(TypeError, match="floating-point"):
        fake_quant(torch.ones(3, dtype=torch.int32), "int8/row")


def test_fake_quant_accepts_modelopt_dicts():
    x = torch.randn(2, 3, 16, 64)
    assert torch.equal(fake_quant(x, SEED_STATE_FP8, site="state"), fake_quant(x, "fp8_e4m3/tile64"))
    with pytest.raises(QuantConfigError, match="enable=False"):
        fake_quant(x, {"enable": False}, site="state")


@pytest.mark.parametrize("cfg", ["fp8_e4m3/tile64", "int8/block32", "nvfp4/block16", "int8_h32/tile64",
                                 "fp8_e4m3/row", "log_grid:0.03125"])
def test_identity_ste(cfg):
    x = torch.randn(2, 8, 64, requires_grad=True)
    grad = torch.randn(2, 8, 64)
    fake_quant(x, cfg).backward(grad)
    assert torch.equal(x.grad, grad)


def test_clipped_ste_masks_nan_and_nvfp4_saturation():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    x = x.requires_grad_()
    grad = torch.randn(2, 32)
    fake_quant(x, "fp8_e4m3/row/clip").backward(grad)
    expected = grad.clone(); expected[0, 3] = 0.0
    assert torch.equal(x.grad, expected)
    # NVFP4: block amax 102 with gs = 1 -> s_b = 16 -> 6 * s_b = 96 < 102: 102 is clipped, 90 is not.
    y = torch.zeros(1, 32); y[0, 0], y[0, 1], y[0, 16] = 102.0, 90.0, 2688.0
    y.requires_grad_()
    fake_quant(y, "nvfp4/block16/clip").backward(torch.ones(1, 32))
    assert y.grad[0, 0] == 0 and y.grad[0, 1] == 1 and y.grad[0, 16] == 1 and y.grad.sum() == 31
    y.grad = None
    fake_quant(y, "nvfp4/block16").backward(torch.ones(1, 32))
    assert torch.equal(y.grad, torch.ones(1, 32))
