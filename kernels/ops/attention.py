"""Attention over a paged KV cache: a float64 reference, a batch-*invariant* Triton kernel and
its split-KV *variant* twin.

The paged KV cache
------------------
``k_cache``, ``v_cache``: ``(num_blocks, block_size, kv_heads, head_dim)`` (fp32, fp16 or bf16).
A sequence's key at position ``p`` lives in physical block ``block_table[s, p // block_size]``,
row ``p % block_size``.  :func:`write_kv` stores new keys/values at *slots*
(``slot = block * block_size + row``, ``-1`` = skip, vLLM's convention) with a Triton kernel
that copies bits (16-bit and fp32 values travel as integers: no rounding anywhere).
:class:`PagedCache` is the cache with its allocator, for tests, benchmarks and the book: a
seeded shuffled free list, block lists grown on demand (:func:`grow_blocks`), writes through
the slot mapping (:func:`slots`) and a step's padded :func:`block_table` and metadata.

One kernel for prefill, decode and mixed batches
------------------------------------------------
:func:`attention` takes a *varlen* batch like vLLM: ``q`` ``(num_tokens, q_heads, head_dim)``
holds the new tokens of every sequence back to back (``query_start_loc``), ``seq_lens[s]`` is
the context of sequence ``s`` *after* this step (cached tokens + new ones), so the new tokens
of ``s`` are at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and are causal.  Decode is
the case ``q_len = 1`` (:func:`decode`), prefill ``q_len = prompt`` (:func:`prefill`), chunked
prefill, prefix-cache hits and speculative verify steps ``q_len < seq_len``, starting at any
position.  GQA: ``q_heads`` a multiple of ``kv_heads``.  A sequence with ``q_len = 0`` (a
padding entry) takes no work.

The reduction schedule (what makes a token's bits independent of everything but itself)
-------------------------------------------------------------------------------------
Every query row (one token, one q head) at position ``p`` is reduced over its keys ``0..p`` in
the same way, whichever launch it is part of:

1. keys are cut into KV tiles of ``block_n`` positions (tile ``j`` = keys ``j*block_n ..``),
   visited in increasing order; the row's own position lies in its *diagonal* tile
   ``p // block_n``, where keys ``> p`` are masked (score ``-inf``); every earlier tile is
   visible to the whole row (launches of many-token steps leave its mask out: no bit moves);
2. tiles are grouped into *splits* of ``S(p)`` keys (a multiple of ``block_n``): split ``i``
   covers tiles ``i*S/block_n ..``; the row has ``ceil((p+1) / S)`` splits.  ``S`` is
   :func:`split_size_at`: ``min(split_size, block_n * next_pow2(ceil(n / split_target)))``
   for a row whose keys span ``n`` tiles (on the GPU: 64-key splits up to 2048 keys of
   context, 128 up to 4096, 256 up to 8192, then 512), or ``split_size`` for every row when
   ``split_target`` is ``None``.  A function of the row's diagonal tile only.  Each split's
   state is an online softmax from scratch over its tiles in fp32: running max ``m``, sum
   ``l`` and ``acc`` (``alpha = exp(m_old - m_new)``, ``p = exp(s - m_new)`` with the
   score's scaling fused into the subtraction on the GPU, ``l = l*alpha +
   rowsum(p)``, ``acc = acc*alpha + p @ V``; 16-bit ``p`` is rounded to V's dtype for the
   tensor cores; ``rowsum`` is a fixed pairwise tree, below);
3. the split states are merged by the *left fold* ``((((e + s0) + s1) + s2) + ...)`` from the
   empty state ``e`` (``m = -inf``, ``l = 0``, ``acc = 0``), with ``M = max(m_a, m_b)``,
   ``l = fma(l_a, e^(m_a-M), l_b*e^(m_b-M))``, ``acc`` likewise (:func:`_fold`); then
   ``out = acc / l`` rounded once (RNE) to q's dtype.  (``e + s0`` is ``s0`` but for a ``-0``
   in its ``acc``, which becomes ``+0``: every launch folds split 0 the same way.)

Query tiles sit on an absolute grid
-----------------------------------
A program's query tile holds up to ``q_tile`` consecutive tokens of one sequence times the q
heads of one kv head (the rows of ``tl.dot``; rows never mix: every reduction is along a row).
Tiles are cut at the multiples of ``q_tile`` *of the position*, not of the chunk: a chunk that
starts at position 70 with ``q_tile = 16`` gets a partial first tile 70..79, then 80..95, ...
Because ``q_tile`` divides ``block_n``, every tile lies inside one KV tile, so all its rows
share the diagonal tile, hence the tiles they visit and the split size; the tile's last key
only decides how far loads go (keys past a row's position are masked either way).  A row
therefore runs exactly the tiles, splits and operations that decoding its position alone
runs: chunk boundaries, prefix-cache hits and verify steps may fall anywhere.

Launches: parallel or serial
----------------------------
Who computes what is a launch decision that never changes the bits.  A launch with fewer than
``serial_programs`` (query tile, kv head) programs runs one program per split, writes the fp32
states to a workspace, and a second kernel (one program per token, q head and block of
:data:`MERGE_COLUMNS` output columns) folds them; a larger launch runs *serially*: one program
per (query tile, kv head) builds each split's state in turn inside one loop over the row's
tiles and folds it into the running state as soon as the split closes, then writes the output.
The serial program performs exactly the operations of the split programs plus the merge kernel,
in the same order.  The merge folds column-wise (each column carries its own ``m`` and ``l``:
the same operations on the same values), so a thread folds its own columns with no data from
other threads; on Hopper it is launched with programmatic dependent launch and waits
(``griddepcontrol.wait``) before it reads a state.

Decode tiles and the row sum
----------------------------
A one-token step fills only ``q_heads / kv_heads`` rows of a tile (4 of 64 with 32 q and 8 kv
heads).  With ``decode_block_m=16`` the one-token steps of a launch run in a second launch of
the same kernel source with 16-row tiles (which tile a token gets depends on its own step
only).  Prefill == decode then needs every row to see the same arithmetic in a 64-row tile and
a 16-row tile.  ``tl.sum`` reduces in an order set by the register layout: with 16 rows and 4
warps, the warps split a row's keys among them, a cross-warp step the 64-row tile does not
have, and on the H200 decode differed from prefill at dozens of positions
(``results/h200/explorations/attention_16row_decode_tiles``).  The row sum ``l`` therefore never
goes through ``tl.sum``.  Compiled, it is ``p @ ones`` on the tensor cores (the 16-bit ``p``
that ``p @ V`` uses; the tensor cores' order is the same for every tile height), its 16 equal
columns kept as they are in 16-row programs and one of them taken in 64-row programs, updated
by an explicit FMA; under the interpreter (and for fp32 values) it is a fixed pairwise tree
built from ``tl.split`` (``(0+1)+(2+3)...``, :func:`_row_sum`).  Compiled kernels keep the
softmax state in base 2 (``exp2`` of scores scaled by ``scale * log2 e``, the fold in ``exp2``);
the interpreter keeps base e.  (d) holds at every position on both
(``results/h200/attention_decode_tiles.json``, ``tests/test_attention.py``).

Planning once per step
----------------------
:func:`make_plan` builds everything a launch needs besides the tensors (query tiles, per-token
positions and split sizes, the workspace) from the step's *host* metadata (``seq_lens`` and
``query_start_loc`` as lists or CPU tensors: vLLM keeps such copies).  It works on whole NumPy
arrays of the step's sequences, tiles and tokens (the split size of a position is a table
lookup, :func:`split_size_at` tabulated once per config), with no Python loop over any of them,
and moves the plan's index tensors to the device in one copy: tens of microseconds for a decode
step of hundreds of sequences (``python -m batch_invariance_kit.bench.host``).  Every layer of a
step reuses the plan (``attention(..., plan=plan)``): no device-to-host copy per layer.  With
``decode_capacity`` and ``max_seq_len`` the decode part of the plan has fixed sizes (padding
tiles of zero rows run no loop iteration and store nothing; padding merge entries are
skipped), so a decode launch can be captured once in a CUDA graph and replayed with the plan's
buffers refilled (:meth:`AttnPlan.copy_`).

``impl``:

* ``"invariant"`` (default): split sizes from the config and the row's own position;
* ``"variant"``: the same kernels, launched like production split-KV decode: the *number* of
  splits comes from the occupancy, ``num_splits = max(1, 2*SMs // (num_seqs*kv_heads))``, and
  ``split_size = ceil(seq_len / num_splits)`` (rounded up to whole tiles).  Another batch size,
  another split, another merge: it fails the invariance check (the negative control);
* ``"reference"``: float64 math (SDPA-style: ``softmax(q k^T * scale + causal mask) v``) on the
  keys gathered from the cache, rounded once to q's dtype;
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` on a gathered contiguous KV
  (the peer; one call per sequence, in q's dtype).

Caveat: bitwise prefill == decode holds for finite inputs; a signed zero can differ in the
degenerate case where every probability of a diagonal tile underflows to 0 (in prefill, keys
beyond a row's position up to its tile's last row read the real cache, in decode zeros, and
``0 * -v = -0``).

No TMA: plain pointer loads, ``tl.dot`` with ``input_precision``; on Hopper the merge launch uses
``triton.language.extra.cuda``'s grid dependency control (present in Triton 3.6 and in newer
Triton, where the interpreter never takes that branch).
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch

from .. import checks
from ..device import DEVICE, INTERPRET, sm_count

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402  (Hopper's PDL)
from .tl_numerics import from_f32, to_f32  # noqa: E402  (exact bf16 moves on the interpreter)

__all__ = [
    "IMPLS",
    "AttnConfig",
    "DEFAULT_CONFIG",
    "INTERPRETER_CONFIG",
    "default_config",
    "new_cache",
    "block_table",
    "grow_blocks",
    "allocate_blocks",
    "slots",
    "write_kv",
    "PagedCache",
    "query_tile",
    "split_size_at",
    "split_plan",
    "attention",
    "TileGroup",
    "MergePlan",
    "AttnPlan",
    "make_plan",
    "launch",
    "prefill",
    "decode",
    "gather_kv",
]

IMPLS = ("invariant", "variant", "reference", "sdpa")

#: columns of ``p @ ones``, the compiled kernels' row sum of 16-bit probabilities (the narrowest
#: tensor-core product that every tile height takes)
ROW_SUM_COLUMNS = 16

#: ``log2(e)``: the compiled kernels keep their softmax state in base 2 (scores scaled by
#: ``scale * LOG2E``, ``exp2``)
LOG2E = 1.4426950408889634


def _pos_int(name, v, *, none_ok=False):
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be {'None or ' if none_ok else ''}a positive int, got {v!r}")


@dataclass(frozen=True)
class AttnConfig:
    """The reduction schedule and its launch.  ``AttnConfig()`` is the schedule that ships on a
    GPU (:data:`DEFAULT_CONFIG`); :data:`INTERPRETER_CONFIG` shrinks tiles and splits so that
    short CPU test contexts cross every boundary.  Which fields change bits and which only move
    work is said per field."""

    #: keys per KV tile (a power of two, 16..256).  Changes bits.
    block_n: int = 64
    #: rows per program of multi-token steps (query tokens times q heads per kv head).  Work only.
    block_m: int = 64
    #: the largest split, in keys (a multiple of ``block_n``).  Changes bits.
    split_size: int = 512
    #: splits graded by the row's position: a row whose keys span ``n`` KV tiles gets splits of
    #: ``min(split_size, block_n * next_pow2(ceil(n / split_target)))`` keys (short contexts get
    #: short splits: more programs); ``None``: ``split_size`` for every row.  Changes bits (a
    #: function of the row's position only, never of the batch).
    split_target: int | None = 32
    #: warps / pipeline stages of the multi-token launch (and of a parallel decode-tile launch).  Work only.
    num_warps: int = 4
    num_stages: int = 2
    #: rows per program of one-token steps (decode), or ``None`` to give them ``block_m`` rows.  Work only.
    decode_block_m: int | None = 16
    #: a launch with at least this many (query tile, kv head) programs runs serially (one program
    #: folds a row's splits in order; no workspace, no merge launch); ``None``: always one
    #: program per split.  Work only.
    serial_programs: int | None = 512
    #: warps / pipeline stages of a serial decode-tile launch.  Work only.
    serial_decode_warps: int = 2
    serial_decode_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_m") + (("decode_block_m",) if self.decode_block_m is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.block_n > 256:
            raise ValueError(f"block_n must be at most 256 (the row sum's pairwise tree), got {self.block_n}")
        for name in ("num_warps", "num_stages", "serial_decode_warps", "serial_decode_stages"):
            _pos_int(name, getattr(self, name))
        for name in ("split_target", "serial_programs"):
            _pos_int(name, getattr(self, name), none_ok=True)
        if (isinstance(self.split_size, bool) or not isinstance(self.split_size, int) or self.split_size < 1
                or self.split_size % self.block_n):
            raise ValueError(f"split_size must be a positive multiple of block_n={self.block_n}, "
                             f"got {self.split_size!r}")

    def as_dict(self) -> dict:
        return asdict(self)


#: Compiled on a GPU: 64-key tiles, 64-row programs; splits graded by the row's position (64 to
#: 512 keys); one-token steps in 16-row tiles; serial launches from 512 programs with 2-warp,
#: 3-stage serial decode programs (``results/h200/attention_decode_tiles.json``,
#: ``results/h200/attention_bench.json``).
DEFAULT_CONFIG = AttnConfig()
#: Under the interpreter: small tiles and splits so that short test contexts cross tile, split
#: and launch-mode boundaries.
INTERPRETER_CONFIG = AttnConfig(block_n=32, block_m=32, split_size=64, split_target=2, serial_programs=8)


def default_config() -> AttnConfig:
    return INTERPRETER_CONFIG if INTERPRET else DEFAULT_CONFIG


def _cfg(config) -> AttnConfig:
    if config is None:
        return default_config()
    if not isinstance(config, AttnConfig):
        raise TypeError(f"config must be None or an AttnConfig, got {type(config).__name__}")
    return config


def query_tile(q_heads: int, kv_heads: int, config: AttnConfig | None = None, *, decode: bool = False) -> tuple:
    """``(q_tile, qpk_pad)``: tokens per program and padded q heads per kv head.  A function of
    the head layout, the config and whether the step is a one-token (decode) step: never of the
    batch.  ``q_tile`` divides ``block_n`` (both powers of two, ``q_tile <= block_n``)."""
    cfg = _cfg(config)
    bm = cfg.decode_block_m if decode and cfg.decode_block_m is not None else cfg.block_m
    qpk_pad = triton.next_power_of_2(q_heads // kv_heads)
    q_tile = max(1, min(bm // qpk_pad, cfg.block_n)) if qpk_pad <= bm else 1
    return q_tile, qpk_pad


@functools.lru_cache(maxsize=256)
def _layout(q_heads: int, kv_heads: int, head_dim: int, cfg: AttnConfig) -> tuple:
    """``(q_tile, qpk_pad, decode q_tile, d_pad)``: :func:`query_tile` of the head layout and
    config, and the head dim padded to a power of two (at least 16) as the workspace holds it;
    once per head layout and config."""
    return (*query_tile(q_heads, kv_heads, cfg), query_tile(q_heads, kv_heads, cfg, decode=True)[0],
            max(16, triton.next_power_of_2(head_dim)))


def _num_sms() -> int:
    """SMs the variant plans for (8 under the interpreter: small batches cross its thresholds)."""
    return 8 if INTERPRET else sm_count()


def split_size_at(pos: int, config: AttnConfig | None = None) -> int:
    """Keys per split of the invariant schedule for a query row at position ``pos`` (a multiple
    of ``block_n``): position-graded with ``split_target``, else ``split_size``.  Depends on
    the row's diagonal KV tile and the config only, never on the batch."""
    cfg = _cfg(config)
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
        raise ValueError(f"pos must be a non-negative int, got {pos!r}")
    if cfg.split_target is None:
        return cfg.split_size
    tiles = int(pos) // cfg.block_n + 1  # KV tiles the row reads, its diagonal tile included
    return min(cfg.split_size, triton.next_power_of_2(triton.cdiv(tiles, cfg.split_target)) * cfg.block_n)


