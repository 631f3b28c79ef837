"""The ``laqat`` command line: look at specs, kernel variants, the selection table and the kernels a spec runs.

    laqat spec 'gdn[src=fla; state=kv; q.state=fp8_e4m3/tile64]'
    laqat kernels
    laqat source 'gdn[src=fla; state=kv; kernel=chunk; q.state=fp8_e4m3/tile64]' [--paths]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def _cmd_spec(args) -> int:
    from la_compiler.quant import QuantConfig
    from la_compiler.quant.config import QuantConfigError
    from la_compiler.spec import RecurrenceSpec, SpecError

    try:
        spec = RecurrenceSpec.parse(args.spec)
        for site, text in spec.quant:
            try:
                QuantConfig.parse(text)
            except QuantConfigError as e:
                raise SpecError(f"q.{site}={text}: {e}") from None
    except SpecError as e:
        print(f"laqat spec: {e}", file=sys.stderr)
        return 2
    print(spec.to_string())
    for field in dataclasses.fields(spec):
        print(f"  {field.name:7s} {getattr(spec, field.name)!r}")
    return 0


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


def _cmd_source(args) -> int:
    from la_compiler.kernels.common.errors import KernelParamsError
    from la_compiler.kernels.sources import constexprs_of_spec, kernel_modules_for_spec

    try:
        modules = kernel_modules_for_spec(args.spec)
        constexprs = constexprs_of_spec(args.spec)
    except (KernelParamsError, ValueError) as e:
        print(f"laqat source: {e}", file=sys.stderr)
        return 2
    # the spec's choices are these constexpr values, not the file's text
    values = ", ".join(f"{name}={value!r}" for name, value in constexprs.items())
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="laqat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("spec", help="parse a spec string and show its fields")
    p.add_argument("spec")
    p.set_defaults(fn=_cmd_spec)
    p = sub.add_parser("kernels", help="list kernel variants and the selection table")
    p.set_defaults(fn=_cmd_kernels)
    p = sub.add_parser("source", help="print the Triton kernels a spec runs (their files) and the constexpr values "
                                      "the spec specializes them with")
    p.add_argument("spec", help="a spec string whose kernel= names a Triton family (chunk, fused_recurrent, "
                                "decode_fused)")
    p.add_argument("--paths", action="store_true", help="print only the files, one per module (and the "
                                                        "constexpr values the spec fixes, if any)")
    p.set_defaults(fn=_cmd_source)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
