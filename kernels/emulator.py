"""The reduction-order emulator: an exact CPU model of a CUDA block reduction.

It models, operation by operation, how a production RMSNorm kernel (one CUDA block per
row) sums a row of ``n`` elements, so that its fp32 result has the GPU's *bits*:

1. **Per-thread partial sums.**  Thread ``t`` of a block of ``block_size`` threads walks
   its elements in a fixed order and accumulates in fp32, starting from ``0.0f``.  With
   vector width ``V`` (16-byte loads: 8 bf16/fp16 or 4 fp32 values) the row is cut into
   vectors of ``V`` consecutive elements; thread ``t`` takes vectors ``t, t+B, t+2B, ...``
   and, inside each vector, elements in order.  Elements before the first 16-byte-aligned
   address (``misalign``) are a scalar prefix handled first, by threads ``0..misalign-1``;
   the elements after the last whole vector are a scalar tail handled last, element ``j``
   of the tail by thread ``j mod B``.  With ``V = 1`` this is the classic
   ``for (i = threadIdx.x; i < n; i += blockDim.x)`` loop.
   For sums of squares the update is one fused multiply-add, ``acc = fmaf(x, x, acc)``
   (what nvcc emits for ``acc += x * x``), emulated with a single rounding.
2. **Warp reduction** (``cub::WarpReduce``, shuffle-down): offsets 1, 2, 4, 8, 16; after
   the step with offset ``o`` lane ``i`` holds ``lane_i + lane_{i+o}``: a balanced binary
   tree over the 32 lanes with adjacent pairing.
3. **Cross-warp combine** (``cub::BlockReduce``, default ``BLOCK_REDUCE_WARP_REDUCTIONS``):
   thread 0 folds the warp aggregates left to right: ``((w0 + w1) + w2) + ...``.

Every operation is an IEEE-754 fp32 operation with round-to-nearest-even, so numpy on any
CPU gives the same bits as the GPU.  :func:`rms_norm` continues to the RMSNorm output:
``scale = 1 / sqrt(sum / n + eps)`` (correctly rounded ``sqrtf`` and division, as the kit's
CUDA kernels compute it) and ``out = (dtype)(x * scale) * weight``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["WARP_SIZE", "thread_schedule", "block_reduce", "rms_scale", "normalize", "rms_norm", "RMSNormTrace",
           "fma_f32"]

WARP_SIZE = 32
_MAX_BLOCK = 1024


def _check_launch(n: int, block_size: int, vec_width: int, misalign: int, warp_size: int = WARP_SIZE) -> None:
    if warp_size not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"warp_size must be a power of two <= 32, got {warp_size!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (row length) must be a positive int, got {n!r}")
    if (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
            or block_size < warp_size or block_size > _MAX_BLOCK or block_size % warp_size):
        raise ValueError(
            f"block_size must be a multiple of warp_size={warp_size} in [{warp_size}, {_MAX_BLOCK}], got {block_size!r}"
        )
    if vec_width not in (1, 2, 4, 8, 16):
        raise ValueError(f"vec_width must be one of 1, 2, 4, 8, 16, got {vec_width!r}")
    if isinstance(misalign, bool) or not isinstance(misalign, (int, np.integer)) or not 0 <= misalign < max(vec_width, 1):
        raise ValueError(f"misalign must be an int in [0, vec_width), got {misalign!r}")


def thread_schedule(n: int, block_size: int, vec_width: int = 1, misalign: int = 0, *,
                    warp_size: int = WARP_SIZE) -> np.ndarray:
    """Element indices each thread accumulates, in order: ``(block_size, L)`` int64, ``-1`` = none."""
    _check_launch(n, block_size, vec_width, misalign, warp_size)
    prefix = min(misalign, n) if vec_width > 1 else 0
    body = n - prefix
    n_vec = body // vec_width
    tail_start = prefix + n_vec * vec_width
    per_thread: list = [[] for _ in range(block_size)]
    for i in range(prefix):
        per_thread[i % block_size].append(i)
    for v in range(n_vec):
        base = prefix + v * vec_width
        per_thread[v % block_size].extend(range(base, base + vec_width))
    for j, i in enumerate(range(tail_start, n)):
        per_thread[j % block_size].append(i)
    length = max(1, max(len(p) for p in per_thread))
    out = np.full((block_size, length), -1, dtype=np.int64)
    for t, p in enumerate(per_thread):
        out[t, : len(p)] = p
    return out


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded fp32 ``a * b + c`` (one rounding), like CUDA's ``fmaf``.

    The product of two fp32 values is exact in float64; the float64 sum is computed with
    round-to-odd (TwoSum error term + sticky bit), which makes the final rounding to fp32
    correct (no double-rounding error)."""
    a = np.asarray(a, dtype=np.float32).astype(np.float64)
    b = np.asarray(b, dtype=np.float32).astype(np.float64)
    c = np.asarray(c, dtype=np.float32).astype(np.float64)
    p = a * b  # exact: 24 + 24 bits <= 53
    with np.errstate(over="ignore", invalid="ignore"):
        s = p + c
        bp = s - p
        err = (p - (s - bp)) + (c - bp)
        odd = (s.view(np.int64) & 1) == 1
        fix = (err != 0) & ~odd & np.isfinite(s)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _to_f32_rows(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got {x.dtype}")
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"x must hold floating values, got numpy dtype {x.dtype}")
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"x must be 1-D (a row) or 2-D (rows, n), got shape {x.shape}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must be non-empty, got shape {x.shape}")
    return x.astype(np.float32)


