"""The decode-phase training context: which tokens of each sequence are prefill, which decode.

    with la_compiler.phase(prefill_lengths=[64, 32], sequence_lengths=[128, 100]):
        loss = compiled_model(batch).loss
        loss.backward()

Inside the context, every laqat node whose spec has ``phase=token|replay`` splits sequence n
into a chunked prefix ``[0, prefill_lengths[n])`` and a recurrent suffix
``[prefill_lengths[n], sequence_lengths[n])``; tokens from ``sequence_lengths[n]`` to the end of
the sequence's storage (padding) are excluded: their outputs are zero, they do not touch the
state and get zero gradients. A list of length one applies to every sequence.

How the lengths reach the kernels without recompiles (docs/decode_phase.md): the phase pass
rewrites such a node into ``laqat::delta_rule_phased``, whose lengths come from a
``laqat::phase_lengths`` node in the same graph. That op reads this context when it *runs*,
not when Dynamo traces, so no guard depends on the lengths; its outputs are ordinary
tensors, which autograd saves for the backward of the phased op, so the backward uses the
lengths its forward used even after the context has exited.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from typing import Iterator, Sequence

from la_compiler.error_base import LaqatError


class PhaseError(LaqatError, ValueError):
    """Phase lengths that are not valid; the message names the argument."""


@dataclasses.dataclass(frozen=True)
class PhaseLengths:
    prefill_lengths: tuple[int, ...]
    sequence_lengths: tuple[int, ...] | None  # None: every sequence is valid to its end

    def __post_init__(self):
        _check_list("prefill_lengths", self.prefill_lengths)
        if self.sequence_lengths is not None:
            _check_list("sequence_lengths", self.sequence_lengths)
            n_pre, n_seq = len(self.prefill_lengths), len(self.sequence_lengths)
            if n_pre != n_seq and 1 not in (n_pre, n_seq):
                raise PhaseError(f"phase: prefill_lengths has {n_pre} entries but sequence_lengths has {n_seq} "
                                 f"(a list of one entry applies to every sequence)")
            n = max(n_pre, n_seq)
            pre = _broadcast("prefill_lengths", self.prefill_lengths, n)
            for i, (p, L) in enumerate(zip(pre, _broadcast("sequence_lengths", self.sequence_lengths, n))):
                if p > L:
                    raise PhaseError(f"phase: prefill_lengths[{i if n_pre > 1 else 0}]={p} exceeds "
                                     f"sequence_lengths[{i if n_seq > 1 else 0}]={L}")

    def resolve(self, storage_lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per-sequence (prefill, valid) lengths for sequences stored with ``storage_lengths`` tokens."""
        n = len(storage_lengths)
        prefill = _broadcast("prefill_lengths", self.prefill_lengths, n)
        valid = list(storage_lengths) if self.sequence_lengths is None else _broadcast(
            "sequence_lengths", self.sequence_lengths, n)
        for i, (p, v, s) in enumerate(zip(prefill, valid, storage_lengths)):
            if v > s:
                raise PhaseError(f"phase: sequence_lengths[{i}]={v} exceeds the {s} tokens stored for sequence {i}")
            if p > v:
                raise PhaseError(f"phase: prefill_lengths[{i}]={p} exceeds the valid length {v} of sequence {i}")
        return prefill, valid


def _check_list(name: str, values) -> None:
    if not isinstance(values, tuple) or not values:
        raise PhaseError(f"phase: {name} must be a non-empty list of ints, got {values!r}")
    for i, x in enumerate(values):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise PhaseError(f"phase: {name}[{i}] must be an int >= 0, got {x!r}")


def _broadcast(name: str, values: tuple[int, ...], n: int) -> list[int]:
    if len(values) == 1:
        return list(values) * n
    if len(values) != n:
        raise PhaseError(f"phase: {name} has {len(values)} entries but the batch has {n} sequences")
    return list(values)


# Process-wide, not thread-local: autograd runs the backward of CUDA tensors (and so any
# activation-checkpoint recompute) on its own device threads, which must see the phase.
_STACK: list = []


def _to_tuple(name: str, values) -> tuple[int, ...]:
    if values is None:
        return None
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
    if isinstance(values, int):
        values = [values]
    try:
        return tuple(values)
    except TypeError:
        raise PhaseError(f"phase: {name} must be a list of ints, got {type(values).__name__}") from None


@contextlib.contextmanager
def phase(prefill_lengths, sequence_lengths=None) -> Iterator[PhaseLengths]:
    """Split every sequence into a chunked prefix and a recurrent (decode-phase) suffix."""
    lengths = PhaseLengths(_to_tuple("prefill_lengths", prefill_lengths),
                           _to_tuple("sequence_lengths", sequence_lengths))
    stack = _stack()
    stack.append(lengths)
    try:
        yield lengths
    finally:
        stack.pop()


def _stack() -> list:
    return _STACK


def current() -> PhaseLengths | None:
    """The innermost active phase, or None."""
    stack = _stack()
    return stack[-1] if stack else None


class _CallableModule(types.ModuleType):
    """``la_compiler.phase`` is this module once imported: calling it enters the context."""

    def __call__(self, prefill_lengths, sequence_lengths=None):
        return phase(prefill_lengths, sequence_lengths)


sys.modules[__name__].__class__ = _CallableModule
