"""FLA's decoder blocks traced once: each block's training call is a nested compile region while Dynamo traces.

Dynamo traces the Python of every layer of a model, so most of the warm first step of a 16-layer FLA LM is that
tracing (docs/model-bench.md, "Where the first step's time goes"). Where Dynamo reuses the trace of a
``torch.compiler.nested_compile_region`` for later calls whose inputs' metadata and guards match (its subgraph reuse:
torch 2.13 has it, 2.11 does not; ``dynamo_reuses_regions``), the forward of an FLA block (``KDABlock``,
``GatedDeltaNetBlock``, holding FLA's GDN or KDA layer) called for training without padding (no attention mask, no
cache, no attention outputs, no attention residuals, no further keyword arguments, no gradient checkpointing) on
hidden states of static sizes (Dynamo's reuse fails on symbolic ones: ``dynamic=True``, automatic dynamic), not
sharded by FSDP2, runs inside one region whose output is the block's hidden states, where the backend Dynamo
compiles for is laqat's (``la_compiler.backend_mark``: ``backend="laqat"``,
``la_compiler.explain``; not under DDP's graph splitting, nor for another backend, which would keep the regions):
Dynamo traces the first block and stamps its trace out for the others (their own parameters as the region's
inputs); a block whose guards do not hold is traced anew. Any other call runs FLA's forward as before, and so does
every call outside ``torch.compile``, and every call with ``LAQAT_FLA_BLOCK_REGIONS=off``.

laqat's backend inlines these regions back before its passes (``passes/inline_regions.py``), each copy's nodes under
its own block's module path: the passes, the policy's rules and the Inductor hand-off see the graph Dynamo traces
without regions, op for op (tests/passes/test_block_regions.py). FLA's block returns ``(hidden_states, attentions,
past_key_values, attnres_states)``; the region checks at trace time that the last three are None for such a call, and
refuses with ``UnsupportedArgumentError`` where an FLA release returns something else. Dynamo refuses a graph break
inside a region (``UncapturedHigherOrderOpError``, with or without ``fullgraph``): FLA's GDN and KDA blocks trace
whole in these calls (an attention mask's unpadding, which breaks the graph, keeps FLA's forward); where another
configuration of FLA's code breaks the graph, ``LAQAT_FLA_BLOCK_REGIONS=off`` traces every block as before.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from la_compiler.backend_mark import compiling_for_laqat
from la_compiler.errors import through_dynamo
from la_compiler.options import OptionsError, fla_block_regions
from la_compiler.passes.frontends.static_sizes import static_sizes
from la_compiler.passes.frontends.fla.substitutions import SUBSTITUTED, _refuse, _while_compiling

# FLA 0.6.0's block forward; another signature leaves the block as it is
BLOCK_FORWARD_PARAMETERS = ("self", "hidden_states", "attention_mask", "past_key_values", "use_cache",
                            "output_attentions", "attnres_states", "kwargs")
# distinct traces of one block class Dynamo keeps for reuse; past it Dynamo raises (its default is 8)
MAX_REUSE_ENTRIES = 256


def dynamo_reuses_regions() -> bool:
    """Whether this torch's Dynamo reuses a nested compile region's trace (``save_reuse_entry``)."""
    try:
        from torch._dynamo.variables import invoke_subgraph
    except ImportError:
        return False
    return hasattr(invoke_subgraph, "save_reuse_entry")


def block_classes() -> tuple:
    from fla.models.gated_deltanet.modeling_gated_deltanet import GatedDeltaNetBlock
    from fla.models.kda.modeling_kda import KDABlock

    return GatedDeltaNetBlock, KDABlock


def recurrent_layers() -> tuple:
    """The attention layers a block's region may hold (a hybrid model's softmax-attention blocks keep FLA's forward)."""
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    return GatedDeltaNet, KimiDeltaAttention


@torch._dynamo.assume_constant_result
def _regions_on() -> bool:
    try:
        return fla_block_regions() and compiling_for_laqat()
    except OptionsError as e:  # as itself through Dynamo (la_compiler/errors.py)
        raise through_dynamo(e) from None


def sharded_module_types() -> tuple:
    """FSDP2's module type (``fully_shard`` makes a block one): its blocks unshard their parameters around the forward,
    and keep FLA's forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ()
    return (FSDPModule,)


def region_forward(original: Callable) -> Optional[Callable]:
    """The block's forward while compiling (None where FLA's forward is not the one this module knows)."""
    if tuple(inspect.signature(original).parameters) != BLOCK_FORWARD_PARAMETERS:
        return None

    def block_hidden_states(block, hidden_states):
        hidden_states, *rest = original(block, hidden_states)
        for value in rest:
            if value is not None:
                _refuse(f"{type(block).__name__}.forward",
                        "FLA's block returned more than its hidden states for a training call (no cache, no attention "
                        "outputs); laqat's block region expects None for the rest")
        return hidden_states

    region = torch.compiler.nested_compile_region(block_hidden_states, max_reuse_entries=MAX_REUSE_ENTRIES)
    layers, sharded = recurrent_layers(), sharded_module_types()

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, attnres_states=None, **kwargs):
        training_call = (attention_mask is None and past_key_values is None and not use_cache and not output_attentions
                         and attnres_states is None and not kwargs and not getattr(self, "use_attnres", False)
                         and not getattr(self, "gradient_checkpointing", False)
                         and isinstance(getattr(self, "attn", None), layers) and not isinstance(self, sharded))
        # torch 2.13's reuse of a region's trace fails on symbolic sizes (dynamic=True, automatic dynamic recompiles)
        if training_call and static_sizes(hidden_states.shape) and _regions_on():
            return region(self, hidden_states), None, None, None
        return original(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                        attnres_states, **kwargs)

    return forward


def install() -> None:
    for cls in block_classes():
        current = cls.__dict__["forward"]
        original = getattr(current, "__laqat_original__", current)
        if original in SUBSTITUTED:
            continue
        replacement = region_forward(original)
        if replacement is not None:
            cls.forward = _while_compiling(original, replacement)
            SUBSTITUTED[original] = replacement


if dynamo_reuses_regions():
    install()
