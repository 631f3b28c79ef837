"""The docs that code, tests and docs point at are in the repository: every ``docs/<name>.md`` they name exists,
and none names the design cards the repository does not ship (its numerics contract is docs/numerics.md, its
design docs/architecture.md)."""
from __future__ import annotations

import re
import subprocess

from tests.la_compiler.test_import_layers import ROOT

RECORDS = "examples/benchmarks/results/"  # measurement records quote the tree of their day
DOC_REFERENCE = re.compile(r"\bdocs/[\w-]+\.md\b")
ABSENT_CARDS = re.compile(r"\b(NUMERICS|DESIGN|BASELINES)\.md\b")


def _texts() -> dict[str, str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    paths = [p for p in out if not p.startswith(RECORDS) and p.endswith((".py", ".md", ".sh", ".yaml", "Makefile"))]
    return {p: (ROOT / p).read_text() for p in paths if (ROOT / p).exists()}


def test_every_cited_doc_exists():
    missing = sorted({(path, ref) for path, text in _texts().items() for ref in DOC_REFERENCE.findall(text)
                      if not (ROOT / ref).exists()})
    assert not missing, missing


def test_no_text_cites_a_design_card_the_repository_lacks():
    citing = sorted(path for path, text in _texts().items() if ABSENT_CARDS.search(text))
    assert not citing, citing
