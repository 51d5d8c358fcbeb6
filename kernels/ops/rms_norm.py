"""The RMSNorm family: float64 references, batch-*variant* and batch-*invariant* Triton kernels.

Five ops, the ones vLLM fixed for batch invariance (its RMSNorm block-size fix):

* ``rms_norm``: ``out = (dtype)((dtype)(x * s) * w)``, ``s = 1/sqrt(mean(x^2) + eps)``;
* ``fused_add_rms_norm``: ``z = (dtype)(x + residual)``; ``residual <- z``; ``out = norm(z)``;
* ``rms_norm_static_fp8_quant``: ``q = fp8(clamp(norm(x) * (1/scale), -448, 448))``;
* ``fused_add_rms_norm_static_fp8_quant``: the two above fused (``residual <- z``,
  ``q = fp8(clamp(norm(z) * (1/scale)))``);
* ``rms_norm_per_block_quant``: ``y = norm(x)``; per group of ``group_size`` columns
  ``scale = max(absmax(y)/448, 1/(448*512))``, ``q = fp8(clamp(y * (1/scale)))``.

Every op takes ``impl=``:

* ``"reference"``: float64 torch, rounded once to the output dtype (the truth for accuracy);
* ``"variant"``: the Triton kernel launched the way production launches it: the reduction
  block is picked from ``num_tokens`` (vLLM: ``max_block = 1024 if num_tokens < 256 else 256``;
  per-block quant: ``512 if num_tokens <= 256 else 256``).  The kernel sums ``x^2`` of a row
  into a ``[BLOCK]`` fp32 vector, chunk by chunk (like ``BLOCK`` CUDA threads striding over the
  row), then reduces that vector with ``tl.sum``: another ``BLOCK`` means another summation
  tree, so a row's bits change when the batch crosses 256 tokens;
* ``"invariant"`` (default): the *same* kernel, launched with a schedule picked from the row's
  shape only (hidden size, dtype, device), never from the number of rows.

:func:`launch_info` is the pure function behind both launch policies (the book prints it).

Numerics, identical for variant and invariant: ``ss = sum(x^2)`` in fp32;
``s = 1 / sqrt_rn(ss / H + eps)`` with correctly rounded division and square root
(``tl.div_rn``, ``tl.sqrt_rn``; Triton's ``/`` on fp32 is an approximate division on the GPU);
``y = (dtype)((dtype)(x * s) * w)``; fp8 outputs are ``e4m3fn`` (``torch.float8_e4m3fn``),
``q = fp8(clamp(y * (1/scale), -448, 448))`` with ``1/scale`` computed in fp32 with ``div_rn``.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import checks
from ..device import INTERPRET

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .tl_numerics import to_f32 as _to_f32  # noqa: E402
from .direct_launch import DirectLaunch  # noqa: E402

__all__ = [
    "OPS",
    "IMPLS",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
    "launch_info",
    "rms_norm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_per_block_quant",
]

IMPLS = ("invariant", "variant", "reference")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Floor of a dynamic per-group scale (vLLM's ``min_scaling_factor``): keeps 1/scale finite.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

#: Largest row the invariant kernel keeps whole in registers (one pass); longer rows are
#: processed in fixed chunks of ``_INVARIANT_CHUNK`` columns.
_MAX_FUSED = 8192
_INVARIANT_CHUNK = 4096
#: Largest group size of ``rms_norm_per_block_quant`` (a group must fit in the variant's
#: smallest block, 256).
_MAX_GROUP = 256
#: Interpreter only: rows per program = min(_INTERPRET_MAX_ROWS, _INTERPRET_TILE // BLOCK).
_INTERPRET_TILE = 65536
_INTERPRET_MAX_ROWS = 128

_QUANT = {"rms_norm": 0, "fused_add_rms_norm": 0, "rms_norm_static_fp8_quant": 1,
          "fused_add_rms_norm_static_fp8_quant": 1, "rms_norm_per_block_quant": 2}
_RESIDUAL = {"fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant"}


# --------------------------------------------------------------------------------------------
# Launch policies (pure functions: the book prints what each batch gets)
# --------------------------------------------------------------------------------------------

def production_max_block(num_tokens: int, op: str = "rms_norm") -> int:
    """vLLM's batch-dependent block size (``num_tokens < 256 ? 1024 : 256``): the bug the variant reproduces."""
    if op == "rms_norm_per_block_quant":
        return 512 if num_tokens <= 256 else 256
    return 1024 if num_tokens < 256 else 256


