"""Triton helpers shared by the kit's kernels: exact moves between 16-bit floats and fp32, the
tile product every GEMM of the kit accumulates with, and that product's arithmetic under the
Triton interpreter.

The Triton interpreter's own bf16 casts are unsafe (its fp32 -> bf16 cast truncates, and
bf16 subnormals are mangled), so bf16 travels through its bits; on a GPU these compile to the
same few integer instructions and give the IEEE result too.

**The interpreter's tile product.**  Triton's interpreter computes ``tl.dot`` as numpy's
``matmul`` of the two tiles, i.e. the BLAS numpy was built with (OpenBLAS in numpy's wheels).
BLAS picks its kernel from the number of rows (a 1-row product is a GEMV, 16 rows a GEMM
micro-kernel), from the CPU (each ISA level has its own kernels) and from the thread setting, and
each kernel sums a row's products in its own order: on some machines row 0 of a 1..8-row product
differs in its last bits from row 0 of the same product with 16 rows.  That is the batch variance
this kit is about, inside the interpreter, and whether a machine shows it is luck.  So when the
kit runs under the interpreter, :func:`fixed_order_matmul` replaces it (:func:`tile_product`
switches; ``"fixed"`` is the default, ``"blas"`` is numpy's ``matmul``, kept as the variant twin
of the tests and of chapter 1).  Every output element is computed from its own row of ``a`` and
column of ``b`` in one documented order, with nothing but IEEE fp32 multiplies and adds (numpy's
elementwise ufuncs, exact on every CPU), so its bits are the same for any tile height, on any
CPU, BLAS build and thread count:

1. ``p[k] = a[i, k] * b[k, j]`` rounded to fp32 (exact for 16-bit inputs widened to fp32);
2. ``K`` padded with zero products to a power of two, then folded in halves,
   ``p[k] = p[k] + p[k + K/2]`` for ``k < K/2``, until one value is left;
3. the accumulator added last: ``acc + p[0]``.

On a GPU ``tl.dot`` is the tensor cores' (or, for ``input_precision="ieee"``, the FMA units')
order, fixed by the tile shape alone; nothing here touches the compiled path.

**The interpreter's helper calls.**  The interpreter runs a kernel as Python: before a program
runs it wraps ``triton.language``'s builtins for its NumPy arithmetic (and restores them after
the launch), and it wraps them again on *every* call of a ``@triton.jit`` helper inside the
kernel, scanning the language modules with ``inspect.getmembers`` each time, although they are
already wrapped.  With the kit's helpers (a fold per KV tile, a step per K block) that scan was a
third of the CPU time of a model step.  :func:`_install_interpreter_patch_once` makes a helper's
call skip it while the running kernel has wrapped the same language modules (a helper that sees
other ones is wrapped as before).  What any operation computes is unchanged: the same wrapped
builtins run.
"""
import contextlib

import numpy as np
import triton
import triton.language as tl

from ..device import INTERPRET


