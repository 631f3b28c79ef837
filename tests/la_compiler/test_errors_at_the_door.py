"""laqat's errors reach the user as themselves (not wrapped by Dynamo), naming the argument or key."""
import re

import pytest
import torch

import la_compiler
from la_compiler.backend import BackendOptionsError
from la_compiler.cli import main as laqat_cli


def test_options_as_a_string_is_named_with_the_fix():
    fn = torch.compile(lambda x: x + 1, backend="laqat", options="state_fp8")
    with pytest.raises(BackendOptionsError, match=r"options=\.\.\.\) must be a dict .*options=\{'policy': 'state_fp8'\}"):
        fn(torch.ones(2))


@pytest.mark.parametrize("via", ["compile", "explain"])
def test_policy_error_is_catchable_as_itself(via):
    with pytest.raises(la_compiler.PolicyError, match=r"options\['policy'\]: 'no_such_recipe' is neither") as info:
        if via == "compile":
            torch.compile(lambda x: x + 1, backend="laqat", options={"policy": "no_such_recipe"})(torch.ones(2))
        else:
            la_compiler.explain(lambda x: x + 1, torch.ones(2), policy="no_such_recipe")
    assert "backend='" not in str(info.value)  # not Dynamo's BackendCompilerFailed text


def test_a_policy_error_from_a_dict_policy_is_catchable():
    from tests.ir_inputs import random_inputs

    (q, k, v, g, beta, _), _ = random_inputs("gdn", T=4)
    policy = {"linear_attention": [{"module_name": "*", "cfg": {"backend": "no_such_kernel"}}]}

    def fn(q, k, v, g, beta):
        return torch.ops.laqat.delta_rule(q, k, v, g, beta, None, None, 1.0, "gdn[src=user]")[0]
    with pytest.raises(la_compiler.PolicyError, match=r"linear_attention\[0\]\.cfg\.backend: must be one of"):
        torch.compile(fn, backend="laqat", options={"policy": policy, "compiler": "eager"})(q, k, v, g, beta)


def test_an_empty_policy_file_is_an_error(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(la_compiler.PolicyError, match=r"empty.yaml'.*the file is empty"):
        la_compiler.load_policy(str(path))


@pytest.mark.parametrize("spec, message", [
    ("gdn[q.state=fp8]", "q.state=fp8: .*format must be one of"),
    ("gdn[q.stat=fp8_e4m3/tile64]", "unknown quant site 'stat'"),
])
def test_laqat_spec_refuses_bad_specs_without_a_traceback(capsys, spec, message):
    assert laqat_cli(["spec", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laqat spec: ") and "Traceback" not in err
    assert re.search(message, err), err
