"""The book's _config.yml with execution off: build from the notebooks' stored outputs.

    python tools/book_config.py OUT.yml

CI (after nbval has re-executed and matched every chapter) and tests/test_book.py build the
book this way; ``bash tools/kit.sh book`` executes every chapter instead.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def execution_off() -> str:
    """The text of _config.yml with ``execute_notebooks: "off"``."""
    text, n = re.subn(r"^(\s*execute_notebooks:).*$", r'\1 "off"', (ROOT / "_config.yml").read_text(), flags=re.M)
    if n != 1:
        raise ValueError("_config.yml must set execute.execute_notebooks exactly once")
    return text


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    Path(sys.argv[1]).write_text(execution_off())
