"""FX passes of the laqat pipeline: frontends -> annotate -> verify -> lower.

Each pass is a function over a ``torch.fx.GraphModule`` that returns how many rewrites it
made and keeps ``node.meta`` accurate (the pipeline at the top of docs/architecture.md).
"""
