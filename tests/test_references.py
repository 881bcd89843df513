"""Every cross-reference in the repo's .py and .md files resolves inside the repo.

- A repo-relative path (its first component a top-level entry of the repo: `docs/SERVING.md`,
  `bench/kernels/gemm.py`, `serving/engine/`) must exist. Patterns (`*`, `{a,b}`, `<name>`) are not checked.
- A markdown link `[text](target)` must resolve from the file's directory (URLs and anchors aside).
- A document named by its bare name (`README.md`, `BENCHMARKS.md`) must be a file of the repo: in the citing
  file's directory, the root or docs/. So must a section citation (`NAME §2.3`, `NAME.md §2.3`), and the file must
  have that numbered section.
- Nothing cites the spec directory outside the repo (`../shared/spec/`, `/work/shared`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDORED = ("tools/official_parity/official/",)  # the official reference code, as published
SELF = "tests/test_references.py"  # its examples are broken on purpose

PATH = re.compile(r"(?<![\w/~$.:@-])([A-Za-z_.][\w.-]*(?:/[\w.*{},<>-]+)+/?)")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
BARE_MD = re.compile(r"(?<![\w/.\"'-])([A-Z][A-Z0-9_]*\.md)\b(?![\"'])")
SECTION = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]{2,})(?:\.md)? §\s?(\d+(?:\.\d+)*)")
OUTSIDE = re.compile(r"(\.\./shared/spec/|/work/shared\b)")


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(f for f in out if f.endswith((".py", ".md")) and not f.startswith(VENDORED) and f != SELF and
                  (ROOT / f).is_file())


def _md_home(name: str, citing: str) -> Path | None:
    for d in ((ROOT / citing).parent, ROOT, ROOT / "docs"):
        if (d / name).is_file():
            return d / name
    return None


def problems(rel: str, text: str) -> list[tuple[int, str, str]]:
    """(line, reference, why) of every reference in one file's text that does not resolve."""
    tops = {p.name for p in ROOT.iterdir() if p.name != ".git"}
    out = []

    def add(pos, ref, why):
        out.append((text.count("\n", 0, pos) + 1, ref, why))

    for m in PATH.finditer(text):
        ref = m.group(1).rstrip(".,:;")
        if ref.split("/")[0] in tops and not any(c in ref for c in "*{}<>") and not (ROOT / ref).exists():
            add(m.start(), ref, "no such path")
    if rel.endswith(".md"):
        for m in LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not ((ROOT / rel).parent / target).exists():
                add(m.start(), target, "broken link")
    for m in BARE_MD.finditer(text):
        if _md_home(m.group(1), rel) is None:
            add(m.start(), m.group(1), "not a file of the repo")
    for m in SECTION.finditer(text):
        home = _md_home(m.group(1) + ".md", rel)
        numbered = home is not None and re.search(rf"^#+\s*§?{re.escape(m.group(2))}\b", home.read_text(), re.M)
        if not numbered and not any(r == m.group(1) + ".md" for _, r, _ in out):
            add(m.start(), m.group(1) + ".md", f"no section {m.group(2)} in the repo")
    for m in OUTSIDE.finditer(text):
        add(m.start(), m.group(1), "outside the repo")
    return out


@pytest.fixture(scope="module")
def found() -> list[tuple[str, int, str, str]]:
    return [(rel, line, ref, why) for rel in repo_files()
            for line, ref, why in problems(rel, (ROOT / rel).read_text(errors="replace"))]


def test_every_reference_resolves(found):
    bad = [f"{rel}:{line}: {ref} ({why})" for rel, line, ref, why in found]
    assert not bad, "references that do not resolve inside the repo:\n" + "\n".join(bad)


def test_the_checker_catches_what_it_should():
    text = ("see docs/SERVING.md and docs/NOPE.md, [a](SERVING.md) [b](GONE.md) [c](https://x.org/y.md), "
            "MODEL.md §2.7, ../shared/spec/JAX_GPU.md, bench/results/*.json, `tmp_path / \"Q.md\"`, "
            "README.md, ARCHITECTURE §6")
    got = {(ref, why) for _, ref, why in problems("docs/X.md", text)}
    assert got == {("docs/NOPE.md", "no such path"), ("GONE.md", "broken link"), ("GONE.md", "not a file of the repo"),
                   ("MODEL.md", "not a file of the repo"),
                   ("../shared/spec/", "outside the repo"), ("ARCHITECTURE.md", "no section 6 in the repo")}