def split_plan(seq_lens, kv_heads: int, *, impl: str = "invariant", config: AttnConfig | None = None) -> list:
    """Keys per split for each sequence's last position (a multiple of ``block_n``).  Invariant:
    :func:`split_size_at` of that position.  Variant: ``num_splits = max(1, 2*SMs //
    (num_seqs*kv_heads))``, ``split = ceil(ceil(seq_len / num_splits) / block_n) * block_n``:
    it depends on the batch."""
    cfg = _cfg(config)
    if impl not in ("invariant", "variant"):
        raise ValueError(f"split_plan: impl must be 'invariant' or 'variant', got {impl!r}")
    return _seq_splits(_host_ints("seq_lens", seq_lens), kv_heads, impl, cfg).tolist()


@functools.lru_cache(maxsize=None)
def _split_steps(cfg: AttnConfig) -> tuple:
    """:func:`split_size_at` as a step function of the position: ``(edges, sizes, table)``.
    ``sizes[k]`` holds from position ``edges[k - 1]`` (0 for ``k = 0``) up to ``edges[k]``
    (the last size for ever): a row in KV tile ``t`` spans ``t + 1`` tiles, more than
    ``split_target * 2**i`` of them from ``t = split_target * 2**i`` on, where its splits
    double, up to ``split_size``.  ``table``: the size at every position up to the last edge
    (int32; ``None`` past ``2**20`` positions)."""
    bn, top = cfg.block_n, cfg.split_size
    edges, sizes = [], [top if cfg.split_target is None else min(top, bn)]
    while sizes[-1] < top:
        edges.append(cfg.split_target * bn << len(edges))
        sizes.append(min(top, bn << len(edges)))
    end = edges[-1] + 1 if edges else 1
    table = np.repeat(np.array(sizes, dtype=np.int32), np.diff([0, *edges, end])) if end <= 1 << 20 else None
    return np.array(edges, dtype=np.int64), np.array(sizes, dtype=np.int32), table


def _split_sizes(pos: np.ndarray, cfg: AttnConfig) -> np.ndarray:
    """:func:`split_size_at` of every position of ``pos`` (>= 0), vectorised (int32)."""
    edges, sizes, table = _split_steps(cfg)
    if table is None:
        return sizes[np.searchsorted(edges, pos, side="right")]
    return table.take(pos, mode="clip")  # past the table: its last entry


