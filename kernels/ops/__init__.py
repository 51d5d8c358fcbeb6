"""The kernels: each op's float64 reference, its *variant* twin (a launch configuration chosen
from the batch, as production kernels do) and its *invariant* implementation.

* :mod:`.rms_norm` (Triton) and :mod:`.rms_norm_cuda` (CUDA C++ of ``csrc/``): the RMSNorm family;
* :mod:`.matmul`: GEMM without batch-chosen split-K;
* :mod:`.moe`: router, dispatch, grouped GEMM, combine;
* :mod:`.attention`: paged attention with split sizes fixed per position;
* :mod:`.override`: ``torch.library`` override mode that routes a model's torch ops to the kit;
* :mod:`.fixed_shape`: invariant ops out of a CPU library that is not (fixed-shape GEMM tiles, a
  fixed reduction tree): the CPU replacements of the vLLM plugin;
* :mod:`.custom_ops`: the ops vLLM calls, as torch custom ops that torch.compile and CUDA graphs
  capture.
"""
from ..device import require_triton as _require_triton

_require_triton()
