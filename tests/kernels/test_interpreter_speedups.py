"""The suite's interpreter speed-ups (tests/interpreter_speedups.py) compute what Triton's interpreter computes:
the GDN chunk kernels' forward and backward with every operand site, the state and W rounded to FP8 (device
functions, reductions, fp8 and index dtypes, varlen with an empty sequence), bit for bit against the same
launches run by Triton's own functions."""
import os

import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.chunk.bwd import chunk_bwd
from la_compiler.kernels.chunk.fwd import chunk_fwd
from la_compiler.kernels.chunk.params import ChunkParams
from tests import interpreter_speedups
from tests.kernels.chunk_checks import ALL_FP8, chunk_case

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


def test_the_speedups_apply_to_this_triton():
    assert interpreter_speedups.installed(), (
        "Triton's interpreter is not the one tests/interpreter_speedups.py was checked against: check the "
        "replaced functions against the new source, then update CHECKED_SOURCE")


def test_kernels_compute_the_same_as_with_tritons_own_functions():
    inputs, cu = chunk_case("gdn", True, "kv")
    params = ChunkParams.from_spec(RecurrenceSpec(kind="gdn", chunk=8).replace(quant=ALL_FP8))
    do, dht = torch.randn(inputs[2].shape), torch.randn(inputs[5].shape)

    def run():
        return [*chunk_fwd(params, *inputs[:5], 0.4, inputs[5], cu),
                *chunk_bwd(params, *inputs[:5], 0.4, do, dht, inputs[5], cu)]

    skipped = interpreter_speedups.skipped_patches
    fast = run()
    assert interpreter_speedups.skipped_patches > skipped  # the speed-ups ran
    skipped = interpreter_speedups.skipped_patches
    with interpreter_speedups.triton_originals():
        plain = run()
    assert interpreter_speedups.skipped_patches == skipped  # Triton's own functions ran
    assert len(fast) == len(plain) == 8
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"], fast, plain):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name  # every bit
