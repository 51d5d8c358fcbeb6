"""Override mode: make an *unmodified* torch model batch-invariant.

    with batch_invariance_kit.ops.override.batch_invariant():
        y = model(x)          # nn.Linear -> aten::addmm / mm, log_softmax, mean ... now invariant

Inside the context, ``torch.library.Library("aten", "IMPL")`` routes five aten ops, for the
dispatch key of the kit's device (``"CUDA"`` on a GPU, ``"CPU"`` here), to the kit's kernels:

=====================  ===========================================================
``aten::mm``           :func:`batch_invariance_kit.ops.matmul.mm` (invariant)
``aten::addmm``        :func:`batch_invariance_kit.ops.matmul.addmm` (``beta == alpha == 1``)
``aten::bmm``          :func:`batch_invariance_kit.ops.matmul.bmm`
``aten::_log_softmax`` :func:`log_softmax` below (what ``F.log_softmax`` calls)
``aten::mean.dim``     :func:`mean` below (``x.mean(dim)``)
=====================  ===========================================================

On exit the registrations are destroyed and the original kernels are in force again.
Contexts nest (only the outermost one registers and unregisters) and an exception inside
the context still restores.  ``enable()`` / ``disable()`` do the same by hand.

Arguments the kit's kernels do not cover (float64 or integer tensors, mixed dtypes, tensors
on another device, ``addmm`` with ``beta``/``alpha`` other than 1, ``half_to_float`` on a
32-bit input, 0-d tensors, repeated dims) **fall back to the original aten kernel**, called
through a handle saved before the override was registered (``torch.library.get_kernel``,
torch >= 2.9).  A fallback is *not* batch-invariant, so every one is counted in
:data:`fallback_counts`; ``batch_invariant(strict=True)`` raises ``NotImplementedError``
instead.  ``out=`` variants (``torch.mm(a, b, out=c)``, i.e. ``aten::mm.out``) are not
overridden.  Kit calls of each op are counted in :data:`call_counts`.

No recursion: the kernels called from the override use only ``torch.empty``, views,
``contiguous``/``copy_``/``zero_``/``fill_`` and Triton launches, never the overridden ops.

The two row-wise kernels here (invariant by construction: the summation schedule of a row
is a function of the row length only, never of the number of rows):

* :func:`log_softmax`: ``y = (x - max) - log(sum(exp(x - max)))`` in fp32, the sum taken as
  ``acc[j] += e[c*BLOCK + j]`` over the row's chunks in order, then one ``tl.sum(acc)``;
* :func:`mean`: ``sum(x) / L`` (``tl.div_rn``) with the same chunked sum, over the last dim
  or any set of dims (moved last and collapsed into one row length ``L``).

Each has a *variant twin*, ``impl="variant"`` (the negative control: the same invariance check
must catch it).  The variant is launched the way production reductions are launched when there
are few rows: a handful of rows cannot fill a GPU of 132 SMs with one program per row, so each
row is **split into pieces reduced by different programs** (split-reduction, as in PyTorch's
``Reduce.cuh`` when there are few outputs, or flash-decoding's split-KV), and a second pass
merges the pieces' partial results in piece order.  The number of pieces is chosen from the
*number of rows* (:func:`row_launch`): ``min(16, 132 // rows)`` pieces (at most one per chunk),
one piece from 132 rows up.  Another number of pieces is another summation tree, so a row's
bits change with the batch.  For ``mean`` the pieces' sums are added; for ``log_softmax`` each
piece stores its log-sum-exp ``lse_p = m_p + log(sum(exp(x - m_p)))`` and the merge computes
``lse = M + log(sum_p exp(lse_p - M))``, ``M = max_p lse_p`` (flash-decoding's merge of
split states), then ``y = x - lse``: every piece adds a rounding of its own.  Both impls are
accurate to a few fp32 ulps; only the variant's bits depend on the batch.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter

import torch

from .. import checks
from . import matmul as _mm
from ..device import DEVICE, INTERPRET
from .tl_numerics import from_f32, to_f32

import triton  # noqa: E402  (after batch_invariance_kit.device)
import triton.language as tl  # noqa: E402

__all__ = [
    "OVERRIDDEN",
    "batch_invariant",
    "enable",
    "disable",
    "is_enabled",
    "enabled_ops",
    "dispatch_key",
    "call_counts",
    "fallback_counts",
    "log_softmax",
    "mean",
    "launch_rows",
    "row_launch",
]

#: The aten ops routed to the kit's kernels.
OVERRIDDEN = ("mm", "addmm", "bmm", "_log_softmax", "mean.dim")

#: op -> number of calls served by the kit's invariant kernels (since import).
call_counts: Counter = Counter()
#: op -> number of calls passed to the original aten kernel (not invariant).
fallback_counts: Counter = Counter()

_MAX_BLOCK = 4096  # longest chunk of a row held in registers
_INTERPRET_TILE = 65536
_INTERPRET_MAX_ROWS = 128

#: Variant only: the programs a launch aims for (an H100 has 132 SMs), the variant's chunk
#: width (a production-like 512 threads) and the most pieces a row is split into.
_VARIANT_FILL = 132
_VARIANT_BLOCK = 512
_VARIANT_MAX_SPLITS = 16


# --------------------------------------------------------------------------------------------
# Row-wise invariant kernels
# --------------------------------------------------------------------------------------------

def _row_schedule(L: int) -> tuple:
    """(BLOCK, NUM_CHUNKS, ROWS per program, num_warps) for rows of length ``L``: a function
    of ``L`` and the execution mode only.  ROWS > 1 only under the interpreter (fewer, larger
    programs); ``tl.sum(axis=1)`` reduces each row of the tile on its own."""
    block = min(triton.next_power_of_2(max(L, 1)), _MAX_BLOCK)
    rows = 1 if not INTERPRET else max(1, min(_INTERPRET_MAX_ROWS, _INTERPRET_TILE // block))
    return block, triton.cdiv(L, block), rows, min(max(block // 256, 1), 8)


@triton.jit
def _row_tile(n_rows, L, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's rows: (row mask [ROWS], row offsets [ROWS, 1] (int64), columns [1, BLOCK])."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    return rows < n_rows, rows.to(tl.int64)[:, None] * L, tl.arange(0, BLOCK)[None, :]


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, n_rows, L,
                        BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr):
    row_mask, base, cols0 = _row_tile(n_rows, L, ROWS, BLOCK)
    if NUM_CHUNKS == 1:
        col_mask = cols0 < L
        mask = row_mask[:, None] & col_mask
        x = tl.where(col_mask, to_f32(tl.load(x_ptr + base + cols0, mask=mask, other=0.0)), float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.where(col_mask, tl.exp(x - m[:, None]), 0.0)
        lse = tl.log(tl.sum(e, axis=1))
        y = (x - m[:, None]) - lse[:, None]
        tl.store(out_ptr + base + cols0, from_f32(y, out_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        for c in range(NUM_CHUNKS):  # the max is order-free
            cols = c * BLOCK + cols0
            x = tl.where(cols < L, to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L),
                                                  other=0.0)), float("-inf"))
            m = tl.maximum(m, tl.max(x, axis=1))
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in range(NUM_CHUNKS):  # chunks in order into one [BLOCK] accumulator per row
            cols = c * BLOCK + cols0
            x = to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L), other=0.0))
            acc += tl.where(cols < L, tl.exp(x - m[:, None]), 0.0)
        lse = tl.log(tl.sum(acc, axis=1))
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + cols0
            mask = row_mask[:, None] & (cols < L)
            x = to_f32(tl.load(x_ptr + base + cols, mask=mask, other=0.0))
            y = (x - m[:, None]) - lse[:, None]
            tl.store(out_ptr + base + cols, from_f32(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, n_rows, L,
                     BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr):
    row_mask, base, cols0 = _row_tile(n_rows, L, ROWS, BLOCK)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        cols = c * BLOCK + cols0
        acc += to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L), other=0.0))
    s = tl.sum(acc, axis=1)
    mean = tl.div_rn(s, tl.zeros_like(s) + L)  # L -> fp32 exactly (L < 2**24); correctly rounded
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tl.store(out_ptr + rows, from_f32(mean, out_ptr.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# The variant twins: a row split into pieces, how many chosen from the number of rows
# --------------------------------------------------------------------------------------------

@triton.jit
def _split_partials_kernel(x_ptr, part_ptr, n_rows, L, SPLITS, PER_SPLIT,
                           LOG_SOFTMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Variant, pass 1: program ``(i, p)`` reduces chunks ``p*PER_SPLIT ..`` (at most PER_SPLIT)
    of its rows into ``[BLOCK]`` accumulators, one ``tl.sum``, and writes the piece's partial to
    ``part_ptr[row, p]``: log_softmax, the piece's log-sum-exp ``m_p + log(sum(exp(x - m_p)))``
    (``m_p`` the piece's max); mean, the piece's ``sum(x)``."""
    row_mask, base, cols0 = _row_tile(n_rows, L, ROWS, BLOCK)
    piece = tl.program_id(1)
    c_lo = piece * PER_SPLIT
    c_hi = tl.minimum(c_lo + PER_SPLIT, tl.cdiv(L, BLOCK))
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = rows.to(tl.int64) * SPLITS + piece
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    if LOG_SOFTMAX:
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        for c in range(c_lo, c_hi):
            cols = c * BLOCK + cols0
            x = tl.where(cols < L, to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L),
                                                  other=0.0)), float("-inf"))
            m = tl.maximum(m, tl.max(x, axis=1))
        for c in range(c_lo, c_hi):
            cols = c * BLOCK + cols0
            x = to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L), other=0.0))
            acc += tl.where(cols < L, tl.exp(x - m[:, None]), 0.0)
        tl.store(part_ptr + slot, m + tl.log(tl.sum(acc, axis=1)), mask=row_mask)
    else:
        for c in range(c_lo, c_hi):
            cols = c * BLOCK + cols0
            acc += to_f32(tl.load(x_ptr + base + cols, mask=row_mask[:, None] & (cols < L), other=0.0))
        tl.store(part_ptr + slot, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _split_finish_kernel(x_ptr, out_ptr, part_ptr, n_rows, L, SPLITS, NUM_CHUNKS,
                         LOG_SOFTMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Variant, pass 2: the pieces of each row merged in piece order 0, 1, ..., SPLITS-1.
    log_softmax (flash-decoding's merge of split log-sum-exps): ``M = max_p lse_p``,
    ``lse = M + log(sum_p exp(lse_p - M))``, then ``x - lse`` chunk by chunk; mean:
    ``div_rn(sum_p part_p, L)``."""
    row_mask, base, cols0 = _row_tile(n_rows, L, ROWS, BLOCK)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    first = rows.to(tl.int64) * SPLITS
    total = tl.zeros((ROWS,), dtype=tl.float32)
    if LOG_SOFTMAX:
        big = tl.full((ROWS,), float("-inf"), tl.float32)
        for p in range(SPLITS):  # the max: exact in any order
            big = tl.maximum(big, tl.load(part_ptr + first + p, mask=row_mask, other=0.0))
        for p in range(SPLITS):  # the rescaled sums, in piece order
            total += tl.exp(tl.load(part_ptr + first + p, mask=row_mask, other=0.0) - big)
        lse = big + tl.log(total)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + cols0
            mask = row_mask[:, None] & (cols < L)
            x = to_f32(tl.load(x_ptr + base + cols, mask=mask, other=0.0))
            tl.store(out_ptr + base + cols, from_f32(x - lse[:, None], out_ptr.dtype.element_ty), mask=mask)
    else:
        for p in range(SPLITS):
            total += tl.load(part_ptr + first + p, mask=row_mask, other=0.0)
        mean = tl.div_rn(total, tl.zeros_like(total) + L)
        tl.store(out_ptr + rows, from_f32(mean, out_ptr.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------

_KINDS = ("log_softmax", "mean")
_KERNEL_IMPLS = ("invariant", "variant")


def row_launch(num_rows: int, L: int, impl: str = "invariant") -> dict:
    """The launch of the row kernels for ``num_rows`` rows of length ``L`` (a pure function:
    the book can print it).  ``block``: width of a row's fp32 accumulator; ``num_chunks =
    ceil(L / block)``; ``splits``: pieces a row is cut into, each reduced by its own program
    (``chunks_per_split`` chunks each) and combined in a second pass; ``rows_per_program``;
    ``num_warps``.  (``block``, ``splits``, ``chunks_per_split``) is the row's summation tree.

    Invariant: a function of ``L`` only (``splits`` = 1).  Variant: ``block`` 512 and
    ``splits = min(16, num_chunks, 132 // num_rows)`` (at least 1): a function of the number
    of rows, so that few rows still give enough programs to fill the GPU."""
    if impl not in _KERNEL_IMPLS:
        raise ValueError(f"impl must be 'invariant' or 'variant', got {impl!r}")
    num_rows = checks.positive_int("num_rows", num_rows)
    L = checks.positive_int("L", L)
    if impl == "invariant":
        block, chunks, rows, warps = _row_schedule(L)
        return {"impl": impl, "num_rows": num_rows, "L": L, "block": block, "num_chunks": chunks,
                "splits": 1, "chunks_per_split": chunks, "rows_per_program": rows, "num_warps": warps}
    block = min(triton.next_power_of_2(L), _VARIANT_BLOCK)
    chunks = triton.cdiv(L, block)
    want = max(1, min(_VARIANT_MAX_SPLITS, chunks, _VARIANT_FILL // num_rows))
    per_split = triton.cdiv(chunks, want)
    _, _, rows, warps = _row_schedule(block)  # rows per program and warps of a ``block``-wide tile
    return {"impl": impl, "num_rows": num_rows, "L": L, "block": block, "num_chunks": chunks,
            "splits": triton.cdiv(chunks, per_split),  # no empty piece
            "chunks_per_split": per_split, "rows_per_program": rows, "num_warps": warps}


def launch_rows(kind: str, x2: torch.Tensor, out: torch.Tensor, impl: str = "invariant") -> None:
    """Launch the row kernel ``kind`` ("log_softmax" or "mean") on a contiguous (R, L) ``x2``
    with R, L >= 1; ``out`` contiguous, (R, L) or (R,).  (Tests pass guarded outputs here.)
    ``impl="variant"`` uses the split launch of :func:`row_launch` (an fp32 workspace of
    ``R x splits`` partials, then the second pass)."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'log_softmax' or 'mean', got {kind!r}")
    R, L = x2.shape
    cfg = row_launch(R, L, impl)  # checks impl
    block, rows, warps = cfg["block"], cfg["rows_per_program"], cfg["num_warps"]
    if impl == "invariant":
        kernel = _log_softmax_kernel if kind == "log_softmax" else _row_mean_kernel
        kernel[(triton.cdiv(R, rows),)](x2, out, R, L, BLOCK=block, NUM_CHUNKS=cfg["num_chunks"], ROWS=rows,
                                        num_warps=warps)
        return
    splits = cfg["splits"]
    part = torch.empty((R, splits), dtype=torch.float32, device=x2.device)
    lsm = kind == "log_softmax"
    _split_partials_kernel[(triton.cdiv(R, rows), splits)](
        x2, part, R, L, splits, cfg["chunks_per_split"], LOG_SOFTMAX=lsm, BLOCK=block, ROWS=rows, num_warps=warps)
    _split_finish_kernel[(triton.cdiv(R, rows),)](
        x2, out, part, R, L, splits, cfg["num_chunks"], LOG_SOFTMAX=lsm, BLOCK=block, ROWS=rows, num_warps=warps)


def _check_row_impl(impl):
    if impl not in ("invariant", "variant", "reference"):
        raise ValueError(f"impl must be 'invariant', 'variant' or 'reference', got {impl!r}")


def _norm_dim(name, d, ndim):
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"{name} must be an int, got {type(d).__name__}")
    if not -ndim <= d < ndim:
        raise ValueError(f"{name} {d} is out of range for a {ndim}-D tensor")
    return d % ndim


def log_softmax(x, dim=-1, *, half_to_float=False, impl="invariant"):
    """``log_softmax(x)`` along ``dim``, fp32 math.  Output dtype: ``x``'s, or float32 when
    ``half_to_float`` and ``x`` is fp16/bf16 (aten's ``_log_softmax`` flag).  A ``dim`` other
    than the last costs a transposed copy in and out.  ``impl``: "invariant", "variant" (the
    negative control: a row split into pieces, how many chosen from the number of rows; see
    :func:`row_launch`) or "reference" (float64 torch)."""
    _check_row_impl(impl)
    checks.tensor("x", x, contiguous=False, nonempty=False)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim, got a 0-d tensor")
    dim = _norm_dim("dim", dim, x.dim())
    if half_to_float and x.dtype == torch.float32:
        raise TypeError("half_to_float needs a float16 or bfloat16 x, got float32")
    out_dtype = torch.float32 if half_to_float else x.dtype
    if impl == "reference":
        return torch.log_softmax(x.double(), dim).to(out_dtype)
    checks.kernel_device("x", x)
    xr = x.movedim(dim, -1).contiguous()
    out = torch.empty(xr.shape, dtype=out_dtype, device=x.device)
    L = xr.shape[-1]
    if out.numel():
        launch_rows("log_softmax", xr.view(-1, L), out.view(-1, L), impl)
    return out if dim == x.dim() - 1 else out.movedim(-1, dim).contiguous()


def _mean_dims(dim, ndim):
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int) and not isinstance(dim, bool):
        dim = [dim]
    if not isinstance(dim, (list, tuple)):
        raise TypeError(f"dim must be None, an int or a sequence of ints, got {type(dim).__name__}")
    if len(dim) == 0:  # aten: an empty dim list reduces every dim
        return list(range(ndim))
    dims = [_norm_dim("dim", d, ndim) for d in dim]
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim {list(dim)} names a dim more than once")
    return sorted(dims)


def mean(x, dim=None, keepdim=False, *, dtype=None, impl="invariant"):
    """Mean over ``dim`` (an int, a sequence, or None / [] for all dims), fp32 sum in a fixed
    per-row order then one correctly rounded division.  Output dtype ``dtype`` if given (fp32,
    fp16 or bf16) else ``x``'s.  An empty reduction gives NaN (like torch).  ``impl``:
    "invariant", "variant" (the negative control, see :func:`row_launch`) or "reference"."""
    _check_row_impl(impl)
    checks.tensor("x", x, contiguous=False, nonempty=False)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim, got a 0-d tensor")
    if dtype is not None and dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be None, float32, float16 or bfloat16, got {dtype}")
    out_dtype = dtype if dtype is not None else x.dtype
    red = _mean_dims(dim, x.dim())
    keep = [d for d in range(x.dim()) if d not in red]
    kept_shape = [x.shape[d] for d in keep]
    out_shape = [1 if d in red else x.shape[d] for d in range(x.dim())] if keepdim else kept_shape
    if impl == "reference":
        return x.double().mean(red, keepdim=keepdim).to(out_dtype)
    checks.kernel_device("x", x)
    L = math.prod(x.shape[d] for d in red)
    R = math.prod(kept_shape)
    out = torch.empty(R, dtype=out_dtype, device=x.device)
    if R and not L:
        out.fill_(float("nan"))
    elif R:
        launch_rows("mean", x.permute(keep + red).contiguous().view(R, L), out, impl)
    return out.view(out_shape)


# --------------------------------------------------------------------------------------------
# The override
# --------------------------------------------------------------------------------------------

_state = {"lib": None, "originals": {}, "strict": [], "ops": ()}


def dispatch_key() -> str:
    """The dispatch key the override registers for: ``"CUDA"`` on a GPU, ``"CPU"`` here."""
    return "CUDA" if DEVICE.type == "cuda" else "CPU"


def is_enabled() -> bool:
    return _state["lib"] is not None


def _float_on_device(*ts) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in checks.FLOAT_DTYPES and t.device.type == DEVICE.type
               for t in ts) and len({t.dtype for t in ts}) == 1


