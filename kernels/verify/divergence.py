"""First-divergence searches of library ops (``torch.mm`` ...) on the present device.

Used by chapter 1 (small, on whatever device is present) and by :mod:`batch_invariance_kit.bench.matmul`
(the H200 tables stored in ``results/h200``): for each dtype and (N, K), the smallest batch
``M`` at which some row of ``x @ W`` differs bitwise from the same row computed alone.
"""
from __future__ import annotations

import multiprocessing
import os

import torch

from ..checks import DTYPES, dtype_name
from ..device import DEVICE
from .harness import first_divergence, row_maker, seeded_normal


def default_batch_sizes(limit: int) -> list:
    """Every M up to 64, then a geometric ladder (x1.5 / x2) up to ``limit``."""
    out = list(range(1, min(64, limit) + 1))
    m = 64
    while m < limit:
        for s in (m * 3 // 2, m * 2):
            if s <= limit:
                out.append(s)
        m *= 2
    return sorted(set(out))


def _search(label: str, f, make, dtype: torch.dtype, n: int, k: int, batch_sizes, positions, seeds, device) -> dict:
    """One row of a first-divergence table for ``f`` on rows from ``make``."""
    m, rep = first_divergence(f, make, batch_sizes, positions=positions, seeds=seeds)
    first = rep.first
    return {
        "op": label, "impl": "cuBLAS" if torch.device(device).type == "cuda" else "CPU BLAS",
        "dtype": dtype_name(dtype), "N": n, "K": k,
        "searched_up_to": max(batch_sizes), "row_checks": rep.checks,
        "first_divergence_M": m,
        "row": first.position if first else None,
        "elements_differing": first.elements_differing if first else 0,
        "max_ulp": first.max_ulp if first else 0,
    }


def mm_first_divergence(dtype: torch.dtype, n: int, k: int, batch_sizes, *, positions="all",
                        seeds=(0,), device=None) -> dict:
    """One row of the table: where ``torch.mm(x, W)`` first depends on the batch."""
    device = device if device is not None else DEVICE
    w = seeded_normal((k, n), 12345).to(dtype=dtype, device=device) * (k ** -0.5)
    make = row_maker(k, dtype=dtype, device=device)
    return _search("torch.mm", lambda x: torch.mm(x, w), make, dtype, n, k, batch_sizes, positions, seeds, device)

OPS = ("mm", "bmm", "linear")


def _op_fn(op: str, w: torch.Tensor, bias: torch.Tensor | None, heads: int):
    if op == "mm":
        return lambda x: torch.mm(x, w)
    if op == "linear":  # w is (N, K) for linear
        return lambda x: torch.nn.functional.linear(x, w, bias)
    if op == "bmm":  # x: (M, heads, K) -> per-head (M, K) @ (K, N); the batch is M
        return lambda x: torch.bmm(x.transpose(0, 1).contiguous(), w).transpose(0, 1)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def op_first_divergence(op: str, dtype: torch.dtype, n: int, k: int, batch_sizes, *, heads: int = 8,
                        positions=None, seeds=(0,), device=None) -> dict:
    """Where ``torch.mm`` / ``torch.bmm`` / ``F.linear`` (with bias) first depends on the batch M."""
    device = device if device is not None else DEVICE
    if positions is None:
        positions = lambda bs: range(bs) if bs <= 16 else (0, bs // 2, bs - 1)  # noqa: E731
    if op == "bmm":
        w = seeded_normal((heads, k, n), 12346).to(dtype=dtype, device=device) * (k ** -0.5)
        make = row_maker((heads, k), dtype=dtype, device=device)
        bias = None
    elif op == "linear":
        w = seeded_normal((n, k), 12347).to(dtype=dtype, device=device) * (k ** -0.5)
        bias = seeded_normal(n, 12348).to(dtype=dtype, device=device)
        make = row_maker(k, dtype=dtype, device=device)
    else:
        return mm_first_divergence(dtype, n, k, batch_sizes, positions=positions, seeds=seeds, device=device)
    label = f"torch.{op}" if op != "linear" else "F.linear(+bias)"
    return _search(label, _op_fn(op, w, bias, heads), make, dtype, n, k, batch_sizes, positions, seeds, device)


def invariance_map(shapes=((4096, 4096), (4096, 12288)), dtypes=("bfloat16", "float16", "float32"),
                   limit: int = 2048, ops=OPS) -> list:
    """:func:`op_first_divergence` for every op, dtype and (N, K), in this process."""
    sizes = default_batch_sizes(limit)
    rows = []
    for op in ops:
        for dt in dtypes:
            for n, k in shapes:
                rows.append(op_first_divergence(op, DTYPES[dt], n, k, sizes))
    return rows


def _map_in_child(env: dict, cublaslt: bool, limit: int, quick: bool) -> list:
    os.environ.update(env)  # before the first cuBLAS call of this fresh process
    if cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if quick:  # mm and linear, bf16 and fp16, N = K = 4096
        out = invariance_map(shapes=((4096, 4096),), dtypes=("bfloat16", "float16"), limit=limit, ops=("mm", "linear"))
    else:
        out = invariance_map(limit=limit)
    for r in out:
        r["cublas_env"] = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
        r["preferred_blas"] = "cublaslt" if cublaslt else "default"
    return out


def invariance_map_in_process(env: dict, *, cublaslt: bool = False, limit: int = 2048, quick: bool = False,
                              timeout_s: float = 600) -> list:
    """:func:`invariance_map` in a fresh (spawned) process with ``env`` added to its environment
    and, with ``cublaslt``, cuBLASLt as torch's preferred BLAS: cuBLAS reads its workspace
    variables once, when it starts, so each set-up needs its own process.  ``quick``: mm and
    linear, bf16 and fp16, N = K = 4096 only.  Each row records the set-up it ran under."""
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(_map_in_child, (env, cublaslt, limit, quick)).get(timeout_s)
