"""The CUDA C++ RMSNorm family (``csrc/rms_norm.cuh``) and its CPU emulation twin.

Five ops, in vLLM's in-place calling style (outputs first), each in two implementations:

* ``impl="variant"``: the production launch policy: the block size depends on the number of
  tokens (1024 threads below 256 tokens, 256 from there; per-block quant: 512 up to 256
  tokens, 256 above), so a row's reduction order, hence its bits, depends on the batch.
* ``impl="invariant"``: the block size is pinned (1024; 512 for per-block quant) whatever
  the batch: every row is reduced in the same order in every batch.
* ``impl="invariant256"``: the block size is pinned at 256 for every op and every batch
  (still batch-invariant: it never depends on the number of tokens).  Hypothesis, to be
  measured on a GPU: as invariant as the 1024 pin and as fast as the variant at large
  batches (where the variant also uses 256).  Its bits differ from ``"invariant"``'s (another
  reduction order), but never from batch to batch.

Tensors on CUDA run the compiled kernels (:mod:`batch_invariance_kit.ops.cuda_ext`); tensors on the CPU get
the emulator's prediction of exactly those bits (:func:`emulate`, built on
:func:`batch_invariance_kit.emulator.block_reduce`), through the same launch policy, so CPU tests
exercise the same batch-size dependence as the GPU.

The kernels' arithmetic, step by step (the emulator does the same, in numpy/torch):

1. fused ops: ``z = (T)(x + residual)`` (fp32 add, one rounding to T); ``residual <- z``.
2. ``sum = sum of z^2`` in the block's reduction order (fp32 FMA partials per thread, warp
   shuffle tree, sequential fold of warp aggregates: ``kernels/emulator.py``).
3. ``s = 1 / sqrtf(sum / n + eps)`` (fp32, correctly rounded).
4. ``v = (T)((float)(T)(z * s) * (float)w)``.
5. rms_norm: ``out = v``; fused_add_rms_norm: ``x <- v``; static fp8:
   ``out = e4m3(clamp(float(v) * (1 / scale), -448, 448))``; per-block quant: per group of
   ``group_size`` elements ``gs = max(absmax(v) / 448, MIN_SCALE)``,
   ``out = e4m3(clamp(float(v) / gs))``, ``scales[row, g] = gs``.
   The clamp is ``fmaxf(fminf(q, 448), -448)``; e4m3 conversion rounds to nearest even.

``MIN_SCALE = (float)(1 / (448 * 512))`` (about 4.36e-6) keeps an all-zero group finite.

Vectorization: pass 1 loads 16 bytes at a time (``V = 16 / itemsize``: 8 for bf16/fp16, 4
for fp32), after a scalar prefix up to the first 16-byte-aligned address of the row and
before a scalar tail; the misalignment is taken from each row's actual address.  The fused
ops vectorize only when ``x`` and ``residual`` rows have the same misalignment (else V = 1).
Pass 2 (elementwise) uses the same split with 16-byte loads/stores (fp8 outputs: 8 or 4
bytes packed per store) where the other operands' alignment allows, and each thread keeps
its first ``VPT`` (1, 2, 4 or 8, chosen from hidden, dtype and block size) vectors of pass 1
in registers, so ``x`` (``z`` for the fused ops) is read from memory once for rows of up to
``VPT * block`` vectors.  None of this changes a bit: pass 1's FMA chain is the same.

Launch policy (:func:`launch_block_size`): the variant's block is also capped at the
number of 16-byte vectors of a row rounded up to a warp (``max(32, roundup32(ceil(H/V)))``):
threads past the last vector would only add ``+0.0`` partials, so for aligned (vectorized)
rows the cap never changes bits: it only saves idle threads.  The invariant impl does not
cap.  NaN inputs are outside the bit-exact contract.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import checks
from . import cuda_ext
from ..emulator import WARP_SIZE, block_reduce, normalize, rms_scale

__all__ = [
    "OPS", "IMPLS", "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "GROUP_SIZES",
    "INVARIANT_SMALL_BLOCK", "vec_width", "launch_block_size", "impl_block_size",
    "emulate",
    "rms_norm", "fused_add_rms_norm", "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant", "rms_norm_per_block_quant", "gpu_crosscheck",
]

OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_per_block_quant",
)
IMPLS = ("variant", "invariant", "invariant256")
INVARIANT_SMALL_BLOCK = 256  # impl="invariant256": the pin for every op
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = np.float32(448.0)
MIN_SCALE = np.float32(1.0) / np.float32(448.0 * 512.0)  # == kMinScale in csrc/rms_norm.cuh
GROUP_SIZES = (64, 128)
_FUSED = ("fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant")
_PER_BLOCK = "rms_norm_per_block_quant"


# ---------------------------------------------------------------- launch policy

def vec_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte load: 8 for bf16/fp16, 4 for fp32."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _check_op(op) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def launch_block_size(num_tokens: int, hidden: int, dtype: torch.dtype, op: str, invariant: bool) -> int:
    """CUDA block size (threads per row) for a launch; a pure function of its arguments.

    invariant: 1024 (512 for per-block quant), whatever ``num_tokens``.
    variant: ``1024 if num_tokens < 256 else 256`` (per-block quant:
    ``512 if num_tokens <= 256 else 256``), capped at ``max(32, roundup32(ceil(hidden / V)))``
    (bit-neutral for vectorized rows, see the module docstring)."""
    _check_op(op)
    num_tokens = checks.positive_int("num_tokens", num_tokens)
    hidden = checks.positive_int("hidden", hidden)
    if dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {checks.FLOAT_DTYPES}, got {dtype}")
    per_block = op == _PER_BLOCK
    if invariant:
        return 512 if per_block else 1024
    if per_block:
        policy = 512 if num_tokens <= 256 else 256
    else:
        policy = 1024 if num_tokens < 256 else 256
    vectors = math.ceil(hidden / vec_width(dtype))
    cap = max(WARP_SIZE, -(-vectors // WARP_SIZE) * WARP_SIZE)
    return min(policy, cap)


def impl_block_size(impl: str, num_tokens: int, hidden: int, dtype: torch.dtype, op: str) -> int:
    """CUDA block size of ``impl`` for a launch: ``"variant"`` and ``"invariant"`` as
    :func:`launch_block_size`; ``"invariant256"``: :data:`INVARIANT_SMALL_BLOCK` for every
    op, number of tokens, hidden size and dtype (arguments still validated)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    block = launch_block_size(num_tokens, hidden, dtype, op, impl != "variant")
    return INVARIANT_SMALL_BLOCK if impl == "invariant256" else block


