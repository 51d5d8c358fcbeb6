"""Triton helpers shared by the kit's kernels: exact moves between 16-bit floats and fp32, and
the tile product every GEMM of the kit accumulates with.

The Triton interpreter's own bf16 casts are unsafe (its fp32 -> bf16 cast truncates, and
bf16 subnormals are mangled), so bf16 travels through its bits; on a GPU these compile to the
same few integer instructions and give the IEEE result too.
"""
import triton
import triton.language as tl


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
