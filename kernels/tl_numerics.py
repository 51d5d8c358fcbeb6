"""Triton helpers shared by the kit's kernels: exact moves between 16-bit floats and fp32.

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
