"""The kernel-selection table: data rows, explicit errors, never a fallback to other numerics."""
import inspect
import re

import pytest
import torch

from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels import registry, selection
from la_compiler.kernels.selection import KernelSelectionError, select_kernel


def choose(spec, head_v=16, **kwargs):
    return select_kernel(spec, device="cpu", dtype=torch.float32, head_k=8, head_v=head_v, **kwargs)


def test_table_is_data_one_row_a_line():
    source = inspect.getsource(selection)
    table = source[source.index("ORDER: tuple[str, ...] = ("):]
    rows = table[: table.index("\n)\n")].splitlines()[1:]
    assert len(rows) == len(selection.ORDER) >= 3
    assert all(re.fullmatch(r'    "\w+",', line) for line in rows), rows
    assert all(registry.registered(name) for name in selection.ORDER), "every row names a registered variant"
    assert selection.ORDER[-1] == "reference" and registry.get_variant("reference").implementation == "torch"


def test_no_variant_fits_is_an_error_naming_every_candidate():
    spec = RecurrenceSpec(kind="gdn", phase="token", quant=(("state", "int8/tensor"),),
                          extra=(("readout", "working"),))
    with pytest.raises(KernelSelectionError) as info:
        choose(spec)
    message = str(info.value)
    assert message.startswith(f"no kernel variant implements {spec} on cpu: ")
    for name in selection.ORDER:
        assert f"{name}: " in message
    assert "reference: phase=token: the reference variant computes prefill only" in message
    prefill_with_options = RecurrenceSpec(kind="gdn", extra=(("decay_log_step", "0.5"),))
    with pytest.raises(KernelSelectionError, match=re.escape("options ['x.decay_log_step'] belong to a decode phase "
                                                             "(phase=token|replay); a prefill spec (phase=none) "
                                                             "takes none")):
        choose(prefill_with_options)  # every prefill row would ignore it


def test_reference_rejects_what_it_cannot_round():
    h32 = RecurrenceSpec(kind="gdn", quant=(("state", "int8_h32/tile64"),))
    with pytest.raises(KernelSelectionError, match=re.escape("reference: the Hadamard-32 state codec needs a value "
                                                             "head dim that is a multiple of 32, got V=16")):
        choose(h32, requested="reference")
    assert choose(h32, head_v=64, requested="reference").variant == "reference"
    tensor_operand = RecurrenceSpec(kind="kda", quant=(("wy_key.lhs", "fp8_e4m3/tensor"),))
    with pytest.raises(KernelSelectionError, match=r"reference: cannot build the rounding of .*q\.wy_key\.lhs="
                                                   r"fp8_e4m3/tensor: GEMM operands and W take row or block"):
        choose(tensor_operand, requested="reference")
    decode = RecurrenceSpec(kind="gdn", phase="token", quant=(("state", "fp8_e4m3/tile64"),))
    with pytest.raises(KernelSelectionError, match=re.escape("reference: phase=token: the reference variant "
                                                             "computes prefill only")):
        choose(decode, requested="reference")


@pytest.mark.parametrize("spec", [
    RecurrenceSpec(kind="gdn", quant=(("state", "fp8_e4m3/tile64"),)),
    RecurrenceSpec(kind="kda", solve="neumann", degree=3, quant=(("w", "nvfp4/block16"),),
                   acc=(("output_value", "bf16:16"),)),
])
def test_reference_applies_state_and_chunk_specs(spec):
    chosen = choose(spec, requested="reference")
    assert chosen.variant == "reference" and "(requested by the policy)" in chosen.reason


def test_requested_and_family_errors():
    spec = RecurrenceSpec(kind="gdn")
    with pytest.raises(KernelSelectionError, match=r"policy backend 'tvm' is not a kernel variant; known: "
                                                   r"\['fla_chunk', 'fused_recurrent'"):
        choose(spec, requested="tvm")
    with pytest.raises(KernelSelectionError, match=re.escape("reference: a torch kernel; the policy asks for "
                                                             "implementation='triton'")):
        choose(spec, requested="reference", family="triton")
    assert choose(spec, family="torch").variant == "reference"