def _seq_splits(lens: np.ndarray, kv_heads: int, impl: str, cfg: AttnConfig) -> np.ndarray:
    """:func:`split_plan` of the host array ``lens`` (int64)."""
    if impl == "invariant":
        return _split_sizes(np.maximum(lens - 1, 0), cfg)
    num_splits = max(1, (2 * _num_sms()) // max(1, len(lens) * kv_heads))
    keys = lens if num_splits == 1 else _cdiv(lens, num_splits)
    # rounded up to a multiple of block_n (a power of two), at least block_n (lens >= 0)
    return np.maximum((keys + (cfg.block_n - 1)) & -cfg.block_n, cfg.block_n)


def _cdiv(a, b):
    """``ceil(a / b)`` of integers or integer arrays."""
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# The paged cache
# --------------------------------------------------------------------------------------------

def new_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16,
              device=None) -> tuple:
    """``(k_cache, v_cache)`` of shape ``(num_blocks, block_size, kv_heads, head_dim)``, zeros."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):
        checks.positive_int(name, v)
    if dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    shape = (num_blocks, block_size, kv_heads, head_dim)
    dev = DEVICE if device is None else device
    return torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)


def _index(name, v) -> int:
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


def block_table(tables, device=None) -> torch.Tensor:
    """The block table ``(num_seqs, max_blocks)`` int32 of per-sequence block lists (host lists
    of physical block ids, one a sequence), padded with 0 (at least one column)."""
    if isinstance(tables, torch.Tensor) or not hasattr(tables, "__iter__"):
        raise TypeError(f"tables must be a list of block lists, got {type(tables).__name__}")
    rows = [_host_list(f"tables[{s}]", t) for s, t in enumerate(tables)]
    table = torch.zeros((len(rows), max([len(t) for t in rows] + [1])), dtype=torch.int32)
    for s, t in enumerate(rows):
        table[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return table.to(DEVICE if device is None else device)


def grow_blocks(blocks: list, n: int, block_size: int, alloc) -> list:
    """Append ``alloc()`` blocks to the block list ``blocks`` until it holds positions
    ``0..n-1`` (``ceil(n / block_size)`` blocks); returns ``blocks``."""
    while len(blocks) * block_size < n:
        blocks.append(alloc())
    return blocks


def allocate_blocks(seq_lens, block_size: int, num_blocks: int, *, seed: int | None = None,
                    device=None) -> torch.Tensor:
    """A block table ``(num_seqs, max_blocks)`` int32 giving each sequence its own physical
    blocks, in a seeded random order (``seed=None``: in order); unused entries are 0."""
    need = [triton.cdiv(int(n), block_size) for n in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"seq_lens need {sum(need)} blocks of {block_size}, the cache has {num_blocks}")
    order = (torch.arange(num_blocks) if seed is None else
             torch.randperm(num_blocks, generator=torch.Generator().manual_seed(int(seed)))).tolist()
    rows, at = [], 0
    for n in need:
        rows.append(order[at:at + n])
        at += n
    return block_table(rows, device)


def slots(block_table: torch.Tensor, seq: int, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot mapping (int64) of positions ``start..end-1`` of sequence ``seq``."""
    pos = torch.arange(start, end, device=block_table.device)
    return (block_table[seq, pos // block_size].long() * block_size + pos % block_size)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_tokens, s_kt, s_kh, s_vt, s_vh, s_cb, s_cs, s_ch,
                     CACHE_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr):
    """BLOCK_T tokens: copy the bits of their kv heads to their slots (integers: no rounding)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1)[:, None, None]
    t = t[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D_PAD)[None, None, :]
    m = (h < KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    dst = (slot // CACHE_BLOCK) * s_cb + (slot % CACHE_BLOCK) * s_cs + h * s_ch + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m), mask=m)


def _check_caches(k_cache, v_cache) -> None:
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


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, check_slots: bool = True) -> None:
    """Store ``key``/``value`` ``(num_tokens, kv_heads, head_dim)`` at ``slot_mapping``
    ``(num_tokens,)`` (int64 or int32; ``-1`` skips a token) of the paged caches.
    ``check_slots=False`` skips the range check of the slots (it reads them back to the host:
    an engine whose scheduler made the slots passes False, so no layer waits on the device)."""
    _check_caches(k_cache, v_cache)
    nb, bs, hkv, d = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        checks.tensor(name, t, dim=3, contiguous=False, nonempty=False)
        checks.same_dtype(name, t, "k_cache", k_cache)
        checks.same_device(name, t, "k_cache", k_cache)
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
        if tuple(t.shape[1:]) != (hkv, d):
            raise ValueError(f"{name} has {t.shape[1]} heads of dim {t.shape[2]}; the cache holds {hkv} kv heads "
                             f"of dim {d}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    checks.tensor("slot_mapping", slot_mapping, dtypes=(torch.int64, torch.int32), dim=1, nonempty=False)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    n = key.shape[0]
    if n == 0:
        return
    lo, hi = (int(slot_mapping.min()), int(slot_mapping.max())) if check_slots else (-1, -1)
    if lo < -1 or hi >= nb * bs:
        raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}]; the cache has {nb * bs} slots (-1 = skip)")
    iv = _INT_VIEW[key.dtype]
    _write_kv_kernel[(triton.cdiv(n, 16),)](
        key.view(iv), value.view(iv), k_cache.view(iv), v_cache.view(iv), slot_mapping.long(), n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), CACHE_BLOCK=bs,
        BLOCK_T=16, KV_HEADS=hkv, H_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, D_PAD=triton.next_power_of_2(d))


class PagedCache:
    """A paged KV cache (:func:`new_cache`) whose sequences get physical blocks on demand, and
    the varlen launch of a step over it.

    ``k``, ``v``: the caches, on ``device`` (default: the kit's device); ``tables`` maps a
    sequence's name (any hashable) to its block list.  Free blocks form a list taken from its
    end: ``torch.randperm(num_blocks)`` of a generator seeded by ``seed`` (blocks scattered
    over the cache, as in an engine after some traffic), or with ``seed=None`` blocks ``0, 1,
    2, ...`` in order.  Sequences may share blocks: a prefix-cache
    hit starts a sequence with another's blocks (``shared``), and ``tables[name] =
    tables[other]`` lets a decode step of any position read a prompt's blocks.

    A *step* is a list of ``(name, q, seq_len)``: ``q`` ``(q_len, q_heads, head_dim)`` holds the
    queries of the sequence's new tokens and ``seq_len`` is its context after the step (the
    new tokens are its last ``q_len`` positions, as in :func:`attention`)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16,
                 *, device=None, seed: int | None = None):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be None or an int, got {type(seed).__name__}")
        self.k, self.v = new_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = (list(range(num_blocks - 1, -1, -1)) if seed is None else
                     torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist())
        self.tables: dict = {}

    def table(self, name, n: int, shared=None) -> list:
        """The block list of sequence ``name``, grown to hold positions ``0..n-1``; a new
        sequence starts with the blocks ``shared`` (a prefix-cache hit), if given."""
        n = _index("n", n)
        if shared is not None:
            if name in self.tables:
                raise ValueError(f"shared: sequence {name!r} already has blocks; only a new sequence starts "
                                 f"with shared blocks")
            shared = _host_list("shared", shared)
            bad = [b for b in shared if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(f"shared holds block {bad[0]}; the cache has {self.num_blocks} blocks")
        t = self.tables.get(name, shared or [])
        need = triton.cdiv(n, self.block_size) - len(t)
        if need > len(self.free):
            raise ValueError(f"out of blocks: sequence {name!r} needs {need} more blocks of {self.block_size} "
                             f"for {n} positions, {len(self.free)} of num_blocks={self.num_blocks} are free")
        self.tables[name] = t
        return grow_blocks(t, n, self.block_size, self.free.pop)

    def write(self, name, k: torch.Tensor, v: torch.Tensor, start: int, shared=None) -> None:
        """Store keys ``k`` and values ``v`` ``(n, kv_heads, head_dim)`` of sequence ``name`` at
        positions ``start..start+n-1``, growing its block list (``shared``: see :meth:`table`)."""
        start = _index("start", start)
        checks.tensor("k", k, dim=3, contiguous=False, nonempty=False)
        checks.tensor("v", v, dim=3, contiguous=False, nonempty=False)
        end = start + k.shape[0]
        bt = block_table([self.table(name, end, shared)], self.k.device)
        write_kv(k, v, self.k, self.v, slots(bt, 0, start, end, self.block_size))

    def _steps(self, steps) -> list:
        """``steps`` as a list, checked: known sequences, 3-D queries, contexts their blocks hold."""
        if isinstance(steps, (str, bytes, torch.Tensor)) or not hasattr(steps, "__iter__"):
            raise TypeError(f"steps must be a list of (name, q, seq_len), got {type(steps).__name__}")
        steps = list(steps)
        if not steps:
            raise ValueError("steps must hold at least one (name, q, seq_len)")
        for i, st in enumerate(steps):
            if not isinstance(st, (tuple, list)) or len(st) != 3:
                raise TypeError(f"steps[{i}] must be a (name, q, seq_len) triple, got {st!r:.80}")
            name, q, n = st
            if name not in self.tables:
                raise ValueError(f"steps[{i}]: sequence {name!r} has no blocks in this cache (write it first)")
            checks.tensor(f"steps[{i}] q", q, dim=3, contiguous=False, nonempty=False)
            n = _index(f"steps[{i}] seq_len", n)
            if n > len(self.tables[name]) * self.block_size:
                raise ValueError(f"steps[{i}] seq_len={n} is longer than sequence {name!r}'s "
                                 f"{len(self.tables[name])} blocks of {self.block_size} hold")
        return steps

    def args(self, steps) -> tuple:
        """``(q, block_table, seq_lens, query_start_loc)`` of a step, the metadata on the cache's
        device: :func:`attention`'s arguments besides the caches."""
        steps = self._steps(steps)
        dev = self.k.device
        bt = block_table([self.tables[name] for name, _, _ in steps], dev)
        lens = torch.tensor([n for _, _, n in steps], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0] + [q.shape[0] for _, q, _ in steps]).cumsum(0).to(torch.int32).to(dev)
        return torch.cat([q for _, q, _ in steps]), bt, lens, qsl

    def new_kv(self, steps) -> tuple:
        """``(key, value)`` ``(num_tokens, kv_heads, head_dim)``: the keys and values of a step's
        new tokens (each sequence's last ``q_len`` positions) read back from the cache, token
        by token as :func:`attention`'s ``key`` and ``value`` take them."""
        steps = self._steps(steps)
        bs, dev = self.block_size, self.k.device
        pos = torch.cat([torch.arange(n - q.shape[0], n) for _, q, n in steps]).long()
        blk = torch.cat([torch.tensor(self.tables[name], dtype=torch.long)[torch.arange(n - q.shape[0], n) // bs]
                         for name, q, n in steps]).long()
        blk, row = blk.to(dev), (pos % bs).to(dev)
        return self.k[blk, row], self.v[blk, row]

    def run(self, steps, *, impl: str = "invariant", config=None, out=None, new_kv: bool = False) -> list:
        """The outputs of a step, one ``(q_len, q_heads, head_dim)`` per entry of ``steps``, from
        one :func:`attention` launch (``impl``, ``config``, ``out``: passed on; ``new_kv``: pass
        the step's own keys and values, :meth:`new_kv`, as ``key`` and ``value``)."""
        steps = self._steps(steps)
        q, bt, lens, qsl = self.args(steps)
        kv = dict(zip(("key", "value"), self.new_kv(steps))) if new_kv else {}
        o = attention(q, self.k, self.v, bt, lens, qsl, impl=impl, config=config, out=out, **kv)
        return list(o.split([st[1].shape[0] for st in steps]))


#: columns of the output per program of the left-fold merge (one warp: a column per lane);
#: the fold is column-wise, so this moves work between programs, never the arithmetic.  Under
#: the interpreter a program takes the whole row (its cost is per operation, not per element)
MERGE_COLUMNS = 1 << 30 if INTERPRET else 32
#: states per step of the left-fold merge (unrolled: their loads are in flight together); a
#: load schedule, never the arithmetic.  Under the interpreter one state per step (states past
#: a row's last are selected away, so a longer step only adds operations)
FOLD_CHUNK = 1 if INTERPRET else 16

# --------------------------------------------------------------------------------------------
# The kernels: partial states per split, then the fixed-order merge
# --------------------------------------------------------------------------------------------

@triton.jit
def _pair_sum(x, ROWS: tl.constexpr, W: tl.constexpr):
    """(ROWS, W) -> (ROWS, W / 2): column 2j + column 2j+1 (element-wise: no layout enters)."""
    a, b = tl.split(tl.reshape(x, (ROWS, W // 2, 2)))
    return a + b


@triton.jit
def _row_sum(p, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of each row of ``p`` (ROWS, BLOCK_N) by a fixed pairwise tree: the same additions in
    the same order for any tile shape and warp count (``tl.sum``'s order follows the layout).
    Unrolled by hand: each level has another constexpr shape."""
    x = _pair_sum(p, ROWS, BLOCK_N)
    if BLOCK_N >= 4:
        x = _pair_sum(x, ROWS, BLOCK_N // 2)
    if BLOCK_N >= 8:
        x = _pair_sum(x, ROWS, BLOCK_N // 4)
    if BLOCK_N >= 16:
        x = _pair_sum(x, ROWS, BLOCK_N // 8)
    if BLOCK_N >= 32:
        x = _pair_sum(x, ROWS, BLOCK_N // 16)
    if BLOCK_N >= 64:
        x = _pair_sum(x, ROWS, BLOCK_N // 32)
    if BLOCK_N >= 128:
        x = _pair_sum(x, ROWS, BLOCK_N // 64)
    if BLOCK_N >= 256:
        x = _pair_sum(x, ROWS, BLOCK_N // 128)
    return tl.reshape(x, (ROWS,))


@triton.jit
def _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt, s_vnt,
             BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, EDGE: tl.constexpr, EVEN_D: tl.constexpr,
             NEW: tl.constexpr):
    """K (as ``(D, BLOCK_N)``) and V (``(BLOCK_N, D)``) of KV tile ``t``: from the paged cache
    through the block table, or (``NEW``) from the step's own keys and values, which hold the
    same values as the cache: key position ``p`` is token ``p`` of ``kn_row`` / ``vn_row``
    (pointers already moved to the sequence's token at position 0 and the kv head), rows
    ``s_knt`` / ``s_vnt`` apart.  Only the addresses differ, never the values.  ``EDGE``: the
    tile may reach ``key_end`` (keys ``>= key_end`` read as zeros, neither their block-table
    entries nor their rows are read); otherwise every key of the tile is below it and the loads
    carry no key mask."""
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    if EDGE:
        k_ok = keys < key_end
    if NEW:
        k_addr = kn_row + (keys.to(tl.int64) * s_knt)[None, :] + d[:, None]
        v_addr = vn_row + (keys.to(tl.int64) * s_vnt)[:, None] + d[None, :]
    else:
        if EDGE:
            blk = tl.load(bt_row + keys // CACHE_BLOCK, mask=k_ok, other=0)
        else:
            blk = tl.load(bt_row + keys // CACHE_BLOCK)
        base = blk.to(tl.int64) * s_cb + (keys % CACHE_BLOCK) * s_cs + kv_off
        k_addr = kc_ptr + base[None, :] + d[:, None]
        v_addr = vc_ptr + base[:, None] + d[None, :]
    if EDGE:
        kt = tl.load(k_addr, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(v_addr, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:  # head_dim is its power of two: no column mask
        kt = tl.load(k_addr)
        v = tl.load(v_addr)
    else:
        kt = tl.load(k_addr, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_addr, mask=d_ok[None, :], other=0.0)
    return kt, v


@triton.jit
def _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 UPCAST: tl.constexpr, EDGE: tl.constexpr, LCOLS: tl.constexpr):
    """One online-softmax step over KV tile ``t``: the arithmetic every schedule shares, whatever
    the load schedule around it.  ``EDGE``: keys ``>= limit`` of a row are masked (score
    ``-inf``, probability 0), as the row's diagonal tile needs; in an earlier tile every key is
    visible to every row and the mask changes nothing (a launch may leave it out there: the
    same bits).

    Compiled (``UPCAST`` false), the state is kept in base 2: ``scale`` holds the score scale
    times ``log2(e)``, ``m`` is in base-2 units and the probability is ``exp2(fma(score, scale,
    -m))``, the scaling fused into the subtraction (one rounding), written out so that no
    compiler contracts it in one tile and not in another.  16-bit probabilities are rounded to
    V's dtype once; that tile goes through the tensor cores twice, ``p @ V`` and ``p @ ones``:
    every column of the second is the row sum of the rounded ``p``, in the tensor cores' fixed
    order for any tile height; ``tl.max`` over the equal columns picks it exactly.  A program
    with ``LCOLS`` keeps ``l`` as those equal columns instead (the same operations on the same
    values in each column, so the same bits) and picks a row's value only where it is needed
    (:func:`_l_row`): a 16-row tile spreads the columns over its warps, and no reduction across
    warps then runs per tile; 64-row programs reduce within a thread group and keep rows.  Under the
    interpreter (``UPCAST``) the state is in base e (``exp(score * scale - m)``, the product
    rounded first) and the row sum is the fixed pairwise tree of the fp32 ``p``
    (:func:`_row_sum`); the interpreter's products are BLAS-free (``tl_numerics``)."""
    if UPCAST:
        kt = to_f32(kt)
    if kt.dtype == tl.float32:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    x = s * scale
    if EDGE:
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        vis = keys[None, :] < limit[:, None]
        x = tl.where(vis, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if UPCAST:
        alpha = tl.exp(m - m_use)
        p = tl.exp(x - m_use[:, None])
    else:
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(tl.fma(s, scale, -m_use[:, None]))
        if EDGE:
            p = tl.where(vis, p, 0.0)
    if v.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
        rs = _row_sum(p, ROWS, BLOCK_N)
    elif UPCAST:  # interpreter: p rounded to V's dtype (as on the GPU), then exact fp32 dot
        pv = tl.dot(to_f32(from_f32(p, v.dtype)), to_f32(v), input_precision="ieee")
        rs = _row_sum(p, ROWS, BLOCK_N)
    else:  # the GPU's own conversion rounds to nearest even, as from_f32 does (p is finite)
        pb = p.to(v.dtype)
        pv = tl.dot(pb, v)
        rs = tl.dot(pb, tl.full((BLOCK_N, 16), 1.0, v.dtype))  # ROW_SUM_COLUMNS of equal row sums
        if not LCOLS:
            rs = tl.max(rs, 1)
    if UPCAST:
        l = l * alpha + rs
        acc = acc * alpha[:, None] + pv
    else:  # an explicit FMA: the row form and the column form must not be contracted differently
        if LCOLS:
            l = tl.fma(l, alpha[:, None], rs)
        else:
            l = tl.fma(l, alpha, rs)
        acc = acc * alpha[:, None] + pv  # one form in every program
    return m_new, l, acc


@triton.jit
def _l_zeros(ROWS: tl.constexpr, LCOLS: tl.constexpr):
    """The empty state's row sums: ``(ROWS,)``, or ``(ROWS, LCOLS)`` equal columns."""
    if LCOLS:
        return tl.zeros((ROWS, LCOLS), tl.float32)
    else:
        return tl.zeros((ROWS,), tl.float32)


@triton.jit
def _l_row(l, LCOLS: tl.constexpr):
    """Each row's sum from a state's ``l`` (its equal columns: ``tl.max`` picks the value exactly)."""
    if LCOLS:
        return tl.max(l, 1)
    else:
        return l


@triton.jit
def _split_state(q, kc_ptr, vc_ptr, bt_row, t_lo, t_hi, n_tiles, key_stop, kv_off, s_cb, s_cs, d, d_ok, limit,
                 scale, kn_row, vn_row, s_knt, s_vnt, t_new, ROWS: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr,
                 LCOLS: tl.constexpr, EVEN_D: tl.constexpr, NEW: tl.constexpr):
    """The fp32 state ``(m, l, acc)`` of one split: online softmax from scratch over KV tiles
    ``t_lo .. t_hi - 1`` in increasing order (the row's diagonal tile ``n_tiles - 1``, when the
    split holds it, last).  ``WIDE``: the loop shape of the multi-token programs (``_row_state``);
    with ``NEW``, tiles from ``t_new`` on (every key in the step's own chunk) are read from the
    step's keys and values (``_tile_kv``), the ones before from the cache."""
    key_end = tl.minimum(key_stop, t_hi * BLOCK_N)  # the split's last key + 1 (loads stop there)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = _l_zeros(ROWS, LCOLS)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    if WIDE:  # the tiles below the diagonal without masks, then the diagonal tile if the split holds it
        t_mid = tl.minimum(t_hi, n_tiles - 1)
        t_pg = tl.minimum(t_mid, t_new) if NEW else t_mid
        for t in range(t_lo, t_pg):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, BLOCK_N, CACHE_BLOCK, False, EVEN_D, False)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, False, LCOLS)
        if NEW:
            for t in range(tl.maximum(t_lo, t_pg), t_mid):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, BLOCK_N, CACHE_BLOCK, False, EVEN_D, True)
                m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, False, LCOLS)
        t_dg = tl.maximum(t_lo, n_tiles - 1)
        for t in range(t_dg, tl.minimum(t_hi, t_new) if NEW else t_hi):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
        if NEW:
            for t in range(tl.maximum(t_dg, t_new), t_hi):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, BLOCK_N, CACHE_BLOCK, True, EVEN_D, True)
                m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
    else:  # one loop, every tile masked
        for t in range(t_lo, t_hi):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
    return m, l, acc


@triton.jit
def _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles, key_end, kv_off, s_cb, s_cs, d, d_ok, limit,
                 scale, m, l, acc, m_i, l_i, acc_i, kn_row, vn_row, s_knt, s_vnt, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, EDGE: tl.constexpr,
                 BRANCH: tl.constexpr, LCOLS: tl.constexpr, EVEN_D: tl.constexpr, NEW: tl.constexpr):
    """Tile ``t`` of the serial launch: the split state's online-softmax step, then, when the
    split is complete, it is folded into the running state (``_fold``) and the split state
    starts again."""
    kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt, s_vnt,
                     BLOCK_N, CACHE_BLOCK, EDGE, EVEN_D, NEW)
    m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, UPCAST, EDGE, LCOLS)
    done = ((t + 1) % split_tiles == 0) | (t + 1 == n_tiles)
    if BRANCH:
        if done:
            m, l, acc = _fold(m, l, acc, m_i, l_i, acc_i, ROWS, not UPCAST, LCOLS)
            m_i = tl.full((ROWS,), float("-inf"), tl.float32)
            l_i = tl.zeros_like(l_i)
            acc_i = tl.zeros_like(acc_i)
    else:
        m_f, l_f, acc_f = _fold(m, l, acc, m_i, l_i, acc_i, ROWS, not UPCAST, LCOLS)
        m = tl.where(done, m_f, m)
        l = tl.where(done, l_f, l)
        acc = tl.where(done, acc_f, acc)
        m_i = tl.where(done, float("-inf"), m_i)
        l_i = tl.where(done, 0.0, l_i)
        acc_i = tl.where(done, 0.0, acc_i)
    return m, l, acc, m_i, l_i, acc_i


