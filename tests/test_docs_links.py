"""Every local file the docs point at exists: markdown links and images (relative to the linking file's folder, as
GitHub resolves them) and bare repository paths in inline code (`bench/results/...`, relative to the repository
root; a * matches as a glob). A target must be a file git keeps (tracked, or new and not ignored): a link to an
ignored file passes where it was made and fails on a clean clone. Web links, anchors within a page and fenced code
blocks (commands) are not checked."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    {
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        ROOT / "bench" / "README.md",
        *ROOT.glob("studies/**/README.md"),
        *ROOT.glob("colab/*.md"),
    }
)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"(?<!`)`([^`\s]+)`(?!`)")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
REPO_DIRS = ("bench/", "studies/", "docs/", "kvzip_jax/", "tests/", "colab/")  # where a bare path starts
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def targets(doc: Path) -> list[tuple[int, str, Path | None]]:
    """(line, as written, the path it names; None for a glob of the repository root) of each local target in doc."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text(encoding="utf-8"))
    found = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not EXTERNAL.match(m.group(1)):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1), doc.parent / target.split("?", 1)[0]))
    for m in CODE.finditer(text):
        path = m.group(1).rstrip(".,;:")
        if path.startswith(REPO_DIRS) and not EXTERNAL.match(path):
            found.append((text.count("\n", 0, m.start()) + 1, path, None if "*" in path else ROOT / path))
    return found


def kept_by_git() -> set[str] | None:
    """Repository-relative paths of the files and folders a clean clone would hold; None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {f for f in out.split("\0") if f and (ROOT / f).exists()}
    return files | {p.as_posix() for f in files for p in Path(f).parents if p != Path(".")}


KEPT = kept_by_git()


def kept(written: str, path: Path | None) -> bool:
    """Whether a clean clone holds the target (path None: any match of written as a glob of the root)."""
    found = list(ROOT.glob(written)) if path is None else [path.resolve()] if path.exists() else []
    if KEPT is None:
        return bool(found)
    return any(not p.is_relative_to(ROOT) or p == ROOT or p.relative_to(ROOT).as_posix() in KEPT for p in found)


def test_the_docs_are_found():
    names = {d.relative_to(ROOT).as_posix() for d in DOCS}
    assert {"README.md", "docs/results.md", "bench/README.md", "studies/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_local_link_and_repo_path_exists(doc):
    missing = [
        f"{doc.relative_to(ROOT)}:{line}: {written}" for line, written, path in targets(doc) if not kept(written, path)
    ]
    assert not missing, "links to files a clean clone lacks (missing or ignored by git):\n" + "\n".join(missing)


def test_the_checker_sees_links_and_paths(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(
        "[x](b.md#part) ![p](img/c.png) [w](https://example.com/d) [in page](#e)\n"
        "see `bench/results/` and `studies/*/README.md`, not `a b` nor `--flag`\n"
        "```\n[hidden](nowhere.md) `bench/results/nowhere.txt`\n```\n"
    )
    found = [(line, written) for line, written, _ in targets(doc)]
    assert found == [(1, "b.md#part"), (1, "img/c.png"), (2, "bench/results/"), (2, "studies/*/README.md")]
