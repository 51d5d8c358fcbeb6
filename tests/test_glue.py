"""Numbers in a chapter's prose come from the computation (myst-nb ``glue``), not from a keyboard.

A markdown cell of a chapter may not type a number next to a unit or ratio word (×, %, µs, ms,
s, TF/s, GB/s, TB/s, MB, "of cuBLAS", "of the copy ceiling", ...), nor a ratio or a tiny value
written out (``0.85``, ``1e-12``): such numbers are measured or computed, so they are glued from
the cell that computes them (``{glue:text}`key``` in the markdown), and the prose changes when the
result does.  A number that is a constant of the text -- a shape, a threshold of the design, a
setting of an experiment (``255``, ``1024``, ``16 seeds``, ``64×32``) -- is marked as such in the
cell's metadata, ``"text_constants": ["64×32", ...]``, so an exemption is explicit and visible in
review.  A marked constant that no longer occurs in its cell is an error too (no stale
exemptions).  Maths (``$...$``), code spans and code blocks are not prose and are not scanned.

The chapters listed in ``PENDING`` are not this test's to mend: the test lists their typed
numbers exactly, and fails when the list and the chapter disagree, so the list only shrinks.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "book").glob("*.ipynb"))

_NUM = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?:\s?[–-]\s?\d[\d,]*(?:\.\d+)?)?"
_UNIT = (r"(?:×(?!\s?\d)|x\b|%|µs\b|us\b|ms\b|ns\b|s\b|TF/s|TFLOP/s|TFLOPS\b|GB/s|TB/s|MB\b|GB\b|KB\b|kB\b|"
         r"of cuBLAS|of the copy|of copy|of the (?:H200's )?(?:memory|bandwidth|peak|ceiling)|"
         r"times (?:faster|slower)|faster|slower)")
# a number next to a unit or ratio word, a written-out ratio (0.85) or a tiny value (1e-12)
_FLAGGED = re.compile(rf"(?<![\w.{{])(?:(?:{_NUM})\s?{_UNIT}|0\.\d+(?:\s?[–-]\s?\d+(?:\.\d+)?)?(?![\d.])|\d+(?:\.\d+)?e[-+]?\d+\b)")
# not prose: fenced code, inline code, maths, MyST roles and directive options, links' targets
_NOT_PROSE = re.compile(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$\n]*\$|\]\([^)]*\)|\{[a-z:]+\}", re.S)

_VERSION = re.compile(r"(?:version|vLLM|Triton|torch|nvcc|CUDA|Python)\s$")  # 'vLLM 0.26.0' is a name

# Chapters whose typed numbers belong to other authors: exactly these fragments, per chapter.
PENDING: dict[str, list[str]] = {}


def typed_numbers(cell: dict) -> list[str]:
    """The flagged fragments of one markdown cell that its ``text_constants`` do not mark."""
    text = _NOT_PROSE.sub(" ", "".join(cell["source"]))
    found = [m.group(0) for m in _FLAGGED.finditer(text) if not _VERSION.search(text[:m.start()])]
    constants = list(cell.get("metadata", {}).get("text_constants", []))
    left = []
    for f in found:
        if f in constants:
            constants.remove(f)
        else:
            left.append(f)
    return left


def stale_constants(cell: dict) -> list[str]:
    text = _NOT_PROSE.sub(" ", "".join(cell["source"]))
    found = [m.group(0) for m in _FLAGGED.finditer(text) if not _VERSION.search(text[:m.start()])]
    return [c for c in cell.get("metadata", {}).get("text_constants", []) if c not in found]


def chapter_report(path: str) -> tuple[list[str], list[str]]:
    nb = json.loads((ROOT / path).read_text(encoding="utf-8"))
    typed, stale = [], []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        typed += [(i, f) for f in typed_numbers(cell)]
        stale += [f"cell {i}: {c!r}" for c in stale_constants(cell)]
    return typed, stale


def test_the_scanner_flags_what_it_should():
    cell = lambda s, **md: {"cell_type": "markdown", "source": [s], "metadata": md}  # noqa: E731
    assert typed_numbers(cell("within about 10 % of cuBLAS")) == ["10 %"]
    assert typed_numbers(cell("a speed ratio of 0.84, and 1e-12 above")) == ["0.84", "1e-12"]
    assert typed_numbers(cell("at 91–97 % of the copy ceiling, 94 µs, 790 TF/s")) == ["91–97 %", "94 µs", "790 TF/s"]
    assert typed_numbers(cell("3× faster")) == ["3×"]
    assert typed_numbers(cell("{glue:text}`ratio:.2f` of cuBLAS, `0.85` in code, $0.5$ in maths")) == []
    assert typed_numbers(cell("a tile of 64×32 or 28672 × 4096 outputs (shapes), vLLM 0.26.0")) == []
    assert typed_numbers(cell("more than 3× the L2 cache", text_constants=["3×"])) == []
    assert typed_numbers(cell("ratios 0.80–0.90")) == ["0.80–0.90"]
    assert typed_numbers(cell("255 tokens and 16 seeds, hidden 4096, Triton 3.6")) == []
    assert stale_constants(cell("no number", text_constants=["10 %"])) == ["10 %"]


@pytest.mark.parametrize("path", CHAPTERS)
def test_numbers_in_prose_are_glued_or_marked_constants(path):
    typed, stale = chapter_report(path)
    assert not stale, f"{path}: text_constants that no longer occur in their cell: {stale}"
    fragments = [f for _, f in typed]
    if path in PENDING:
        assert sorted(fragments) == sorted(PENDING[path]), (
            f"{path}: its typed numbers changed; update PENDING to exactly these "
            f"(glue them or mark them as constants, then remove them): {typed}")
        return
    assert not typed, (f"{path}: numbers typed in prose (cell, fragment); glue them from the cell "
                       f"that computes them, or mark a constant of the text in the cell's "
                       f"metadata text_constants: {typed}")


def test_pending_names_only_existing_chapters():
    assert set(PENDING) <= set(CHAPTERS), set(PENDING) - set(CHAPTERS)
