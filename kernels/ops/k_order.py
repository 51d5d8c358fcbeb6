"""The K order: how every GEMM of the kit (:mod:`.matmul`, the MoE grouped GEMM of :mod:`.moe`)
sums an output element over K.  One home, so that the two cannot drift apart.

* :func:`block_k`: the K step, a function of the dtype only (64 for 16-bit inputs, 32 for fp32);
* :func:`k_chunk` / :func:`k_chunk_blocks`: the K chunking.  Up to ``K = 4096`` the whole K is
  one loop; a longer K is cut into fixed chunks of 2048 keys (64 and 128 under the interpreter),
  each summed from zero upward, the chunk sums added in chunk order.  A function of K and the
  dtype only, never of M;
* :func:`ptr_step`: one step of the loop, ``acc = tl.dot(A[:, block], B[block, :], acc)`` from
  masked pointer loads, fp32 accumulation;
* :func:`sum_splits` and :func:`chunk_reduce_kernel` (launched by :func:`launch_chunk_reduce`):
  the second pass that adds fp32 partial sums (the chunks of a split-chunks launch, or a
  variant's split-K ranges) in order from zero, adds the bias and rounds once;
* :class:`Product`: the sizes and element strides of one batched product, the record a GEMM
  launch (:func:`batch_invariance_kit.ops.matmul.launch`) takes.

What may change from launch to launch is only *which program* computes an element (the M/N
tiling, the number of programs along K when the chunks are computed apart, a running sum handed
from one program to the next at a chunk edge in a stream-K launch); what each element's sum is,
is fixed here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..device import INTERPRET

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .tl_numerics import dot_acc, from_f32, to_f32  # noqa: E402
from .direct_launch import DirectLaunch  # noqa: E402

__all__ = [
    "LONG_K",
    "block_k",
    "k_chunk",
    "k_chunk_blocks",
    "Product",
    "ptr_step",
    "sum_splits",
    "chunk_reduce_kernel",
    "launch_chunk_reduce",
]


def block_k(dtype: torch.dtype) -> int:
    """The K step of every kit matmul: 64 for 16-bit inputs, 32 for fp32.  A function of the
    dtype only, so that the K summation order never depends on M (or on the config)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 64
    if dtype == torch.float32:
        return 32
    raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")


#: (longest K summed in one loop, chunk length of a longer K): compiled, and under the
#: interpreter (small, so that the tests' K crosses both)
LONG_K = {False: (4096, 2048), True: (128, 64)}


def k_chunk(K: int, dtype: torch.dtype, *, compiled: bool | None = None) -> int:
    """Keys per K chunk of the invariant order for a reduction of length ``K``: ``K`` itself
    (one chunk, one loop) up to 4096, else 2048 (64 and 128 under the interpreter).  Every
    output element is the in-order sum of its chunks' sums, each chunk summed from zero,
    BLOCK_K at a time.  A function of K and the dtype only: never of M, so the order never
    depends on the batch.  Why not chunk every K: the chunk loop cost the large tiles time at
    K = 4096 and bought thin M most at K = 12288 (the H200 sweep
    ``results/h200/explorations/matmul_k_chunks/every_k_chunked.json``).  ``compiled``:
    whose rule, the interpreter's (False) or a GPU's (True); ``None``: this process's (pass
    True to read GPU results on a CPU)."""
    bk = block_k(dtype)  # a float dtype, or TypeError
    longest, chunk = LONG_K[INTERPRET if compiled is None else not compiled]
    assert chunk % bk == 0
    return K if K <= longest else chunk


def k_chunk_blocks(K: int, dtype: torch.dtype, *, compiled: bool | None = None) -> int:
    """``CHUNK_BLOCKS`` of a kernel that follows the invariant K order: the :func:`block_k`
    blocks per chunk of :func:`k_chunk` for a long K, 0 for a K summed in one loop.  The
    matmul's kernels and the MoE grouped GEMM (:mod:`batch_invariance_kit.ops.moe`) both take
    it from here: one K order for every weight of the kit.  ``compiled``: as in :func:`k_chunk`."""
    chunk = k_chunk(K, dtype, compiled=compiled)
    return chunk // block_k(dtype) if chunk < K else 0


