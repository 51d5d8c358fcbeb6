"""The batch-invariance kit: kernels, references, the harness and the emulator.

``import kernels`` first: it selects the device (and the Triton interpreter on a machine
without a GPU) before anything imports ``triton``.
"""
from . import device  # noqa: F401  (must come first: sets TRITON_INTERPRET without CUDA)
from .device import DEVICE, HAS_CUDA, INTERPRET  # noqa: F401

__all__ = ["DEVICE", "HAS_CUDA", "INTERPRET", "device"]
