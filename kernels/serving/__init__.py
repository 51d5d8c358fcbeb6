"""End to end: a small Qwen3/Llama-style model on the kit's kernels, a DeepSeek-V3-style one
(:mod:`.deepseek`: MLA over a paged latent cache, grouped sigmoid routing, shared experts), a
continuous-batching engine (chunked prefill, prefix cache) that serves both, the Qwen3 model
sharded over tensor-parallel ranks with a fixed-order all-reduce (:mod:`.tensor_parallel`), and
chapter 1's torch-only toy decoder."""
