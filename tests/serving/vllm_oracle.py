"""vLLM 0.33.0's GDN / KDA serving kernels, loaded from its wheel: the oracle of the parity tests.

Nothing of vLLM is in this repository. ``load()`` fetches the wheel with ``pip download --no-deps``
into a cache directory outside the repository (``$LAQAT_TEST_CACHE`` or ``~/.cache/laqat-test``, then
``vllm-0.33.0/``; a wheel already there is reused), extracts only the kernel files below, writes a
minimal fake ``vllm`` package around them (its ``__version__`` and the few names those files import: ``current_platform``,
``triton_utils``, two helpers of ``vllm.utils``) and imports them with that directory on ``sys.path``
only while importing. The modules keep their own file names, so Triton reads the kernels' source
from the extracted files.

Two things differ from running inside vLLM, neither of them arithmetic:
- autotuned kernels run their first config, as vLLM's ``VLLM_TRITON_FORCE_FIRST_CONFIG=1`` does;
- under ``TRITON_INTERPRET=1`` two source edits let Triton's interpreter run the files: in FLA's
  state kernel ``i_t.to(tl.int64)`` on a loop index becomes ``tl.cast(i_t, tl.int64)`` (the
  interpreter's loop index is a Python int, which has no ``.to``), and ``op.py``'s aliases
  ``exp = tl.exp`` (and exp2, log, log2) become ``@triton.jit`` functions that call them (the
  interpreter patches ``tl``'s functions at launch, which a module-level alias does not see). Both
  compute the same operations. Compiled for a GPU, the files run unedited.

On a machine that cannot reach the package index (a GPU host), ``python -m tests.serving.vllm_oracle
--prepare out/vllm-oracle`` (run where it can) writes the extracted files, and ``load(src=...)`` reads them.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

VERSION = "0.33.0"
FLA_OPS = "vllm/third_party/flash_linear_attention/ops"
KDA_OPS = "vllm/models/kimi_k3/nvidia/ops/third_party/kda"
KERNEL_FILES = tuple(
    [f"{FLA_OPS}/{name}.py" for name in (
        "chunk", "chunk_delta_h", "chunk_o", "chunk_scaled_dot_kkt", "cumsum", "fused_gdn_prefill_post_conv",
        "fused_recurrent", "index", "l2norm", "op", "solve_tril", "utils", "wy_fast")]
    + [f"{KDA_OPS}/{name}.py" for name in ("chunk", "chunk_intra", "chunk_intra_token_parallel",
                                             "fused_recurrent")]
    + ["vllm/utils/math_utils.py"])
# Packages whose __init__ is replaced by an empty one (theirs import the rest of vLLM).
PACKAGES = ("vllm", "vllm/third_party", "vllm/third_party/flash_linear_attention", FLA_OPS, "vllm/models",
            "vllm/models/kimi_k3", "vllm/models/kimi_k3/nvidia", "vllm/models/kimi_k3/nvidia/ops",
            "vllm/models/kimi_k3/nvidia/ops/third_party", KDA_OPS, "vllm/utils")
_ALIASES = "    exp = tl.exp\n    exp2 = tl.exp2\n    log = tl.log\n    log2 = tl.log2\n"
_JIT_ALIASES = "".join(f"    @triton.jit\n    def {name}(x):\n        return tl.{name}(x)\n\n"
                       for name in ("exp", "exp2", "log", "log2"))
INTERPRETER_EDITS = {
    f"{FLA_OPS}/chunk_delta_h.py": [("i_t.to(tl.int64)", "tl.cast(i_t, tl.int64)")],
    f"{FLA_OPS}/op.py": [(_ALIASES, _JIT_ALIASES)],
}

STUBS = {
    "vllm/__init__.py": f'''"""Stand-in for vllm: the release its kernel files come from (``vllm.__version__``)."""
__version__ = "{VERSION}"
''',
    "vllm/platforms/__init__.py": '''"""Stand-in for vllm.platforms: the questions the kernel files ask of the device."""
import torch


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available() and torch.version.hip is None

    def is_cuda_alike(self):
        return torch.cuda.is_available()

    def is_rocm(self):
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self):
        return False

    def _capability(self, device_id=None):
        if not self.is_cuda():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor

    def is_device_capability(self, capability, device_id=None):
        return self._capability(device_id) == capability

    def is_device_capability_family(self, capability, device_id=None):
        found = self._capability(device_id)
        return found is not None and found // 10 == capability // 10

    def has_device_capability(self, capability, device_id=None):
        found = self._capability(device_id)
        return found is not None and found >= capability

    def is_arch_support_pdl(self):
        return False  # programmatic dependent launch orders launches; it computes nothing


current_platform = _Platform()
''',
    "vllm/triton_utils/__init__.py": '''"""Stand-in for vllm.triton_utils: Triton itself."""
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice
''',
    "vllm/utils/gpu_sync_debug.py": '''"""Stand-in: vLLM's GPU-sync checker is off unless configured."""
