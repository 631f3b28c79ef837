"""The lower pass: the kernel-selection table picks one kernel variant per laqat node.

On CUDA it also says where the table sent a node to a slow kernel that nobody pinned (a policy's ``backend:`` /
``implementation:``, or the node's own spec naming that kernel): the fp64 torch reference (a variant of
implementation "torch"), or a token-by-token Triton kernel (``selection.TOKEN_BY_TOKEN``) on a sequence longer than
``FUSED_RECURRENT_MAX_TOKENS_ON_CUDA`` tokens or of symbolic length. Where a Triton kernel runs the node's inputs
(the same recurrence without the spec's numerics fields) and only those fields keep it off, the reference is
refused: ``NoFastKernelError`` names the layers, the fields and what to do. Otherwise (float64 inputs, head dims no
Triton kernel holds, a token-by-token kernel) one ``SlowKernelWarning`` per compiled graph names every such layer,
its kernel, why the faster ones were rejected and what it costs (docs/policy.md, "Kernel selection"). Nothing is
said on the CPU, where the Triton kernels run in the interpreter.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from la_compiler.errors import SlowKernelWarning, warn_at_caller
from la_compiler.ir.delta_rule import is_delta_rule
from la_compiler.ir.spec import RecurrenceSpec
from la_compiler.kernels.recurrent.variant import FUSED_RECURRENT_MAX_TOKENS_ON_CUDA
from la_compiler.kernels.registry import get_variant
from la_compiler.kernels.selection import (TOKEN_BY_TOKEN, KernelSelectionError, NoFastKernelError, Selection,
                                           select_kernel)
from la_compiler.passes.annotate import _set_spec_arg
from la_compiler.policy.quantizer_names import quantizer_sites
from la_compiler.record import GraphRecord


def static_int(size) -> int | None:
    """A size known at compile time; None for a symbolic one (never specialized here)."""
    return size if isinstance(size, int) else None


def lower(gm: torch.fx.GraphModule, record: GraphRecord | None = None) -> int:
    """Writes ``kernel=<variant>`` into every node's spec. Returns how many nodes were lowered. On CUDA, refuses or
    warns once about the nodes sent to a slow kernel nobody pinned (the warning also becomes a note of ``record``)."""
    count = 0
    slow = []
    for node in gm.graph.nodes:
        if not is_delta_rule(node):
            continue
        meta = node.meta["laqat"]
        q, v = (a.meta.get("example_value", a.meta.get("val")) for a in node.args[:3:2])
        inputs = dict(device=q.device.type, dtype=q.dtype, head_k=q.shape[-1], head_v=v.shape[-1],
                      seq_len=static_int(q.shape[1]))
        spec = meta.spec.replace(kernel="auto")
        try:
            choice = select_kernel(spec, requested=meta.requested_backend, family=meta.requested_family, **inputs)
        except KernelSelectionError as e:
            raise KernelSelectionError(f"laqat node for module {meta.module or '<top>'!r}: {e}") from None
        pinned = (meta.requested_backend is not None or meta.requested_family is not None
                  or meta.spec.kernel == choice.variant)
        found = None if pinned else slow_kernel(meta.module, spec, choice, **inputs)
        if found is not None:
            slow.append(found)
        meta.spec = meta.spec.replace(kernel=choice.variant)
        meta.kernel_reason = choice.explain()
        _set_spec_arg(node, meta.spec.to_string())
        count += 1
    report_slow_kernels(slow, record)
    return count


# ---- slow kernels nobody pinned (CUDA) ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SlowKernel:
    """A node that the table sent to a slow kernel on CUDA, unpinned."""

    module: str
    spec: RecurrenceSpec  # what the table was given (kernel=auto)
    selection: Selection
    inputs: str  # "bfloat16, K=128, V=128, T=4096"
    cost: str
    blockers: tuple[str, ...] | None = None  # refused: the fields that keep the Triton kernels off (numerics_blockers)

    @property
    def refused(self) -> bool:
        return self.blockers is not None


def slow_kernel(module: str, spec: RecurrenceSpec, selection: Selection, *, device: str, dtype: torch.dtype,
                head_k: int, head_v: int, seq_len: int | None) -> SlowKernel | None:
    """What ``lower`` says of a node the table sent, unpinned, to ``selection.variant``: None where that kernel is a
    fast one or the device is not CUDA."""
    if device != "cuda":
        return None
    name = selection.variant
    inputs = dict(device=device, dtype=dtype, head_k=head_k, head_v=head_v, seq_len=seq_len)
    tokens = "T symbolic" if seq_len is None else f"T={seq_len}"
    described = f"{str(dtype).removeprefix('torch.')}, K={head_k}, V={head_v}, {tokens}"
    if get_variant(name).implementation == "torch":
        cost = (f"{name} is the fp64 torch reference: it runs in Python and float64, token by token (chunk by chunk "
                f"where W or GEMM operands round), forward and backward: orders of magnitude slower than the Triton "
                f"kernels")
        return SlowKernel(module, spec, selection, described, cost, numerics_blockers(spec, inputs))
    if name in TOKEN_BY_TOKEN and (seq_len is None or seq_len > FUSED_RECURRENT_MAX_TOKENS_ON_CUDA):
        steps = "T" if seq_len is None else str(seq_len)
        chunks = f"T / {spec.chunk}" if seq_len is None else str(math.ceil(seq_len / spec.chunk))
        cost = (f"{name} walks each sequence token by token: {steps} dependent steps where the chunk kernels run "
                f"{chunks} chunks (on CUDA they are faster beyond {FUSED_RECURRENT_MAX_TOKENS_ON_CUDA} tokens)")
        return SlowKernel(module, spec, selection, described, cost)
    return None


def numerics_fields(spec: RecurrenceSpec) -> dict[str, RecurrenceSpec]:
    """Each numerics field of ``spec``, as the spec spells it -> the spec without it (the field at its default)."""
    fields = {}
    for site, fmt in spec.quant:
        fields[f"q.{site}={fmt}"] = spec.replace(quant=tuple(item for item in spec.quant if item[0] != site))
    for site, acc in spec.acc:
        fields[f"acc.{site}={acc}"] = spec.replace(acc=tuple(item for item in spec.acc if item[0] != site))
    if spec.solve != "exact":
        fields[f"solve={spec.solve}:{spec.degree}"] = spec.replace(solve="exact", degree=None)
    if spec.chunk != 64:
        fields[f"chunk={spec.chunk}"] = spec.replace(chunk=64)
    for key, value in spec.numerics:
        fields[f"n.{key}={value}"] = spec.replace(numerics=tuple(item for item in spec.numerics if item[0] != key))
    for key, value in spec.extra:
        fields[f"x.{key}={value}"] = spec.replace(extra=tuple(item for item in spec.extra if item[0] != key))
    return fields


def numerics_blockers(spec: RecurrenceSpec, inputs: dict) -> tuple[str, ...] | None:
    """Where a Triton kernel runs these inputs (the recurrence without any numerics field), the fields that keep the
    Triton kernels off ``spec``: those each of which alone does, else all of them. None where no Triton kernel runs
    the inputs whatever the numerics (float64, head dims beyond theirs)."""
    bare = spec.replace(quant=(), acc=(), solve="exact", degree=None, chunk=64, numerics=(), extra=())
    if not _triton_runs(bare, inputs):
        return None
    fields = numerics_fields(spec)
    alone = tuple(field for field, without in fields.items() if _triton_runs(without, inputs))
    return alone or tuple(fields) or None


def _triton_runs(spec: RecurrenceSpec, inputs: dict) -> bool:
    try:
        select_kernel(spec, family="triton", **inputs)
    except (KernelSelectionError, ValueError):  # ValueError: a probe spec that is not valid (x.state_dtype alone)
        return False
    return True


def report_slow_kernels(slow: list[SlowKernel], record: GraphRecord | None = None) -> None:
    """Raises ``NoFastKernelError`` for the refused nodes, else gives one ``SlowKernelWarning`` naming every node."""
    refused = [s for s in slow if s.refused]
    if refused:
        raise NoFastKernelError(refusal_message(refused))
    if slow:
        message = slow_kernel_message(slow)
        if record is not None:
            record.notes.append(message)
        warn_at_caller(message, SlowKernelWarning)


def slow_kernel_message(slow: list[SlowKernel]) -> str:
    lines = [f"laqat: on CUDA the kernel-selection table sent {_layers(len(slow))} to slow kernels that the policy "
             f"did not pin (docs/policy.md, \"Kernel selection\"):"]
    for group in _groups(slow):
        first = group[0]
        lines += _describe(group)
        lines.append(f"  to say this kernel is meant (no warning then), pin it for these modules: "
                     f"{_pin_keys(first)}")
    return "\n".join(lines)


def refusal_message(refused: list[SlowKernel]) -> str:
    lines = [f"laqat: on CUDA no Triton kernel implements the numerics of {_layers(len(refused))}, and the policy did "
             f"not pin the fp64 torch reference that the kernel-selection table fell to; laqat refuses rather than "
             f"run it unasked (docs/policy.md, \"Kernel selection\"):"]
    for group in _groups(refused):
        first = group[0]
        fields = ", ".join(f"{field}{_policy_source(field, first.spec.kind)}" for field in first.blockers)
        lines += _describe(group)
        lines.append(f"  the Triton kernels run these inputs without {fields}")
        lines.append(f"  to do: set {'that field' if len(first.blockers) == 1 else 'those fields'} to what the Triton "
                     f"kernels implement (the reasons above; `laqat kernels` lists them), or pin the reference for "
                     f"these modules to run it knowingly: {_pin_keys(first)}")
    return "\n".join(lines)


def _layers(n: int) -> str:
    return "1 layer" if n == 1 else f"{n} layers"


def _groups(slow: list[SlowKernel]) -> list[list[SlowKernel]]:
    """The nodes with the same spec, inputs, choice and cost together (a model's identical layers: one entry)."""
    groups: dict[tuple, list[SlowKernel]] = {}
    for s in slow:
        groups.setdefault((s.spec, s.selection, s.inputs, s.cost, s.blockers), []).append(s)
    return list(groups.values())


def _describe(group: list[SlowKernel]) -> list[str]:
    first = group[0]
    modules = ", ".join(repr(s.module or "<top>") for s in group)
    chosen = first.selection.explain().splitlines()
    return [f"- module{'s' if len(group) > 1 else ''} {modules} ({first.spec.kind}; {first.inputs}): "
            f"{first.selection.variant}, {first.cost}",
            f"  spec {first.spec}",
            f"  chosen {chosen[0]}",
            *(f"    {line.strip()}" for line in chosen[1:])]


def _pin_keys(slow: SlowKernel) -> str:
    """The policy keys that pin the chosen kernel (its name, or its implementation) for a module."""
    implementation = get_variant(slow.selection.variant).implementation
    family = "decode" if slow.spec.phase != "none" else "solve"
    return (f"linear_attention cfg `backend: {slow.selection.variant}` (or `{family}: {{implementation: "
            f"{implementation}}}`)")


def _policy_source(field: str, kind: str) -> str:
    """Where a spec field comes from in the policy, for the refusal's "to do"."""
    key = field.partition("=")[0]
    if key.startswith("q."):
        names = [name for name, site in quantizer_sites(kind).items() if site == key[2:]]
        return f" (quant_cfg: the {names[0]})" if names else ""
    prefix, _, rest = key.partition(".")
    source = {"acc": f"matmul.{rest}", "n": f"numerics.{rest}", "x": "decode / serving", "solve": "solve",
              "chunk": "chunk_size"}.get(prefix)
    return f" (linear_attention cfg {source})" if source else ""
