"""The registry of parts: every check and measurement that :mod:`batch_invariance_kit.validate` runs.

A part is a function ``run(quick) -> (rows, checks)`` in the shape of
:mod:`batch_invariance_kit.report.results`; the validation command stores its result as
``<name>.json`` (the stored H200 results in ``results/h200`` are such files).  ``device`` says
where a part runs: ``"cuda"`` parts need a CUDA GPU; ``"cpu"`` parts are what a machine
without one checks by default (the Triton interpreter, the CUDA kernels through the emulator)
and run anywhere.  A part's speed comparisons are goals
(:func:`batch_invariance_kit.report.results.goal`): reported, never a failure.
``incremental`` parts also take ``save=`` (a callback that stores the rows
done so far, so that a part cut by a time limit keeps them).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Part:
    name: str
    #: ``"module:function"`` under :mod:`batch_invariance_kit.bench` (imported when the part runs)
    target: str
    device: str
    #: one line for ``--list``
    what: str
    incremental: bool = False
    #: run by the validation command without ``--only`` (False: a measurement for a refit, by name only)
    default: bool = True

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    def function(self):
        module, name = self.target.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)

    def run(self, quick: bool, save=None) -> tuple:
        """``(rows, checks)``; ``save(rows, checks)`` is passed on to incremental parts."""
        f = self.function()
        return f(quick, save=save) if self.incremental else f(quick)


_PARTS = [
    Part("mm_first_divergence", "matmul:first_divergence", "cuda",
         "chapter 1: first M at which a torch.mm (cuBLAS) row depends on the batch"),
    Part("decoder_under_load", "e2e:decoder_under_load", "cuda",
         "chapter 1: the torch-only toy decoder under load on cuBLAS"),
    Part("rms_norm_crosscheck", "rms_norm:crosscheck", "cuda",
         "chapter 3: CUDA kernels' bits vs the reduction-order emulator's"),
    Part("rms_norm_invariance", "rms_norm:invariance", "cuda",
         "chapter 3: 255 vs 300 tokens, 16 seeds, every op, backend, dtype and impl"),
    Part("rms_norm_flips", "rms_norm:flips", "cuda", "chapter 3: rows differing from the row alone vs batch size"),
    Part("rms_norm_bench", "rms_norm:bench", "cuda", "chapter 3: the RMSNorm family vs torch.compile, bf16, hidden 4096"),
    Part("rms_norm_hidden_sizes", "rms_norm:bench_hidden_sizes", "cuda",
         "chapter 3: the RMSNorm family vs torch.compile at hidden 2048, 5120, 7168, 8192", incremental=True),
    Part("rms_norm_tune_warps", "rms_norm:tune_warps", "cuda",
         "chapter 3: the warp-count sweep behind the invariant kernel's warps at hidden 4096"),
    Part("invariance_map", "matmul:invariance_map", "cuda",
         "chapter 4: torch.mm / bmm / F.linear first divergence under three cuBLAS set-ups", incremental=True),
    Part("matmul_sweep", "matmul:sweep", "cuda",
         "chapter 4: eight (N, K) shapes: the cost model's pick and runners-up, bits and time beside cuBLAS",
         incremental=True),
    Part("matmul_refit_new_a", "matmul:refit_new_a", "cuda",
         "chapter 4: every config (shipped and trial) at 5120x5120, 5120x13824, 3584x18944, M 1-8192",
         incremental=True, default=False),
    Part("matmul_refit_new_b", "matmul:refit_new_b", "cuda",
         "chapter 4: every config (shipped and trial) at 7168x2048, 2048x7168, M 1-8192", incremental=True,
         default=False),
    Part("matmul_refit_stored_a", "matmul:refit_stored_a", "cuda",
         "chapter 4: every config (shipped and trial) at three hidden-4096 shapes, M 1-8192", incremental=True,
         default=False),
    Part("matmul_refit_stored_b", "matmul:refit_stored_b", "cuda",
         "chapter 4: every config (shipped and trial) at four large stored shapes, M 1-8192", incremental=True,
         default=False),
    Part("moe_invariance", "moe:invariance", "cuda", "chapter 5: a token alone vs in batches of 1..8192 tokens"),
    Part("moe_loads", "moe:loads", "cuda", "chapter 5: tokens per expert vs batch size"),
    Part("moe_bench", "moe:bench", "cuda", "chapter 5: invariant vs tuned variant fused MoE"),
    Part("moe_tiles", "moe:tiles", "cuda",
         "chapter 5: every grouped-GEMM tile of the invariant MoE at both models' shapes, 1-8192 tokens",
         default=False),
    Part("moe_vs_vllm", "moe_vllm:vs_vllm", "cuda",
         "chapter 5: invariant MoE vs vLLM's default Triton fused_moe (Qwen3-30B-A3B, DeepSeek-V2-Lite)"),
    Part("moe_stages", "moe_vllm:stages", "cuda",
         "chapter 5: each step of the invariant MoE and of vLLM's fused_moe timed alone, 1-64 tokens",
         default=False),
    Part("attention_consistency", "attention:consistency", "cuda",
         "chapter 6: attention properties (a)-(d) at production head shapes"),
    Part("attention_bench", "attention:bench", "cuda", "chapter 6: decode and prefill vs SDPA and FlashAttention-3"),
    Part("attention_tune", "attention:tune", "cuda", "chapter 6: fixed attention schedules, decode and prefill time"),
    Part("attention_decode_tiles", "attention:decode_tiles", "cuda",
         "chapter 6: prefill == decode, serial == per-split launches, per schedule"),
    Part("e2e_model", "e2e:e2e_model", "cuda", "chapter 7: the kit's Qwen3 dense/MoE model served under load"),
    Part("cpu_rms_norm", "rms_norm:cpu_invariance", "cpu",
         "the RMSNorm family, both backends, fp32: 255 vs 300 tokens (interpreter and emulator)"),
    Part("cpu_matmul", "matmul:cpu_invariance", "cpu", "the invariant matmul and its split-K twin, fp32"),
]

#: name -> :class:`Part`, in the order the validation command runs them
PARTS = {p.name: p for p in _PARTS}


def runnable(name: str, has_cuda: bool) -> bool:
    """Whether part ``name`` can run on this machine (CUDA parts need a GPU)."""
    return PARTS[name].device == "cpu" or has_cuda


def default_parts(has_cuda: bool) -> list:
    """What the validation command runs without ``--only``: the CUDA parts on a GPU, the CPU
    parts on a machine without one (parts with ``default=False`` only by name)."""
    want = "cuda" if has_cuda else "cpu"
    return [n for n, p in PARTS.items() if p.device == want and p.default]
