"""The batch-invariance kit: kernels, references, the harness and the emulator.

``import batch_invariance_kit`` first: it selects the device (and the Triton interpreter on a
machine without a GPU) before anything imports ``triton``.  The roles: :mod:`.ops` (the
kernels), :mod:`.verify` (the proofs), :mod:`.bench` (GPU measurements, the registry of parts),
:mod:`.serving` (a model and a serving loop), :mod:`.vllm`, :mod:`.report` and
:mod:`.validate` (the one command).
"""
if __name__ == "batch_invariance_kit":
    from . import device  # noqa: F401  (must come first: sets TRITON_INTERPRET without CUDA)
    from .device import DEVICE, HAS_CUDA, INTERPRET  # noqa: F401
# Under any other name (from the repository root, ``import kernels`` finds this folder: that is
# how transformers probes for Hugging Face's ``kernels`` package) the folder stays an empty
# module without a version, so such a probe reads "not installed" and imports nothing else.

__all__ = ["DEVICE", "HAS_CUDA", "INTERPRET", "device"]