def policy_block_sizes(op: str) -> tuple:
    """The uncapped block sizes the variant switches between (small batch, large batch)."""
    return (512, 256) if _check_op(op) == _PER_BLOCK else (1024, 256)


# ---------------------------------------------------------------- emulation

def _misalign(t: torch.Tensor, row: int, vec: int) -> int:
    """Elements from row ``row`` of ``t`` to the next 16-byte-aligned address."""
    addr = t.data_ptr() + row * t.stride(0) * t.element_size()
    return ((16 - addr % 16) % 16) // t.element_size() if vec > 1 else 0


def _row_layouts(x: torch.Tensor, residual: torch.Tensor | None) -> list:
    """(vec_width, misalign) of pass 1 for every row, as the kernel derives them."""
    vec = vec_width(x.dtype)
    out = []
    for r in range(x.shape[0]):
        mx = _misalign(x, r, vec)
        if residual is not None and _misalign(residual, r, vec) != mx:
            out.append((1, 0))
        else:
            out.append((vec, mx))
    return out


def _row_sum_sq(z: torch.Tensor, block_size: int, layouts: list) -> np.ndarray:
    """fp32 sum of squares of each row of ``z`` (CPU, dtype T) in the kernel's order."""
    sums = np.empty(z.shape[0], np.float32)
    groups: dict = {}
    for r, key in enumerate(layouts):
        groups.setdefault(key, []).append(r)
    for (vec, mis), rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long)
        sums[rows] = block_reduce(z[idx], block_size, vec, square=True, misalign=mis)
    return sums


def _clamp_fp8(q: np.ndarray) -> torch.Tensor:
    q = np.fmax(np.fmin(q.astype(np.float32), FP8_MAX), -FP8_MAX)  # fminf/fmaxf semantics
    return torch.from_numpy(np.ascontiguousarray(q)).to(FP8_DTYPE)


