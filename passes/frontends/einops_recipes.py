"""einops' ``rearrange`` / ``repeat`` / ``reduce`` while Dynamo traces: the recipe computed, not traced.

Dynamo traces einops' Python at every call, its pattern parser included (einops' ``lru_cache``s are not consulted
while tracing): for a 16-layer FLA GDN LM, 70% of the bytecode instructions Dynamo steps through are einops'
(docs/model-bench.md, "einops under Dynamo"). Installed only there (``dynamo_traces_einops`` in this package's
``__init__``: where einops' functions are ``allow_in_graph`` ops, each call is one graph op, cheaper still). The
substitution below gets einops' parsed recipe
(``_prepare_transformation_recipe``: its arguments, the pattern, the axis names and the rank, are constants) at
trace time as a constant (``assume_constant_result``), runs einops' ``_reconstruct_from_shape`` steps on it (a
constant too where every size is static, traced where a size is symbolic) and applies the result with the torch ops
einops' torch backend applies (``reshape``, ``permute``, ``unsqueeze`` + ``expand``, ``amin`` / ``amax`` / ``sum`` /
``mean`` / ``prod`` / ``any`` / ``all``), so the graph holds the same ops as when Dynamo traces einops. A callable
reduction traces einops' own ``_apply_recipe``.
"""
from __future__ import annotations

import torch
from einops import einops as _einops

from la_compiler.passes.frontends.static_sizes import static_sizes

Recipe = tuple  # einops' TransformRecipe as nested tuples of ints (_plain_recipe)


@torch._dynamo.assume_constant_result
def _plain_recipe(pattern: str, reduction: str, axes_names: tuple, ndim: int) -> Recipe:
    """einops' parsed recipe (``_prepare_transformation_recipe``, its own cache) as nested tuples: its arguments
    are constants even where the sizes are symbolic."""
    r = _einops._prepare_transformation_recipe(pattern, reduction, axes_names=axes_names, ndim=ndim)
    return (tuple(r.elementary_axes_lengths), tuple(r.axis_name2elementary_axis.items()),
            tuple((tuple(known), tuple(unknown)) for known, unknown in r.input_composition_known_unknown),
            tuple(r.axes_permutation), r.first_reduced_axis, tuple(r.added_axes.items()),
            tuple(tuple(axes) for axes in r.output_composite_axes))


def _cook(recipe: Recipe, shape, axes_dims):
    """einops' ``_reconstruct_from_shape_uncached`` on the plain recipe: the same steps, traced (sizes may be
    symbolic)."""
    elementary_lengths, name2axis, known_unknown, permutation, first_reduced, added_axes, output_axes = recipe
    name2axis = dict(name2axis)
    need_init_reshape = False
    axes_lengths = list(elementary_lengths)
    for axis, dim in axes_dims:
        axes_lengths[name2axis[axis]] = dim
    for input_axis, (known_axes, unknown_axes) in enumerate(known_unknown):
        length = shape[input_axis]
        if len(known_axes) == 0 and len(unknown_axes) == 1:
            axes_lengths[unknown_axes[0]] = length
            continue
        known_product = 1
        for axis in known_axes:
            known_product *= axes_lengths[axis]
        if len(unknown_axes) == 0:
            if isinstance(length, int) and isinstance(known_product, int) and length != known_product:
                raise _einops.EinopsError(f"Shape mismatch, {length} != {known_product}")
        else:
            if isinstance(length, int) and isinstance(known_product, int) and length % known_product != 0:
                raise _einops.EinopsError(
                    f"Shape mismatch, can't divide axis of length {length} in chunks of {known_product}")
            axes_lengths[unknown_axes[0]] = length // known_product
        if len(known_axes) + len(unknown_axes) != 1:
            need_init_reshape = True
    init = axes_lengths[: len(permutation)] if need_init_reshape else None
    need_final_reshape = False
    final = []
    for grouping in output_axes:
        lengths = [axes_lengths[axis] for axis in grouping]
        product = 1
        for length in lengths:
            product *= length
        final.append(product)
        if len(lengths) != 1:
            need_final_reshape = True
    added = [(position, axes_lengths[elementary]) for position, elementary in added_axes]
    reduced = tuple(range(first_reduced, len(permutation)))
    reordering = None if permutation == tuple(range(len(permutation))) else permutation
    return init, reordering, reduced, added, (final if need_final_reshape else None), len(added) + len(permutation)