def _fallback(op, why, keyset, *args, **kwargs):
    if _state["strict"] and _state["strict"][-1]:
        raise NotImplementedError(f"batch_invariant(strict=True): aten::{op} has no invariant kernel for "
                                  f"these arguments ({why})")
    orig = _state["originals"].get(op)
    if orig is None:
        raise NotImplementedError(f"aten::{op} ({why}): no invariant kernel, and this torch "
                                  f"({torch.__version__}) has no torch.library.get_kernel to call the original")
    fallback_counts[op] += 1
    return orig.call_boxed(keyset, *args, **kwargs)


def _mm_impl(keyset, a, b):
    if not (_float_on_device(a, b) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]):
        return _fallback("mm", "dtype, device or shape", keyset, a, b)
    call_counts["mm"] += 1
    return _mm.mm(a, b)


def _addmm_impl(keyset, bias, a, b, *, beta=1, alpha=1):
    ok = (_float_on_device(bias, a, b) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
          and beta == 1 and alpha == 1 and bias.dim() <= 2)
    if ok:
        try:
            bias.expand(a.shape[0], b.shape[1])
        except RuntimeError:
            ok = False
    if not ok:
        return _fallback("addmm", "dtype, device, shape, or beta/alpha != 1", keyset, bias, a, b,
                         beta=beta, alpha=alpha)
    call_counts["addmm"] += 1
    return _mm.addmm(bias, a, b)


