"""Shared test helpers: relative L2 error and NaN-filled outputs."""
import torch


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    return (actual - expected).norm().item() / (denom if denom > 0 else 1.0)


def assert_close_rel(actual, expected, tol, name=""):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_l2(actual, expected)
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol:.1e}"
