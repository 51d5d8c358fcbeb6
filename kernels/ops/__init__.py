"""The kernels: each op's float64 reference, its *variant* twin (a launch configuration chosen
from the batch, as production kernels do) and its *invariant* implementation.

* :mod:`.rms_norm` (Triton) and :mod:`.rms_norm_cuda` (CUDA C++ of ``csrc/``): the RMSNorm family;
* :mod:`.k_order`: the one K order that matmul and MoE share (``block_k``, the K chunking, the
  pointer step, the chunk reduction pass, the strides record of a launch);
* :mod:`.matmul`: GEMM without batch-chosen split-K;
* :mod:`.moe`: router, dispatch, grouped GEMM, combine, and the dense SwiGLU activation;
* :mod:`.routing`: DeepSeek routing (sigmoid scores with a correction bias, group-limited top-k,
  renormalised and scaled) and the routed + shared-expert layer;
* :mod:`.attention`: paged attention with split sizes fixed per position, a package by role
  (schedule, cache, kernels, plan and its one layout, launcher, ops, validate, reference,
  testing);
* :mod:`.mla`: Multi-head Latent Attention over a paged latent cache, one (absorbed) form for
  prefill and decode;
* :mod:`.override`: ``torch.library`` override mode that routes a model's torch ops to the kit;
* :mod:`.fixed_shape`: invariant ops out of a CPU library that is not (fixed-shape GEMM tiles, a
  fixed reduction tree): the CPU replacements of the vLLM plugin;
* :mod:`.custom_ops`: the ops vLLM calls, as torch custom ops that torch.compile and CUDA graphs
  capture.
* :mod:`.direct_launch`: the eager launch of the kit's Triton kernels (the compiled kernel's
  launcher, called directly for an argument signature Triton specialised before).
"""
from ..device import require_triton as _require_triton

_require_triton()
