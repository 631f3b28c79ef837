"""The base of laqat's errors, at the bottom of the import layers: it imports nothing, so that every module of the
package (the policy schema, the spec, the kernels) can derive its errors from it. ``la_compiler.errors`` and
``la_compiler`` re-export it; ``la_compiler.errors`` also carries it through ``torch.compile``."""
from __future__ import annotations


class LaqatError(Exception):
    """The base of laqat's errors: ``except la_compiler.LaqatError`` catches every error laqat raises on purpose,
    also from inside ``torch.compile`` (where ``la_compiler.errors.through_dynamo`` makes it a subclass of this one
    where its class is not already). Each error keeps its standard base as well (``ValueError`` for a bad value,
    ``RuntimeError`` for a state), so that ``except ValueError`` clauses keep working."""