import contextlib


def gpu_sync_allowed(first_only=False):
    return contextlib.nullcontext()
''',
    "vllm/utils/torch_utils.py": '''"""Stand-in: async_tensor_h2d without pinned memory (the same values)."""
import torch


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return t.to(device=device, dtype=dtype or t.dtype)
''',
}


class OracleUnavailable(RuntimeError):
    """The oracle cannot be loaded (a wheel without an expected file, another vllm imported already)."""


class IndexUnreachable(OracleUnavailable):
    """The vLLM wheel is not cached and ``pip download`` could not fetch it (the package index cannot be reached)."""


def cache_dir() -> Path:
    root = os.environ.get("LAQAT_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "laqat-test")
    return Path(root) / f"vllm-{VERSION}"


def _wheel_in(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"vllm-{VERSION}-*.whl"))
    return found[0] if found else None


def fetch_wheel(directory: Path) -> Path:
    """The cached wheel, or one downloaded now (``pip download vllm==0.33.0 --no-deps``)."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = _wheel_in(directory)
    if wheel is not None:
        return wheel
    # into a directory of this process's own, then renamed into place: pytest-xdist's workers may fetch at once
    incoming = Path(tempfile.mkdtemp(prefix="download-", dir=directory))
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps", "--only-binary=:all:",
           "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "-d", str(incoming),
           "--disable-pip-version-check", "-q"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        fetched = _wheel_in(incoming)
        if done.returncode != 0 or fetched is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise IndexUnreachable(f"pip download vllm=={VERSION} failed (the package index cannot be reached?): "
                                   + " | ".join(tail))
        os.replace(fetched, directory / fetched.name)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise IndexUnreachable(f"pip download vllm=={VERSION} did not finish: {e}") from None
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    return _wheel_in(directory)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def extract(wheel: Path, root: Path, *, interpreter: bool | None = None) -> Path:
    """The kernel files and the stubs under ``root/src-<tag>``; the tag names the wheel and the edits
    (the interpreter's, where ``interpreter`` or, left None, ``TRITON_INTERPRET=1``)."""
    edits = INTERPRETER_EDITS if (_interpreting() if interpreter is None else interpreter) else {}
    tag = hashlib.sha256(repr((wheel.name, wheel.stat().st_size, KERNEL_FILES, sorted(edits.items()),
                               sorted(STUBS.items()))).encode()).hexdigest()[:12]
    src = root / f"src-{tag}"
    if (src / ".complete").exists():
        return src
    tmp = root / f"src-{tag}.tmp-{os.getpid()}"
    with zipfile.ZipFile(wheel) as z:
        for name in KERNEL_FILES:
            text = z.read(name).decode()
            for old, new in edits.get(name, ()):
                if old not in text:
                    raise OracleUnavailable(f"{name}: expected {old!r} to edit for the interpreter")
                text = text.replace(old, new)
            _write(tmp / name, text)
    for package in PACKAGES + ("vllm/platforms", "vllm/triton_utils"):
        if not (tmp / package / "__init__.py").exists():
            _write(tmp / package / "__init__.py", '"""Empty: the kernel files are imported one by one."""\n')
    for name, text in STUBS.items():
        _write(tmp / name, text)
    (tmp / ".complete").write_text(wheel.name)
    try:
        tmp.rename(src)
    except OSError:  # another process extracted the same tag first
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def _write(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@contextlib.contextmanager
def _on_path(src: Path):
    clash = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    if clash and not str(getattr(sys.modules["vllm"], "__file__", "")).startswith(str(src)):
        raise OracleUnavailable(f"another vllm is imported already ({sys.modules['vllm']}); the oracle needs "
                                f"its own stub package")
    sys.path.insert(0, str(src))
    try:
        yield
    finally:
        sys.path.remove(str(src))


def _first_config_only(module):
    """Autotuned kernels of ``module`` keep their first config (vLLM's VLLM_TRITON_FORCE_FIRST_CONFIG)."""
    import triton

    for value in vars(module).values():
        while isinstance(value, triton.runtime.KernelInterface):  # heuristics wrap autotuners wrap kernels
            if isinstance(value, triton.runtime.Autotuner) and len(value.configs) > 1:
                value.configs = value.configs[:1]
            value = getattr(value, "fn", None)


_loaded: SimpleNamespace | None = None
_stand_in_modules: dict = {}  # sys.modules' vllm entries as load() left them


def load(src: Path | None = None) -> SimpleNamespace:
    """The oracle's modules: ``gdn_chunk``, ``gdn_recurrent``, ``gdn_post_conv``, ``kda_chunk``,
    ``kda_recurrent`` (vLLM's own files) and ``src`` (where they were extracted). ``src``: a directory
    ``extract`` (or ``--prepare``) wrote before, e.g. on a machine that cannot reach the package index."""
    global _loaded
    if _loaded is None:
        if src is None:
            root = cache_dir()
            src = extract(fetch_wheel(root), root)
        elif not (Path(src) / ".complete").exists():
            raise OracleUnavailable(f"{src} holds no extracted vLLM kernels (write it with "
                                    f"`python -m tests.serving.vllm_oracle --prepare DIR`)")
        src = Path(src).resolve()
        names = {"gdn_chunk": f"{FLA_OPS}/chunk", "gdn_recurrent": f"{FLA_OPS}/fused_recurrent",
                 "gdn_post_conv": f"{FLA_OPS}/fused_gdn_prefill_post_conv", "kda_chunk": f"{KDA_OPS}/chunk",
                 "kda_recurrent": f"{KDA_OPS}/fused_recurrent"}
        modules = {}
        with _on_path(src):
            for key, path in names.items():
                modules[key] = importlib.import_module(path.replace("/", "."))
            for name, module in list(sys.modules.items()):
                if name.startswith("vllm."):
                    _first_config_only(module)
        _stand_in_modules.update({n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")})
        _loaded = SimpleNamespace(src=src, **modules)
    sys.modules.update(_stand_in_modules)  # importable as ``vllm`` again after a caller removed it
    return _loaded


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Fetch vLLM's wheel and extract the oracle's kernel files.")
    parser.add_argument("--prepare", metavar="DIR", required=True,
                        help="extract into DIR/src-<tag> (prints the path), e.g. out/vllm-oracle to carry to a GPU")
    parser.add_argument("--for-interpreter", action="store_true",
                        help="apply the interpreter's source edits (by default the files are left as vLLM ships them)")
    args = parser.parse_args(argv)
    print(extract(fetch_wheel(cache_dir()), Path(args.prepare), interpreter=args.for_interpreter))


if __name__ == "__main__":
    main()
