"""The ``laqat`` command line: the shipped recipes, checking a policy file (against a model's layers too), and
looking at specs, kernel variants, the selection table and the kernels a spec runs.

    laqat recipes [NAME]
    laqat policy check FILE [--model NAME_OR_CONFIG] [--strict]
    laqat policy schema
    laqat spec 'gdn[src=fla; state=kv; q.state=fp8_e4m3/tile64]'
    laqat kernels
    laqat source 'gdn[src=fla; state=kv; q.state=fp8_e4m3/tile64]' [--device cuda] [--paths]
    laqat --version

Output goes to stdout and pipes cleanly (``laqat source SPEC | head`` ends quietly); errors go to stderr with exit
status 2 (a bad argument, an invalid policy) or 1 (``policy check``: a layer the policy cannot compile, or with
``--strict`` a warning).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path

# Linear-attention layer classes laqat rewrites, by class name (transformers' torch fallbacks, FLA's layers,
# Megatron-Core's GatedDeltaNet): what `laqat policy check --model` resolves the policy for, without tracing.
LAYER_CLASSES = {
    "GatedDeltaNet": "gdn", "Qwen3NextGatedDeltaNet": "gdn", "Qwen3_5GatedDeltaNet": "gdn",
    "Qwen3_5MoeGatedDeltaNet": "gdn", "Qwen4ExpTextGatedDeltaNet": "gdn", "LaraMiniGatedDeltaNet": "gdn",
    "OlmoHybridGatedDeltaNet": "gdn", "KimiDeltaAttention": "kda", "KimiLinearDeltaAttention": "kda",
    "Glm5NextTextLinearAttention": "kda", "BailingHybridDeltaAttention": "kda",
}


def _fail(command: str, message) -> int:
    print(f"laqat {command}: {message}", file=sys.stderr)
    return 2


# ---- laqat recipes ----------------------------------------------------------------------------

def _cmd_recipes(args) -> int:
    from la_compiler.policy.file_format import PolicyError
    from la_compiler.policy.resolution import load_recipe
    from la_compiler.recipes import SERVES, recipe_names, recipe_path

    if args.name is not None:
        try:
            path = recipe_path(args.name)
        except PolicyError as e:
            return _fail("recipes", e)
        print(f"# {path}")
        print(path.read_text(), end="")
        return 0
    for name in recipe_names():
        policy = load_recipe(name)
        print(name)
        print(f"  rounds: {policy.description}")
        print(f"  serves: {SERVES.get(name, '(not said)')}")
    print("\n`laqat recipes NAME` prints a recipe's file; options={'policy': NAME} or "
          "la_compiler.attach_policy(model, NAME) uses it.")
    return 0


# ---- laqat policy check / schema -------------------------------------------------------------

def _cmd_policy_schema(args) -> int:
    from la_compiler.policy.json_schema import SCHEMA_PATH

    print(SCHEMA_PATH.read_text(), end="")
    return 0


def _cmd_policy_check(args) -> int:
    from la_compiler.policy.file_format import PolicyError
    from la_compiler.policy.resolution import load_policy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            policy = load_policy(args.file, key="FILE")
        except PolicyError as e:
            return _fail("policy check", f"invalid: {e}")
    laqat_warnings = [str(w.message) for w in caught if type(w.message).__module__.startswith("la_compiler")]
    print(f"policy {policy.name!r} ({args.file}): valid, {len(policy.quant_cfg)} quant_cfg and "
          f"{len(policy.linear_attention)} linear_attention rule(s)")
    errors = 0
    if args.model is not None:
        try:
            model, source = _model_from(args.model)
        except (ValueError, OSError, ImportError) as e:
            return _fail("policy check", f"--model {args.model}: {e}")
        layers = [(name, LAYER_CLASSES[type(m).__name__]) for name, m in model.named_modules()
                  if type(m).__name__ in LAYER_CLASSES]
        print(f"model: {type(model).__name__} ({source}): {len(layers)} linear-attention layer(s)")
        if not layers:
            print(f"  none of its modules is a class laqat rewrites ({', '.join(sorted(LAYER_CLASSES))})")
        errors = _check_on_layers(policy, layers)
        if layers:
            laqat_warnings += [m.replace(" in this graph", " of this model")
                               for m in policy.unmatched_rules(layers, reachable_only=True)]
    for message in laqat_warnings:
        print(f"warning: {message}")
    if errors or (args.strict and laqat_warnings):
        return 1
    return 0


def compact(names: list[str]) -> str:
    """Module names with one varying index written once: ``model.layers.{0-3,5}.attn``."""
    import re

    groups: dict[tuple[str, str], list[int]] = {}
    order = []
    for name in names:
        m = re.search(r"(?:^|\.)(\d+)(?=\.|$)", name)
        key = (name[:m.start(1)], name[m.end(1):]) if m else (name, None)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m.group(1)))
    out = []
    for head, tail in order:
        indices = groups[(head, tail)]
        if tail is None:
            out.append(head)
        elif len(indices) == 1:
            out.append(f"{head}{indices[0]}{tail}")
        else:
            runs, start = [], indices[0]
            for prev, cur in zip(indices, indices[1:] + [None]):
                if cur != prev + 1:
                    runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                    start = cur
            out.append(f"{head}{{{','.join(runs)}}}{tail}")
    return ", ".join(out)


def _check_on_layers(policy, layers) -> int:
    """Prints, for each rule, the layers it matches, and for each layer what the policy resolves to; returns how
    many layers it cannot resolve."""
    import fnmatch

    from la_compiler.policy.file_format import PolicyError
    from la_compiler.policy.quantizer_names import quantizer_name, quantizer_sites

    print("rules:")
    for i, rule in enumerate(policy.quant_cfg):
        groups: dict[tuple[str, ...], list[str]] = {}
        for module, kind in layers:
            hit = tuple(q for q in quantizer_sites(kind) if fnmatch.fnmatchcase(quantizer_name(module, q),
                                                                               rule.quantizer_name))
            if hit:
                whole = len(hit) == len(quantizer_sites(kind))
                groups.setdefault(("every quantizer",) if whole else hit, []).append(module)
        what = "; ".join(f"{', '.join(q)} of {compact(modules)}" for q, modules in groups.items()) or "nothing"
        print(f"  quant_cfg[{i}] ({rule.quantizer_name!r}, {'cfg' if rule.cfg is not None else 'enable'}"
              f"{'' if rule.enables else ', off'}): {what}")
    for i, rule in enumerate(policy.linear_attention):
        won = [module for module, _ in layers if (policy.module_rule(module) or (None,))[0] == i]
        matched = [module for module, _ in layers if fnmatch.fnmatchcase(module, rule.module_name)]
        lost = [m for m in matched if m not in won]
        print(f"  linear_attention[{i}] ({rule.module_name!r}): {compact(won) or 'nothing'}"
              + (f" (also matches {compact(lost)}, where a later rule wins)" if lost else ""))
    print("layers:")
    errors = 0
    resolved: dict[str, list[str]] = {}
    for module, kind in layers:
        try:
            res = policy.resolve(module, kind)
        except PolicyError as e:
            resolved.setdefault(f"({kind}): error: {e}", []).append(module)
            errors += 1
            continue
        fields = [f"q.{site}={fmt}" for site, fmt in res.quant] + [f"acc.{site}={a}" for site, a in res.acc]
        fields += [f"chunk={res.chunk}", f"solve={res.solve}" + (f":{res.degree}" if res.degree else ""),
                   f"phase={res.phase}"] + [f"x.{k}={v}" for k, v in res.extra] + [f"n.{k}={v}" for k, v in
                                                                                   res.numerics]
        if res.backend:
            fields.append(f"kernel={res.backend}")
        resolved.setdefault(f"({kind}): {'; '.join(fields)}", []).append(module)
    for what, modules in resolved.items():
        print(f"  {compact(modules)} {what}")
    return errors


def _model_from(spec: str):
    """A model built on the meta device (no memory, no weights) from a config.json, a directory holding one, or a
    transformers / FLA model type; (model, where its config came from)."""
    import torch
    import transformers

    if os.path.exists(spec):
        config = transformers.AutoConfig.from_pretrained(spec)
        source = spec
    else:
        config = _config_for_type(spec)
        source = f"the default {spec} config"
    classes = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    with torch.device("meta"):
        for cls in [c for c in classes if c is not None]:
            return cls(config), source
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(config), source
            except ValueError:
                continue
    raise ValueError(f"transformers builds no model from a {type(config).__name__}")


def _config_for_type(model_type: str):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from la_compiler.suggest import did_you_mean

    if model_type not in CONFIG_MAPPING:
        try:
            import fla.models  # noqa: F401  (registers FLA's model types with transformers)
        except ImportError:
            pass
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"neither a path nor a model type transformers knows{did_you_mean(model_type, CONFIG_MAPPING)}"
                         f" (a config.json, a directory holding one, or a model type such as qwen3_5_text)")
    return transformers.AutoConfig.for_model(model_type)


# ---- laqat spec / kernels / source ----------------------------------------------------------

_SPEC_FIELDS = {"kind": "gdn or kda", "src": "the frontend that produced the node", "layout": "the inputs' layout",
                "state": "the state's layout (kv, or vk: V first)", "chunk": "the chunk length",
                "chunk_passed": "the program passed the chunk length (a policy may not replace it)",
                "solve": "the WY triangular solve", "degree": "its Neumann degree", "phase": "the decode phase",
                "kernel": "the kernel variant (auto: the selection table chooses)"}


def _cmd_spec(args) -> int:
    from la_compiler.quant import QuantConfig
    from la_compiler.quant.config import QuantConfigError
    from la_compiler.ir.spec import RecurrenceSpec, SpecError

    try:
        spec = RecurrenceSpec.parse(args.spec)
        for site, text in spec.quant:
            try:
                QuantConfig.parse(text)
            except QuantConfigError as e:
                raise SpecError(f"q.{site}={text}: {e}") from None
    except SpecError as e:
        return _fail("spec", e)
    print(spec.to_string())
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name in _SPEC_FIELDS:
            if value is not None and value is not False:  # degree without Neumann, chunk_passed unset: not shown
                print(f"  {field.name:22s} {value!s:18s} {_SPEC_FIELDS[field.name]}")
            continue
        prefix = {"quant": "q.", "acc": "acc.", "extra": "x.", "numerics": "n.", "tuning": "t."}[field.name]
        for key, text in value:
            print(f"  {prefix + key:22s} {text:18s} {_describe_item(prefix, key, text)}")
    return 0


def _describe_item(prefix: str, key: str, text: str) -> str:
    if prefix == "q.":
        return f"quantizer of site {key}"
    if prefix == "acc.":
        return f"{text.split(':')[0]} accumulator of {key}, rounded every {text.split(':')[1]} products"
    return {"x.": "decode option (docs/options.md)", "n.": "numerics option (docs/options.md)",
            "t.": "tuning option (docs/options.md)"}[prefix]


def _cmd_kernels(args) -> int:
    from la_compiler.kernels.registry import get_variant, registered, variant_names
    from la_compiler.kernels.selection import ORDER

    print("kernel variants:")
    for name in variant_names():
        print(f"  {name:18s} {get_variant(name).description}")
    print("selection table (the first variant that supports a spec wins):")
    for i, name in enumerate(ORDER):
        summary = get_variant(name).summary if registered(name) else "(not registered in this build)"
        print(f"  {i}. {name:18s} {summary}")
    return 0


def _resolve_auto(spec, args):
    """``kernel=auto`` resolved as the lower pass would on ``args.device`` / dtype / head dims / length."""
    import torch

    from la_compiler.kernels.selection import select_kernel

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    head_k, _, head_v = (args.head_dims or "128").partition("x")
    head_k, head_v = int(head_k), int(head_v or head_k)
    choice = select_kernel(spec, device=device, dtype=dtype, head_k=head_k, head_v=head_v, seq_len=args.seq_len)
    where = (f"{device}, {str(dtype).removeprefix('torch.')}, head dims {head_k}x{head_v}"
             + (f", {args.seq_len} tokens" if args.seq_len else ""))
    return spec.replace(kernel=choice.variant), f"kernel=auto selects {choice.variant} on {where}: {choice.reason}"


def _cmd_source(args) -> int:
    from la_compiler.kernels.common.errors import KernelParamsError
    from la_compiler.kernels.selection import KernelSelectionError
    from la_compiler.kernels.sources import constexprs_of_spec, kernel_modules_for_spec
    from la_compiler.ir.spec import RecurrenceSpec

    chosen = None
    try:
        spec = RecurrenceSpec.parse(args.spec)
        if spec.kernel == "auto":
            spec, chosen = _resolve_auto(spec, args)
        modules = kernel_modules_for_spec(spec)
        constexprs = constexprs_of_spec(spec)
    except (KernelParamsError, KernelSelectionError, ValueError) as e:
        return _fail("source", f"{chosen}; {e}" if chosen else e)
    # the spec's choices are these constexpr values, not the file's text
    values = ", ".join(f"{name}={value!r}" for name, value in constexprs.items())
    if chosen:
        print(f"# {chosen}" if not args.paths else f"kernel: {spec.kernel} ({chosen})")
    for role, module in modules.items():
        path = Path(module.__file__)
        if args.paths:
            print(f"{role}: {path}")
        elif constexprs:
            print(f"# ---- {role}: {path}\n# specialized by the spec with tl.constexpr {values} "
                  f"(the inputs fix the other flags at launch)\n{path.read_text()}")
        else:
            print(f"# ---- {role}: {path}\n{path.read_text()}")
    if args.paths and constexprs:
        print(f"constexpr: {values}")
    return 0


# ---- the parser ---------------------------------------------------------------------------------

def _version() -> str:
    from importlib import metadata

    import la_compiler

    versions = []
    for package in ("torch", "triton"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"laqat {la_compiler.__version__} ({', '.join(versions)})"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laqat", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("recipes", help="list the shipped recipes: what each rounds, which serving setting it matches")
    p.add_argument("name", nargs="?", help="print this recipe's YAML file instead")
    p.set_defaults(fn=_cmd_recipes)

    p = sub.add_parser("policy", help="check a policy file, print the policy file's JSON Schema")
    policy = p.add_subparsers(dest="policy_command", required=True)
    c = policy.add_parser("check", help="validate a policy (everything the loader checks); with --model, also "
                                        "resolve it for every linear-attention layer of a model and show which "
                                        "layers each rule matches")
    c.add_argument("file", help="a .yaml / .json policy file, or a recipe name")
    c.add_argument("--model", metavar="NAME_OR_CONFIG",
                   help="a transformers config.json, a directory holding one, or a model type (qwen3_5_text, "
                        "kimi_linear, FLA's gated_deltanet, ...): the model is built on the meta device, no weights")
    c.add_argument("--strict", action="store_true", help="exit with status 1 on a warning too (a rule that "
                                                         "matches nothing)")
    c.set_defaults(fn=_cmd_policy_check)
    c = policy.add_parser("schema", help="print the JSON Schema of a policy file (editors complete and check YAML "
                                         "with it)")
    c.set_defaults(fn=_cmd_policy_schema)

    p = sub.add_parser("spec", help="parse a spec string and show its fields")
    p.add_argument("spec")
    p.set_defaults(fn=_cmd_spec)
    p = sub.add_parser("kernels", help="list kernel variants and the selection table")
    p.set_defaults(fn=_cmd_kernels)
    p = sub.add_parser("source", help="print the Triton kernels a spec runs (their files) and the constexpr values "
                                      "the spec specializes them with")
    p.add_argument("spec", help="a spec string; kernel=auto (or none) is resolved by the selection table for "
                                "--device, --dtype, --head-dims, --seq-len")
    p.add_argument("--paths", action="store_true", help="print only the files, one per module (and the "
                                                        "constexpr values the spec fixes, if any)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where kernel=auto is resolved (default: cuda if "
                                                              "this machine has it, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"),
                   help="the inputs' dtype for kernel=auto (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--head-dims", metavar="K[xV]", help="head dims for kernel=auto (default: 128)")
    p.add_argument("--seq-len", type=int, help="sequence length for kernel=auto (default: not known)")
    p.set_defaults(fn=_cmd_source)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader left (`laqat source SPEC | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit writes nowhere
        return 0


if __name__ == "__main__":
    sys.exit(main())