@torch._dynamo.assume_constant_result
def _cooked(pattern: str, reduction: str, axes_names: tuple, shape: tuple, axes_dims: tuple) -> tuple:
    """``_cook`` of the pattern's recipe where every size is an int, computed at trace time as a constant (its lists
    as tuples): stepping through ``_cook`` costs Dynamo more bytecode than the rest of a layer, and handing it the
    recipe as an argument makes Dynamo rebuild that constant value by value (docs/model-bench.md, "einops under
    Dynamo")."""
    recipe = _plain_recipe(pattern, reduction, axes_names, len(shape))
    init, reordering, reduced, added, final, n_axes = _cook(recipe, shape, axes_dims)
    return (None if init is None else tuple(init), reordering, reduced, tuple(added),
            None if final is None else tuple(final), n_axes)


def _static(shape: tuple, axes_dims: tuple) -> bool:
    return static_sizes(shape) and static_sizes([dim for _, dim in axes_dims])


def _reduce_axes(x: torch.Tensor, reduction: str, axes: tuple) -> torch.Tensor:
    """einops' torch backend's ``reduce``."""
    if reduction == "min":
        return x.amin(dim=axes)
    if reduction == "max":
        return x.amax(dim=axes)
    if reduction == "sum":
        return x.sum(dim=axes)
    if reduction == "mean":
        if x.dtype not in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
            raise NotImplementedError("reduce_mean is not available for non-floating tensors")
        return x.mean(dim=axes)
    if reduction == "prod":
        for axis in sorted(axes)[::-1]:
            x = x.prod(dim=axis)
        return x
    if reduction in ("any", "all"):
        return getattr(torch, reduction)(x, dim=axes)
    raise ValueError(f"unknown reduction {reduction!r}")


def reduce(tensor, pattern: str, reduction, **axes_lengths):
    if isinstance(tensor, list):
        tensor = torch.stack(tensor)
    lengths = tuple(axes_lengths.items())
    if callable(reduction):
        recipe = _einops._prepare_transformation_recipe(pattern, reduction, axes_names=tuple(axes_lengths),
                                                        ndim=tensor.dim())
        return _einops._apply_recipe(_einops.get_backend(tensor), recipe, tensor, reduction_type=reduction,
                                     axes_lengths=lengths)
    shape = tuple(tensor.shape)
    if _static(shape, lengths):
        init, permutation, reduced, added, final, n_axes = _cooked(pattern, reduction, tuple(axes_lengths), shape,
                                                                   lengths)
    else:
        recipe = _plain_recipe(pattern, reduction, tuple(axes_lengths), tensor.dim())
        init, permutation, reduced, added, final, n_axes = _cook(recipe, shape, lengths)
    if init is not None:
        tensor = tensor.reshape(init)
    if permutation is not None:
        tensor = tensor.permute(permutation)
    if reduced:
        tensor = _reduce_axes(tensor, reduction, reduced)
    if added:
        repeats = [-1] * n_axes
        for position, length in added:
            tensor = torch.unsqueeze(tensor, position)
            repeats[position] = length
        tensor = tensor.expand(repeats)
    if final is not None:
        tensor = tensor.reshape(final)
    return tensor


def rearrange(tensor, pattern: str, **axes_lengths):
    return reduce(tensor, pattern, reduction="rearrange", **axes_lengths)


def repeat(tensor, pattern: str, **axes_lengths):
    return reduce(tensor, pattern, reduction="repeat", **axes_lengths)


for _original, _replacement in ((_einops.reduce, reduce), (_einops.rearrange, rearrange),
                                (_einops.repeat, repeat)):
    torch._dynamo.substitute_in_graph(_original, skip_signature_check=True)(_replacement)