@triton.jit
def _row_state(q, kc_ptr, vc_ptr, bt_row, n_tiles, split_tiles, key_stop, kv_off, s_cb, s_cs, d, d_ok, limit, scale,
               kn_row, vn_row, s_knt, s_vnt, t_new, ROWS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr, LCOLS: tl.constexpr,
               EVEN_D: tl.constexpr, NEW: tl.constexpr):
    """The serial launch: the row's folded state over KV tiles ``0 .. n_tiles - 1``.  One flat
    loop over the tiles below the diagonal (the loads of the next tile never wait for a split
    to close), then the diagonal tile: each split's state is built from scratch exactly as
    ``_split_state`` builds it and, when the split's last tile is done, is folded into the
    running state, which starts empty, in split order (``_serial_step``).

    Two loop shapes, the same operations on the kept values, so the same bits.  ``WIDE`` (the
    64-row programs of multi-token steps): the tiles below the diagonal without masks and the
    fold under a branch taken when a split closes, then the diagonal tile in a loop of its own
    and the last split's fold after it (every row has keys: no padding tiles here); with
    ``NEW``, each of the two loops runs in two parts: tiles before ``t_new`` from the cache,
    from ``t_new`` on from the step's own keys and values (``_tile_kv``).  Otherwise (16-row
    decode programs) one loop masking every tile, the fold computed at every tile and kept by
    selects.  On the H200 each shape is the faster one for its programs
    (``results/h200/explorations/attention_loop``)."""
    key_end = tl.minimum(key_stop, n_tiles * BLOCK_N)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = _l_zeros(ROWS, LCOLS)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = _l_zeros(ROWS, LCOLS)
    acc_i = tl.zeros((ROWS, D_PAD), tl.float32)
    if WIDE:
        t_mid = n_tiles - 1
        t_pg = tl.minimum(t_mid, t_new) if NEW else t_mid
        for t in range(0, t_pg):
            m, l, acc, m_i, l_i, acc_i = _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles, key_end,
                                                      kv_off, s_cb, s_cs, d, d_ok, limit, scale, m, l, acc, m_i, l_i,
                                                      acc_i, kn_row, vn_row, s_knt, s_vnt, ROWS, BLOCK_N, CACHE_BLOCK,
                                                      UPCAST, False, True, LCOLS, EVEN_D, False)
        if NEW:
            for t in range(tl.maximum(t_pg, 0), t_mid):
                m, l, acc, m_i, l_i, acc_i = _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles,
                                                          key_end, kv_off, s_cb, s_cs, d, d_ok, limit, scale, m, l,
                                                          acc, m_i, l_i, acc_i, kn_row, vn_row, s_knt, s_vnt, ROWS,
                                                          BLOCK_N, CACHE_BLOCK, UPCAST, False, True, LCOLS, EVEN_D,
                                                          True)
        t_dg = tl.maximum(t_mid, 0)
        # the diagonal tile, which closes the last split
        for t in range(t_dg, tl.minimum(n_tiles, t_new) if NEW else n_tiles):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False)
            m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, UPCAST, True,
                                           LCOLS)
        if NEW:
            for t in range(tl.maximum(t_dg, t_new), n_tiles):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, BLOCK_N, CACHE_BLOCK, True, EVEN_D, True)
                m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, UPCAST,
                                               True, LCOLS)
        m, l, acc = _fold(m, l, acc, m_i, l_i, acc_i, ROWS, not UPCAST, LCOLS)
    else:
        for t in range(0, n_tiles):
            m, l, acc, m_i, l_i, acc_i = _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles, key_end,
                                                      kv_off, s_cb, s_cs, d, d_ok, limit, scale, m, l, acc, m_i, l_i,
                                                      acc_i, kn_row, vn_row, s_knt, s_vnt, ROWS, BLOCK_N, CACHE_BLOCK,
                                                      UPCAST, True, False, LCOLS, EVEN_D, False)
    return m, l, acc


