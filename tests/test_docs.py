"""Cheap checks that the documentation stays findable: the README stays short, every relative
link in README.md and docs/*.md (and the #anchor of a link into a Markdown page) exists, and
the code cites the design page as docs/design.md, by sections that exist."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 160
CODE_DIRS = ("zkernels", "tests", "benchmarks", "examples", "csrc", "python", ".ci")
CODE_EXTS = (".py", ".pyi", ".cpp", ".h", ".cu", ".cuh", ".sh", ".txt", ".toml", ".cfg", "")
BARE_DESIGN = "DESIGN" + ".md"        # spelled apart so that this file does not cite it
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"docs/design\.md(#[A-Za-z0-9_-]+)?")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_pages(root=ROOT):
    pages = [os.path.join(root, "README.md"), os.path.join(root, "benchmarks", "README.md")]
    docs = os.path.join(root, "docs")
    pages += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return pages


def anchors(markdown: str) -> set:
    """GitHub's heading ids: lower case, punctuation dropped, each space a hyphen (fenced code
    skipped, so a '#' comment in a shell block is no heading)."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def broken_links(page: str) -> list:
    text = _read(page)
    text = re.sub(r"```.*?```", "", text, flags=re.S)     # links only in prose, not in code
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):                   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(full):
            bad.append(f"{target} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in anchors(_read(full)):
            bad.append(f"{target} (no such section)")
    return bad


def code_files(root=ROOT):
    for top in CODE_DIRS:
        for dirpath, dirnames, files in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "build")]
            for f in files:
                if os.path.splitext(f)[1] in CODE_EXTS and not f.endswith(".so"):
                    yield os.path.join(dirpath, f)


def bad_citations(root=ROOT) -> list:
    sections = anchors(_read(os.path.join(root, "docs", "design.md")))
    bad = []
    for path in code_files(root):
        try:
            text = _read(path)
        except UnicodeDecodeError:
            continue
        rel = os.path.relpath(path, root)
        if os.path.abspath(path) == os.path.abspath(__file__):
            continue                     # this file's made-up citations, in the last test
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"(?<![\w/])" + re.escape(BARE_DESIGN), line):
                bad.append(f"{rel}:{n}: cites {BARE_DESIGN}, which is docs/design.md")
            for anchor in CITATION.findall(line):
                if anchor and anchor[1:] not in sections:
                    bad.append(f"{rel}:{n}: docs/design.md{anchor}: no such section")
    return bad


def readme_too_long(root=ROOT):
    n = len(_read(os.path.join(root, "README.md")).splitlines())
    return f"README.md has {n} lines; move detail into docs/" if n > README_MAX_LINES else None


def test_readme_is_short():
    assert readme_too_long() is None, readme_too_long()


def test_relative_links_resolve():
    bad = {os.path.relpath(p, ROOT): broken_links(p) for p in doc_pages()}
    assert not {p: b for p, b in bad.items() if b}


def test_code_cites_design_sections_that_exist():
    assert os.path.exists(os.path.join(ROOT, "docs", "design.md"))
    assert not bad_citations()


def test_the_checks_can_fail(tmp_path):
    """Each check catches what it is for, on a made-up tree."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "zkernels").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## The ladder\n\n```\n# no\n```\n")
    (tmp_path / "benchmarks" / "README.md").write_text("[ok](../docs/design.md#the-ladder)\n")
    (tmp_path / "README.md").write_text(
        "[gone](docs/gone.md) [no section](docs/design.md#no) [fenced](docs/design.md#no)\n"
        "[web](https://example.com) [self](#top)\n```\n[in code](nowhere.md)\n```\n# Top\n")
    (tmp_path / "zkernels" / "a.py").write_text(
        f"# see {BARE_DESIGN}\n# docs/design.md#the-ladder\n# docs/design.md#nowhere\n")
    pages = doc_pages(str(tmp_path))
    assert broken_links(pages[0]) == ["docs/gone.md (no such file)",
                                      "docs/design.md#no (no such section)",
                                      "docs/design.md#no (no such section)"]
    assert broken_links(pages[1]) == []
    assert anchors(_read(str(tmp_path / "docs" / "design.md"))) == {"design", "the-ladder"}
    assert readme_too_long(str(tmp_path)) is None
    (tmp_path / "README.md").write_text("line\n" * (README_MAX_LINES + 1))
    assert readme_too_long(str(tmp_path)) == "README.md has 161 lines; move detail into docs/"
    assert [b.split(": ", 1)[1] for b in bad_citations(str(tmp_path))] == [
        f"cites {BARE_DESIGN}, which is docs/design.md",
        "docs/design.md#nowhere: no such section"]