def emulate(op: str, x: torch.Tensor, weight: torch.Tensor, *, eps: float, block_size: int,
            residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
            group_size: int = 128) -> tuple:
    """The bits the CUDA kernel of ``op`` produces with ``block_size`` threads per row.

    Reads the inputs (any device; the row addresses of ``x`` and ``residual`` decide the
    vectorization, as in the kernel) and writes nothing.  Returns CPU tensors:
    rms_norm ``(out,)``; fused_add_rms_norm ``(x_new, residual_new)``;
    rms_norm_static_fp8_quant ``(out_fp8,)``; fused_add_rms_norm_static_fp8_quant
    ``(out_fp8, residual_new)``; rms_norm_per_block_quant ``(out_fp8, scales)``.
    On a GPU, call it before an in-place kernel (it reads the inputs the kernel overwrites)."""
    _check_op(op)
    dtype = x.dtype
    n = x.shape[1]
    layouts = _row_layouts(x, residual if op in _FUSED else None)
    xc = x.detach().to("cpu")
    if op in _FUSED:
        z = (xc.float() + residual.detach().to("cpu").float()).to(dtype)
    else:
        z = xc
    v = normalize(z, rms_scale(_row_sum_sq(z, block_size, layouts), n, eps), weight)
    if op == "rms_norm":
        return (v,)
    if op == "fused_add_rms_norm":
        return (v, z)
    vf = v.float().numpy()
    if op in ("rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant"):
        inv = np.float32(1.0) / np.float32(scale.detach().to("cpu", torch.float32).reshape(()).item())
        q = _clamp_fp8((vf * inv).astype(np.float32))
        return (q,) if op == "rms_norm_static_fp8_quant" else (q, z)
    rows = vf.shape[0]
    g = vf.reshape(rows, n // group_size, group_size)
    amax = np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0.0)).astype(np.float32)
    gscale = np.fmax((amax / FP8_MAX).astype(np.float32), MIN_SCALE).astype(np.float32)
    q = _clamp_fp8((g / gscale[:, :, None]).astype(np.float32).reshape(rows, n))
    return (q, torch.from_numpy(gscale))


# ---------------------------------------------------------------- validation and dispatch

def _byte_range(t: torch.Tensor) -> tuple:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _no_overlap(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        return
    a0, a1 = _byte_range(t)
    b0, b1 = _byte_range(ref)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name} must not overlap {ref_name} in memory")


