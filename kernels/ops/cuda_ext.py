"""Lazy JIT build of the kit's CUDA C++ extension (``csrc/``), on a GPU box only.

``import batch_invariance_kit.ops.cuda_ext`` never builds and never fails.  :func:`available` is ``False``
without CUDA (and when the build fails; :func:`load` then re-raises the build error).
:func:`load` builds once per process with ``torch.utils.cpp_extension.load`` (ninja + nvcc),
for the present GPU's architecture only, into ``<repo>/build/cuda_ext/<name>`` (ignored by
git); torch rebuilds when a source changes.

nvcc flags: ``-O3``, no fast-math (the kernels need correctly rounded ``sqrtf`` and
division: nvcc's defaults ``-prec-sqrt=true -prec-div=true``), and ``-fmad=false`` so that
no ``a * b + c`` is contracted into an FMA behind the emulator's back (the kernels' only
FMAs are explicit ``fmaf`` calls, which ``-fmad=false`` keeps).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

__all__ = ["SOURCES", "available", "load"]

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
SOURCES = (CSRC / "rms_norm.cu", CSRC / "rms_norm_binding.cpp")
NVCC_FLAGS = ("-O3", "-fmad=false", "-prec-sqrt=true", "-prec-div=true", "-ftz=false")

_lock = threading.Lock()
_module = None
_error: BaseException | None = None


def _arch() -> tuple:
    major, minor = torch.cuda.get_device_capability()
    return major, minor


def _name() -> str:
    major, minor = _arch()
    return f"bik_rms_norm_sm{major}{minor}"


def build_dir() -> Path:
    """Where the extension is built (``BIK_CUDA_EXT_DIR`` overrides)."""
    root = os.environ.get("BIK_CUDA_EXT_DIR")
    base = Path(root) if root else REPO / "build" / "cuda_ext"
    return base / (_name() if torch.cuda.is_available() else "nocuda")


def load():
    """The compiled extension module (builds it on first call).  Raises ``RuntimeError``
    without CUDA, or the build error."""
    global _module, _error
    if _module is not None:
        return _module
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA extension needs a CUDA device; on CPU use the emulator "
                           "(batch_invariance_kit.ops.rms_norm_cuda dispatches CPU tensors to it)")
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(f"building the CUDA extension failed earlier: {_error}") from _error
        from torch.utils import cpp_extension

        major, minor = _arch()
        gencode = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        try:
            _module = cpp_extension.load(
                name=_name(),
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=[*NVCC_FLAGS, gencode],  # a flag with "arch" stops torch adding its own
                extra_include_paths=[str(CSRC)],
                build_directory=str(d),
                verbose=os.environ.get("BIK_CUDA_EXT_VERBOSE") == "1",
            )
        except BaseException as e:  # noqa: BLE001 - remembered, re-raised on every load()
            _error = e
            raise
    return _module


def available() -> bool:
    """``True`` when CUDA is present and the extension builds (building it if needed)."""
    if not torch.cuda.is_available():
        return False
    try:
        load()
    except Exception:  # noqa: BLE001
        return False
    return True
