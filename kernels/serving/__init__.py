"""End to end: a small Qwen3/Llama-style model on the kit's kernels, a continuous-batching
engine (chunked prefill, prefix cache), the model sharded over tensor-parallel ranks with a
fixed-order all-reduce (:mod:`.tensor_parallel`), and chapter 1's torch-only toy decoder."""
