"""Decode phases through FLA layers: their eval path (fused_recurrent for short sequences) and
the V-first state layout they use become phased laqat nodes, with the shipped FP8 decode recipe."""
import pytest
import torch

import la_compiler
from la_compiler.backend import laqat_backend
from la_compiler.ir.delta_rule_phased import is_delta_rule_phased
from tests.helpers import rel_l2

pytest.importorskip("fla")


def test_fla_eval_path_is_phased_and_phases_change_without_recompile():
    from la_compiler.tiny_models import TinyConfig, TinyHybridLM

    model = TinyHybridLM(TinyConfig(use_short_conv=False)).eval()  # eval + T <= 64: FLA calls fused_recurrent
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return laqat_backend(gm, example_inputs, options={"policy": "decode_token_state_fp8", "compiler": "eager"})

    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        with la_compiler.phase([3, 5]):
            a = compiled(tokens)
        with la_compiler.phase([0], sequence_lengths=[8, 6]):
            b = compiled(tokens)
        with la_compiler.phase([8]):  # no suffix: nothing rounded (no initial state)
            c = compiled(tokens)
    assert len(graphs) == 1
    specs = [n.args[-1] for n in graphs[0].graph.nodes if is_delta_rule_phased(n)]
    assert len(specs) == 2 and {s.split("[")[0] for s in specs} == {"gdn", "kda"}
    for s in specs:
        assert "phase=token" in s and "q.state=fp8_e4m3/tile64" in s and "src=fla" in s
    assert all(torch.isfinite(x).all() for x in (a, b, c))
    assert rel_l2(a, c) > 1e-6 and rel_l2(b, c) > 1e-6 and rel_l2(a, b) > 1e-6
