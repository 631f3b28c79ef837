"""Real text as byte-level tokens: the Python standard library's own source (every machine has it), or English
prose from a package registry (examples/qat/prose.py).

    corpus = load_corpus()                                  # train / held-out split by module name
    corpus = load_corpus(source="prose")                    # State of the Union addresses and Moby-Dick
    tokens = train_batch(corpus, step=7, seed=0, batch_size=8, seq_len=256)   # [8, 257], deterministic
    batches = eval_batches(corpus, sequences=64, seq_len=256, batch_size=16)  # fixed held-out windows

Tokens are the bytes 0..255 of each ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, each file
preceded by ``BOS`` (256): ``VOCAB_SIZE`` = 257. A file belongs to its top-level module (``json/decoder.py``
to ``json``, ``os.py`` to ``os``); a module is held out when the SHA-256 of its name falls in the held-out
fraction, so the split depends on names only, never on file order, sizes or the machine. The regression-test
package ``test`` (half the bytes, one module) and ``site-packages`` are left out. The text differs between
Python versions: ``Corpus.fingerprint`` (a hash of both token streams) says which text a result was measured on.
With ``source="prose"`` a document is one address or one chapter, held out by the SHA-256 of its name the same way.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from pathlib import Path

import torch

BOS = 256  # the start of every file
VOCAB_SIZE = 257
EXCLUDED_MODULES = ("test", "site-packages", "__pycache__")
SOURCES = ("stdlib", "prose")


class CorpusError(ValueError):
    """A corpus or batch argument that cannot be satisfied; the message names the argument."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # int16 token stream of the training modules' files, in path order
    heldout: torch.Tensor  # the same for the held-out modules
    train_modules: tuple[str, ...]
    heldout_modules: tuple[str, ...]
    python: str  # the version whose standard library this is
    fingerprint: str  # sha256 of both streams (first 16 hex digits)
    source: str = "Python standard library (.py files)"

    def describe(self) -> dict:
        return {"source": self.source, "python": self.python,
                "train_tokens": int(self.train.numel()), "heldout_tokens": int(self.heldout.numel()),
                "train_modules": len(self.train_modules), "heldout_modules": list(self.heldout_modules),
                "fingerprint": self.fingerprint}

    def to(self, device) -> "Corpus":
        return dataclasses.replace(self, train=self.train.to(device), heldout=self.heldout.to(device))


def module_of(relative: Path) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def is_heldout(module: str, fraction: float) -> bool:
    bucket = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) / 16 ** 8
    return bucket < fraction


def stdlib_files(root: Path) -> dict[str, list[Path]]:
    """Module name -> its .py files (sorted), for every module not in EXCLUDED_MODULES."""
    modules: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in EXCLUDED_MODULES for part in relative.parts):
            continue
        modules.setdefault(module_of(relative), []).append(path)
    return modules


def _stream(blobs: list[bytes]) -> torch.Tensor:
    """The documents' bytes, each preceded by BOS, as one int16 stream."""
    blobs = [b"\0" + blob for blob in blobs]  # the \0 is each document's BOS slot
    if not blobs:
        return torch.zeros(0, dtype=torch.int16)
    stream = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).to(torch.int16)
    starts = torch.tensor([0] + [len(b) for b in blobs[:-1]]).cumsum(0)
    stream[starts] = BOS
    return stream


def load_corpus(heldout_fraction: float = 0.1, root: str | Path | None = None, source: str = "stdlib") -> Corpus:
    """``root``: the standard library's folder (stdlib) or the folder holding prose.py's tarballs (prose; default:
    fetched into the cache)."""
    if not 0 < heldout_fraction < 1:
        raise CorpusError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if source == "stdlib":
        root = Path(root or sysconfig.get_paths()["stdlib"])
        modules = {m: [f.read_bytes() for f in files] for m, files in stdlib_files(root).items()}
        what, description = f"no .py files under {str(root)!r}", "Python standard library (.py files)"
    elif source == "prose":
        from prose import DESCRIPTION, prose_documents

        modules = {name: [text] for name, text in prose_documents(root).items()}
        what, description = "no documents", DESCRIPTION
    else:
        raise CorpusError(f"source must be one of {SOURCES}, got {source!r}")
    if not modules:
        raise CorpusError(f"root: {what}")
    heldout = sorted(m for m in modules if is_heldout(m, heldout_fraction))
    train = sorted(m for m in modules if m not in heldout)
    if not heldout or not train:
        raise CorpusError(f"heldout_fraction={heldout_fraction} leaves an empty split of {len(modules)} modules")
    train_stream = _stream([b for m in train for b in modules[m]])
    heldout_stream = _stream([b for m in heldout for b in modules[m]])
    digest = hashlib.sha256(train_stream.numpy().tobytes() + heldout_stream.numpy().tobytes()).hexdigest()[:16]
    return Corpus(train_stream, heldout_stream, tuple(train), tuple(heldout),
                  f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}", digest, description)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(seq_len + 1, device=stream.device)
    return stream[starts.to(stream.device)[:, None] + offsets].long()


def _check_shape(stream: torch.Tensor, seq_len: int, name: str) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise CorpusError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if stream.numel() < seq_len + 1:
        raise CorpusError(f"seq_len={seq_len}: the {name} split has only {stream.numel()} tokens")


def train_batch(corpus: Corpus, step: int, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` training tokens; a function of (seed, step) only, so a
    resumed run sees the batches the uninterrupted run would have seen."""
    _check_shape(corpus.train, seq_len, "training")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.train.numel() - seq_len, (batch_size,), generator=generator)
    return _windows(corpus.train, starts, seq_len)


def eval_batches(corpus: Corpus, sequences: int, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """``sequences`` windows of ``seq_len + 1`` held-out tokens, evenly spaced over the held-out stream (so
    that every held-out module weighs by its size), in batches of ``batch_size``."""
    _check_shape(corpus.heldout, seq_len, "held-out")
    if sequences < 1 or batch_size < 1 or sequences % batch_size:
        raise CorpusError(f"sequences must be a positive multiple of batch_size (one batch shape, one compiled "
                          f"graph), got {sequences} and {batch_size}")
    last = corpus.heldout.numel() - seq_len - 1
    starts = torch.linspace(0, last, sequences).round().long()
    return [_windows(corpus.heldout, starts[i:i + batch_size], seq_len) for i in range(0, sequences, batch_size)]
