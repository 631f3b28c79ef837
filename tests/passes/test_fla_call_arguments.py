"""What the program passes is what runs: an FLA call's ``chunk_size`` is kept under a policy that leaves
chunk_size at its default, and a policy that sets another one is an error naming both values (under a quantizing
policy the state rounds at every chunk boundary: another chunk size is other numerics)."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("fla")

import la_compiler  # noqa: E402
from la_compiler.policy.file_format import PolicyError  # noqa: E402

STATE_FP8 = {
    "version": "laqat.policy/1", "name": "state_fp8_chunk",
    "quant_cfg": [{"quantizer_name": "*", "enable": False},
                  {"quantizer_name": "*_state_quantizer", "cfg": {"num_bits": [4, 3], "type": "dynamic",
                                                                  "axis": [0, 1]}}],
    "linear_attention": [{"module_name": "*", "cfg": {"state": {"block_v": 16}}}],
}


def _with_chunk(chunk):
    policy = copy.deepcopy(STATE_FP8)
    if chunk is not None:
        policy["linear_attention"][0]["cfg"]["chunk_size"] = chunk
    return policy


def _inputs(T=40, H=1, K=16, V=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -0.1 * torch.rand(1, T, H, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _gdn(chunk_size=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(q, k, v, g, beta):
        kw = {} if chunk_size is None else {"chunk_size": chunk_size}
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kw)
    return fn


def _explain(fn, policy):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return la_compiler.explain(fn, *_inputs(), policy=policy)


def test_the_calls_chunk_size_is_kept_under_a_policy_that_sets_none():
    kept = _explain(_gdn(16), _with_chunk(None))
    (m,) = kept.matches
    assert "chunk=16" in str(m.spec) and "q.state=" in str(m.spec), m.spec
    assert any("chunk_size=16 from the FLA call kept" in r for r in m.policy_rules), m.policy_rules
    # the same numerics as the policy that asks for chunk 16, different from chunk 64's
    agreed = _explain(_gdn(16), _with_chunk(16))
    assert "chunk=16" in str(agreed.matches[0].spec)
    torch.testing.assert_close(kept.output[0], agreed.output[0], rtol=0, atol=0)
    default = _explain(_gdn(), _with_chunk(None))
    assert "chunk=64" in str(default.matches[0].spec)
    assert not torch.equal(kept.output[0], default.output[0])


def test_a_policy_chunk_size_against_the_calls_names_both():
    with pytest.raises(PolicyError, match=r"the FLA call passes chunk_size=16 but linear_attention\[0\] .*sets "
                                          r"chunk_size=32"):
        _explain(_gdn(16), _with_chunk(32))


def test_a_call_without_chunk_size_takes_the_policys():
    (m,) = _explain(_gdn(), _with_chunk(32)).matches
    assert "chunk=32" in str(m.spec), m.spec


def test_an_explicit_chunk_size_of_64_against_the_policys_names_both():
    with pytest.raises(PolicyError, match=r"the FLA call passes chunk_size=64 but linear_attention\[0\] .*sets "
                                          r"chunk_size=32"):
        _explain(_gdn(64), _with_chunk(32))
