"""Which compiler runs a rewritten graph (the hand-off), and why (docs/options.md, "Hand-off").

``options["compiler"]``, where the user gives it, is used as given. Unset, the graph's devices decide: Inductor
where a tensor of the graph lives on an accelerator (CUDA, XPU, ...), eager where every tensor is on the CPU:
there Inductor's C++ build costs a minute or more of the first step and its later steps were no faster
(measured: docs/options.md, "Hand-off").
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from la_compiler.hand_off.cache_key import cache_key_patches
from la_compiler.hand_off.linear_outputs import hand_back_linear_outputs, with_linear_outputs
from la_compiler.hand_off.loss_tails import split_loss_tail, with_loss_tail
from la_compiler.hand_off.recompute_tags import tag_recomputed_ops
from la_compiler.hand_off.regions import compile_regions, layer_partitions, unsplit_reason
from la_compiler.options import CPU_HAND_OFF, DEVICE_HAND_OFF, LAYERS_PER_PIECE

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HandOff:
    compiler: str  # "inductor" | "eager"
    reason: str  # why: the option, or the devices the default was chosen by


def graph_devices(gm: torch.fx.GraphModule, example_inputs) -> set[str]:
    """The device types of the graph's inputs and of every value it computes (Dynamo's example values), so that a
    graph that creates its tensors on a GPU from CPU inputs counts as a GPU graph."""
    values = list(example_inputs) + [node.meta.get("example_value") for node in gm.graph.nodes]
    return {leaf.device.type for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor)}


def choose_hand_off(option: str | None, gm: torch.fx.GraphModule, example_inputs) -> HandOff:
    if option is not None:
        return HandOff(option, "options['compiler']")
    accelerators = sorted(graph_devices(gm, example_inputs) - {"cpu", "meta"})
    if accelerators:
        return HandOff(DEVICE_HAND_OFF, f"default: the graph's tensors are on {', '.join(accelerators)}")
    return HandOff(CPU_HAND_OFF, "default: every tensor of the graph is on the CPU")


def compile_rewritten(choice: HandOff, fingerprint: str, graph: torch.fx.GraphModule, inputs,
                      regional: bool | int = True) -> Callable:
    """The callable that runs ``graph`` (laqat's passes done) under the chosen compiler; a loss that overwrites its
    logits with their gradient runs after it, outside (loss_tails.py). ``fingerprint`` (cache_key.py) joins the keys
    of Inductor's and AOTAutograd's caches. ``regional``: under Inductor, repeated layers compile once, ``True``
    ``LAYERS_PER_PIECE`` of them per piece, an int that many (regions.py);
    ``graph.meta["laqat_record"]``, where set, learns how the graph was split."""
    tail = split_loss_tail(graph)
    compiled = _compile_head(choice, fingerprint, graph, inputs, regional)
    return with_loss_tail(compiled, tail) if tail is not None else compiled


def _compile_head(choice: HandOff, fingerprint: str, graph: torch.fx.GraphModule, inputs,
                  regional: bool | int) -> Callable:
    record = graph.meta.pop("laqat_record", None)
    if choice.compiler == "eager":
        return graph.forward
    per_piece = LAYERS_PER_PIECE if isinstance(regional, bool) else regional
    partition, layers = layer_partitions(graph, per_piece)
    why_whole = unsplit_reason(graph, inputs, layers, per_piece) if regional else "options['regional'] is False"
    if why_whole is None:
        compiled, regions = compile_regions(graph, inputs, partition, layers,
                                            functools.partial(_compile_piece, fingerprint), per_piece)
        described = regions.describe()
    else:
        compiled, described = _compile_piece(fingerprint, graph, inputs), f"whole: {why_whole}"
    if record is not None:
        record.regions = described
    logger.info("graph %s under Inductor: %s", "?" if record is None else record.graph_id, described)
    return compiled


def _compile_piece(fingerprint: str, graph: torch.fx.GraphModule, inputs, handed_back: frozenset | None = None
                   ) -> Callable:
    """Inductor's callable of ``graph``; ``handed_back``: the outputs that may leave through their own autograd node
    (linear_outputs.py; None: any)."""
    from torch._inductor.compile_fx import compile_fx

    # AOTAutograd rebuilds an output that aliases an intermediate (FLA's logits view) by replaying the
    # view's recorded ViewMeta sequence; on torch 2.11 + CUDA that replay read garbage sizes
    # ("shape '[140323329983992, 8766216997877507016, 32000]' is invalid", GatedDeltaNetForCausalLM at
    # T=4096). Without replay it rebuilds the alias with as_strided from the output's own size, stride and
    # offset: the same view of the same storage.
    plan, count = hand_back_linear_outputs(graph, handed_back)
    tag_recomputed_ops(graph)
    with torch._functorch.config.patch(view_replay_for_aliased_outputs=False):
        compiled = compile_fx(graph, inputs, config_patches=cache_key_patches(fingerprint))
    return with_linear_outputs(compiled, plan, count) if plan else compiled