@triton.jit
def _fold(m, l, acc, m_i, l_i, acc_i, ROWS: tl.constexpr, BASE2: tl.constexpr, LCOLS: tl.constexpr = 0):
    """The left-fold step ``state (+) state_i`` in fp32: ``M = max(m, m_i)``, ``a = e^(m-M)``,
    ``b = e^(m_i-M)``, ``l = fma(l, a, l_i*b)``, ``acc = fma(acc, a, acc_i*b)``.  Written with
    explicit FMAs so that no compiler contracts it differently in the merge kernel (one row,
    ``ROWS = 0``: scalars and a ``(D,)`` vector) and in the serial split kernel (a tile of rows)."""
    m_new = tl.maximum(m, m_i)
    if BASE2:  # the compiled kernels' states are in base 2 (``_tile_update``)
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_i - m_new)
    else:
        a = tl.exp(m - m_new)
        b = tl.exp(m_i - m_new)
    if LCOLS:
        l = tl.fma(l, a[:, None], l_i * b[:, None])
    else:
        l = tl.fma(l, a, l_i * b)
    if ROWS == 0:
        acc = tl.fma(acc, a, acc_i * b)
    else:
        acc = tl.fma(acc, a[:, None], acc_i * b[:, None])
    return m_new, l, acc


@triton.jit(do_not_specialize=["max_splits", "q_heads", "scale", "s_bts"])
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, tile_seq_ptr, tile_tok_ptr, tile_rows_ptr, tile_pos_ptr,
                       tile_split_ptr, tok_ws_ptr, ws_acc_ptr, ws_ml_ptr, out_ptr, scale, max_splits,
                       q_heads, s_qt, s_qh, s_cb, s_cs, s_ch, s_bts, s_ot, s_oh,
                       kn_ptr, vn_ptr, qsl_ptr, s_knt, s_knh, s_vnt, s_vnh,
                       QPK: tl.constexpr, QPK_PAD: tl.constexpr, Q_TILE: tl.constexpr,
                       BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr,
                       WIDE: tl.constexpr, LCOLS: tl.constexpr, NEW: tl.constexpr):
    """Parallel (``SERIAL`` false): program (query tile, kv head, split) writes the split's fp32
    state (acc, m, l) for the tile's valid rows; the merge kernel folds them.  Serial: program
    (query tile, kv head) computes the states of all the row's splits in order, folds each into
    the running state (empty at first) with the merge kernel's left fold (``_fold``) and writes
    ``acc / l``: the same operations in the same order, so the same bits, without the workspace or the merge
    launch (the launch picks the mode; the bits never depend on it).  A tile of zero tokens (a
    padding entry of a fixed-size plan) runs no loop iteration and stores nothing.
    ``WIDE``: the loop shape of the 64-row multi-token programs (``_row_state``); work only.
    ``NEW`` (``WIDE`` programs): the step's own keys and values ``kn``/``vn`` (token-major, as
    written to the cache) and ``query_start_loc`` are given; the KV tiles whose keys all belong
    to the step's chunk of the sequence are read from them instead of through the block table
    (the same values: only the addresses differ)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the merge launch may start its prologue now (it waits for this grid before reading)
        gdc_launch_dependents()
    # the tile's own entries of the plan (independent loads): sequence, first token, tokens,
    # position of the first token, keys per split
    seq = tl.load(tile_seq_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    n_tok = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    split_tiles = tl.load(tile_split_ptr + tile) // BLOCK_N

    rows = tl.arange(0, Q_TILE * QPK_PAD)
    tok = tok0 + rows // QPK_PAD
    hh = rows % QPK_PAD
    # (written so that no per-row token index stays live through the loops: with one, ptxas
    # gave the 64-row prefill program 184 instead of 96 bytes of spill stack, and prefill 4k
    # took 1090 instead of 890 us on the H200)
    row_ok = (tok < tok0 + n_tok) & (hh < QPK)
    pos = (pos0 - tok0) + tok
    head = kvh * QPK + hh
    # every valid row of the tile has the same diagonal KV tile (tiles sit on the absolute grid
    # of q_tile, which divides block_n); keys past the tile's last row are masked for all its
    # rows and never loaded
    key_stop = pos0 + n_tok  # the tile's last row's position + 1
    n_tiles = tl.where(n_tok > 0, tl.maximum(key_stop - 1, 0) // BLOCK_N + 1, 0)  # 0: a padding tile
    limit = tl.where(row_ok, pos + 1, 1)  # keys < limit are visible to the row

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = to_f32(q)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bts
    kv_off = kvh * s_ch
    # the step's own keys: token tok0 - pos0 + p holds key position p of the chunk, which starts
    # at position pos0 - (tok0 - query_start_loc[seq]); tiles from t_new on lie inside it
    if NEW:
        tok_at0 = (tok0 - pos0).to(tl.int64)
        kn_row = kn_ptr + tok_at0 * s_knt + kvh * s_knh
        vn_row = vn_ptr + tok_at0 * s_vnt + kvh * s_vnh
        t_new = (pos0 - tok0 + tl.load(qsl_ptr + seq) + BLOCK_N - 1) // BLOCK_N
    else:
        kn_row, vn_row, t_new = kn_ptr, vn_ptr, 0
    if SERIAL:
        m, l, acc = _row_state(q, kc_ptr, vc_ptr, bt_row, n_tiles, split_tiles, key_stop, kv_off, s_cb, s_cs, d,
                               d_ok, limit, scale, kn_row, vn_row, s_knt, s_vnt, t_new, Q_TILE * QPK_PAD, D_PAD,
                               BLOCK_N, CACHE_BLOCK, UPCAST, WIDE, LCOLS, HEAD_DIM == D_PAD, NEW)
        o = acc / _l_row(l, LCOLS)[:, None]
        o_ptr = out_ptr + tok.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(o_ptr, from_f32(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        t_lo = split * split_tiles
        t_hi = tl.minimum(t_lo + split_tiles, n_tiles)
        m, l, acc = _split_state(q, kc_ptr, vc_ptr, bt_row, t_lo, t_hi, n_tiles, key_stop, kv_off, s_cb, s_cs, d,
                                 d_ok, limit, scale, kn_row, vn_row, s_knt, s_vnt, t_new, Q_TILE * QPK_PAD, D_PAD,
                                 BLOCK_N, CACHE_BLOCK, UPCAST, WIDE, LCOLS, HEAD_DIM == D_PAD, NEW)
        keep = row_ok & ((rows * 0 + t_lo) < t_hi)
        # the workspace holds the states of the launch's parallel tokens only (tok_ws: a token's rank)
        w0 = (tl.load(tok_ws_ptr + tok, mask=row_ok, other=0).to(tl.int64) * q_heads + head) * max_splits
        w = w0 + split
        tl.store(ws_acc_ptr + w[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
        tl.store(ws_ml_ptr + w * 2, m, mask=keep)
        tl.store(ws_ml_ptr + w * 2 + 1, _l_row(l, LCOLS), mask=keep)


@triton.jit(do_not_specialize=["max_splits", "q_heads"])
def _attn_merge_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, merge_tok_ptr, tok_pos_ptr, tok_split_ptr, max_splits,
                       q_heads, s_ot, s_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_BLK: tl.constexpr,
                       CHUNK: tl.constexpr, PDL: tl.constexpr, BASE2: tl.constexpr):
    """Program (token of a parallel launch, q head, block of ``D_BLK`` columns): the left fold
    of the row's split states 0, 1, 2, ... into the empty state in fp32 (``_fold``), then ``out = acc / l`` rounded
    once to out's dtype.  A token entry ``-1`` (padding of a fixed-size plan) stores nothing.

    The fold is column-wise: every column carries its own copy of ``m`` and ``l`` (the same
    operations on the same values, so the same bits in every column) and folds its ``acc``
    element, so the columns can be split among programs and a thread folds its own columns
    with no data from other threads (no shuffles, no extraction).  The loop body holds CHUNK
    states, unrolled: their loads do not wait for the fold."""
    rank = tl.program_id(0)  # the token's place in the workspace
    tok_e = tl.load(merge_tok_ptr + rank)
    real = tok_e >= 0
    tok = tl.maximum(tok_e, 0)
    h = tl.program_id(1)
    pos = tl.load(tok_pos_ptr + tok)
    n = tl.where(real, pos // tl.load(tok_split_ptr + tok) + 1, 1)  # the row's splits: ceil((pos + 1) / split)
    d = tl.program_id(2) * D_BLK + tl.arange(0, D_BLK)
    w = (rank.to(tl.int64) * q_heads + h) * max_splits
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel's states
        gdc_wait()
    col = d * 0
    # split 0 folded into the empty state, then the rest CHUNK at a time
    m, l, acc = _fold(tl.full((D_BLK,), float("-inf"), tl.float32), tl.zeros((D_BLK,), tl.float32),
                      tl.zeros((D_BLK,), tl.float32), tl.load(ws_ml_ptr + w * 2 + col),
                      tl.load(ws_ml_ptr + w * 2 + 1 + col), tl.load(ws_acc_ptr + w * D_PAD + d), 0, BASE2)
    for c in range(1, n, CHUNK):  # CHUNK states per step: their loads are independent of the fold
        for j in tl.static_range(CHUNK):
            live = col + c + j < n  # states past the row's last leave it as it is (a select)
            m_j = tl.load(ws_ml_ptr + (w + c + j) * 2 + col, mask=live, other=float("-inf"))
            l_j = tl.load(ws_ml_ptr + (w + c + j) * 2 + 1 + col, mask=live, other=0.0)
            acc_j = tl.load(ws_acc_ptr + (w + c + j) * D_PAD + d, mask=live, other=0.0)
            m_f, l_f, acc_f = _fold(m, l, acc, m_j, l_j, acc_j, 0, BASE2)
            m = tl.where(live, m_f, m)
            l = tl.where(live, l_f, l)
            acc = tl.where(live, acc_f, acc)
    o = acc / l
    tl.store(out_ptr + tok.to(tl.int64) * s_ot + h * s_oh + d, from_f32(o, out_ptr.dtype.element_ty),
             mask=(d < HEAD_DIM) & (col + tok_e >= 0))


# --------------------------------------------------------------------------------------------
# Validation and metadata
# --------------------------------------------------------------------------------------------

def _validate_tensors(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out):
    """Dtypes, shapes and devices of the arguments (no value is read: no host synchronisation)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    checks.tensor("q", q, dim=3, contiguous=False)
    if q.stride(2) != 1:
        raise ValueError(f"q must have unit stride in its last dim, got strides {q.stride()}")
    _check_caches(k_cache, v_cache)
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