def _bmm_impl(keyset, a, b):
    if not (_float_on_device(a, b) and a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]
            and a.shape[2] == b.shape[1]):
        return _fallback("bmm", "dtype, device or shape", keyset, a, b)
    call_counts["bmm"] += 1
    return _mm.bmm(a, b)


def _log_softmax_impl(keyset, x, dim, half_to_float):
    if not (_float_on_device(x) and x.dim() >= 1 and not (half_to_float and x.dtype == torch.float32)):
        return _fallback("_log_softmax", "dtype, device, 0-d or half_to_float", keyset, x, dim, half_to_float)
    call_counts["_log_softmax"] += 1
    return log_softmax(x, dim, half_to_float=half_to_float)


def _mean_impl(keyset, x, dim=None, keepdim=False, *, dtype=None):
    ok = _float_on_device(x) and x.dim() >= 1 and (dtype is None or dtype in checks.FLOAT_DTYPES)
    if ok:
        try:
            _mean_dims(list(dim) if dim is not None else None, x.dim())
        except (TypeError, ValueError):
            ok = False
    if not ok:
        return _fallback("mean.dim", "dtype, device, 0-d or dims", keyset, x, dim, keepdim, dtype=dtype)
    call_counts["mean.dim"] += 1
    return mean(x, list(dim) if dim is not None else None, keepdim, dtype=dtype)