@triton.jit
def to_f32(x):
    """Exact widening to fp32 (bf16 by a 16-bit shift of its bits)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def from_f32(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE rounded to nearest even (bf16 by integer arithmetic; NaN stays NaN)."""
    if DTYPE == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        r = tl.where(v != v, (u >> 16) | 0x40, r)  # quiet NaN, never rounded into infinity
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32.  ``UPCAST`` (the Triton interpreter, whose ``tl.dot``
    misreads bf16 tiles): the tiles are widened to fp32 first, exactly (a product of two 16-bit
    floats fits in fp32).  fp32 tiles multiply in IEEE fp32 (``input_precision="ieee"``: never
    TF32); 16-bit tiles go to the tensor cores."""
    if UPCAST:
        a = to_f32(a)
        b = to_f32(b)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def fixed_order_matmul(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """``acc + a @ b`` for 2-D (or batched 3-D) float arrays in the order of the module docstring:
    fp32 products (fp64 when either input is fp64), a halving tree over ``k`` in index order, the
    accumulator last.  Each output element depends on its own row and column only."""
    if a.ndim not in (2, 3) or b.ndim != a.ndim or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a and b: shapes {a.shape} and {b.shape} do not multiply")
    ct = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
    a = a.astype(ct, copy=False)
    b = b.astype(ct, copy=False)
    if a.ndim == 3:
        out = np.stack([fixed_order_matmul(a[i], b[i]) for i in range(a.shape[0])])
    else:
        k = a.shape[1]
        # (K, M, N) products: each fold adds two contiguous slabs, in place
        p = np.multiply(np.ascontiguousarray(a.T)[:, :, None], b[:, None, :])
        width = 1 << max(k - 1, 0).bit_length()
        if width != k:
            p = np.concatenate([p, np.zeros((width - k,) + p.shape[1:], dtype=ct)])
        while width > 1:
            width //= 2
            np.add(p[:width], p[width:2 * width], out=p[:width])
        out = p[0] if k else np.zeros((a.shape[0], b.shape[1]), dtype=ct)
    return out if acc is None else acc + out.astype(acc.dtype, copy=False)


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_PRODUCT = {"kind": "fixed"}


def _interpreter_dot(blas_dot):
    """The interpreter builder's ``create_dot``, with :func:`fixed_order_matmul` for float tiles
    (integer and 8-bit float tiles, which the kit's kernels never multiply, keep Triton's own)."""
    from triton.runtime.interpreter import TensorHandle

    def create_dot(self, a, b, d, *args, **kwargs):
        if (_PRODUCT["kind"] == "blas" or a.data.dtype not in _FLOATS or b.data.dtype not in _FLOATS
                or d.data.dtype not in _FLOATS):
            return blas_dot(self, a, b, d, *args, **kwargs)
        return TensorHandle(fixed_order_matmul(a.data, b.data, d.data), d.dtype.scalar)

    create_dot.kit_fixed_order = True
    return create_dot


def _install_interpreter_dot() -> None:
    from triton.runtime.interpreter import InterpreterBuilder

    if not getattr(InterpreterBuilder.create_dot, "kit_fixed_order", False):
        InterpreterBuilder.create_dot = _interpreter_dot(InterpreterBuilder.create_dot)


@contextlib.contextmanager
def tile_product(kind: str):
    """Within the block, the Triton interpreter multiplies tiles with ``kind``: ``"fixed"``
    (:func:`fixed_order_matmul`, the default) or ``"blas"`` (numpy's ``matmul``, whose per-row
    bits may follow the tile height: the variant twin).  No effect on compiled kernels."""
    if kind not in ("fixed", "blas"):
        raise ValueError(f"kind: expected 'fixed' or 'blas', got {kind!r}")
    old = _PRODUCT["kind"]
    _PRODUCT["kind"] = kind
    try:
        yield
    finally:
        _PRODUCT["kind"] = old


def _patch_lang_once(patch_lang):
    """Triton's ``interpreter._patch_lang``, skipped for a helper called inside a running kernel
    whose launch has wrapped the same language modules (``tl``, ``tl.core``)."""
    from triton.runtime import interpreter

    running = []  # a running launch: [the language modules wrapped since it began]

    def langs_of(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang_once(fn):
        if running:
            langs = langs_of(fn)
            if langs <= running[0]:
                return interpreter._LangPatchScope()  # nothing to wrap, nothing to restore
            scope = patch_lang(fn)  # Triton never restores a helper's wrapping
            running[0] |= langs
            return scope
        scope = patch_lang(fn)
        running.append(langs_of(fn))
        restore = scope.restore

        def restore_and_end():
            running.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang_once.kit_patch_once = True
    patch_lang_once.__wrapped__ = patch_lang
    return patch_lang_once


def _install_interpreter_patch_once() -> None:
    """Install :func:`_patch_lang_once` where this Triton's interpreter has the structure it
    wraps (a ``_patch_lang(fn)`` that returns a scope with ``restore()``); otherwise nothing."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if (patch is None or getattr(patch, "kit_patch_once", False)
            or not hasattr(getattr(interpreter, "_LangPatchScope", None), "restore")):
        return
    interpreter._patch_lang = _patch_lang_once(patch)


if INTERPRET:
    _install_interpreter_dot()
    _install_interpreter_patch_once()
