"""Whether sizes are static while Dynamo traces; trace-time frontends take their constant paths only where they are."""
from __future__ import annotations


def static_sizes(sizes) -> bool:
    """Every size an int, not symbolic; traced by Dynamo, which answers ``has_static_value`` as a constant."""
    from torch.fx.experimental.symbolic_shapes import has_static_value

    for size in sizes:
        if not has_static_value(size):
            return False
    return True
