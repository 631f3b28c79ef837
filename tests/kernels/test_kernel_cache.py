"""The code cache and the code generator: atomic writes, LAQAT_CACHE_DIR, real module files, keys."""
import inspect
import os
from pathlib import Path

import pytest

from la_compiler.kernels.chunk import codegen as chunk_codegen
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.common import cache
from la_compiler.kernels import sources
from la_compiler.kernels.common.codegen import CodegenError, render
from la_compiler.kernels.decode import kernels as decode_kernels
from la_compiler.kernels.decode.fused import DecodeParams
from la_compiler.kernels.sources import kernel_module_for_spec
from la_compiler.spec import RecurrenceSpec

SPEC = "{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=fused_recurrent]"
CHUNK_SPEC = ("{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=chunk; "
              "q.state=int8/tile32]")
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
    chunk_codegen._module.cache_clear()
    yield
    chunk_codegen._module.cache_clear()


def test_generated_module_per_spec(tmp_path, monkeypatch, fresh_generated_modules):
    """The chunk family's generated forward module: one per spec, in the code cache, its real file."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    gdn_kv = kernel_module_for_spec(CHUNK_SPEC.format(kind="gdn", state="kv"))
    others = [kernel_module_for_spec(CHUNK_SPEC.format(kind=k, state=s)) for k, s in (("kda", "kv"), ("gdn", "vk"))]
    keys = {m.__laqat_key__ for m in [gdn_kv, *others]}
    assert len(keys) == 3 and len({cache.path_of(m) for m in [gdn_kv, *others]}) == 3
    assert all(cache.path_of(m).is_relative_to(tmp_path) and sources.is_generated(m) for m in [gdn_kv, *others])
    # a spec field the kernel does not depend on (src) gives the same module
    assert kernel_module_for_spec(CHUNK_SPEC.format(kind="gdn", state="kv").replace("src=user", "src=fla")) is gdn_kv
    text = sources.source_of(CHUNK_SPEC.format(kind="gdn", state="kv"))
    assert text == chunk_codegen.chunk_fwd_source(ChunkParams.from_spec(
        RecurrenceSpec.parse(CHUNK_SPEC.format(kind="gdn", state="kv"))))
    assert "def chunk_gdn_fwd_kernel_h" in text and "def chunk_kda_fwd_kernel_h" in cache.source_of(others[0])
    assert inspect.getsourcefile(gdn_kv.chunk_gdn_fwd_kernel_h.fn) == str(cache.path_of(gdn_kv))
    assert sources.constexprs_of_spec(CHUNK_SPEC.format(kind="gdn", state="kv")) == {}  # in the source instead


def test_decode_kernels_are_one_module_specialized_by_constexprs(tmp_path, monkeypatch, capsys):
    """The decode family is not generated: every spec runs decode/kernels.py, and what the spec fixes is its
    tl.constexpr values (DecodeParams.constants()), one set per spec, which laqat source prints with the file."""
    from la_compiler.cli import main

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    specs = {(k, s): DECODE_SPEC.format(kind=k, state=s) for k, s in (("gdn", "kv"), ("kda", "kv"), ("gdn", "vk"))}
    for spec in specs.values():
        assert sources.kernel_modules_for_spec(spec) == {"forward and backward": decode_kernels}
    path = Path(decode_kernels.__file__)
    assert not sources.is_generated(decode_kernels) and sources.path_of(specs["gdn", "kv"]) == path
    text = sources.source_of(specs["gdn", "kv"])
    assert text == path.read_text() and "def decode_fwd_kernel" in text and "def decode_bwd_kernel" in text
    assert inspect.getsourcefile(decode_kernels.decode_fwd_kernel.fn) == str(path)
    values = {key: sources.constexprs_of_spec(spec) for key, spec in specs.items()}
    assert len({tuple(sorted(v.items())) for v in values.values()}) == 3  # one specialization per spec
    assert values["gdn", "kv"] == DecodeParams.from_spec(specs["gdn", "kv"]).constants()
    assert values["gdn", "kv"]["IS_KDA"] is False and values["kda", "kv"]["IS_KDA"] is True
    assert values["gdn", "kv"]["STATE_VK"] is False and values["gdn", "vk"]["STATE_VK"] is True
    assert values["gdn", "kv"]["CODEC"] == 1  # q.state=fp8_e4m3
    # a spec field the kernels do not depend on (src, chunk) gives the same values
    assert sources.constexprs_of_spec(specs["gdn", "kv"].replace("src=user", "src=fla")) == values["gdn", "kv"]
    assert main(["source", specs["kda", "kv"], "--paths"]) == 0
    listed = ", ".join(f"{name}={value!r}" for name, value in values["kda", "kv"].items())
    assert capsys.readouterr().out.splitlines() == [f"forward and backward: {path}", f"constexpr: {listed}"]
    assert main(["source", specs["kda", "kv"]]) == 0
    out = capsys.readouterr().out
    assert "# specialized by the spec with tl.constexpr IS_KDA=True, STATE_VK=False, CODEC=1" in out and text in out


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
