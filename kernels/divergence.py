"""First-divergence searches of library ops (``torch.mm`` ...) on the present device.

Used by chapter 1 (small, on whatever device is present) and by ``kernels.gpu_run``
(the H200 table stored in ``results/h200``): for each dtype and (N, K), the smallest batch
``M`` at which some row of ``x @ W`` differs bitwise from the same row computed alone.
"""
from __future__ import annotations

import torch

from .device import DEVICE
from .harness import first_divergence, row_maker, seeded_normal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def mm_first_divergence(dtype: torch.dtype, n: int, k: int, batch_sizes, *, positions="all",
                        seeds=(0,), device=None) -> dict:
    """One row of the table: where ``torch.mm(x, W)`` first depends on the batch."""
    device = device if device is not None else DEVICE
    w = seeded_normal((k, n), 12345).to(dtype=dtype, device=device) * (k ** -0.5)
    make = row_maker(k, dtype=dtype, device=device)
    m, rep = first_divergence(lambda x: torch.mm(x, w), make, batch_sizes, positions=positions, seeds=seeds)
    first = rep.first
    return {
        "op": "torch.mm", "impl": "cuBLAS" if torch.device(device).type == "cuda" else "CPU BLAS",
        "dtype": str(dtype).replace("torch.", ""), "N": n, "K": k,
        "searched_up_to": max(batch_sizes), "row_checks": rep.checks,
        "first_divergence_M": m,
        "row": first.position if first else None,
        "elements_differing": first.elements_differing if first else 0,
        "max_ulp": first.max_ulp if first else 0,
    }
