"""How the kit proves invariance: the bitwise harness (row alone vs row in a batch, first
divergence search), the reduction-order emulator of the CUDA kernels, and guard regions that
catch out-of-bounds stores under the Triton interpreter."""