#: Rows of one chunk whose ``BLOCK`` elements take at most this many bytes (16 per lane of one
#: warp: a head-dim norm such as Qwen3's q/k norms, up to 256 columns of bf16 or 128 of fp32)
#: are summed by one warp each, :data:`_WARP_ROWS` rows (and warps) to a program: see
#: :func:`_rows_per_program`.
_WARP_ROW_BYTES = 512
_WARP_ROWS = 4


def _packed(hidden: int, block: int, itemsize: int) -> bool:
    """Whether compiled programs pack rows one warp each (:func:`_rows_per_program`): a row of
    one chunk, at least a warp's 32 lanes wide, of at most :data:`_WARP_ROW_BYTES`, with no warp
    count set through :data:`NUM_WARPS_OVERRIDE`."""
    return (not INTERPRET and hidden <= block and 32 <= block and block * itemsize <= _WARP_ROW_BYTES
            and block not in NUM_WARPS_OVERRIDE)


def _rows_per_program(block: int, packed: bool) -> int:
    """Rows handled by one program: a function of the row's shape and dtype and the execution
    mode, never of the batch.

    Compiled on a GPU: one row per program (the production layout), except rows that
    :func:`_packed` selects, which a program of one warp would sum: those are packed
    :data:`_WARP_ROWS` to a program of as many warps.  Triton lays such a ``[ROWS, BLOCK]`` tile
    out one row per warp with the same per-thread elements and the same 32 lanes along the row
    as a one-row, one-warp program, so each row is summed in the same order (the offline sm_90
    compile compares the layouts, the GPU tests the bits); and a program of four warps keeps an
    SM full where one-warp programs hit its limit on resident blocks.

    Under the interpreter, which costs about a millisecond per program, a tile of
    ``ROWS x BLOCK`` (~32k elements) cuts the number of programs; ``tl.sum`` over axis 1 then
    reduces each row of the tile on its own, in the same order whatever ROWS is (tests check the
    bits do not depend on the batch)."""
    if not INTERPRET:
        return _WARP_ROWS if packed else 1
    rows = max(1, min(_INTERPRET_MAX_ROWS, _INTERPRET_TILE // block))
    return 1 << (rows.bit_length() - 1)  # a power of two (tl.arange)


#: Tuning hook (benchmarks only): ``{block: num_warps}`` replacing the default below.  The
#: warp count shapes ``tl.sum``'s tree, so it must stay a function of the block (hence of the
#: hidden size) alone: never of the batch.
NUM_WARPS_OVERRIDE: dict = {}
#: Measured on the H200 (results/h200/rms_norm_tune_warps.json): a 4096-wide row is fastest
#: with 4 warps (93% of the copy ceiling at 16384 tokens, against 87% with 8).
_MEASURED_NUM_WARPS = {4096: 4}


#: Rounding to bf16 by the GPU's conversion instruction (compiled kernels; the interpreter always
#: rounds by integer arithmetic, :func:`_round_bf16`).  Both round to nearest even, so the bits are
#: the same; ``False`` forces the integer rounding on a GPU too (a test and benchmark hook).
BF16_HW_CAST = True


def _num_warps(block: int, packed: bool) -> int:
    if block in NUM_WARPS_OVERRIDE:
        return NUM_WARPS_OVERRIDE[block]
    if block in _MEASURED_NUM_WARPS:
        return _MEASURED_NUM_WARPS[block]
    if packed:  # one warp per row (_rows_per_program)
        return _WARP_ROWS
    return min(max(block // 256, 1), 8)


def launch_info(num_tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16,
                  op: str = "rms_norm", invariant: bool = True) -> dict:
    """The launch decision of ``op`` for a batch of ``num_tokens`` rows of ``hidden`` columns.

    Returns ``{"op", "impl", "num_tokens", "hidden", "dtype", "max_block", "block",
    "num_chunks", "rows_per_program", "num_warps", "grid"}``.  ``block`` is the width of the
    fp32 accumulator a row is summed into; ``num_chunks = ceil(hidden / block)`` chunks are
    added into it before one ``tl.sum``; so (``block``, ``num_chunks``) *is* the row's
    reduction tree.  Invariant: a function of ``hidden`` only.  Variant: of ``num_tokens`` too.
    """
    if op not in _QUANT:
        raise ValueError(f"op must be one of {sorted(_QUANT)}, got {op!r}")
    num_tokens = checks.positive_int("num_tokens", num_tokens)
    hidden = checks.positive_int("hidden", hidden)
    if dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {checks.FLOAT_DTYPES}, got {dtype}")
    max_block = _max_block(num_tokens, op, invariant)
    block = _block(hidden, max_block, invariant)
    packed = _packed(hidden, block, dtype.itemsize)
    rows = _rows_per_program(block, packed)
    return {
        "op": op,
        "impl": "invariant" if invariant else "variant",
        "num_tokens": num_tokens,
        "hidden": hidden,
        "dtype": checks.dtype_name(dtype),
        "max_block": max_block,
        "block": block,
        "num_chunks": -(-hidden // block),
        "rows_per_program": rows,
        "num_warps": _num_warps(block, packed),
        "grid": -(-num_tokens // rows),
    }


def _max_block(num_tokens: int, op: str, invariant: bool) -> int:
    """The widest reduction block allowed: fixed (invariant) or chosen from the batch (variant)."""
    return _MAX_FUSED if invariant else production_max_block(num_tokens, op)


def _block(hidden: int, max_block: int, invariant: bool) -> int:
    """The fp32 accumulator width of a ``hidden``-wide row: the row's next power of two, at most
    ``max_block`` (variant); the invariant schedule cuts a row wider than ``max_block`` into
    ``_INVARIANT_CHUNK`` chunks."""
    full = 1 << (hidden - 1).bit_length()
    if invariant:
        return full if full <= max_block else _INVARIANT_CHUNK
    return min(full, max_block)


@functools.lru_cache(maxsize=1024)
def _kernel_params(op: str, hidden: int, itemsize: int, max_block: int, invariant: bool, group_size: int,
                   has_residual: bool, knobs: tuple) -> tuple:
    """``(rows per program, constexprs and launch options)`` of ``_rms_norm_kernel``: what
    :func:`launch_info` decides, cached per row shape and element size (``knobs``: the tuning
    values that the decision reads, so that changing one takes effect)."""
    block = _block(hidden, max_block, invariant)
    packed = _packed(hidden, block, itemsize)
    rows = _rows_per_program(block, packed)
    return rows, dict(H=hidden, BLOCK=block, NUM_CHUNKS=-(-hidden // block), ROWS=rows, HAS_RESIDUAL=has_residual,
                      QUANT=_QUANT[op], GROUP=group_size, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, HW_CAST=knobs[3],
                      num_warps=_num_warps(block, packed))


# --------------------------------------------------------------------------------------------
# The Triton kernel (one kernel; variant and invariant differ only in BLOCK / NUM_CHUNKS)
# --------------------------------------------------------------------------------------------

@triton.jit
def _round_bf16(v):
    """fp32 -> fp32 holding ``v`` rounded to bf16, to nearest even, by integer arithmetic.
    (The Triton interpreter's fp32->bf16 cast truncates, and it mangles subnormals both ways;
    the GPU rounds to nearest even.  Doing the rounding and the bf16 <-> fp32 moves with
    integer ops and bitcasts gives the IEEE result on both.)"""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return tl.where(v != v, v, u.to(tl.float32, bitcast=True))


@triton.jit
def _round(v, DTYPE: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 -> fp32 holding ``(DTYPE)v`` (round to nearest even).  ``HW_CAST`` (compiled for a
    GPU): bf16 by the hardware's conversion (``cvt.rn``, two values per instruction), which
    rounds to nearest even like :func:`_round_bf16` and costs a few times fewer instructions
    per element; under the interpreter by :func:`_round_bf16`."""
    if DTYPE == tl.bfloat16:
        if HW_CAST:
            return _to_f32(v.to(tl.bfloat16))
        else:
            return _round_bf16(v)
    elif DTYPE == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _from_f32(v, DTYPE: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 that already holds a DTYPE value -> DTYPE, exactly (bf16: keep the top 16 bits, or
    the hardware's conversion, exact for such a value, when ``HW_CAST``)."""
    if DTYPE == tl.bfloat16:
        if HW_CAST:
            return v.to(tl.bfloat16)
        else:
            return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)


@triton.jit
def _round_fp8e4m3(v):
    """fp32 in [-448, 448] -> fp32 holding it rounded to float8 e4m3fn, to nearest even.
    Normal range (|v| >= 2^-6): round the fp32 mantissa to 3 bits with integer arithmetic;
    subnormals (spacing 2^-9): add and subtract 2^14, whose fp32 ulp is 2^-9.  (The
    interpreter's own fp32->fp8 cast rounds ties up and mishandles carries; after this the
    cast is exact on interpreter and GPU alike.)"""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    a_bits = u & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    normal = (a_bits + (0x7FFFF + ((a_bits >> 20) & 1))) & 0xFFF00000
    sub = ((a + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    r = tl.where(a < 0.015625, sub, normal) | sign
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _load_chunk(x_ptr, res_ptr, res_out_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 values of one chunk of the input; with a residual: z = (dtype)(x + r), stored."""
    x = _to_f32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    if HAS_RESIDUAL:
        r = _to_f32(tl.load(res_ptr + offs, mask=mask, other=0.0))
        x = _round(x + r, res_out_ptr.dtype.element_ty, HW_CAST)
        tl.store(res_out_ptr + offs, _from_f32(x, res_out_ptr.dtype.element_ty, HW_CAST), mask=mask)
    return x


@triton.jit
def _load_weight(w_ptr, scale_ptr, cols, H: tl.constexpr, QUANT: tl.constexpr):
    """The weight of one chunk (``[1, BLOCK]``) and, for the static fp8 quantization (QUANT 1),
    ``1 / scale``.  A row of one chunk loads them before its sum of squares, so that their latency
    overlaps the row's load instead of following the reduction; a chunked row loads each chunk's
    in its second pass.  The arithmetic is the same either way."""
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    if QUANT == 1:
        inv = tl.div_rn(1.0, tl.load(scale_ptr))
    else:
        inv = 1.0
    return w, inv


@triton.jit
def _finish_chunk(x, s, w, inv, out_ptr, scales_ptr, rows, row_mask, start, offs, mask,
                  H: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr,
                  GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, HW_CAST: tl.constexpr):
    """y = (dtype)((dtype)(x*s) * w), then store it (QUANT 0), its static fp8 quantization
    (QUANT 1, ``inv`` = 1 / scale) or its per-group dynamic fp8 quantization and the group
    scales (QUANT 2).  ``w``, ``inv``: from :func:`_load_weight`."""
    xs = _round(x * s[:, None], w.dtype, HW_CAST)
    y = _round(xs * _to_f32(w), w.dtype, HW_CAST)
    if QUANT == 0:
        tl.store(out_ptr + offs, _from_f32(y, out_ptr.dtype.element_ty, HW_CAST), mask=mask)
    elif QUANT == 1:
        q = _round_fp8e4m3(tl.minimum(tl.maximum(y * inv, -FP8_MAX), FP8_MAX))
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        NG: tl.constexpr = BLOCK // GROUP
        yg = tl.reshape(y, (ROWS, NG, GROUP))
        amax = tl.max(tl.abs(yg), axis=2)  # [ROWS, NG]; max is order-free
        scale = tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)
        inv = tl.div_rn(tl.full((ROWS, NG), 1.0, tl.float32), scale)
        q = _round_fp8e4m3(tl.minimum(tl.maximum(yg * inv[:, :, None], -FP8_MAX), FP8_MAX))
        q = tl.reshape(q, (ROWS, BLOCK))
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        NGROUPS: tl.constexpr = H // GROUP
        g = start // GROUP + tl.arange(0, NG)[None, :]  # [1, NG]: group indices of this chunk
        g_offs = rows.to(tl.int64)[:, None] * NGROUPS + g
        tl.store(scales_ptr + g_offs, scale, mask=row_mask[:, None] & (g < NGROUPS))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr,
                     n_rows, eps,
                     H: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                     ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     HW_CAST: tl.constexpr):
    """ROWS rows per program.  A row's sum of squares: ``acc[j] = sum_k x[k*BLOCK + j]^2``
    (chunks in order), then ``tl.sum(acc)``; so the tree is fixed by (BLOCK, NUM_CHUNKS)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    row_offs = rows.to(tl.int64)[:, None] * H
    cols0 = tl.arange(0, BLOCK)[None, :]
    if NUM_CHUNKS == 1:  # the whole row in registers: one read, one write
        mask = row_mask[:, None] & (cols0 < H)
        w, inv = _load_weight(w_ptr, scale_ptr, cols0, H, QUANT)
        x = _load_chunk(x_ptr, res_ptr, res_out_ptr, row_offs + cols0, mask, HAS_RESIDUAL, HW_CAST)
        ss = tl.sum(x * x, axis=1)
        s = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full((ROWS,), H, tl.float32)) + eps))
        _finish_chunk(x, s, w, inv, out_ptr, scales_ptr, rows, row_mask, 0, row_offs + cols0, mask,
                      H, BLOCK, ROWS, QUANT, GROUP, FP8_MAX, MIN_SCALE, HW_CAST)
    else:
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k in range(NUM_CHUNKS):
            cols = k * BLOCK + cols0
            mask = row_mask[:, None] & (cols < H)
            x = _load_chunk(x_ptr, res_ptr, res_out_ptr, row_offs + cols, mask, HAS_RESIDUAL, HW_CAST)
            acc += x * x
        ss = tl.sum(acc, axis=1)
        s = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full((ROWS,), H, tl.float32)) + eps))
        tl.debug_barrier()  # z written by pass 1 is read back by pass 2
        for k in range(NUM_CHUNKS):
            cols = k * BLOCK + cols0
            mask = row_mask[:, None] & (cols < H)
            if HAS_RESIDUAL:  # re-read z (the residual input may have been overwritten)
                x = _to_f32(tl.load(res_out_ptr + row_offs + cols, mask=mask, other=0.0))
            else:
                x = _to_f32(tl.load(x_ptr + row_offs + cols, mask=mask, other=0.0))
            w, inv = _load_weight(w_ptr, scale_ptr, cols, H, QUANT)
            _finish_chunk(x, s, w, inv, out_ptr, scales_ptr, rows, row_mask, k * BLOCK, row_offs + cols, mask,
                          H, BLOCK, ROWS, QUANT, GROUP, FP8_MAX, MIN_SCALE, HW_CAST)


def _launch(op, x, residual, residual_out, weight, out, scale, scales, eps, group_size, invariant):
    n, h = x.shape
    knobs = (_INTERPRET_MAX_ROWS, _INTERPRET_TILE, tuple(NUM_WARPS_OVERRIDE.items()), BF16_HW_CAST and not INTERPRET)
    rows, kw = _kernel_params(op, h, x.element_size(), _max_block(n, op, invariant), invariant, group_size,
                              residual is not None, knobs)
    _RMS_NORM((-(-n // rows),),
        x, residual if residual is not None else x, residual_out if residual_out is not None else x,
        weight, out, scale if scale is not None else weight, scales if scales is not None else out,
        n, eps, **kw)


# --------------------------------------------------------------------------------------------
# float64 references
# --------------------------------------------------------------------------------------------

def _norm64(x64: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = 1.0 / torch.sqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps)
    return x64 * s * weight.double()


def _fp8_64(y64: torch.Tensor, inv_scale64) -> torch.Tensor:
    return (y64 * inv_scale64).clamp(-FP8_MAX, FP8_MAX).to(torch.float32).to(FP8_DTYPE)


def _reference(op, x, residual, weight, scale, eps, group_size):
    """Returns the op's outputs (tuple) computed in float64, each rounded once at the end."""
    x64 = x.double()
    outs = []
    if residual is not None:
        z = (x.float() + residual.float()).to(x.dtype)  # the op's own definition of z
        outs.append(z)
        x64 = z.double()
    y64 = _norm64(x64, weight, eps)
    q = _QUANT[op]
    if q == 0:
        main = [y64.to(x.dtype)]
    elif q == 1:
        main = [_fp8_64(y64, 1.0 / scale.double().reshape(()))]
    else:
        g = y64.reshape(y64.shape[0], -1, group_size)
        sc = (g.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
        main = [_fp8_64(g, 1.0 / sc[..., None]).reshape(y64.shape), sc.to(torch.float32)]
    return tuple(main + outs)


# --------------------------------------------------------------------------------------------
# Validation and dispatch
# --------------------------------------------------------------------------------------------

def _check_inputs(x, weight, eps, impl, residual=None, scale=None, group_size=None):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    checks.tensor("x", x, dim=2)
    checks.norm_operands(x, weight, residual)
    h = x.shape[1]
    if scale is not None:
        checks.tensor("scale", scale, dtypes=(torch.float32,))
        checks.same_device("scale", scale, "x", x)
        if scale.numel() != 1:
            raise ValueError(f"scale must have exactly 1 element, got shape {tuple(scale.shape)}")
        v = float(scale.reshape(()).item())
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"scale must be positive and finite, got {v!r}")
    if group_size is not None:
        checks.positive_int("group_size", group_size)
        if group_size & (group_size - 1) or group_size > _MAX_GROUP:
            raise ValueError(f"group_size must be a power of two <= {_MAX_GROUP}, got {group_size}")
        if h % group_size:
            raise ValueError(f"group_size {group_size} must divide the hidden size {h}")
    eps = checks.positive_float("eps", eps)
    if not math.isfinite(eps):
        raise ValueError(f"eps must be finite, got {eps!r}")
    if impl != "reference":
        checks.kernel_device("x", x)
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x must be on cpu or cuda, got {x.device}")
    return eps


def _run(op, x, weight, eps, impl, *, residual=None, scale=None, group_size=128,
         out=None, residual_out=None, scales_out=None):
    q = _QUANT[op]
    out = checks.output("out", out, x.shape, x.dtype if q == 0 else FP8_DTYPE, x)
    if residual is not None:
        residual_out = checks.output("residual_out", residual_out, x.shape, x.dtype, x)
    if q == 2:
        scales_out = checks.output("scales_out", scales_out, (x.shape[0], x.shape[1] // group_size),
                             torch.float32, x)
    results = [out] + ([scales_out] if q == 2 else []) + ([residual_out] if residual is not None else [])
    if impl == "reference":
        for dst, src in zip(results, _reference(op, x, residual, weight, scale, eps, group_size)):
            dst.copy_(src)
    else:
        _launch(op, x, residual, residual_out, weight, out, scale, scales_out, eps, group_size,
                impl == "invariant")
    return results[0] if len(results) == 1 else tuple(results)


def rms_norm(x, weight, eps=1e-6, *, impl="invariant", out=None):
    """``(dtype)((dtype)(x * s) * weight)`` with ``s = 1/sqrt(mean(x^2) + eps)``; ``x`` is
    ``(num_tokens, hidden)``.  Returns ``out`` (allocated when not given)."""
    eps = _check_inputs(x, weight, eps, impl)
    return _run("rms_norm", x, weight, eps, impl, out=out)


def fused_add_rms_norm(x, residual, weight, eps=1e-6, *, impl="invariant", out=None, residual_out=None):
    """``z = (dtype)(x + residual)``; returns ``(rms_norm(z), z)``, written to ``out`` and
    ``residual_out`` when given (they may alias ``x`` and ``residual``)."""
    eps = _check_inputs(x, weight, eps, impl, residual=residual)
    return _run("fused_add_rms_norm", x, weight, eps, impl, residual=residual, out=out,
                residual_out=residual_out)


def fused_add_rms_norm_(x, residual, weight, eps=1e-6, *, impl="invariant"):
    """In place, like vLLM's ``fused_add_rms_norm``: ``residual <- x + residual``,
    ``x <- rms_norm(residual)``.  Returns ``(x, residual)``."""
    return fused_add_rms_norm(x, residual, weight, eps, impl=impl, out=x, residual_out=residual)


def rms_norm_static_fp8_quant(x, weight, scale, eps=1e-6, *, impl="invariant", out=None):
    """``fp8_e4m3fn(clamp(rms_norm(x) * (1/scale), -448, 448))``; ``scale`` a 1-element fp32 tensor."""
    eps = _check_inputs(x, weight, eps, impl, scale=scale)
    return _run("rms_norm_static_fp8_quant", x, weight, eps, impl, scale=scale, out=out)


def fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, eps=1e-6, *, impl="invariant",
                                        out=None, residual_out=None):
    """``z = (dtype)(x + residual)``; returns ``(fp8 quant of rms_norm(z), z)``."""
    eps = _check_inputs(x, weight, eps, impl, residual=residual, scale=scale)
    return _run("fused_add_rms_norm_static_fp8_quant", x, weight, eps, impl, residual=residual,
                scale=scale, out=out, residual_out=residual_out)


def rms_norm_per_block_quant(x, weight, eps=1e-6, group_size=128, *, impl="invariant", out=None,
                             scales_out=None):
    """Dynamic per-group fp8: ``y = rms_norm(x)``; for each group of ``group_size`` columns
    ``scale = max(absmax(y)/448, MIN_SCALE)`` and ``q = fp8(clamp(y * (1/scale)))``.
    Returns ``(q, scales)`` with ``scales`` fp32 of shape ``(num_tokens, hidden // group_size)``."""
    eps = _check_inputs(x, weight, eps, impl, group_size=group_size)
    return _run("rms_norm_per_block_quant", x, weight, eps, impl, group_size=group_size, out=out,
                scales_out=scales_out)


#: name -> op, for tests and notebooks.  Signatures differ by the op's extra inputs
#: (``residual``, ``scale``, ``group_size``); every op takes ``impl=`` and ``out=``.
OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rms_norm_static_fp8_quant": rms_norm_static_fp8_quant,
    "fused_add_rms_norm_static_fp8_quant": fused_add_rms_norm_static_fp8_quant,
    "rms_norm_per_block_quant": rms_norm_per_block_quant,
}


#: the eager launch of :func:`_rms_norm_kernel` (:mod:`.direct_launch`)
_RMS_NORM = DirectLaunch(_rms_norm_kernel)
