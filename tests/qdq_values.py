"""Test inputs and oracles for QDQ: fp32 values of every class that rounding can trip on,
and an E4M3 rounding oracle built from the format's definition (not from torch's cast)."""
import torch

FP8_MAX = 448.0


def e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite E4M3 values, ascending; index parity = mantissa parity."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # the NaN pattern of float8_e4m3fn
            vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def oracle_round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of fp32 v (|v| <= 448), ties to even mantissa, sign kept, NaN kept."""
    grid = e4m3_grid()
    a = v.abs().double()
    a_safe = torch.nan_to_num(a, nan=0.0).clamp(max=FP8_MAX)
    hi = torch.searchsorted(grid, a_safe).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a_safe - grid[lo], grid[hi] - a_safe
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    q = torch.where(pick_hi, grid[hi], grid[lo])
    q = torch.copysign(q, v.double())
    return torch.where(torch.isnan(v), v.double(), q)


def oracle_qdq_fp8(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """clamp(x/s) rounded by the oracle, times s, with the product rounded once to fp32."""
    v = (x / s).clamp(-FP8_MAX, FP8_MAX)
    return (oracle_round_e4m3(v) * s.double()).to(torch.float32)


def _from_bits(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def special_values() -> torch.Tensor:
    """Ties, near-ties, binade edges, subnormals, saturation, zeros (both signs), in E4M3 units."""
    grid = e4m3_grid().float()
    mids = ((grid[1:].double() + grid[:-1].double()) / 2).float()  # exact ties (fit in fp32)
    pows = torch.exp2(torch.arange(-24, 12, dtype=torch.float32))
    base = torch.cat([grid, mids, pows, torch.tensor([448.0, 464.0, 480.0, 500.0, 1e4, 3.0e38])])
    below = torch.nextafter(base, torch.zeros_like(base))
    above = torch.nextafter(base, torch.full_like(base, float("inf")))
    fp32_subnormals = _from_bits([1, 2, 3, 0x3FFFFF, 0x400000, 0x7FFFFF, 0x800000])
    vals = torch.cat([base, below, above, fp32_subnormals, torch.tensor([0.0])])
    return torch.cat([vals, -vals])


def random_finite(n: int, generator=None) -> torch.Tensor:
    """Uniformly random fp32 bit patterns, finite, all exponents."""
    bits = torch.randint(0, 0x7F800000, (n,), generator=generator, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64) << 31
    return _from_bits(bits | sign)


def random_near(n: int, lo_exp: int, hi_exp: int, generator=None) -> torch.Tensor:
    """Random fp32 with exponents in [lo_exp, hi_exp), all mantissas, both signs."""
    e = torch.randint(lo_exp + 127, hi_exp + 127, (n,), generator=generator, dtype=torch.int64)
    m = torch.randint(0, 1 << 23, (n,), generator=generator, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64) << 31
    return _from_bits((e << 23) | m | sign)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: identical fp32 bit patterns, any NaN equal to any NaN."""
    a, b = a.float().cpu(), b.float().cpu()
    return (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((~same_bits(a, b)).sum())
