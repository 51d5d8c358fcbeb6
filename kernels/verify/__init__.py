"""How the kit proves invariance: the bitwise harness (row alone vs row in a batch, first
divergence search) and guard regions that catch out-of-bounds stores under the Triton
interpreter (the reduction-order emulator of the CUDA kernels is :mod:`batch_invariance_kit.emulator`,
below the kernels that run on it).  Importing it registers a planted
fault named in ``KIT_PLANT_VARIANT`` (:mod:`.planted`; nothing when unset)."""
from . import planted as _planted  # noqa: F401  (registers KIT_PLANT_VARIANT's faults with the ops)