class Product(NamedTuple):
    """``batch`` products of (M, K) x (K, N), each operand read in place through its element
    strides: ``a`` (batch, m, k), ``b`` (batch, k, n), ``c`` (batch, m, n) of the output and
    ``bias`` (m, n) (stride 0 along a broadcast dim; (0, 0) without a bias)."""

    batch: int
    M: int
    N: int
    K: int
    a: tuple
    b: tuple
    c: tuple
    bias: tuple = (0, 0)

    @classmethod
    def linear(cls, x, weight, out, bias=None) -> "Product":
        """``out = x @ weight.T (+ bias)`` for 2-D ``x`` (M, K), a linear layer's ``weight``
        (N, K), 2-D ``out`` (M, N) and a 1-D ``bias`` (N,) or None."""
        sx, sw, so = x.stride(), weight.stride(), out.stride()
        return cls(1, x.shape[0], weight.shape[0], x.shape[1], (0, sx[0], sx[1]), (0, sw[1], sw[0]),
                   (0, so[0], so[1]), (0, 0) if bias is None else (0, bias.stride(0)))


@triton.jit
def ptr_step(a_base, b_base, acc, kb, K, s_ak, s_bk, mask_m, mask_n, BLOCK_K: tl.constexpr,
             UPCAST: tl.constexpr):
    """``acc += A[:, kb-th K block] @ B[kb-th K block, :]`` from pointer loads (masked: zeros)."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = k < K
    kk = k.to(tl.int64)
    a = tl.load(a_base + kk[None, :] * s_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    b = tl.load(b_base + kk[:, None] * s_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    return dot_acc(a, b, acc, UPCAST)


@triton.jit
def sum_splits(ws, split_stride, mask, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(p_0 + p_1) + ...`` in fp32, from zero in split order: partial sum ``s`` of the tile is
    read at ``ws + s * split_stride`` (``ws``: the tile's pointers into split 0; int64 stride)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws + s * split_stride, mask=mask, other=0.0)
    return acc


@triton.jit(do_not_specialize=["M"])
def chunk_reduce_kernel(ws_ptr, c_ptr, bias_ptr, M, N, n_batch,
                        s_cb, s_cm, s_cn, s_biasm, s_biasn,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    """out = round(((p_0 + p_1) + ...) + bias): the second pass of the invariant's chunk
    programs (``split_chunks``) and of the variants' split-K (matmul's and the MoE grouped
    GEMM's), partial sums added in order (the workspace is contiguous ``[SPLIT_K, n_batch, M, N]``)."""
    bid = tl.program_id(2)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = (bid.to(tl.int64) * M + rows[:, None]) * N + cols[None, :]
    acc = sum_splits(ws_ptr + offs, tl.cast(n_batch, tl.int64) * M * N, mask, SPLIT_K, BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows[:, None] * s_biasm + cols[None, :] * s_biasn, mask=mask, other=0.0)
        acc = acc + to_f32(bias)
    c_offs = bid.to(tl.int64) * s_cb + rows[:, None] * s_cm + cols[None, :] * s_cn
    tl.store(c_ptr + c_offs, from_f32(acc, c_ptr.dtype.element_ty), mask=mask)


def launch_chunk_reduce(ws, out, bias, M: int, N: int, n_batch: int, sc: tuple, sbias: tuple, split: int, *,
                        block_m: int, block_n: int, grid: tuple | None = None) -> None:
    """:func:`chunk_reduce_kernel` over ``ws`` (contiguous fp32 ``[split, n_batch, M, N]``) into
    ``out`` (element strides ``sc`` = (batch, m, n)), plus ``bias`` (strides ``sbias`` = (m, n);
    None: no bias), in tiles of ``block_m`` x ``block_n`` (``grid``: the launch grid, when the
    caller has it cached)."""
    if grid is None:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), n_batch)
    has_bias = bias is not None
    _CHUNK_REDUCE(grid, ws, out, bias if has_bias else out, M, N, n_batch, *sc, *sbias,
                  SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias, num_warps=4)


#: the eager launch of :func:`chunk_reduce_kernel` (:mod:`.direct_launch`)
_CHUNK_REDUCE = DirectLaunch(chunk_reduce_kernel)
