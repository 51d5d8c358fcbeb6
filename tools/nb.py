"""Author tool: (re)execute chapter notebooks in place so their stored outputs are fresh.

    python tools/nb.py book/01_reproducing.ipynb [more.ipynb ...]

Runs each notebook top to bottom with its working directory in book/ (as jupyter-book and
nbval do) and writes the outputs back.  Commit the notebooks after a CPU run: nbval in CI
re-executes them and must reproduce every output that is not tagged nbval-ignore-output.
"""
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 1800) -> None:
    nb = nbformat.read(path, as_version=4)
    t = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:  # keep diffs small: no per-run metadata
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.time() - t:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        execute(Path(p))
