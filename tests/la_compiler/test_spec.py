import pytest

from la_compiler.ir.spec import RecurrenceSpec, SpecError


def test_round_trip_and_canonical_order():
    spec = RecurrenceSpec(kind="kda", src="fla", state="vk", solve="neumann", degree=3,
                          quant=(("state", "fp8_e4m3/tile64"), ("w", "fp8_e4m3/row")),
                          acc=(("wy_key", "fp16:16"),), kernel="reference")
    text = spec.to_string()
    assert text.startswith("kda[src=fla; layout=bthd; state=vk; chunk=64; solve=neumann:3; phase=none; kernel=reference")
    assert "q.state=fp8_e4m3/tile64; q.w=fp8_e4m3/row; acc.wy_key=fp16:16" in text
    assert RecurrenceSpec.parse(text) == spec
    assert RecurrenceSpec.parse(text).to_string() == text


def test_a_chunk_size_the_program_passed_is_marked_and_round_trips():
    passed = RecurrenceSpec(kind="gdn", src="fla", chunk=64, chunk_passed=True)
    assert "; chunk=64:passed; " in passed.to_string()
    assert RecurrenceSpec.parse(passed.to_string()) == passed
    default = passed.replace(chunk_passed=False)
    assert "; chunk=64; " in default.to_string() and default != passed


def test_replace_accepts_mappings_and_sorts():
    spec = RecurrenceSpec(kind="gdn").replace(quant={"w": "int8/row", "state": "int8/block32"})
    assert spec.quant == (("state", "int8/block32"), ("w", "int8/row"))
    assert not spec.is_exact
    assert RecurrenceSpec(kind="gdn").is_exact


@pytest.mark.parametrize("fields, message", [
    (dict(kind="mamba"), "kind must be one of"),
    (dict(kind="gdn", layout="bhtd"), "layout must be 'bthd'"),
    (dict(kind="gdn", state="kk"), "state layout"),
    (dict(kind="gdn", solve="neumann"), "degree is required"),
    (dict(kind="gdn", degree=3), "degree is required with solve=neumann and forbidden"),
    (dict(kind="gdn", chunk=48), "power of two"),
    (dict(kind="gdn", quant=(("bogus", "fp8_e4m3/row"),)), "unknown quant site 'bogus'"),
    (dict(kind="gdn", quant=(("w", "a"), ("state", "b"))), "sorted and unique"),
    (dict(kind="gdn", quant=(("w", "has space"),)), "characters outside"),
    (dict(kind="gdn", acc=(("state", "fp16:16"),)), "unknown accumulator site"),
])
def test_invalid_specs_name_the_field(fields, message):
    with pytest.raises(SpecError, match=message):
        RecurrenceSpec(**fields)


@pytest.mark.parametrize("text, message", [
    ("gdn(src=fla)", "not a laqat spec string"),
    ("gdn[src]", "is not key=value"),
    ("gdn[color=blue]", "unknown spec key 'color'"),
    ("gdn[chunk=64:given]", "the only mark after the size is ':passed'"),
])
def test_parse_errors(text, message):
    with pytest.raises(SpecError, match=message):
        RecurrenceSpec.parse(text)