def _validate_new_kv(key, value, k_cache, q) -> None:
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


def _host_list(name, x) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got {x.dtype} {tuple(x.shape)}")
        return x.tolist()
    try:
        return [int(v) for v in x]
    except TypeError:
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {type(x).__name__}") from None


def _host_ints(name, x) -> np.ndarray:
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
            a = np.array(_host_list(name, x), dtype=np.int64)  # anything else: int() of each entry
    if a.dtype.itemsize > 4 or a.dtype.kind == "u" and a.dtype.itemsize == 4:
        if a.size and a.max() > _INT32_MAX:
            raise ValueError(f"{name} holds {a.max()}, more than an int32 holds")
    return a.astype(np.int64, copy=False)


_INT32_MAX = 2 ** 31 - 1
_TORCH_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})


def _check_metadata(lens: np.ndarray, qsl: np.ndarray, num_tokens: int | None = None) -> tuple:
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


def _check_blocks(block_table, lens: np.ndarray, nb: int, bs: int) -> None:
    """Every block a sequence's ``seq_lens`` entry uses is a block of the cache (one pass over
    the table on its device)."""
    width = block_table.shape[1]
    cap = width * bs
    need = torch.from_numpy(_cdiv(lens, bs)).to(block_table.device)
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


def gather_kv(k_cache, v_cache, block_table, seq: int, length: int) -> tuple:
    """Keys and values ``(length, kv_heads, head_dim)`` of sequence ``seq``, contiguous."""
    bs = k_cache.shape[1]
    pos = torch.arange(length, device=k_cache.device)
    blk = block_table[seq, pos // bs].long()
    return k_cache[blk, pos % bs], v_cache[blk, pos % bs]


def _reference(q, k_cache, v_cache, block_table, lens, qsl, scale, out):
    hq, hkv = q.shape[1], k_cache.shape[2]
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        k, v = gather_kv(k_cache, v_cache, block_table, s, lens[s])
        k = k.double().repeat_interleave(hq // hkv, dim=1)  # (L, Hq, D)
        v = v.double().repeat_interleave(hq // hkv, dim=1)
        qs = q[a:b].double()
        pos = torch.arange(lens[s] - (b - a), lens[s], device=q.device)
        sc = torch.einsum("thd,lhd->htl", qs, k) * scale
        mask = torch.arange(lens[s], device=q.device)[None, :] > pos[:, None]
        sc = sc.masked_fill(mask[None], float("-inf"))
        out[a:b] = torch.einsum("htl,lhd->thd", torch.softmax(sc, dim=-1), v).to(q.dtype)
    return out


def _sdpa(q, k_cache, v_cache, block_table, lens, qsl, scale, out):
    hq, hkv = q.shape[1], k_cache.shape[2]
    F = torch.nn.functional
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        k, v = gather_kv(k_cache, v_cache, block_table, s, lens[s])
        pos = torch.arange(lens[s] - (b - a), lens[s], device=q.device)
        mask = torch.arange(lens[s], device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k.transpose(0, 1).repeat_interleave(hq // hkv, 0),
                                           v.transpose(0, 1).repeat_interleave(hq // hkv, 0), attn_mask=mask,
                                           scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# The plan of a step: built once on the host, reused by every layer
# --------------------------------------------------------------------------------------------

class TileGroup(NamedTuple):
    """The query tiles of one launch of the split kernel, and how it is launched."""

    #: tokens per tile
    q_tile: int
    #: per tile: sequence, first token, tokens (0: padding), position of the first token, keys
    #: per split (the kernel's prologue reads its own entries: no chain of dependent loads)
    seq: torch.Tensor
    tok: torch.Tensor
    rows: torch.Tensor
    pos: torch.Tensor
    split: torch.Tensor
    #: one program per (tile, kv head) folding all splits, or one program per split
    serial: bool
    num_warps: int
    num_stages: int


class MergePlan(NamedTuple):
    """The tokens of the parallel launches, whose split states go through the fp32 workspace."""

    #: the tokens, in workspace order (``-1``: padding), and each token's rank among them
    tokens: torch.Tensor
    rank: torch.Tensor
    #: per token of the step: its position and keys per split
    pos: torch.Tensor
    split: torch.Tensor
    #: splits per row the workspace holds (the grid's third axis of a parallel launch)
    max_splits: int
    acc: torch.Tensor
    ml: torch.Tensor


@dataclass(frozen=True)
class AttnPlan:
    """Everything a launch needs besides the tensors (:func:`make_plan`): :func:`launch` does no
    host work, and every layer of a step reuses the plan."""

    config: AttnConfig
    impl: str
    num_tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    qpk_pad: int
    #: multi-token steps (and one-token steps when the config has no ``decode_block_m``)
    tiles: TileGroup
    #: one-token steps in ``decode_block_m``-row tiles
    decode: TileGroup
    merge: MergePlan

    def tensors(self) -> list:
        return [*self.tiles[1:6], *self.decode[1:6], *self.merge[:4]]

    def copy_(self, other: "AttnPlan") -> "AttnPlan":
        """Refill this plan's buffers with ``other``'s entries (same sizes, same launch modes:
        two plans built with the same ``decode_capacity``, ``max_seq_len`` and step shape), so
        that a launch captured in a CUDA graph with this plan replays the other step."""
        if not isinstance(other, AttnPlan):
            raise TypeError(f"other must be an AttnPlan, got {type(other).__name__}")
        mine, theirs = self.tensors(), other.tensors()
        same = (self.tiles.serial, self.decode.serial, self.merge.max_splits, self.merge.acc.shape) == \
            (other.tiles.serial, other.decode.serial, other.merge.max_splits, other.merge.acc.shape)
        if not same or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            raise ValueError("other must have this plan's sizes and launch modes (build both with the same "
                             "decode_capacity, max_seq_len and number of tokens)")
        for a, b in zip(mine, theirs):
            a.copy_(b, non_blocking=True)
        return self


@functools.lru_cache(maxsize=256)
def _max_splits_upto(n: int, cfg: AttnConfig) -> int:
    """The most splits a row at a position ``< n`` has under the invariant schedule: where the
    split size holds (:func:`_split_steps`), ``p // size + 1`` grows with ``p``, so the last
    position below ``n`` of each stretch has its most."""
    edges, sizes, _ = _split_steps(cfg)
    starts, ends = [0, *edges.tolist()], [*edges.tolist(), n]
    return max([(min(e, n) - 1) // int(sz) + 1 for a, e, sz in zip(starts, ends, sizes) if a < n] or [1])


def _device_ints(pieces: list, sizes: list, device: torch.device) -> list:
    """Int32 tensors on ``device`` of lengths ``sizes``, holding the host integer arrays
    ``pieces`` laid end to end (a tensor may span several pieces): views of one buffer, moved in
    one copy (:func:`_aligned` off the CPU); every empty one is :func:`_no_ints` of the device."""
    buf = np.concatenate(pieces, dtype=np.int32)
    filled = [n for n in sizes if n]
    if device.type == "cpu":  # the interpreter: no alignment enters
        whole = torch.from_numpy(buf)
        parts = iter(whole.split_with_sizes(filled))
    else:
        buf, padded = _aligned(buf, filled)
        whole = torch.from_numpy(buf).to(device)
        parts = iter(whole.split_with_sizes(padded)[::2])
    empty = _no_ints(whole.device)
    return [next(parts) if n else empty for n in sizes]


@functools.lru_cache(maxsize=None)
def _no_ints(device: torch.device) -> torch.Tensor:
    """The empty int32 tensor on ``device`` (an index device: ``cuda:0``, never ``cuda``) that
    stands for every empty index tensor of the plans there: no entry to read or write."""
    return torch.empty(0, dtype=torch.int32, device=device)


def _aligned(buf: np.ndarray, sizes: list) -> tuple:
    """``buf`` (int32) with zeros after each of its consecutive parts of ``sizes``, so that every
    part starts on a 16-byte boundary, as a tensor of its own would (Triton specialises a
    compiled kernel on its pointer arguments' alignment); and the sizes of parts and gaps."""
    gaps = [-n % 4 for n in sizes]
    out = np.zeros(len(buf) + sum(gaps), dtype=np.int32)
    src = dst = 0
    for n, gap in zip(sizes, gaps):  # one slice per tensor of the plan
        out[dst:dst + n] = buf[src:src + n]
        src, dst = src + n, dst + n + gap
    return out, [n for pair in zip(sizes, gaps) for n in pair]


#: The cached read-only int32 runs of :func:`_run`: ``arange``, zeros, ones
_RUNS = [np.zeros(0, dtype=np.int32)] * 3


def _run(kind: int, n: int) -> np.ndarray:
    """The first ``n`` entries of a cached read-only int32 run: ``np.arange`` (``kind`` 0),
    zeros (1) or ones (2); grown (doubled, at least 1024) when a step needs more."""
    a = _RUNS[kind]
    if len(a) < n:
        size = max(n, 2 * len(a), 1024)
        a = np.arange(size, dtype=np.int32) if kind == 0 else np.full(size, kind - 1, dtype=np.int32)
        a.flags.writeable = False
        _RUNS[kind] = a
    return a[:n]


def _workspace(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An uninitialised fp32 ``(rows, cols)`` tensor on ``device``: below 4 MiB on the CPU a
    NumPy allocation (fewer host calls than ``torch.empty``; larger ones NumPy advises into huge
    pages, a system call more), else ``torch.empty`` (and its error where NumPy cannot allocate)."""
    if device.type == "cpu" and rows * cols < 1 << 20:
        try:
            return torch.from_numpy(np.empty((rows, cols), dtype=np.float32))
        except MemoryError:
            pass
    return torch.empty((rows, cols), dtype=torch.float32, device=device)


def make_plan(seq_lens, query_start_loc, *, q_heads: int, kv_heads: int, head_dim: int, impl: str = "invariant",
              config: AttnConfig | None = None, device=None, decode_capacity: int | None = None,
              max_seq_len: int | None = None) -> AttnPlan:
    """The launch plan of one step from its host metadata (``seq_lens``, ``query_start_loc`` as
    lists or CPU tensors; no device is read).  Query tiles sit on the absolute grid of
    ``q_tile`` (see "Query tiles sit on an absolute grid"); a tile's and a token's split size is
    :func:`split_size_at` of its position (invariant) or its sequence's batch-chosen split
    (variant).  ``decode_capacity``: pad the one-token tiles to this many (and the merge to as
    many tokens) and ``max_seq_len``: size the workspace for contexts up to it, so that plans of
    steps with up to ``decode_capacity`` one-token sequences have the same sizes
    (:meth:`AttnPlan.copy_`, CUDA graphs).

    Built from whole-array NumPy operations on the step's sequences, tiles and tokens (no
    Python loop over any of them) and moved to ``device`` in one copy: one int32 buffer whose
    views are the index tensors (every empty one the device's shared empty tensor,
    :func:`_no_ints`).  The per-call host work is a fixed few dozen NumPy calls: the head
    layout, the split-size table and the padded workspace bound are cached per config
    (:func:`_layout`, :func:`_split_steps`, :func:`_max_splits_upto`), the runs of
    consecutive ints, zeros and ones are slices of cached read-only arrays (:func:`_run`), an
    int32 CPU tensor of metadata is read without a check of its range, and a decode step (one
    token per sequence) is told apart by one reduction and builds no tile arrays."""
    cfg = _cfg(config)
    if impl not in ("invariant", "variant"):
        raise ValueError(f"make_plan: impl must be 'invariant' or 'variant', got {impl!r}")
    checks.positive_int("q_heads", q_heads)
    checks.positive_int("kv_heads", kv_heads)
    checks.positive_int("head_dim", head_dim)
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (GQA)")
    _pos_int("decode_capacity", decode_capacity, none_ok=True)
    _pos_int("max_seq_len", max_seq_len, none_ok=True)
    lens, qsl = _host_ints("seq_lens", seq_lens), _host_ints("query_start_loc", query_start_loc)
    ql, first = _check_metadata(lens, qsl)
    if max_seq_len is not None and lens.size and lens[lens.argmax()] > max_seq_len:
        raise ValueError(f"seq_lens holds {lens.max()} > max_seq_len={max_seq_len}")
    dev = DEVICE if device is None else device if type(device) is torch.device else torch.device(device)
    S, T = len(lens), int(qsl[-1])
    q_tile, qpk_pad, dec_q_tile, d_pad = _layout(q_heads, kv_heads, head_dim, cfg)
    invariant = impl == "invariant"
    seq_split = None if invariant else _seq_splits(lens, kv_heads, impl, cfg)
    start = qsl[:-1]  # per sequence: its first token (at position ``first``)
    # one-token steps: in decode tiles (one tile each) when the config has them
    if cfg.decode_block_m is None:
        one, n_dec = np.zeros(S, dtype=bool), 0
    elif T == S and S and ql[ql.argmin()] == 1:  # a decode step: S tokens, each sequence at least one
        one, n_dec = None, S
    else:
        one = ql == 1
        n_dec = int(np.count_nonzero(one))
    if n_dec == S:  # a decode step
        d_seq, d_tok, d_pos = _run(0, S), start, first
    else:
        d_seq = np.flatnonzero(one)
        d_tok, d_pos = start[d_seq], first[d_seq]
    d_split = _split_sizes(d_pos, cfg) if invariant else seq_split[d_seq]
    decode = [d_seq, d_tok, _run(2, n_dec), d_pos, d_split]
    # the other steps: tiles cut at the multiples of q_tile of the position (a power of two),
    # with the split size of their last row
    if n_dec < T:
        shift = q_tile.bit_length() - 1
        grid0 = first >> shift  # grid tile of each sequence's first token
        multi = ql > (0 if cfg.decode_block_m is None else 1)  # sequences with tokens, none in a decode tile
        n_tiles = np.where(multi, ((lens - 1) >> shift) - grid0 + 1, 0)
        seq = np.repeat(_run(0, S), n_tiles)
        edge = (_run(0, len(seq)) + np.repeat(grid0 - (n_tiles.cumsum() - n_tiles), n_tiles)) << shift
        # a tile's rows: from its grid edge (or its sequence's first position) to the next edge (or the end)
        lo = np.maximum(edge, first[seq])
        hi = np.minimum(edge + q_tile, lens[seq])
        tok = lo + (start - first)[seq]
        tiles = [seq, tok, hi - lo, lo, _split_sizes(hi - 1, cfg) if invariant else seq_split[seq]]
    else:
        tiles = [_run(1, 0)] * 5
    # per token (int32): its position and keys per split (from the tiles when one group holds them all)
    if n_dec == T:
        tok_pos, tok_split = d_pos, d_split
    else:
        tok_pos = _run(0, T) + np.repeat((first - start).astype(np.int32), ql)
        if n_dec == 0:
            tok_split = np.repeat(tiles[4], tiles[2])
        else:
            tok_split = _split_sizes(tok_pos, cfg) if invariant else np.repeat(seq_split, ql)
    n_pad = 0
    if decode_capacity is not None:
        if n_dec > decode_capacity:
            raise ValueError(f"the step has {n_dec} one-token sequences, more than decode_capacity={decode_capacity}")
        n_pad = decode_capacity - n_dec  # padding tiles: 0 rows, and (parallel) merge entries -1
    serial_at = cfg.serial_programs if invariant else None
    ser_t = serial_at is not None and len(tiles[0]) * kv_heads >= serial_at
    ser_d = serial_at is not None and (n_dec + n_pad) * kv_heads >= serial_at
    # the tokens of the parallel launches: their split states go through the workspace, which
    # is indexed by their rank here (serial tokens take no room in it)
    dec_merge, tile_merge = not ser_d and n_dec > 0, not ser_t and n_dec < T
    if (dec_merge or n_dec == 0) and (tile_merge or n_dec == T):  # every token
        merge = rank = _run(0, T)
    else:
        merge = d_tok if dec_merge else np.flatnonzero(np.repeat(~one, ql)) if tile_merge else d_tok[:0]
        rank = _run(1, T)
        if len(merge):
            rank = rank.copy()
            rank[merge] = _run(0, len(merge))
    if max_seq_len is not None and cfg.split_target is not None and invariant:
        max_splits = _max_splits_upto(max_seq_len, cfg)
    elif max_seq_len is not None:  # every split is a multiple of block_n
        max_splits = _cdiv(max_seq_len, cfg.block_n)
    elif len(merge) == T and T:
        max_splits = int((tok_pos // tok_split).max()) + 1
    elif merge is d_tok:  # the decode tokens
        max_splits = int((d_pos // d_split).max()) + 1
    elif len(merge):
        max_splits = int((tok_pos[merge] // tok_split[merge]).max()) + 1
    else:
        max_splits = 1
    ws_rows = max(1, (len(merge) + (0 if ser_d else n_pad)) * q_heads * max_splits)
    dec_warps, dec_stages = (cfg.serial_decode_warps, cfg.serial_decode_stages) if ser_d else \
        (cfg.num_warps, cfg.num_stages)
    if n_pad:  # padding tiles and merge entries
        zeros = _run(1, n_pad)
        decode = [d_seq, zeros, d_tok, zeros, decode[2], zeros, d_pos, zeros, d_split,
                  np.full(n_pad, cfg.block_n, dtype=np.int32)]
        if not ser_d:
            merge = [merge, np.full(n_pad, -1, dtype=np.int32)]
    merge = merge if isinstance(merge, list) else [merge]
    nt, nd, nm = len(tiles[0]), n_dec + n_pad, sum(len(x) for x in merge)
    t = _device_ints([*tiles, *decode, *merge, rank, tok_pos, tok_split],
                     [nt] * 5 + [nd] * 5 + [nm, T, T, T], dev)
    return AttnPlan(cfg, impl, T, q_heads, kv_heads, head_dim, qpk_pad,
                    TileGroup(q_tile, *t[0:5], ser_t, cfg.num_warps, cfg.num_stages),
                    TileGroup(dec_q_tile, *t[5:10], ser_d, dec_warps, dec_stages),
                    MergePlan(*t[10:14], max_splits,
                              _workspace(ws_rows, d_pad, dev), _workspace(ws_rows, 2, dev)))


_PDL: dict = {}


def _pdl(device) -> bool:
    """Programmatic dependent launch for the merge kernel: compiled Triton on Hopper or newer
    (``griddepcontrol`` is sm_90+).  The merge launch may then start while the split kernel
    runs and waits (``gdc_wait``) before it reads the states: the same operations, only the
    launch latency moves."""
    if INTERPRET or device.type != "cuda":
        return False
    idx = torch.cuda.current_device() if device.index is None else device.index
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


def launch(plan: AttnPlan, q, k_cache, v_cache, block_table, scale, out, *, merge: bool = True, key=None,
           value=None, query_start_loc=None):
    """The kernel launches of :func:`attention` for a prepared plan: the split kernel over the
    multi-token tiles and over the decode tiles (each launched when it has tiles), then the
    merge (no validation, no host synchronisation: the benchmark times this, and it can be
    captured in a CUDA graph).  ``merge=False`` leaves the merge out (the output of parallel
    launches is then unfinished): the benchmark times the split kernels alone with it.
    ``key``, ``value`` (the step's new keys and values as written to the cache) with
    ``query_start_loc`` on the device: the multi-token tiles read the keys of their own chunk
    from them (:func:`attention`)."""
    T, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    mp = plan.merge
    d_pad = mp.acc.shape[1]
    merging = merge and mp.tokens.shape[0] > 0
    pdl = merging and _pdl(q.device)
    for g in (plan.tiles, plan.decode):
        if g.seq.shape[0] == 0:
            continue
        new = key is not None and g is plan.tiles
        kn, vn, qsl = (key, value, query_start_loc) if new else (q, q, g.seq)
        _attn_split_kernel[(g.seq.shape[0], hkv, 1 if g.serial else mp.max_splits)](
            q, k_cache, v_cache, block_table, g.seq, g.tok, g.rows, g.pos, g.split, mp.rank,
            mp.acc, mp.ml, out, scale if INTERPRET else scale * LOG2E, mp.max_splits, hq,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), kn, vn, qsl, *((kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1))
                                                         if new else (0, 0, 0, 0)),
            QPK=hq // hkv, QPK_PAD=plan.qpk_pad, Q_TILE=g.q_tile, BLOCK_N=plan.config.block_n, CACHE_BLOCK=bs,
            HEAD_DIM=d, D_PAD=d_pad, SERIAL=g.serial, PDL=pdl, UPCAST=INTERPRET, WIDE=g is plan.tiles,
            LCOLS=0 if INTERPRET or q.dtype == torch.float32 or g is plan.tiles else ROW_SUM_COLUMNS, NEW=new,
            num_warps=g.num_warps, num_stages=g.num_stages)
    if merging:
        d_blk = min(d_pad, MERGE_COLUMNS)
        _attn_merge_kernel[(mp.tokens.shape[0], hq, d_pad // d_blk)](
            mp.acc, mp.ml, out, mp.tokens, mp.pos, mp.split, mp.max_splits, hq,
            out.stride(0), out.stride(1), HEAD_DIM=d, D_PAD=d_pad, D_BLK=d_blk, CHUNK=FOLD_CHUNK, PDL=pdl,
            BASE2=not INTERPRET,
            num_warps=1, **({"launch_pdl": True} if pdl else {}))
    return out


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------

def attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, scale=None, impl="invariant",
              config=None, out=None, plan: AttnPlan | None = None, key=None, value=None) -> torch.Tensor:
    """Causal GQA attention of a varlen batch over the paged cache; returns ``out``
    ``(num_tokens, q_heads, head_dim)`` in q's dtype.  See the module docstring for the
    arguments and the reduction schedule.  ``plan``: the step's :func:`make_plan` (built once
    from host metadata, shared by the layers): then nothing is read back from the device.

    ``key``, ``value``: optionally the step's new keys and values ``(num_tokens, kv_heads,
    head_dim)`` in the cache's dtype, *exactly as written to the cache* (:func:`write_kv`).
    The multi-token tiles then read the KV tiles that lie wholly inside their sequence's new
    chunk from them, token-major and contiguous, instead of gathering them through the block
    table.  The values are the same, so are the bits (the tests check it); a caller that passes
    other values than it wrote gets other results, as with any wrong cache."""
    _validate_tensors(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out)
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    _validate_new_kv(key, value, k_cache, q)
    scale = 1.0 / math.sqrt(d) if scale is None else checks.positive_float("scale", scale)
    if out is None:
        out = torch.empty_like(q)
    new = {} if key is None else {"key": key, "value": value, "query_start_loc": query_start_loc}
    if plan is not None:
        if not isinstance(plan, AttnPlan):
            raise TypeError(f"plan must be None or an AttnPlan, got {type(plan).__name__}")
        if (plan.impl, plan.num_tokens, plan.q_heads, plan.kv_heads, plan.head_dim) != (impl, T, hq, hkv, d):
            raise ValueError(f"plan was built for impl={plan.impl!r}, {plan.num_tokens} tokens, {plan.q_heads}/"
                             f"{plan.kv_heads} heads of dim {plan.head_dim}; the call has impl={impl!r}, {T} "
                             f"tokens, {hq}/{hkv} heads of dim {d}")
        if config is not None and _cfg(config) != plan.config:
            raise ValueError("config differs from the plan's config")
        return launch(plan, q, k_cache, v_cache, block_table, scale, out, **new)
    cfg = _cfg(config)
    lens, qsl = _host_ints("seq_lens", seq_lens), _host_ints("query_start_loc", query_start_loc)
    _check_metadata(lens, qsl, T)
    _check_blocks(block_table, lens, nb, bs)
    if impl in ("reference", "sdpa"):
        return (_reference if impl == "reference" else _sdpa)(q, k_cache, v_cache, block_table, lens.tolist(),
                                                              qsl.tolist(), scale, out)
    return launch(make_plan(lens, qsl, q_heads=hq, kv_heads=hkv, head_dim=d, impl=impl, config=cfg, device=q.device),
                  q, k_cache, v_cache, block_table, scale, out, **new)


prefill = attention


def decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, impl="invariant", config=None,
           out=None) -> torch.Tensor:
    """One new token per sequence: ``q`` ``(num_seqs, q_heads, head_dim)``, the token of
    sequence ``s`` at position ``seq_lens[s] - 1`` (its key already written to the cache)."""
    checks.tensor("q", q, dim=3, contiguous=False)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale=scale, impl=impl, config=config,
                     out=out)