_IMPLS = {"mm": _mm_impl, "addmm": _addmm_impl, "bmm": _bmm_impl,
          "_log_softmax": _log_softmax_impl, "mean.dim": _mean_impl}


def _ops_arg(ops) -> tuple:
    if ops is None:
        return OVERRIDDEN
    if isinstance(ops, str) or not all(isinstance(o, str) for o in ops):
        raise TypeError(f"ops must be a sequence of op names from {list(OVERRIDDEN)}, got {ops!r}")
    bad = [o for o in ops if o not in OVERRIDDEN]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of {list(OVERRIDDEN)}, got {list(ops)!r}")
    return tuple(o for o in OVERRIDDEN if o in ops)


def enable(strict: bool = False, ops=None) -> None:
    """Route the ops of :data:`OVERRIDDEN` (or the subset ``ops``) to the kit's kernels (nests:
    one :func:`disable` per :func:`enable`; a nested call routes the ops of the outermost one
    and refuses another subset).  ``strict``: raise instead of falling back to the original
    kernel."""
    names = _ops_arg(ops)
    if _state["lib"] is None:
        key = dispatch_key()
        get_kernel = getattr(torch.library, "get_kernel", None)
        originals = {op: get_kernel(f"aten::{op}", key) for op in names} if get_kernel else {}
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                for op in names:
                    lib.impl(op, _IMPLS[op], key, with_keyset=True)
        except Exception:
            lib._destroy()
            raise
        _state.update(lib=lib, originals=originals, ops=names)
    elif ops is not None and names != _state["ops"]:
        raise ValueError(f"ops {list(names)} differ from the active override's {list(_state['ops'])}")
    _state["strict"].append(bool(strict))


def enabled_ops() -> tuple:
    """The aten ops the active override routes to the kit's kernels (``()`` when inactive)."""
    return _state["ops"] if _state["lib"] is not None else ()


def disable() -> None:
    """Undo one :func:`enable`; the outermost one restores the original kernels."""
    if _state["lib"] is None:
        raise RuntimeError("disable() without a matching enable(): the override is not active")
    _state["strict"].pop()
    if not _state["strict"]:
        lib = _state["lib"]
        _state.update(lib=None, originals={}, ops=())
        lib._destroy()


@contextlib.contextmanager
def batch_invariant(strict: bool = False):
    """Context manager: the override is active inside, restored on exit (also on an exception)."""
    enable(strict)
    try:
        yield
    finally:
        disable()
