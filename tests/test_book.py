"""The rendered book, checked as a reader would meet it.

The book is built once for this module, from the notebooks' stored outputs (execution off,
warnings as errors), into a temporary folder, so the check does not depend on a previous
build.  Then, page by page: every page of the table of contents exists; every image it shows
exists; maths is typeset by the MathJax bundled with the book (no TeX outside the elements
MathJax typesets, no script from a network); every internal link and anchor resolves.  The
sources are checked too: a cross-reference to a chapter gives its own link text, so no whole
chapter title lands in the middle of a sentence.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATHJAX = "_static/mathjax/tex-chtml.js"


def toc_files() -> list[str]:
    """The root and every ``file:`` of ``_toc.yml``, in order (paths without suffix)."""
    text = (ROOT / "_toc.yml").read_text()
    root = re.search(r"^root:\s*(\S+)", text, re.M).group(1)
    return [root] + re.findall(r"^\s*-\s*file:\s*(\S+)", text, re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Build the book (stored outputs, ``-W -n``) and return its ``html`` folder."""
    out = tmp_path_factory.mktemp("book")
    config = out / "_config.yml"
    sys.path.insert(0, str(ROOT / "tools"))
    from book_config import execution_off  # the one home of the execution-off rewrite (CI uses it too)
    config.write_text(execution_off())
    exe = shutil.which("jupyter-book", path=str(Path(sys.executable).parent)) or shutil.which("jupyter-book")
    assert exe, "jupyter-book is not installed (requirements.txt)"
    proc = subprocess.run([exe, "build", str(ROOT), "--path-output", str(out), "--config", str(config),
                           "-W", "-n", "--keep-going"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"book build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out / "_build" / "html"


class Page(HTMLParser):
    """Links, images, scripts, ids, and the text outside code and typeset maths."""

    SKIP = {"pre", "script", "style"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links, self.images, self.scripts, self.ids, self.text = [], [], [], set(), []
        self._stack: list[tuple[str, bool]] = []  # (tag, opens a skipped region)

    def _skipping(self) -> bool:
        return any(skip for _, skip in self._stack)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])
        if tag in ("br", "img", "meta", "link", "input", "hr", "source"):
            return
        classes = (a.get("class") or "").split()
        self._stack.append((tag, tag in self.SKIP or "math" in classes))

    def handle_endtag(self, tag):
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break

    def handle_data(self, data):
        if not self._skipping():
            self.text.append(data)


def parse(path: Path) -> Page:
    p = Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def test_every_page_of_the_toc_is_built(site):
    missing = [f for f in toc_files() if not (site / f"{f}.html").is_file()]
    assert not missing, f"pages missing from the built book: {missing}"
    assert (site / "index.html").is_file()


def test_every_image_exists(site):
    missing, count = [], 0
    for f in toc_files():
        page = site / f"{f}.html"
        for src in parse(page).images:
            if src.startswith(("http:", "https:", "data:")):
                continue
            count += 1
            if not (page.parent / unquote(urlsplit(src).path)).is_file():
                missing.append(f"{f}: {src}")
    assert count > 0, "no image found in the book: the figures did not render"
    assert not missing, f"images referenced but not in the build: {missing}"


def test_maths_is_typeset_offline(site):
    assert (site / MATHJAX).is_file(), f"{MATHJAX} is not bundled with the book"
    raw, pages_with_math = [], 0
    for f in toc_files():
        path = site / f"{f}.html"
        html = path.read_text(encoding="utf-8")
        p = parse(path)
        remote = [s for s in p.scripts if "mathjax" in s.lower() and urlsplit(s).scheme]
        assert not remote, f"{f}: MathJax is loaded from the network: {remote}"
        if 'class="math' in html:
            pages_with_math += 1
            local = [s for s in p.scripts if s.endswith("mathjax/tex-chtml.js")]
            assert local and (path.parent / local[0]).resolve() == (site / MATHJAX).resolve(), \
                f"{f}: has maths but does not load the bundled MathJax"
        text = "".join(p.text)
        for pattern in (r"\\\(", r"\\\[", r"\$\$", r"\\frac\b", r"\\text\{"):
            raw += [f"{f}: ...{text[max(0, m.start() - 40):m.end() + 40]!r}..." for m in re.finditer(pattern, text)]
    assert pages_with_math > 0, "no page has maths: the check would prove nothing"
    assert not raw, "TeX outside the elements MathJax typesets:\n" + "\n".join(raw)


def test_every_internal_link_resolves(site):
    broken, checked, ids = [], 0, {}
    for page in sorted(site.rglob("*.html")):
        if "_static" in page.parts or "_sources" in page.parts:
            continue
        p = parse(page)
        ids[page.resolve()] = p.ids
        for href in p.links:
            u = urlsplit(href)
            if u.scheme or href.startswith("mailto:"):
                continue
            target = (page.parent / unquote(u.path)).resolve() if u.path else page.resolve()
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {href}")
            elif u.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = parse(target).ids
                if u.fragment not in ids[target]:
                    broken.append(f"{page.relative_to(site)} -> {href} (no such anchor)")
    assert checked > 0
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def _markdown_sources():
    for f in toc_files():
        for suffix in (".md", ".ipynb"):
            path = ROOT / f"{f}{suffix}"
            if path.suffix == ".md" and path.is_file():
                yield f, path.read_text(encoding="utf-8")
            elif path.is_file():
                nb = json.loads(path.read_text(encoding="utf-8"))
                yield f, "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_cross_references_carry_their_own_text():
    bare = [f"{f}: {m.group(0)}" for f, text in _markdown_sources()
            for m in re.finditer(r"\{doc\}`([^`<]*)`", text)]
    assert not bare, ("a bare {doc} reference prints the whole chapter title; write "
                      "{doc}`chapter N <file>`:\n" + "\n".join(bare))


def test_the_write_your_own_template_runs():
    """The template page's code is the code a reader copies: it runs as printed, its kernel
    passes the harness bitwise and its variant twin is caught (the claims raise otherwise)."""
    text = (ROOT / "book" / "write_your_own.md").read_text(encoding="utf-8")
    m = re.search(r"\(template\)=\n## The template\n\n```python\n(.*?)```", text, re.S)
    assert m, "book/write_your_own.md lost its template block"
    out = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "row_scale: bitwise invariant" in out.stdout and "row_scale variant caught: True" in out.stdout, out.stdout


def test_the_intro_lists_every_chapter_of_the_toc():
    """The intro's chapter table has a row for every numbered chapter of ``_toc.yml``, in order."""
    chapters = [Path(f).name for f in toc_files() if re.match(r"\d\d_", Path(f).name)]
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| \{doc\}`\d+ <(\d\d_\w+)>`", intro, re.M)
    assert listed == chapters, f"intro's chapter table {listed} != the toc's chapters {chapters}"


def test_use_on_your_code_shows_the_plugins_replacement_table():
    """The plugin page's table is the plugin's own ``REPLACEMENT_TABLE``, row for row."""
    from batch_invariance_kit.vllm.plugin import REPLACEMENT_TABLE

    page = (ROOT / "book" / "use_on_your_code.md").read_text(encoding="utf-8")
    rows = [tuple(c.strip() for c in line.strip("|").split(" | "))
            for line in page.splitlines() if line.startswith("| ") and not line.startswith(("| vLLM op", "| ---"))]
    assert rows == [tuple(r) for r in REPLACEMENT_TABLE]
