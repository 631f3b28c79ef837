"""FLA's own kernels: the "fla_chunk" variant of the recurrence (exact numerics, CUDA), and the ``laqat::`` ops
that run FLA's other kernels at run time (the FLA frontend, passes/frontends/fla/, puts them in graphs).

    chunk_variant.py             FLA's chunk kernels as the "fla_chunk" variant
    conv_op.py                   laqat::causal_conv1d
    norm_op.py                   laqat::layer_norm_gated, laqat::layer_norm
    glu_linear_op.py             laqat::glu_linear (the fused gated MLP's activation and down projection)
    glu_formulas.py              the gated-MLP activations' formulas as torch ops
    l2_norm_op.py                laqat::l2_norm (q and k's l2 norm, saving its output and inverse norms)
    softplus_gate_op.py          laqat::softplus_gate (the GDN / KDA log-decay from the raw gate, saving its output)
    cross_entropy_op.py          laqat::cross_entropy
    linear_cross_entropy_op.py   laqat::fused_linear_cross_entropy
"""