def block_reduce(x, block_size: int, vec_width: int = 1, *, square: bool = False,
                 misalign: int = 0, return_partials: bool = False, warp_size: int = WARP_SIZE):
    """fp32 sum (or sum of squares) of each row of ``x`` as one CUDA block computes it.

    ``x``: ``(rows, n)`` or ``(n,)``, a torch tensor or numpy array (converted to fp32
    exactly when it is bf16/fp16).  Returns ``(rows,)`` float32; with
    ``return_partials=True`` also the per-thread partials ``(rows, block_size)`` and the
    warp aggregates ``(rows, block_size // warp_size)``.  ``warp_size`` other than 32 is
    for hand-sized teaching examples (a real GPU warp has 32 lanes)."""
    x = _to_f32_rows(x)
    rows, n = x.shape
    _check_launch(n, block_size, vec_width, misalign, warp_size)
    sched = thread_schedule(n, block_size, vec_width, misalign, warp_size=warp_size)
    padded = np.concatenate([x, np.zeros((rows, 1), np.float32)], axis=1)
    gathered = padded[:, np.where(sched < 0, n, sched)]  # (rows, B, L); padding adds +0.0
    acc = np.zeros((rows, block_size), np.float32)
    for j in range(gathered.shape[2]):
        v = gathered[:, :, j]
        acc = fma_f32(v, v, acc) if square else (acc + v).astype(np.float32)
    partials = acc
    lanes = acc.reshape(rows, block_size // warp_size, warp_size)
    while lanes.shape[2] > 1:  # offsets 1, 2, 4, 8, 16: adjacent pairs
        lanes = (lanes[:, :, 0::2] + lanes[:, :, 1::2]).astype(np.float32)
    warps = lanes[:, :, 0]
    total = warps[:, 0].copy()
    for w in range(1, warps.shape[1]):
        total = (total + warps[:, w]).astype(np.float32)
    if return_partials:
        return total, partials, warps
    return total


def rms_scale(sum_sq: np.ndarray, n: int, eps: float) -> np.ndarray:
    """``1 / sqrt(sum_sq / n + eps)`` in fp32, every step correctly rounded (``div.rn``,
    ``sqrt.rn``, as the kit's CUDA kernels compute it: no ``rsqrtf``)."""
    mean = (np.asarray(sum_sq, dtype=np.float32) / np.float32(n)).astype(np.float32)
    var = (mean + np.float32(eps)).astype(np.float32)
    return (np.float32(1.0) / np.sqrt(var)).astype(np.float32)


def normalize(x: torch.Tensor, scale: np.ndarray, weight: torch.Tensor) -> torch.Tensor:
    """``(T)((T)(x * scale) * weight)`` on the CPU: the fp32 product rounded to the input
    dtype ``T``, then the product with the weight (exact in fp32 for 16-bit values) rounded once."""
    dtype = x.dtype
    normed = (x.detach().to("cpu", torch.float32) * torch.from_numpy(np.asarray(scale, np.float32))[:, None]).to(dtype)
    return (normed.float() * weight.detach().to("cpu", torch.float32)).to(dtype)


@dataclass
class RMSNormTrace:
    """Every intermediate of an emulated RMSNorm, for teaching and for bit comparisons."""

    sum_sq: np.ndarray  # (rows,) fp32 sum of squares as the block reduces it
    scale: np.ndarray  # (rows,) fp32 1/sqrt(sum_sq/n + eps)
    out: torch.Tensor  # (rows, n) in the input dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, block_size: int,
             vec_width: int = 1, *, misalign: int = 0) -> RMSNormTrace:
    """Emulate the kit's CUDA RMSNorm on ``x`` (rows, n) with one block of ``block_size``.

    ``out = (x.dtype)(x_f32 * scale) * weight``, where the last multiply is done in the
    input dtype (fp32 product of two 16-bit values, rounded once)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be torch tensors")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, hidden), got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must have shape ({x.shape[1]},), got {tuple(weight.shape)}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    n = x.shape[1]
    s = block_reduce(x, block_size, vec_width, square=True, misalign=misalign)
    scale = rms_scale(s, n, eps)
    return RMSNormTrace(sum_sq=s, scale=scale, out=normalize(x, scale, weight))