def _validate(op, impl, eps, x, weight, residual=None, out=None, out_dtype=None, scale=None,
              scales=None, group_size=None) -> tuple:
    """Checks every argument (errors name it); returns (eps, group_size)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    checks.tensor("x", x, dim=2)
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x must be on cpu or cuda, got {x.device}")
    rows, hidden = x.shape
    checks.norm_operands(x, weight, residual)
    if residual is not None:
        _no_overlap("residual", residual, "x", x)
    if out is not None:
        checks.tensor("out", out, dtypes=(out_dtype,), dim=2)
        checks.same_device("out", out, "x", x)
        if out.shape != x.shape:
            raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
        _no_overlap("out", out, "x", x)
        if residual is not None:
            _no_overlap("out", out, "residual", residual)
    if scale is not None or op in ("rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant"):
        checks.tensor("scale", scale, dtypes=(torch.float32,))
        checks.same_device("scale", scale, "x", x)
        if scale.numel() != 1:
            raise ValueError(f"scale must have exactly one element, got shape {tuple(scale.shape)}")
    if op == _PER_BLOCK:
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        if hidden % group_size:
            raise ValueError(f"x's hidden size {hidden} must be a multiple of group_size {group_size}")
        checks.tensor("scales", scales, dtypes=(torch.float32,), dim=2)
        checks.same_device("scales", scales, "x", x)
        if tuple(scales.shape) != (rows, hidden // group_size):
            raise ValueError(f"scales must have shape {(rows, hidden // group_size)}, got {tuple(scales.shape)}")
    eps = checks.positive_float("eps", eps)
    return eps, group_size


def _launch(op: str, block_size: int, eps: float, *, x, weight, residual=None, out=None,
            scale=None, scales=None, group_size=128):
    """Run ``op`` with ``block_size``: the CUDA kernel for CUDA tensors, else the emulator.
    Writes the outputs in place (as the kernel does)."""
    if x.is_cuda:
        ext = cuda_ext.load()  # raises the reason when it cannot be built
        if op == "rms_norm":
            ext.rms_norm(out, x, weight, eps, block_size)
        elif op == "fused_add_rms_norm":
            ext.fused_add_rms_norm(x, residual, weight, eps, block_size)
        elif op == "rms_norm_static_fp8_quant":
            ext.rms_norm_static_fp8_quant(out, x, weight, scale, eps, block_size)
        elif op == "fused_add_rms_norm_static_fp8_quant":
            ext.fused_add_rms_norm_static_fp8_quant(out, x, residual, weight, scale, eps, block_size)
        else:
            ext.rms_norm_per_block_quant(out, scales, x, weight, eps, group_size, block_size)
        return
    res = emulate(op, x, weight, eps=eps, block_size=block_size, residual=residual, scale=scale,
                  group_size=group_size)
    targets = {
        "rms_norm": (out,),
        "fused_add_rms_norm": (x, residual),
        "rms_norm_static_fp8_quant": (out,),
        "fused_add_rms_norm_static_fp8_quant": (out, residual),
        _PER_BLOCK: (out, scales),
    }[op]
    for dst, src in zip(targets, res):
        dst.copy_(src)


def _block(op, x, impl) -> int:
    return impl_block_size(impl, x.shape[0], x.shape[1], x.dtype, op)


# ---------------------------------------------------------------- public ops

def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             impl: str = "invariant") -> torch.Tensor:
    """``out <- (T)((T)(x * s) * weight)``; returns ``out``.  ``x``, ``out``: (rows, hidden)."""
    eps, _ = _validate("rms_norm", impl, eps, x, weight, out=out, out_dtype=x.dtype if isinstance(x, torch.Tensor) else None)
    _launch("rms_norm", _block("rms_norm", x, impl), eps, x=x, weight=weight, out=out)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, impl: str = "invariant") -> tuple:
    """In place: ``residual <- z = (T)(x + residual)``, ``x <- rms_norm(z)``; returns ``(x, residual)``."""
    op = "fused_add_rms_norm"
    eps, _ = _validate(op, impl, eps, x, weight, residual=residual)
    _launch(op, _block(op, x, impl), eps, x=x, weight=weight, residual=residual)
    return x, residual


def rms_norm_static_fp8_quant(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              scale: torch.Tensor, eps: float = 1e-6, *,
                              impl: str = "invariant") -> torch.Tensor:
    """``out (float8_e4m3fn) <- e4m3(clamp(rms_norm(x) * (1 / scale)))``; returns ``out``."""
    op = "rms_norm_static_fp8_quant"
    eps, _ = _validate(op, impl, eps, x, weight, out=out, out_dtype=FP8_DTYPE, scale=scale)
    _launch(op, _block(op, x, impl), eps, x=x, weight=weight, out=out, scale=scale)
    return out


def fused_add_rms_norm_static_fp8_quant(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                                        weight: torch.Tensor, scale: torch.Tensor,
                                        eps: float = 1e-6, *, impl: str = "invariant") -> tuple:
    """``residual <- z = (T)(x + residual)``; ``out <- e4m3(clamp(rms_norm(z) / scale))``;
    ``x`` is not written.  Returns ``(out, residual)``."""
    op = "fused_add_rms_norm_static_fp8_quant"
    eps, _ = _validate(op, impl, eps, x, weight, residual=residual, out=out, out_dtype=FP8_DTYPE,
                       scale=scale)
    _launch(op, _block(op, x, impl), eps, x=x, weight=weight, residual=residual, out=out, scale=scale)
    return out, residual


def rms_norm_per_block_quant(out: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
                             weight: torch.Tensor, eps: float = 1e-6, group_size: int = 128, *,
                             impl: str = "invariant") -> tuple:
    """Dynamic per-group fp8: ``out`` (float8_e4m3fn, x's shape), ``scales`` (fp32,
    (rows, hidden // group_size)); returns ``(out, scales)``."""
    op = _PER_BLOCK
    eps, group_size = _validate(op, impl, eps, x, weight, out=out, out_dtype=FP8_DTYPE,
                                scales=scales, group_size=group_size)
    _launch(op, _block(op, x, impl), eps, x=x, weight=weight, out=out, scales=scales,
            group_size=group_size)
    return out, scales


# ---------------------------------------------------------------- GPU cross-check

def _offset_rows(src: torch.Tensor, offset: int, device) -> torch.Tensor:
    """``src`` copied to ``device`` into a buffer starting ``offset`` elements in (misaligned rows)."""
    buf = torch.empty(src.numel() + offset, dtype=src.dtype, device=device)
    t = buf[offset:].view(src.shape)
    t.copy_(src)
    return t


def _crosscheck_inputs(op, rows, hidden, dtype, x_off, r_off, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = _offset_rows((torch.randn(rows, hidden, generator=g) * 2.0).to(dtype), x_off, device)
    res = _offset_rows(torch.randn(rows, hidden, generator=g).to(dtype), r_off, device) if op in _FUSED else None
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
    return x, res, w


def gpu_crosscheck(rows: int = 1000, hiddens=(2048, 4096, 5120),
                   dtypes=(torch.bfloat16, torch.float16), *, offsets=((0, 0), (1, 1), (0, 1)),
                   group_size: int = 128, eps: float = 1e-6, seed: int = 0) -> list:
    """CUDA bits vs emulator bits, for every op, hidden size, dtype, block size and row offset.

    Block sizes: the variant's two policy sizes, the invariant pins (1024 or 512, and 256)
    and the variant's capped size when it differs.  ``offsets``: (x, residual) element offsets of the row
    buffers; (1, 1) exercises the scalar prefix/tail, (0, 1) the fused ops' V = 1 fallback
    (used for the fused ops only).  Returns one dict per case with ``rows`` compared,
    ``rows_differing`` (any bit of any output) and ``elements_differing``."""
    from ..bitwise import bits

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_crosscheck needs a CUDA device")
    cuda_ext.load()
    device = torch.device("cuda")
    results = []
    for op in OPS:
        for hidden in hiddens:
            for dtype in dtypes:
                blocks = sorted({*policy_block_sizes(op),
                                 launch_block_size(1, hidden, dtype, op, False),
                                 launch_block_size(rows, hidden, dtype, op, True),
                                 impl_block_size("invariant256", rows, hidden, dtype, op)}, reverse=True)
                for x_off, r_off in offsets:
                    if op not in _FUSED and r_off != x_off:
                        continue
                    for block in blocks:
                        case_seed = seed + 7919 * len(results)
                        x, res, w = _crosscheck_inputs(op, rows, hidden, dtype, x_off, r_off, case_seed, device)
                        scale = torch.tensor([0.01], dtype=torch.float32, device=device)
                        out = scales = None
                        if op == "rms_norm":
                            out = torch.empty_like(x)
                        elif op != "fused_add_rms_norm":
                            out = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
                        if op == _PER_BLOCK:
                            scales = torch.empty(rows, hidden // group_size, dtype=torch.float32, device=device)
                        expected = emulate(op, x, w, eps=eps, block_size=block, residual=res,
                                           scale=scale, group_size=group_size)
                        _launch(op, block, eps, x=x, weight=w, residual=res, out=out, scale=scale,
                                scales=scales, group_size=group_size)
                        torch.cuda.synchronize()
                        got = {
                            "rms_norm": (out,),
                            "fused_add_rms_norm": (x, res),
                            "rms_norm_static_fp8_quant": (out,),
                            "fused_add_rms_norm_static_fp8_quant": (out, res),
                            _PER_BLOCK: (out, scales),
                        }[op]
                        row_diff = torch.zeros(rows, dtype=torch.bool)
                        elems = 0
                        for g_t, e_t in zip(got, expected):
                            d = (bits(g_t.cpu()) != bits(e_t)).reshape(rows, -1)
                            row_diff |= d.any(dim=1)
                            elems += int(d.sum())
                        results.append({
                            "op": op, "hidden": hidden, "dtype": checks.dtype_name(dtype),
                            "block_size": block, "x_offset": x_off,
                            "residual_offset": r_off if op in _FUSED else None,
                            "rows": rows, "rows_differing": int(row_diff.sum()),
                            "elements_differing": elems,
                        })
    return results
