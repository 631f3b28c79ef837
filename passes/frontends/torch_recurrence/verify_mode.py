"""``verify=True``: run the whole original region and the IR op on the same random inputs of
the example shapes, at compile time, and refuse the rewrite on a mismatch."""
from __future__ import annotations

import torch

from la_compiler.passes.frontends.torch_recurrence.dataflow import Dataflow, tensor_value
from la_compiler.passes.frontends.torch_recurrence.probe import ProbeError, run_nodes
from la_compiler.passes.frontends.torch_recurrence.region import Region
from la_compiler.passes.frontends.torch_recurrence.semantics import TOL, Assignment, _draws, rel_err
from la_compiler.spec import RecurrenceSpec


def verify_rewrite(flow: Dataflow, region: Region, a: Assignment, spec: RecurrenceSpec, seed: int = 1) -> str | None:
    """None when the IR op reproduces the region; else the mismatch, for the near-miss report."""
    body = region.body
    device = tensor_value(region.frontier[0]).device
    env = _draws(region, a.g.node, a.decay_form, torch.Generator().manual_seed(seed), device)
    try:
        out = run_nodes(region.ordered(flow), env)
    except ProbeError as e:
        return f"verify: the original region does not run on random inputs: {e}"
    o_region = out[region.output].permute(a.out_perm)
    last = region.final_state if region.final_state is not None else body.states[-1]
    s_region = out.get(last) if last is not None else None
    q, k, v, g, beta = (a.ir_input64(role, env).contiguous() for role in ("q", "k", "v", "g", "beta"))
    if a.decay_form == "exp":
        g = g.log()
    h0 = a.ir_input64("h0", env) if a.h0 is not None else None
    if h0 is not None and h0.dim() == 3:  # a flattened [B*HV, K, V] state
        h0 = h0.reshape(v.shape[0], v.shape[2], *h0.shape[-2:])
    with torch.no_grad():
        # the fp64 reference variant: this checks the rewrite, not a kernel's rounding
        o_ir, s_ir = torch.ops.laqat.delta_rule(q, k, v, g, beta, h0, None, float(a.scale),
                                                spec.replace(kernel="reference").to_string())
    errors = {"o": rel_err(o_ir.double(), o_region)}
    if s_region is not None and (region.chunk == 1 or region.final_state is not None):
        errors["final_state"] = rel_err(s_ir.double(), s_region.reshape(s_ir.shape))
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    if bad:
        return "verify: the IR node differs from the original region on random inputs (" + ", ".join(
            f"{k} relative L2 {e:.2e}" for k, e in bad.items()) + f" > {TOL:g})"
    return None
