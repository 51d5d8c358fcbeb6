"""Device selection for the whole kit.

Import this module (``import batch_invariance_kit`` does) before anything imports ``triton``:
with no CUDA device present it sets ``TRITON_INTERPRET=1`` so that every Triton kernel
of the kit runs under the Triton interpreter on the CPU; with a GPU the same kernels
are compiled.  One rule, decided once per process.
"""
from __future__ import annotations

import os
import sys

import torch

HAS_CUDA: bool = torch.cuda.is_available()

#: ``True`` when another package imported triton before this module on a machine without CUDA
#: (vLLM's CPU build does, before it loads the kit's plugin): Triton's own library functions were
#: then built for its compiler, so the kit's Triton kernels cannot run in this process
#: (:func:`require_triton` says so when :mod:`batch_invariance_kit.ops` is imported); the rest of
#: the kit works.
TRITON_IMPORTED_FIRST: bool = ("triton" in sys.modules and not HAS_CUDA
                               and os.environ.get("TRITON_INTERPRET") != "1")
if not HAS_CUDA and not TRITON_IMPORTED_FIRST:
    os.environ["TRITON_INTERPRET"] = "1"


def require_triton() -> None:
    """Raise when the kit's Triton kernels cannot run in this process (see ``TRITON_IMPORTED_FIRST``)."""
    if TRITON_IMPORTED_FIRST:
        raise RuntimeError(
            "triton was imported before batch_invariance_kit.device on a machine without CUDA: "
            "import batch_invariance_kit first, or set TRITON_INTERPRET=1"
        )


#: ``True`` when Triton kernels run under the interpreter (no GPU).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

#: The torch device every kernel and notebook of the kit uses.
DEVICE: torch.device = torch.device("cuda" if HAS_CUDA else "cpu")


_SM_COUNTS: dict = {}


def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (the current device when
    ``None``), read once per device from torch's device properties (without CUDA torch raises:
    a CPU caller picks its own stand-in, the interpreter's small counts that cross the kernels'
    thresholds)."""
    idx = torch.cuda.current_device() if device_index is None else int(device_index)
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def device_name() -> str:
    """A human-readable name of the present device (for ignored/sanitized cells)."""
    if HAS_CUDA:
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def describe() -> str:
    """One line: device and execution mode of the Triton kernels."""
    mode = "Triton interpreter" if INTERPRET else "compiled Triton"
    return f"{device_name()}; {mode}; torch {torch.__version__}"
