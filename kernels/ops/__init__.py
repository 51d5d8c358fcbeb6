"""The kernels: each op's float64 reference, its *variant* twin (a launch configuration chosen
from the batch, as production kernels do) and its *invariant* implementation.

* :mod:`.rms_norm` (Triton) and :mod:`.rms_norm_cuda` (CUDA C++ of ``csrc/``): the RMSNorm family;
* :mod:`.matmul`: GEMM without batch-chosen split-K;
* :mod:`.moe`: router, dispatch, grouped GEMM, combine;
* :mod:`.attention`: paged attention with split sizes fixed per position;
* :mod:`.override`: ``torch.library`` override mode that routes a model's torch ops to the kit.
"""
from ..device import require_triton as _require_triton

_require_triton()
