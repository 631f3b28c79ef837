"""The shipped JSON Schema of a policy file: generated from the loader's own definitions, current, and it agrees
with the loader on every recipe and on every misspelt key and out-of-range value."""
import json

import pytest
import yaml

from la_compiler.policy.file_format import PolicyError
from la_compiler.policy.json_schema import SCHEMA_PATH, render
from la_compiler.policy.resolution import Policy
from la_compiler.recipes import recipe_names, recipe_path
from tests.la_compiler.test_policy_validation import LOAD_ERRORS

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def as_json(config):
    """A policy as an editor's YAML language server sees it: JSON data (integer keys become strings)."""
    return json.loads(json.dumps(config))


def test_the_shipped_schema_is_current():
    assert SCHEMA_PATH.read_text() == render(), "run `python -m la_compiler.policy.json_schema --write`"


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_file_and_its_round_trip_is_valid(validator, name):
    validator.validate(as_json(yaml.safe_load(recipe_path(name).read_text())))
    validator.validate(as_json(Policy.from_file(recipe_path(name)).to_dict()))


# the loader's errors that a schema can state: a key, a type, an enum, a range (not one field against another)
SCHEMA_STATES = ("unknown key", "must be one of", "must be an integer", "must be true or false",
                 "must be a non-empty string", "must be a list", "must be a mapping", "must be in", "required (",
                 "must be null", "this laqat reads policies of version", "must be a positive finite number",
                 "must be a positive power of two")


@pytest.mark.parametrize("config, message", [(c, m) for c, m in LOAD_ERRORS if any(s in m for s in SCHEMA_STATES)],
                         ids=lambda x: x[:48] if isinstance(x, str) else "")
def test_the_schema_refuses_what_the_loader_refuses_by_key_or_value(validator, config, message):
    with pytest.raises(PolicyError):
        Policy.from_dict(config)
    assert not validator.is_valid(as_json(config)), message


@pytest.mark.parametrize("config", [
    {"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bit": 8, "type": "dynamic"}}]},
    {"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": "e4m4", "type": "dynamic"}}]},
    {"quant_cfg": [{"quantizer_name": "*gdn_state_quantizer", "cfg": {"num_bits": 8, "type": "dynamc"}}]},
    {"linear_attention": [{"module_name": "*", "cfg": {"numerics": {"gemm": "tf16"}}}]},
    {"linear_attention": [{"module_name": "*", "cfg": {"serving": {"engine": "sglang"}}}]},
    {"linear_attention": [{"module_name": "*", "cfg": {"precision": "vlm"}}]},
])
def test_the_schema_refuses_a_typo_inside_a_cfg(validator, config):
    with pytest.raises(PolicyError):
        Policy.from_dict(config)
    assert not validator.is_valid(as_json(config))
