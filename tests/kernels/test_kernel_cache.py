"""The code cache and the code generator: atomic writes, LAQAT_CACHE_DIR, real module files, keys."""
import inspect
import os
from pathlib import Path

import pytest

from la_compiler.kernels.chunk import codegen as chunk_codegen
from la_compiler.kernels.common import cache
from la_compiler.kernels import sources
from la_compiler.kernels.common.codegen import CodegenError, render
from la_compiler.kernels.decode.fused import DecodeParams, decode_module, decode_source
from la_compiler.kernels.sources import kernel_module_for_spec

SPEC = "{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=fused_recurrent]"
DECODE_SPEC = ("{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=token; kernel=decode_fused; "
               "q.state=fp8_e4m3/tile16]")


def _source(tag: str) -> str:
    return f"TAG = {tag!r}\n\ndef answer():\n    return 41 + 1\n"


def test_cache_dir_env_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    module = cache.load_source("probe", _source(str(tmp_path)), {"tag": "env"})
    assert Path(module.__file__).is_relative_to(tmp_path)
    assert cache.cache_dir() == tmp_path


def test_module_has_its_real_file_and_loads_once(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    text = _source(f"real-file-{tmp_path}")
    module = cache.load_source("probe", text, {"tag": "file"})
    path = Path(module.__file__)
    assert path.read_text() == text
    assert inspect.getsource(module.answer).strip().startswith("def answer")
    assert inspect.getsourcefile(module.answer) == str(path)
    assert module.answer() == 42
    assert cache.load_source("probe", text, {"tag": "file"}) is module
    assert cache.path_of(module) == path and cache.source_of(module) == text


def test_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "kernel.py"
    cache.write_atomic(target, "first\n")
    assert target.read_text() == "first\n"

    def fail(src, dst):
        assert Path(src).read_text() == "second\n" and Path(dst) == target  # written in full, then renamed
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.write_atomic(target, "second\n")
    assert target.read_text() == "first\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["kernel.py"]  # no temporary file left


def test_key_covers_source_params_and_versions(monkeypatch):
    base = cache.cache_key("src", {"kind": "gdn"})
    assert cache.cache_key("src", {"kind": "gdn"}) == base
    assert cache.cache_key("src2", {"kind": "gdn"}) != base
    assert cache.cache_key("src", {"kind": "kda"}) != base
    monkeypatch.setattr(cache, "versions", lambda: {"torch": "0", "triton": "0", "laqat": "0"})
    assert cache.cache_key("src", {"kind": "gdn"}) != base


@pytest.fixture
def fresh_generated_modules(monkeypatch):
    """No generated module loaded earlier in this process (by another test, from another cache directory)."""
    monkeypatch.setattr(cache, "_LOADED", {})
    for per_process in (decode_module, chunk_codegen._module):
        per_process.cache_clear()
    yield
    for per_process in (decode_module, chunk_codegen._module):
        per_process.cache_clear()


def test_generated_module_per_spec(tmp_path, monkeypatch, fresh_generated_modules):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    gdn_kv = kernel_module_for_spec(DECODE_SPEC.format(kind="gdn", state="kv"))
    others = [kernel_module_for_spec(DECODE_SPEC.format(kind=k, state=s)) for k, s in (("kda", "kv"), ("gdn", "vk"))]
    keys = {m.__laqat_key__ for m in [gdn_kv, *others]}
    assert len(keys) == 3 and len({cache.path_of(m) for m in [gdn_kv, *others]}) == 3
    assert all(cache.path_of(m).is_relative_to(tmp_path) and sources.is_generated(m) for m in [gdn_kv, *others])
    # a spec field the kernel does not depend on (src, chunk) gives the same module
    assert kernel_module_for_spec(DECODE_SPEC.format(kind="gdn", state="kv").replace("src=user", "src=fla")) is gdn_kv
    text = sources.source_of(DECODE_SPEC.format(kind="gdn", state="kv"))
    assert text == decode_source(DecodeParams.from_spec(DECODE_SPEC.format(kind="gdn", state="kv")))
    assert "def decode_fwd_kernel" in text and "def decode_bwd_kernel" in text
    assert "IS_KDA = tl.constexpr(True)" in cache.source_of(others[0]) and "IS_KDA = tl.constexpr(False)" in text
    assert inspect.getsourcefile(gdn_kv.decode_fwd_kernel.fn) == str(cache.path_of(gdn_kv))
    assert sources.constexprs_of_spec(DECODE_SPEC.format(kind="gdn", state="kv")) == {}  # in the source instead


def test_spec_without_kernel_source_is_refused():
    with pytest.raises(CodegenError, match="names no Triton kernel family"):
        kernel_module_for_spec(SPEC.format(kind="gdn", state="kv").replace("fused_recurrent", "reference"))
    with pytest.raises(CodegenError, match="names no Triton kernel family"):
        sources.constexprs_of_spec(SPEC.format(kind="gdn", state="kv").replace("fused_recurrent", "reference"))


def test_render_checks_placeholders():
    assert render("a\n    ${BLOCK}\nb = ${EXPR}\n", {"BLOCK": "x = 1\ny = 2", "EXPR": "3"}) == \
        "a\n    x = 1\n    y = 2\nb = 3\n"
    assert render("    ${HOOK}\n", {"HOOK": ""}) == "    # hook HOOK: none\n"
    with pytest.raises(CodegenError, match="no value for placeholder"):
        render("${MISSING}", {})
    with pytest.raises(CodegenError, match="not used"):
        render("x", {"EXTRA": "1"})
    with pytest.raises(CodegenError, match="multi-line"):
        render("y = ${E}", {"E": "1\n2"})


def test_every_module_a_chunk_spec_runs_is_viewable(tmp_path, monkeypatch, capsys, fresh_generated_modules):
    """The chunk family's forward and backward stages are two modules: both reachable from the spec, both
    printed by ``laqat source``; a spec the kernels cannot run is refused by name."""
    from la_compiler.cli import main
    from la_compiler.kernels.sources import kernel_modules_for_spec

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    spec = "kda[src=user; layout=bthd; state=kv; chunk=64; solve=exact; phase=none; kernel=chunk; " \
           "q.state=int8/tile32]"
    modules = kernel_modules_for_spec(spec)
    assert list(modules) == ["forward", "backward"]
    assert hasattr(modules["forward"], "chunk_kda_fwd_kernel_h") and hasattr(modules["backward"], "chunk_kda_bwd_kernel_dh")
    paths = sources.paths_of_spec(spec)
    assert all(path.is_relative_to(tmp_path) for path in paths.values())
    assert main(["source", spec, "--paths"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{role}: {path}" for role, path in paths.items()]
    assert main(["source", spec]) == 0
    out = capsys.readouterr().out
    assert "def chunk_kda_fwd_kernel_h" in out and "def chunk_kda_bwd_kernel_dh" in out
    assert all(str(path) in out for path in paths.values())
    assert list(sources.paths_of_spec(SPEC.format(kind="gdn", state="kv"))) == ["forward and backward"]
    assert main(["source", spec.replace("q.state=int8/tile32", "q.state=int8/row")]) == 2
    assert "q.state=int8/row" in capsys.readouterr().err
