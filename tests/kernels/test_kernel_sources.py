"""What a spec runs (kernels/sources.py, ``laqat source``): the package's kernel files and the tl.constexpr values
the spec specializes them with; the on-disk cache's atomic writes and LAQAT_CACHE_DIR."""
import inspect
import os
from pathlib import Path

import pytest

from la_compiler.kernels import sources
from la_compiler.kernels.chunk import stages
from la_compiler.kernels.chunk.flags import spec_constexprs
from la_compiler.kernels.chunk.params import ChunkParams
from la_compiler.kernels.common import cache
from la_compiler.kernels.common.errors import KernelParamsError
from la_compiler.kernels.decode import kernels as decode_kernels
from la_compiler.kernels.decode.suffix import DecodeParams
from la_compiler.kernels.sources import kernel_module_for_spec
from la_compiler.options import cache_dir

SPEC = "{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=fused_recurrent]"
CHUNK_SPEC = ("{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=none; kernel=chunk; "
              "q.state=int8/tile32]")
DECODE_SPEC = ("{kind}[src=user; layout=bthd; state={state}; chunk=64; solve=exact; phase=token; kernel=decode_fused; "
               "q.state=fp8_e4m3/tile16]")


def test_cache_dir_env_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    assert cache.cache_dir() == tmp_path == cache_dir()


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


def test_decode_kernels_are_one_module_specialized_by_constexprs(tmp_path, monkeypatch, capsys):
    """Every decode spec runs decode/kernels.py for its suffix (and the chunk stage modules for its prefix), and
    what the spec fixes is their tl.constexpr values (DecodeParams.constants(), then the prefix's as "prefix
    <NAME>"), one set per spec, which laqat source prints with the files."""
    from la_compiler.cli import main

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    specs = {(k, s): DECODE_SPEC.format(kind=k, state=s) for k, s in (("gdn", "kv"), ("kda", "kv"), ("gdn", "vk"))}
    for spec in specs.values():
        modules = sources.kernel_modules_for_spec(spec)
        assert next(iter(modules.items())) == ("suffix (decode) forward and backward", decode_kernels)
        assert all(role.startswith("prefix (chunk) ") for role in list(modules)[1:]) and len(modules) > 1
    path = Path(decode_kernels.__file__)
    assert sources.path_of(specs["gdn", "kv"]) == path
    text = sources.source_of(specs["gdn", "kv"])
    assert text == path.read_text() and "def decode_fwd_kernel" in text and "def decode_bwd_kernel" in text
    assert inspect.getsourcefile(decode_kernels.decode_fwd_kernel.fn) == str(path)
    values = {key: sources.constexprs_of_spec(spec) for key, spec in specs.items()}
    suffix_values = {key: {n: x for n, x in v.items() if not n.startswith("prefix ")} for key, v in values.items()}
    assert len({tuple(sorted(v.items())) for v in suffix_values.values()}) == 3  # one specialization per spec
    assert suffix_values["gdn", "kv"] == DecodeParams.from_spec(specs["gdn", "kv"]).constants()
    assert values["gdn", "kv"]["IS_KDA"] is False and values["kda", "kv"]["IS_KDA"] is True
    assert values["kda", "kv"]["prefix KDA"] is True and values["gdn", "kv"]["prefix STATE_Q"] == ""  # exact prefix
    assert values["gdn", "kv"]["STATE_VK"] is False and values["gdn", "vk"]["STATE_VK"] is True
    assert values["gdn", "kv"]["CODEC"] == 1  # q.state=fp8_e4m3
    # a spec field the kernels do not depend on (src) gives the same values
    assert sources.constexprs_of_spec(specs["gdn", "kv"].replace("src=user", "src=fla")) == values["gdn", "kv"]
    assert main(["source", specs["kda", "kv"], "--paths"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"suffix (decode) forward and backward: {path}"
    listed = ", ".join(f"{name}={value!r}" for name, value in values["kda", "kv"].items())
    assert lines[-1] == f"constexpr: {listed}"
    assert main(["source", specs["kda", "kv"]]) == 0
    out = capsys.readouterr().out
    assert "# specialized by the spec with tl.constexpr IS_KDA=True, STATE_VK=False, CODEC=1" in out and text in out


def test_spec_without_kernel_source_is_refused():
    with pytest.raises(KernelParamsError, match="names no Triton kernel family"):
        kernel_module_for_spec(SPEC.format(kind="gdn", state="kv").replace("fused_recurrent", "reference"))
    with pytest.raises(KernelParamsError, match="names no Triton kernel family"):
        sources.constexprs_of_spec(SPEC.format(kind="gdn", state="kv").replace("fused_recurrent", "reference"))


def test_every_module_a_chunk_spec_runs_is_viewable(capsys):
    """The chunk family's stage modules a spec launches, by role, are the package's own files; the spec fixes
    their constexprs (chunk/flags.py), one set per spec, which ``laqat source`` prints with the files; a spec the
    kernels cannot run is refused by name."""
    from la_compiler.cli import main

    kda = CHUNK_SPEC.format(kind="kda", state="kv")
    modules = sources.kernel_modules_for_spec(kda)
    assert list(modules) == ["forward cumsum, pairs", "forward intra_kda", "forward wu", "forward h", "forward o",
                             "backward dh", "backward intra_split_pairs", "backward pairs", "backward dg"]
    assert all(hasattr(m, "KERNELS") and Path(m.__file__).parent.name == "chunk" for m in modules.values())
    assert hasattr(modules["forward h"], "chunk_fwd_kernel_h") and hasattr(modules["backward dh"], "chunk_bwd_kernel_dh")
    assert inspect.getsourcefile(modules["forward h"].chunk_fwd_kernel_h.fn) == modules["forward h"].__file__
    gdn = CHUNK_SPEC.format(kind="gdn", state="vk")
    assert list(sources.kernel_modules_for_spec(gdn)) == ["forward intra_gdn", "forward wu", "forward h", "forward o",
                                                          "backward dh", "backward intra_key_blocks"]
    values = sources.constexprs_of_spec(kda)
    assert values["KDA"] is True and values["STATE_VK"] is False and values["STATE_Q"] == "int8"
    assert sources.constexprs_of_spec(gdn)["KDA"] is False and sources.constexprs_of_spec(gdn)["STATE_VK"] is True
    assert values.items() <= spec_constexprs(ChunkParams.from_spec(kda)).items()
    assert values == stages.constexprs_of(ChunkParams.from_spec(kda))
    # a spec field the kernels do not depend on (src) fixes the same values
    assert sources.constexprs_of_spec(kda.replace("src=user", "src=fla")) == values
    paths = sources.paths_of_spec(kda)
    assert main(["source", kda, "--paths"]) == 0
    listed = ", ".join(f"{name}={value!r}" for name, value in values.items())
    assert capsys.readouterr().out.splitlines() == [f"{role}: {path}" for role, path in paths.items()] + [
        f"constexpr: {listed}"]
    assert main(["source", kda]) == 0
    out = capsys.readouterr().out
    assert "def chunk_fwd_kernel_h" in out and "def chunk_bwd_kernel_dh" in out and "KDA=True" in out
    assert all(str(path) in out for path in paths.values())
    assert list(sources.paths_of_spec(SPEC.format(kind="gdn", state="kv"))) == ["forward and backward"]
    assert main(["source", kda.replace("q.state=int8/tile32", "q.state=int8/row")]) == 2
    assert "q.state=int8/row" in capsys.readouterr().err
