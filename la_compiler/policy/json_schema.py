"""The JSON Schema of a policy file, generated from the definitions the loader checks against.

    python -m la_compiler.policy.json_schema            print it
    python -m la_compiler.policy.json_schema --write    write la_compiler/policy/policy.schema.json (a test checks it)
    laqat policy schema                                 print it

Every key, enum and range comes from where the checks read it: the policy's top and rule keys
(``la_compiler.policy.file_format``), each ``linear_attention`` field's metadata (``file_format.setting``; the
``numerics`` fields' ``la_compiler.options.option``), and ModelOpt's quantizer cfg keys and values
(``la_compiler.quant.config``: ``MODELOPT_KEYS``, ``MODELOPT_VALUES``, ``NUM_BITS``). What the schema cannot say
(one field's value depending on another's) the loader still checks; a power of two without an upper bound is
listed up to 2^16. Editors that
speak JSON Schema (VS Code's and other YAML language servers) complete and check a policy file with a first line
``# yaml-language-server: $schema=<path to policy.schema.json>``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from la_compiler.ir.spec import GEMM_SITES
from la_compiler.policy.file_format import (MODULE_RULE_KEYS, POLICY_VERSION, PRECISIONS, QUANT_RULE_KEYS, TOP_KEYS,
                                            AccCfg, LinearAttentionCfg)
from la_compiler.policy.quantizer_names import all_quantizers
from la_compiler.quant.config import BLOCK_SPECIAL_KEYS, MODELOPT_KEYS, MODELOPT_VALUES, NUM_BITS

SCHEMA_PATH = Path(__file__).resolve().parent / "policy.schema.json"

_TOP_DOCS = {
    "version": "the schema version this file is written in (optional)",
    "name": "the policy's name (default: the file's stem)",
    "description": "what the policy rounds",
    "algorithm": "ModelOpt's calibration algorithm: laqat's scales are dynamic, so it must be null",
    "quant_cfg": "ordered quantizer rules: each applies to every quantizer its glob matches, later entries win",
    "linear_attention": "ordered execution policies: for each module the last rule whose module_name matches wins, "
                        "as a whole",
}


def _json_value(value):
    return [_json_value(v) for v in value] if isinstance(value, tuple) else value


def _enum(choices) -> dict:
    return {"enum": [_json_value(c) for c in choices]}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _field_schema(f: dataclasses.Field, defs: dict) -> dict:
    meta = f.metadata
    kind = meta.get("kind", "choice")  # options.option(): choices only
    choices = meta.get("choices")
    if f.name == "matmul":
        schema = {"type": "object", "additionalProperties": False,
                  "properties": {site: {"$ref": "#/$defs/AccCfg"} for site in GEMM_SITES}}
        _config_schema(defs, AccCfg)
    elif f.name == "version":  # serving.version: a string, YAML's number, or vLLM's x.y.0
        schema = {"anyOf": [_enum([*choices, *(f"{v}.0" for v in choices)]), _enum([float(v) for v in choices])]}
    elif kind in ("choice", "custom"):
        schema = _enum(choices)
    elif kind == "int":
        schema = {"type": "integer"}
        if meta["pow2"]:  # without an upper bound: the powers of two up to 2^16 (beyond any reduction laqat runs)
            hi = meta["hi"] if meta["hi"] is not None else 2 ** 16
            choices = tuple(2 ** i for i in range(hi.bit_length()) if 2 ** i >= (meta["lo"] or 1))
        if choices is not None:
            schema.update(_enum(choices))
        else:
            schema.update({k: v for k, v in (("minimum", meta["lo"]), ("maximum", meta["hi"])) if v is not None})
    elif kind == "bool":
        schema = {"type": "boolean"}
    elif kind == "number":
        schema = {"type": "number", "exclusiveMinimum": 0}
    elif kind == "str":
        schema = {"type": "string", "minLength": 1}
    elif kind == "config":
        schema = {"$ref": f"#/$defs/{_config_schema(defs, meta['cls'])}"}
    else:
        raise ValueError(f"{f.name}: no JSON Schema for field kind {kind!r}")
    if meta.get("optional") and kind != "choice":
        schema = _nullable(schema)
    schema = dict(schema)
    schema["description"] = meta["doc"]
    if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default) and f.name != "matmul":
        schema["default"] = _json_value(f.default)
    return schema


def _config_schema(defs: dict, cls) -> str:
    """Adds the schema of a config dataclass (its fields) to ``defs``; returns its name there."""
    name = cls.__name__
    if name not in defs:
        defs[name] = {}  # reserved first: nested configs refer to each other by name
        fields = dataclasses.fields(cls)
        schema = {"type": "object", "additionalProperties": False,
                  "properties": {f.name: _field_schema(f, defs) for f in fields}}
        required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is
                    dataclasses.MISSING]
        if required:
            schema["required"] = required
        if cls.__doc__ and not cls.__doc__.startswith(f"{name}("):
            schema["description"] = " ".join(cls.__doc__.split())
        defs[name] = schema
    return name


def _modelopt_cfg_schema() -> dict:
    bits = [b for spellings in NUM_BITS.values() for b in spellings]
    properties: dict = {
        "enable": {"type": "boolean", "description": "false switches the quantizer off"},
        "num_bits": {**_enum(bits), "description": "(4, 3) / e4m3: FP8 E4M3; 8 / int8: INT8; (2, 1) / e2m1: NVFP4 "
                                                   "(with block_sizes {-1: 16, type: dynamic, scale_bits: (4, 3)})"},
        "axis": {"anyOf": [{"type": "null"}, {"type": "integer"}, {"type": "array", "items": {"type": "integer"}}],
                 "description": "kept axes: (0, 1) at the state = one scale per [K x block_v] tile; (0, 1, 2) at W / "
                                "GEMM operands = one scale per row of the reduction"},
        "block_sizes": {"type": "object", "additionalProperties": False,
                        "patternProperties": {"^-?[0-9]+$": {"type": ["integer", "null"]}},
                        "properties": {"type": _enum(MODELOPT_VALUES["type"][0]),
                                       "scale_bits": _enum([(4, 3)]), "scale_block_sizes": {"type": "null"}},
                        "description": "{-1: N}: one scale per N values along the last axis (16 or 32)"},
        "rotate": {"anyOf": [{"type": "boolean"}, {"type": "object", "additionalProperties": False,
                                                   "properties": {"enable": {"type": "boolean"}}}],
                   "description": "true with INT8 at the state: ReplaySSM's Hadamard-32 codec"},
    }
    assert set(BLOCK_SPECIAL_KEYS) == set(properties["block_sizes"]["properties"])
    for key, (allowed, default) in MODELOPT_VALUES.items():
        properties[key] = {**_enum(allowed), "default": default}
    assert list(properties) and set(properties) == set(MODELOPT_KEYS), sorted(set(MODELOPT_KEYS) ^ set(properties))
    return {"type": "object", "additionalProperties": False, "properties": {k: properties[k] for k in MODELOPT_KEYS},
            "description": "a ModelOpt quantizer config; laqat's scales are dynamic (type: dynamic)"}


def schema() -> dict:
    defs: dict = {}
    la_cfg = defs[_config_schema(defs, LinearAttentionCfg)]
    la_cfg["properties"]["precision"] = {
        **_enum(PRECISIONS), "description": "ModelOpt's spelling of a serving profile: vllm = serving: {}, "
                                            "vllm_kimi_k3 = serving: {model: kimi_k3}, replayssm = ReplaySSM's "
                                            "decode emulation"}
    defs["ModelOptQuantizerCfg"] = _modelopt_cfg_schema()
    names = sorted({q if not q.startswith("linear_attn_sites.") else "linear_attn_sites.<site>.lhs_quantizer / "
                    "rhs_quantizer" for q in all_quantizers()})
    defs["QuantRule"] = {
        "type": "object", "additionalProperties": False, "required": ["quantizer_name"],
        "anyOf": [{"required": ["cfg"]}, {"required": ["enable"]}],
        "properties": {
            "quantizer_name": {"type": "string", "minLength": 1,
                               "description": "an fnmatch glob over quantizer names <module>.<quantizer>, <quantizer> "
                                              "one of " + ", ".join(names)},
            "cfg": _nullable({"$ref": "#/$defs/ModelOptQuantizerCfg"}),
            "enable": {"type": "boolean"}},
    }
    assert tuple(defs["QuantRule"]["properties"]) == QUANT_RULE_KEYS
    defs["ModuleRule"] = {
        "type": "object", "additionalProperties": False, "required": ["module_name"],
        "properties": {"module_name": {"type": "string", "minLength": 1,
                                       "description": "an fnmatch glob over module names, e.g. model.layers.*.attn"},
                       "cfg": _nullable({"$ref": "#/$defs/LinearAttentionCfg"})},
    }
    assert tuple(defs["ModuleRule"]["properties"]) == MODULE_RULE_KEYS
    top = {"version": {"const": POLICY_VERSION}, "name": {"type": "string", "minLength": 1},
           "description": {"type": "string"}, "quant_cfg": _nullable({"type": "array", "items": {
               "$ref": "#/$defs/QuantRule"}}),
           "linear_attention": _nullable({"type": "array", "items": {"$ref": "#/$defs/ModuleRule"}}),
           "algorithm": {"type": "null"}}
    assert tuple(top) == TOP_KEYS
    for key, doc in _TOP_DOCS.items():
        top[key]["description"] = doc
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"laqat policy ({POLICY_VERSION})",
            "description": "Which numerics each GDN/KDA recurrence gets (docs/policy.md). Generated by "
                           "`python -m la_compiler.policy.json_schema --write`.",
            "type": "object", "additionalProperties": False, "properties": top, "$defs": dict(sorted(defs.items()))}


def render() -> str:
    return json.dumps(schema(), indent=1) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {SCHEMA_PATH.name} instead of printing it")
    args = parser.parse_args()
    if args.write:
        SCHEMA_PATH.write_text(render())
        print(f"wrote {SCHEMA_PATH}")
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
