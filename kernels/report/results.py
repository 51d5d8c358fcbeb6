"""Results measured on a device, stored as JSON with provenance (one shape for every file).

``{"provenance": {...}, "rows": [{"op", "impl", <shape keys>, "median_us", ...}],
"checks": [{"name", "passed", <details>}]}``

A check is one of three kinds (:func:`kind`): **required** (an invariance or correctness
check: a failed one makes the validation command exit 1), **goal** (``"goal": True``: a speed
comparison, reported as met or not, never a failure: :func:`goal`) or **informational**
(``"informational": True``: an observation, e.g. that cuBLAS depends on the batch).

Stored H200 results live in ``results/h200/`` (committed); a reader's own GPU run writes to
``results/local/`` (ignored by git) and the book shows both when present.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def _git_commit() -> str:
    if os.environ.get("KIT_GIT_COMMIT"):  # a copy of the tree without .git (e.g. a lent GPU box)
        return os.environ["KIT_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except Exception:
        return "unknown"


def portable(arg: str) -> str:
    """A command-line argument without the machine's folders: a path inside the repository
    relative to its root, any other absolute path as ``<dir>/`` + its last component."""
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return f"<dir>/{path.name}"


def _command() -> str:
    """``python -m module args`` of this process, with portable arguments."""
    argv = list(sys.argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", portable(argv[0])]
    return " ".join(head + [portable(a) for a in argv[1:]])


def provenance(command: str | None = None) -> dict:
    """Who/what/when of a measurement: device, SM count, versions, date, command, commit."""
    prov = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else _command(),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host_machine": platform.machine(),
    }
    try:
        import triton

        prov["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        prov["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        prov.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    cuda=torch.version.cuda, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1))
        try:
            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            prov["driver"] = drv or None
        except Exception:
            prov["driver"] = None
    else:
        prov.update(device="cpu", sm_count=None, cuda=None)
    try:
        import vllm  # noqa: F401

        prov["vllm"] = vllm.__version__
    except Exception:
        prov["vllm"] = None
    return prov


#: The kinds of check, in the order a report lists them
KINDS = ("required", "goal", "informational")


def goal(name: str, met: bool, **details) -> dict:
    """A speed goal as a check: ``passed`` says whether it is met; ``"goal": True`` keeps it out
    of the exit status (the validation command fails only on a required check)."""
    return {"name": name, "passed": bool(met), "goal": True, **details}


def kind(check: dict) -> str:
    """``"goal"``, ``"informational"`` or ``"required"`` (the default: an invariance or
    correctness check)."""
    if check.get("goal"):
        return "goal"
    if check.get("informational"):
        return "informational"
    return "required"


def of_kind(checks: list, which: str) -> list:
    """The checks of one :data:`KINDS` kind."""
    if which not in KINDS:
        raise ValueError(f"which must be one of {KINDS}, got {which!r}")
    return [c for c in checks if kind(c) == which]


def local_dir() -> Path:
    return RESULTS / "local"


def save(name: str, rows: list, checks: list, *, command: str | None = None, folder: Path | str | None = None,
         extra: dict | None = None) -> Path:
    """Write ``<folder>/<name>.json`` (default: ``results/local``)."""
    if not name or "/" in name or name.endswith(".json"):
        raise ValueError(f"name must be a bare file stem, got {name!r}")
    for c in checks:
        if "name" not in c or "passed" not in c:
            raise ValueError(f"every check needs 'name' and 'passed', got keys {sorted(c)}")
    folder = Path(folder) if folder is not None else local_dir()
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": provenance(command), "rows": rows, "checks": checks}
    if extra:
        doc.update(extra)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")
    return path


def load(name: str, where: str = "h200", root: Path | str | None = None) -> dict | None:
    """Stored results ``<root>/<where>/<name>.json`` (``root``: ``results/``), or ``None`` when absent."""
    path = (RESULTS if root is None else Path(root)) / where / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def describe(doc: dict) -> str:
    """One line of provenance for a figure caption or a table heading."""
    p = doc["provenance"]
    return (f"{p.get('device')} ({p.get('sm_count')} SMs), torch {p.get('torch')}, triton {p.get('triton')}, "
            f"CUDA {p.get('cuda')}, {p.get('date', '')[:10]}, commit {str(p.get('git_commit'))[:10]}")

