"""The checks of attention's arguments: tensors (dtypes, shapes, devices, strides; no value read),
the paged caches, a step's host metadata and the blocks it uses.  Each error names the argument.

The host metadata (``seq_lens``, ``query_start_loc``) arrives as lists, NumPy arrays or 1-D
integer tensors and is read as int64 host arrays (:func:`host_ints`); an int32 CPU tensor, the
form vLLM keeps, is read without a check of its range.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ... import checks
from ...device import DEVICE

__all__ = [
    "IMPLS",
    "check_tensors",
    "check_caches",
    "check_new_kv",
    "check_metadata",
    "check_blocks",
    "index_arg",
    "host_list",
    "host_ints",
]

#: the implementations of :func:`~batch_invariance_kit.ops.attention.attention`
IMPLS = ("invariant", "variant", "reference", "sdpa")

_INT32_MAX = 2 ** 31 - 1
_TORCH_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})


def check_caches(k_cache, v_cache) -> None:
    """The paged caches: 4-D ``(num_blocks, block_size, kv_heads, head_dim)``, one dtype and
    device, unit stride along ``head_dim`` and the same strides (any other strides: a view
    of an engine's own cache layout, e.g. K and V halves of one tensor)."""
    checks.tensor("k_cache", k_cache, dim=4, contiguous=False)
    checks.tensor("v_cache", v_cache, dim=4, contiguous=False)
    checks.same_dtype("v_cache", v_cache, "k_cache", k_cache)
    checks.same_device("v_cache", v_cache, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must have unit stride in head_dim and equal strides, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")


def check_tensors(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out):
    """Dtypes, shapes and devices of the arguments (no value is read: no host synchronisation)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    checks.tensor("q", q, dim=3, contiguous=False)
    if q.stride(2) != 1:
        raise ValueError(f"q must have unit stride in its last dim, got strides {q.stride()}")
    check_caches(k_cache, v_cache)
    checks.same_dtype("k_cache", k_cache, "q", q)
    checks.same_device("k_cache", k_cache, "q", q)
    if impl in ("invariant", "variant") and q.device.type != DEVICE.type:
        raise ValueError(f"q must be on {DEVICE.type} for the Triton kernels, got {q.device}")
    T, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} must equal q head_dim {d}")
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of k_cache's {hkv} kv heads (GQA)")
    checks.tensor("block_table", block_table, dtypes=(torch.int32,), dim=2)
    checks.tensor("seq_lens", seq_lens, dtypes=(torch.int32,), dim=1)
    checks.tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), dim=1)
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        checks.same_device(name, t, "q", q)
    S = seq_lens.shape[0]
    if block_table.shape[0] != S:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but seq_lens has {S} sequences")
    if query_start_loc.shape[0] != S + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {S + 1} entries, got {query_start_loc.shape[0]}")
    if out is not None:
        checks.tensor("out", out, dtypes=(q.dtype,), dim=3, contiguous=False)
        checks.same_device("out", out, "q", q)
        if out.shape != q.shape:
            raise ValueError(f"out must have shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if out.stride(2) != 1:
            raise ValueError(f"out must have unit stride in its last dim, got strides {out.stride()}")


def check_new_kv(key, value, k_cache, q) -> None:
    """The optional new keys and values of :func:`attention`: both or neither, ``(num_tokens,
    kv_heads, head_dim)`` in the cache's dtype on q's device, unit stride in the last dim."""
    if (key is None) != (value is None):
        raise ValueError("key and value must be given together (the step's new keys and values) or not at all")
    if key is None:
        return
    shape = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        checks.tensor(name, t, dtypes=(k_cache.dtype,), dim=3, contiguous=False)
        checks.same_device(name, t, "q", q)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (num_tokens, kv_heads, head_dim) = {shape}, got {tuple(t.shape)}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def index_arg(name, v) -> int:
    """``v`` as an int >= 0 (a Python or NumPy integer, not a bool)."""
    try:
        i = operator.index(v)
    except TypeError:
        i = None
    if i is None or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if i < 0:
        raise ValueError(f"{name} must be >= 0, got {i}")
    return i


def host_list(name, x) -> list:
    """``x`` (a list of ints or a 1-D integer tensor) as a list of Python ints."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got {x.dtype} {tuple(x.shape)}")
        return x.tolist()
    try:
        return [int(v) for v in x]
    except TypeError:
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {type(x).__name__}") from None


def host_ints(name, x) -> np.ndarray:
    """``x`` (a list of ints, a NumPy array or a 1-D integer tensor) as a 1-D int64 host array
    of values an int32 holds (the plan's dtype)."""
    if type(x) is torch.Tensor and x.dtype is torch.int32 and x.ndim == 1 and x.is_cpu:
        return x.numpy().astype(np.int64)  # vLLM's host metadata: every value fits
    if isinstance(x, torch.Tensor):
        if x.dtype not in _TORCH_INTS or x.dim() != 1:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got {x.dtype} {tuple(x.shape)}")
        a = (x if x.is_cpu else x.cpu()).numpy()
    else:
        try:
            a = np.asarray(x)
        except (TypeError, ValueError, OverflowError):
            a = None
        if a is None or a.ndim != 1 or a.dtype.kind not in "iub" or not a.size:
            a = np.array(host_list(name, x), dtype=np.int64)  # anything else: int() of each entry
    if a.dtype.itemsize > 4 or a.dtype.kind == "u" and a.dtype.itemsize == 4:
        if a.size and a.max() > _INT32_MAX:
            raise ValueError(f"{name} holds {a.max()}, more than an int32 holds")
    return a.astype(np.int64, copy=False)


def check_metadata(lens: np.ndarray, qsl: np.ndarray, num_tokens: int | None = None) -> tuple:
    """The step's host metadata (int64 arrays): ``query_start_loc`` from 0 to ``num_tokens``,
    non-decreasing (a sequence may have 0 new tokens: padding), each ``q_len <= seq_len``.
    Returns ``(q_len, first)`` per sequence: its new tokens and the position of the first."""
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {len(lens) + 1} entries, got {len(qsl)}")
    end = qsl[-1] if num_tokens is None else num_tokens
    if qsl[0] != 0 or qsl[-1] != end:
        raise ValueError(f"query_start_loc must start at 0 and end at num_tokens={end}, got {qsl[0]}..{qsl[-1]}")
    ql = qsl[1:] - qsl[:-1]
    first = lens - ql
    low = ql | first  # negative where either is (the sign bit)
    if len(low) and low[low.argmin()] < 0:
        s = int((low < 0).argmax())
        if ql[s] < 0:
            raise ValueError(f"query_start_loc must not decrease: sequence {s} has {ql[s]} query tokens")
        raise ValueError(f"seq_lens[{s}]={lens[s]} is shorter than its {ql[s]} query tokens")
    return ql, first


def check_blocks(block_table, lens: np.ndarray, nb: int, bs: int) -> None:
    """Every block a sequence's ``seq_lens`` entry uses is a block of the cache (one pass over
    the table on its device)."""
    width = block_table.shape[1]
    cap = width * bs
    need = torch.from_numpy(-(-lens // bs)).to(block_table.device)  # blocks per sequence
    used = torch.arange(width, device=block_table.device) < need[:, None]
    bad = used & ((block_table < 0) | (block_table >= nb))
    bad_seq = bad.any(1).cpu().numpy() | (lens > cap)
    if bad_seq.any():
        s = int(bad_seq.argmax())
        if lens[s] > cap:
            raise ValueError(f"seq_lens[{s}]={lens[s]} is longer than the cache can hold for it: block_table has "
                             f"{width} blocks of {bs}")
        j = int(bad[s].nonzero()[0])
        raise ValueError(f"block_table[{s}, {j}] = {int(block_table[s, j])} is out of range: the cache has {nb} "
                         f"blocks")
