"""FLA's trace-time frontend (``install_trace_frontends`` imports ``substitutions`` where ``fla`` is importable).

    substitutions.py   FLA's functions -> laqat ops, registered with ``substitute_in_graph``
    preprocess.py      what FLA's kernels fuse in front of the recurrence (l2norm, gates, beta), as torch ops
    activations.py     FLA's gated-MLP activations as torch ops

The ``laqat::`` ops that run FLA's other kernels at run time live in ``kernels/fla/``.
"""
