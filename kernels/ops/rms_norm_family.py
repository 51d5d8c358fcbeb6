"""One functional face for the RMSNorm family's two backends, used by chapter 3,
the GPU measurements of :mod:`batch_invariance_kit.bench.rms_norm` and the tests.

``functional(backend, op, impl)`` returns ``f(x, residual) -> tuple of output tensors``
that never writes its inputs: ``backend="triton"`` runs :mod:`batch_invariance_kit.ops.rms_norm` (compiled on
a GPU, interpreted on a CPU); ``backend="cuda"`` runs :mod:`batch_invariance_kit.ops.rms_norm_cuda` (the CUDA C++
kernels on a GPU; on a CPU, the reduction-order emulator's prediction of their bits).
"""
from __future__ import annotations

import functools

import torch

from . import rms_norm as tri
from . import rms_norm_cuda as cu
from ..checks import dtype_name
from ..bitwise import bits, seeded_normal

OPS = tuple(tri.OPS)
BACKENDS = ("triton", "cuda")
RESIDUAL_OPS = ("fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant")
GROUP_SIZE = 128
STATIC_SCALE = 0.02  # fp32 scale of the static fp8 ops (|normalized| values ~ up to 4 -> codes up to ~200)


def functional(backend: str, op: str, impl: str, *, eps: float = 1e-6):
    """``f(x, weight, residual=None) -> tuple`` of the op's outputs (fresh tensors)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if impl not in ("variant", "invariant") and not (backend == "cuda" and impl == "invariant256"):
        raise ValueError(f"impl must be 'variant' or 'invariant' (cuda also 'invariant256'), got {impl!r}")

    def scale_for(x):
        return torch.tensor([STATIC_SCALE], dtype=torch.float32, device=x.device)

    def fp8_like(x):
        return torch.empty(x.shape, dtype=tri.FP8_DTYPE, device=x.device)

    if backend == "triton":
        def f(x, weight, residual=None):
            if op == "rms_norm":
                return (tri.rms_norm(x, weight, eps, impl=impl),)
            if op == "fused_add_rms_norm":
                return tuple(tri.fused_add_rms_norm(x, residual, weight, eps, impl=impl))
            if op == "rms_norm_static_fp8_quant":
                return (tri.rms_norm_static_fp8_quant(x, weight, scale_for(x), eps, impl=impl),)
            if op == "fused_add_rms_norm_static_fp8_quant":
                return tuple(tri.fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale_for(x), eps, impl=impl))
            return tuple(tri.rms_norm_per_block_quant(x, weight, eps, GROUP_SIZE, impl=impl))
        return f

    def f(x, weight, residual=None):
        if op == "rms_norm":
            return (cu.rms_norm(torch.empty_like(x), x, weight, eps, impl=impl),)
        if op == "fused_add_rms_norm":
            return tuple(cu.fused_add_rms_norm(x.clone(), residual.clone(), weight, eps, impl=impl))
        if op == "rms_norm_static_fp8_quant":
            return (cu.rms_norm_static_fp8_quant(fp8_like(x), x, weight, scale_for(x), eps, impl=impl),)
        if op == "fused_add_rms_norm_static_fp8_quant":
            return tuple(cu.fused_add_rms_norm_static_fp8_quant(fp8_like(x), x, residual.clone(), weight,
                                                                scale_for(x), eps, impl=impl))
        scales = torch.empty(x.shape[0], x.shape[1] // GROUP_SIZE, dtype=torch.float32, device=x.device)
        return tuple(cu.rms_norm_per_block_quant(fp8_like(x), scales, x, weight, eps, GROUP_SIZE, impl=impl))
    return f


@functools.lru_cache(maxsize=64)
def _raw_inputs(tokens: int, hidden: int, seed: int) -> tuple:
    return (seeded_normal((tokens, hidden), 10_000 + seed), seeded_normal((tokens, hidden), 20_000 + seed),
            1.0 + 0.25 * seeded_normal(hidden, 30_000 + seed))


def inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, device=None) -> tuple:
    """(x, weight, residual) with bitwise machine-independent values (``seeded_normal``)."""
    device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    x, r, w = (t.to(dtype=dtype, device=device) for t in _raw_inputs(tokens, hidden, seed))
    return x, w, r


def rows_differing(a: tuple, b: tuple, rows: int) -> int:
    """Rows among the first ``rows`` where any output of ``a`` and ``b`` differs in any bit."""
    diff = None
    for ta, tb in zip(a, b):
        d = (bits(ta[:rows]) != bits(tb[:rows])).reshape(rows, -1).any(dim=1)
        diff = d if diff is None else diff | d
    return int(diff.sum())


def seed_method(backend: str, op: str, impl: str, dtype: torch.dtype, hidden: int = 4096,
                seeds=range(16), small: int = 255, large: int = 300) -> dict:
    """The regression test of vLLM's RMSNorm block-size fix (255 vs 300 tokens): rows of a ``small``-token batch vs the same rows at the
    head of a ``large``-token batch, over ``seeds``; counts rows that differ."""
    f = functional(backend, op, impl)
    per_seed = []
    for s in seeds:
        x, w, r = inputs(large, hidden, dtype, s)
        res = r if op in RESIDUAL_OPS else None
        a = f(x[:small], w, None if res is None else res[:small])
        b = f(x, w, res)
        per_seed.append(rows_differing(a, b, small))
    return {"backend": backend, "op": op, "impl": impl, "dtype": dtype_name(dtype),
            "hidden": hidden, "small": small, "large": large, "seeds": len(per_seed),
            "rows_differing": sum(per_seed), "seeds_with_difference": sum(c > 0 for c in per_seed),
            "rows_compared": small * len(per_seed)}


def flips_vs_batch(backend: str, op: str, impl: str, dtype: torch.dtype, hidden: int,
                   batch_sizes, seed: int = 0, rows_alone: int = 512) -> list:
    """For each batch size T: how many of the batch's rows (up to ``rows_alone``) differ from
    the same row normalized alone (a batch of 1)."""
    f = functional(backend, op, impl)
    big = max(batch_sizes)
    x, w, r = inputs(big, hidden, dtype, seed)
    res = r if op in RESIDUAL_OPS else None
    n_alone = min(rows_alone, big)
    alone = [f(x[i:i + 1], w, None if res is None else res[i:i + 1]) for i in range(n_alone)]
    alone = tuple(torch.cat([a[k] for a in alone]) for k in range(len(alone[0])))
    out = []
    for t in batch_sizes:
        got = f(x[:t], w, None if res is None else res[:t])
        n = min(t, n_alone)
        out.append({"batch": t, "rows_compared": n, "rows_differing": rows_differing(got, alone, n)})
    return out
