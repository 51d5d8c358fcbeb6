"""Attention over a paged KV cache: a float64 reference, a batch-*invariant* Triton kernel and
its split-KV *variant* twin.

The paged KV cache
------------------
``k_cache``, ``v_cache``: ``(num_blocks, block_size, kv_heads, head_dim)`` (fp32, fp16 or bf16).
A sequence's key at position ``p`` lives in physical block ``block_table[s, p // block_size]``,
row ``p % block_size``.  :func:`write_kv` stores new keys/values at *slots*
(``slot = block * block_size + row``, ``-1`` = skip, vLLM's convention) with a Triton kernel
that copies bits (16-bit and fp32 values travel as integers: no rounding anywhere).

One kernel for prefill, decode and mixed batches
------------------------------------------------
:func:`attention` takes a *varlen* batch like vLLM: ``q`` ``(num_tokens, q_heads, head_dim)``
holds the new tokens of every sequence back to back (``query_start_loc``), ``seq_lens[s]`` is
the context of sequence ``s`` *after* this step (cached tokens + new ones), so the new tokens
of ``s`` are at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and are causal.  Decode is
the case ``q_len = 1`` (:func:`decode`), prefill ``q_len = prompt`` (:func:`prefill`), chunked
prefill and prefix-cache hits ``q_len < seq_len``.  GQA: ``q_heads`` a multiple of ``kv_heads``.

The reduction schedule (what makes a token's bits independent of everything but itself)
-------------------------------------------------------------------------------------
Every query row (one token, one q head) is reduced over its keys ``0..p`` (``p`` its position)
in the same way, whichever launch it is part of:

1. keys are cut into KV tiles of ``block_n`` positions (tile ``j`` = keys ``j*block_n ..``),
   visited in increasing order; the query row's own position lies in its *diagonal* tile
   ``p // block_n``, where keys ``> p`` are masked (score ``-inf``);
2. tiles are grouped into *splits* of ``S(p)`` keys (a multiple of ``block_n``): split ``i``
   covers tiles ``i*S/block_n ..``; the row has ``ceil((p+1) / S)`` splits.  ``S`` is
   :func:`split_size_at`: the config's ``split_size``, or with ``split_target`` (the default)
   a size graded by the row's own position: ``min(split_size, block_n * next_pow2(ceil(n /
   split_target)))`` for a row whose keys span ``n`` tiles (on the GPU: 64-key splits up to
   2048 keys of context, 128 up to 4096, 256 up to 8192, then 512).  A function of the row's
   position only; every row of a query tile shares its diagonal tile, hence ``S``.  Each
   split's state is an online softmax from scratch over its tiles in fp32: running max
   ``m``, sum ``l`` and ``acc`` (``alpha = exp(m_old - m_new)``, ``p = exp(s - m_new)``,
   ``l = l*alpha + sum(p)``, ``acc = acc*alpha + p @ V``; 16-bit ``p`` is rounded to V's
   dtype for the tensor cores);
3. the split states are merged in a fixed order: the *left fold* (the default)
   ``(((s0 + s1) + s2) + ...)`` with ``M = max(m_a, m_b)``, ``l = fma(l_a, e^(m_a-M),
   l_b*e^(m_b-M))``, ``acc`` likewise (:func:`_fold`), or the tree merge (below); then ``out =
   acc / l`` rounded once (RNE) to q's dtype.

Who computes what is a launch decision that never changes the bits.  A launch with fewer
than ``serial_programs`` (query tile, kv head) programs (small batches: few rows, long
contexts) runs one program per split, writes the fp32 states to a workspace, and a second
kernel (one program per token, q head and block of output columns) folds them; a larger
launch (batch 64 decode, prefill) runs *serially*: one program per (query tile, kv head)
builds each split's state in turn inside one loop over the row's tiles and folds it into the
running state as soon as the split closes, then writes the output (no workspace, no second
launch).  The serial program performs exactly the operations of the split programs plus the
merge kernel, in the same order, so ``(a)``-``(d)`` hold across modes; the H200 runs check it bitwise (``attention_
decode_tiles``: serial == one program per split, prefill and decode of 8229 positions).

A program's query tile holds ``q_tile`` consecutive tokens of one sequence times the q heads
of one kv head (the rows of ``tl.dot``); rows never mix (every reduction is along a row).

Decode tiles and the row sum (the default since the H200 runs of session 3)
---------------------------------------------------------------------------
A one-token step (decode) fills only ``q_heads / kv_heads`` rows of a tile (4 of 64 with 32 q
and 8 kv heads): the other rows are masked work, and at large batches that work is most of
the time.  With ``decode_block_m=16`` a launch runs its one-token steps in a second launch of
the *same kernel source* with 16-row tiles.  Which tile a token gets depends on its own step
only (``q_len == 1``), never on the batch, so batch invariance (a) is untouched.  Prefill ==
decode (d) needs more: every row must see the same arithmetic in a 64-row 4-warp tile and a
16-row tile.  A first try (16 rows, 4 warps, ``tl.sum`` for ``l``) failed (d) on the H200 at
dozens of positions (``results/h200/decode_tiles_run11``).  The matmul sweep had shown that
the tensor-core instructions of the two tile shapes give the same bits, so the suspect was the
row sum: ``tl.sum`` reduces in an order set by the register layout, and with 16 rows the 4 warps
split a row's 64 keys among them (a cross-warp step the 64-row tile does not have).  The H200
runs of session 3 (``results/h200/attention_decode_tiles.json`` and ``session3_schedules/``)
confirmed it: (d) holds at all 8229 positions with one warp per 16-row tile (``tl.sum``, each warp
owns whole rows as in the 64-row tile), and with any warp count once ``l`` is summed by a fixed
pairwise tree (``row_sum="tree"``) or by the tensor cores (``row_sum="mma"``, ``P @ ones``).
The default is ``decode_block_m=16, decode_num_warps=4, row_sum="tree"``, the fastest schedule
of those runs at large batch.

The merge.  Session 3 shipped the *tree merge* (``tree_merge=True``): the row's maximum ``M``
over its splits (exact in any order), then ``l = sum_i l_i e^(m_i - M)`` and ``acc`` likewise,
chunk by chunk of 16 splits (:data:`MERGE_CHUNK`, a constant): a fixed pairwise tree inside a
chunk, chunks added in order.  It loads splits in parallel, but it needs every split's state
before the first addition, so no program can merge while it streams: it rules out the serial
launch.  Session 4 made the left fold the default, and the serial launch folds as it streams.
Session 5 made the merge kernel fold *column-wise*: each output column carries its own copy of
``m`` and ``l`` (the same operations on the same values: the same bits in every column), so a
thread folds its own columns with no data from other threads, 32 columns per one-warp program
(:data:`MERGE_COLUMNS`), states loaded :data:`FOLD_CHUNK` at a time; on Hopper it is launched
with programmatic dependent launch and waits (``griddepcontrol.wait``) before it reads a state.
Measured on the H200 (``results/h200/attention_bench.json``, ``session5_schedules/``): batch-1
decode at 1k context 18 us (session 3), 8 us (session 4), 6 us (session 5).

Chunk alignment rule (enforced)
-------------------------------
Query tiles start at the chunk's first token.  A sequence whose step has ``q_len > 1`` must
start at a position that is a multiple of ``block_n`` (``(seq_len - q_len) % block_n == 0``,
``ValueError`` otherwise; ``q_len = 1``, decode, may start anywhere).  Then every query tile
lies inside one KV tile (``q_tile`` divides ``block_n``), so all its rows share the diagonal
tile and the split count, and each row runs exactly the tiles and splits that decoding its
position runs.  Since ``split_size`` is a multiple of ``block_n``, chunk boundaries at multiples
of ``block_n`` are at tile boundaries; a prefix-cache hit must be rounded down to a multiple of
``block_n`` too (with ``block_size`` 16 and ``block_n`` 64: to whole groups of 4 cache blocks).
What the rule buys: equality *by construction* (the same tiles, the same splits, the same
operations per row).  Without it, the earlier rows of a query tile that straddles a KV tile
would run one extra, fully masked tile (``alpha = exp(0) = 1``, ``p = 0``): an exact no-op for
finite values except for signed zeros and ``0 * inf``; a CPU experiment with chunks starting
at ``block_n - 3`` gave the same bits, so the rule is a guarantee, not a measured necessity.

``impl``:

* ``"invariant"`` (default): split sizes from the config and the row's own position
  (:func:`split_size_at`; on a GPU up to 512 keys, under the interpreter 32 or 64); a
  sequence's split count depends on its own length only;
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
``triton.language.extra.cuda``'s grid dependency control (present in Triton 3.6, the H200's, and
in the newer Triton of the CPU runs, where the interpreter never takes that branch).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .. import checks
from ..device import DEVICE, INTERPRET

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .matmul import _sm_count  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402  (Hopper's PDL)
from .tl_numerics import from_f32, to_f32  # noqa: E402  (exact bf16 moves on the interpreter)

__all__ = [
    "IMPLS",
    "AttnConfig",
    "DEFAULT_CONFIG",
    "INTERPRETER_CONFIG",
    "default_config",
    "new_cache",
    "allocate_blocks",
    "slots",
    "write_kv",
    "query_tile",
    "split_size_at",
    "split_plan",
    "attention",
    "AttnPlan",
    "make_plan",
    "launch",
    "prefill",
    "decode",
    "gather_kv",
]

IMPLS = ("invariant", "variant", "reference", "sdpa")


ROW_SUMS = ("sum", "tree", "mma")


@dataclass(frozen=True)
class AttnConfig:
    """The reduction schedule: KV tile ``block_n``, rows per program ``block_m`` (query tokens
    times q heads per kv head), ``split_size`` keys per split (a multiple of ``block_n``).
    ``decode_block_m``: rows per program for the one-token steps of a launch (decode), or
    ``None`` to use ``block_m`` for them too (see "Decode tiles" in the module docstring)."""

    block_n: int = 64
    block_m: int = 64
    split_size: int = 512
    num_warps: int = 4
    num_stages: int = 2
    decode_block_m: int | None = None
    #: warps / pipeline stages of the decode-tile launch (``None``: ``num_warps`` / ``num_stages``)
    decode_num_warps: int | None = None
    decode_num_stages: int | None = None
    #: how ``l`` sums a KV tile's probabilities per row: ``"sum"`` (``tl.sum``: its order follows
    #: the register layout, so it may differ between tile shapes / warp counts), ``"tree"`` (a
    #: fixed pairwise tree, (0+1)+(2+3)..., built from ``tl.split``: no layout enters) or ``"mma"``
    #: (the rounded probabilities that multiply V, summed by the tensor cores: ``P @ ones``)
    row_sum: str = "sum"
    #: the merge as max-then-weighted-sum over chunks of 16 splits with fixed pairwise trees
    #: instead of the left fold (``_fold``); it needs every split's state before its first
    #: addition, so it rules out serial launches (``serial_programs``)
    tree_merge: bool = False
    #: ``None``: every row's splits have ``split_size`` keys.  An int ``T``: a row whose keys
    #: span ``n`` KV tiles (its diagonal tile included) gets splits of
    #: ``min(split_size, block_n * next_pow2(ceil(n / T)))`` keys, so short contexts get short
    #: splits (more programs) and no row has more than ``max(T, ...)`` splits below the cap.  A
    #: function of the row's own position only (:func:`split_size_at`); the rows of a query
    #: tile share their diagonal tile, hence their split size.
    split_target: int | None = None
    #: a launch (its multi-token tiles, or its decode tiles) with at least this many programs of
    #: (query tile, kv head) runs *serially*: one program folds all of a row's splits in order
    #: and writes the output (no workspace, no merge launch); below, one program per split and
    #: the merge kernel.  The same operations either way (the left fold), so the bits never
    #: depend on it; needs ``tree_merge=False``.  ``None``: always one program per split
    serial_programs: int | None = None
    #: warps / pipeline stages of a serial decode-tile launch (``None``: the decode launch's)
    serial_decode_warps: int | None = None
    serial_decode_stages: int | None = None

    def __post_init__(self):
        for name in ("block_n", "block_m") + (("decode_block_m",) if self.decode_block_m is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        for name in ("decode_num_warps", "decode_num_stages", "serial_decode_warps", "serial_decode_stages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        if self.row_sum not in ROW_SUMS:
            raise ValueError(f"row_sum must be one of {ROW_SUMS}, got {self.row_sum!r}")
        if self.row_sum == "tree" and self.block_n > 256:
            raise ValueError(f"row_sum='tree' supports block_n up to 256, got block_n={self.block_n}")
        if self.decode_block_m is None and (self.decode_num_warps, self.decode_num_stages) != (None, None):
            raise ValueError("decode_num_warps / decode_num_stages need decode_block_m (the decode-tile launch)")
        for name in ("split_target", "serial_programs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        if (self.serial_decode_warps, self.serial_decode_stages) != (None, None) and self.decode_block_m is None:
            raise ValueError("serial_decode_warps / serial_decode_stages need decode_block_m (the decode-tile "
                             "launch; they apply when serial_programs makes that launch serial)")
        if self.serial_programs is not None and self.tree_merge:
            raise ValueError("serial_programs needs tree_merge=False (a serial program folds its splits in "
                             "order: the left fold)")
        if (isinstance(self.split_size, bool) or not isinstance(self.split_size, int) or self.split_size < 1
                or self.split_size % self.block_n):
            raise ValueError(f"split_size must be a positive multiple of block_n={self.block_n}, "
                             f"got {self.split_size!r}")

    def as_dict(self) -> dict:
        return asdict(self)


#: Compiled on a GPU: 64-key tiles, 64-row programs; splits graded by the row's position (64 to
#: 512 keys); one-token steps in 16-row, 4-warp tiles; the fixed pairwise row sum; the left fold,
#: serial launches from 512 programs with 2-warp, 3-stage serial decode programs (session 4's and
#: 5's H200 runs: ``results/h200/attention_decode_tiles.json``, ``session5_schedules/``).  Under
#: the interpreter: small tiles and splits so that short test contexts cross tile, split and mode
#: boundaries.
DEFAULT_CONFIG = AttnConfig(64, 64, 512, decode_block_m=16, decode_num_warps=4, row_sum="tree", tree_merge=False,
                            split_target=32, serial_programs=512, serial_decode_warps=2, serial_decode_stages=3)
#: Under the interpreter: small tiles so that short test contexts cross tile and split bounds.
INTERPRETER_CONFIG = AttnConfig(32, 32, 64, decode_block_m=16, decode_num_warps=4, row_sum="tree", tree_merge=False,
                                split_target=2, serial_programs=8, serial_decode_warps=2, serial_decode_stages=3)


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
    batch.  ``decode=True`` uses ``decode_block_m`` when the config sets one."""
    cfg = _cfg(config)
    bm = cfg.decode_block_m if decode and cfg.decode_block_m is not None else cfg.block_m
    qpk_pad = triton.next_power_of_2(q_heads // kv_heads)
    q_tile = max(1, min(bm // qpk_pad, cfg.block_n)) if qpk_pad <= bm else 1
    return q_tile, qpk_pad


def _num_sms() -> int:
    """SMs the variant plans for (8 under the interpreter: small batches cross its thresholds)."""
    return 8 if INTERPRET else _sm_count(torch.cuda.current_device())


def split_size_at(pos: int, config: AttnConfig | None = None) -> int:
    """Keys per split of the invariant schedule for a query row at position ``pos`` (a multiple
    of ``block_n``): ``split_size``, or with ``split_target`` the position-graded size of
    :class:`AttnConfig`.  Depends on the row's position and the config only, never on the
    batch; every row of a query tile has the same diagonal tile, hence the same size."""
    cfg = _cfg(config)
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
        raise ValueError(f"pos must be a non-negative int, got {pos!r}")
    if cfg.split_target is None:
        return cfg.split_size
    tiles = int(pos) // cfg.block_n + 1  # KV tiles the row reads, its diagonal tile included
    return min(cfg.split_size, triton.next_power_of_2(triton.cdiv(tiles, cfg.split_target)) * cfg.block_n)


def split_plan(seq_lens, kv_heads: int, *, impl: str = "invariant", config: AttnConfig | None = None) -> list:
    """Keys per split for each sequence's last position (a multiple of ``block_n``).  Invariant:
    :func:`split_size_at` of that position (the config's ``split_size`` for all, unless it
    sets ``split_target``).  Variant: ``num_splits = max(1, 2*SMs // (num_seqs*kv_heads))``,
    ``split = ceil(ceil(seq_len / num_splits) / block_n) * block_n``: it depends on the batch."""
    cfg = _cfg(config)
    lens = [int(x) for x in seq_lens]
    if impl == "invariant":
        return [split_size_at(n - 1, cfg) for n in lens]
    if impl != "variant":
        raise ValueError(f"split_plan: impl must be 'invariant' or 'variant', got {impl!r}")
    num_splits = max(1, (2 * _num_sms()) // max(1, len(lens) * kv_heads))
    return [max(1, triton.cdiv(triton.cdiv(n, num_splits), cfg.block_n)) * cfg.block_n for n in lens]


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


def allocate_blocks(seq_lens, block_size: int, num_blocks: int, *, seed: int | None = None,
                    device=None) -> torch.Tensor:
    """A block table ``(num_seqs, max_blocks)`` int32 giving each sequence its own physical
    blocks, in a seeded random order (``seed=None``: in order); unused entries are 0."""
    need = [triton.cdiv(int(n), block_size) for n in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"seq_lens need {sum(need)} blocks of {block_size}, the cache has {num_blocks}")
    order = torch.arange(num_blocks) if seed is None else \
        torch.randperm(num_blocks, generator=torch.Generator().manual_seed(int(seed)))
    table = torch.zeros((len(need), max(need + [1])), dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = order[at:at + n].to(torch.int32)
        at += n
    return table.to(DEVICE if device is None else device)


def slots(block_table: torch.Tensor, seq: int, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot mapping (int64) of positions ``start..end-1`` of sequence ``seq``."""
    pos = torch.arange(start, end, device=block_table.device)
    return (block_table[seq, pos // block_size].long() * block_size + pos % block_size)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_tokens, s_kt, s_kh, s_vt, s_vh, s_cslot, s_ch,
                     BLOCK_T: tl.constexpr, KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr):
    """BLOCK_T tokens: copy the bits of their kv heads to their slots (integers: no rounding)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1)[:, None, None]
    t = t[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D_PAD)[None, None, :]
    m = (h < KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    dst = slot * s_cslot + h * s_ch + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m), mask=m)


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``(num_tokens, kv_heads, head_dim)`` at ``slot_mapping``
    ``(num_tokens,)`` (int64 or int32; ``-1`` skips a token) of the paged caches."""
    checks.tensor("k_cache", k_cache, dim=4)
    checks.tensor("v_cache", v_cache, dim=4)
    checks.same_dtype("v_cache", v_cache, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
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
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= nb * bs:
        raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}]; the cache has {nb * bs} slots (-1 = skip)")
    iv = _INT_VIEW[key.dtype]
    _write_kv_kernel[(triton.cdiv(n, 16),)](
        key.view(iv), value.view(iv), k_cache.view(iv), v_cache.view(iv), slot_mapping.long(), n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(1), k_cache.stride(2),
        BLOCK_T=16, KV_HEADS=hkv, H_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, D_PAD=triton.next_power_of_2(d))


#: splits merged per step by the tree merge (``AttnConfig.tree_merge``): a constant, never a
#: function of the batch
MERGE_CHUNK = 16
#: columns of the output per program of the left-fold merge (one warp: a column per lane);
#: the fold is column-wise, so this moves work between programs, never the arithmetic
MERGE_COLUMNS = 32
#: states per step of the left-fold merge (unrolled: their loads are in flight together); a
#: load schedule, never the arithmetic (the tree merge's chunk is :data:`MERGE_CHUNK`)
FOLD_CHUNK = 16

# --------------------------------------------------------------------------------------------
# The kernels: partial states per split, then the fixed-order merge
# --------------------------------------------------------------------------------------------

@triton.jit
def _pair_sum(x, ROWS: tl.constexpr, W: tl.constexpr):
    """(ROWS, W) -> (ROWS, W / 2): column 2j + column 2j+1 (element-wise: no layout enters)."""
    a, b = tl.split(tl.reshape(x, (ROWS, W // 2, 2)))
    return a + b


@triton.jit
def _tile_row_sum(p, ps, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row sums of a tile's probabilities ``p`` (fp32) / ``ps`` (as rounded for ``P @ V``, fp32
    values).  MODE 0: ``tl.sum(p)``; 1: the fixed pairwise tree of ``p``; 2: ``ps @ ones`` on
    the tensor cores (16 equal columns; their max, exact, picks one)."""
    if MODE == 2:
        if ps.dtype == tl.float32:
            ones = tl.full((BLOCK_N, 16), 1.0, tl.float32)
            return tl.max(tl.dot(ps, ones, input_precision="ieee"), 1)
        else:
            ones = tl.full((BLOCK_N, 16), 1.0, ps.dtype)
            return tl.max(tl.dot(ps, ones), 1)
    else:
        return _row_sum(p, MODE == 1, ROWS, BLOCK_N)


@triton.jit
def _row_sum(p, TREE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of each row of ``p`` (ROWS, BLOCK_N).  ``TREE``: a fixed pairwise tree, the same
    additions in the same order for any tile shape and warp count; else ``tl.sum``."""
    if TREE:  # unrolled by hand: each level has another constexpr shape (checked on the H200 as is)
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
    else:
        return tl.sum(p, 1)


@triton.jit
def _tile_blocks(bt_row, t, key_end, BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    """Physical cache block of each key of KV tile ``t`` (keys ``>= key_end``: block 0, unread)."""
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + keys // CACHE_BLOCK, mask=keys < key_end, other=0)


@triton.jit
def _tile_kv(kc_ptr, vc_ptr, blk, t, key_end, kv_off, s_cb, s_cs, d, d_ok,
             BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    """K (as ``(D, BLOCK_N)``) and V (``(BLOCK_N, D)``) of KV tile ``t`` from the paged cache;
    keys ``>= key_end`` read as zeros."""
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = keys < key_end
    base = blk.to(tl.int64) * s_cb + (keys % CACHE_BLOCK) * s_cs + kv_off
    kt = tl.load(kc_ptr + base[None, :] + d[:, None], mask=d_ok[:, None] & k_ok[None, :], other=0.0)
    v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    return kt, v


@triton.jit
def _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 ROW_SUM: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over KV tile ``t`` (keys ``>= limit`` of a row are masked):
    the arithmetic every schedule shares, whatever the load schedule around it."""
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    if UPCAST:
        kt = to_f32(kt)
    if kt.dtype == tl.float32:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * scale
    s = tl.where(keys[None, :] < limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    if v.dtype == tl.float32:
        ps = p
        pv = tl.dot(p, v, input_precision="ieee")
    elif UPCAST:  # interpreter: p rounded to V's dtype (as on the GPU), then exact fp32 dot
        ps = to_f32(from_f32(p, v.dtype))
        pv = tl.dot(ps, to_f32(v), input_precision="ieee")
    else:
        ps = from_f32(p, v.dtype)
        pv = tl.dot(ps, v)
    l = l * alpha + _tile_row_sum(p, ps, ROW_SUM, ROWS, BLOCK_N)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


@triton.jit
def _split_state(q, kc_ptr, vc_ptr, bt_row, t_lo, t_hi, key_stop, kv_off, s_cb, s_cs, d, d_ok, limit, scale,
                 ROWS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                 ROW_SUM: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 state ``(m, l, acc)`` of one split: online softmax from scratch over KV tiles
    ``t_lo .. t_hi - 1`` in increasing order."""
    key_end = tl.minimum(key_stop, t_hi * BLOCK_N)  # the split's last key + 1 (loads stop there)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    for t in range(t_lo, t_hi):
        blk = _tile_blocks(bt_row, t, key_end, BLOCK_N, CACHE_BLOCK)
        kt, v = _tile_kv(kc_ptr, vc_ptr, blk, t, key_end, kv_off, s_cb, s_cs, d, d_ok, BLOCK_N, CACHE_BLOCK)
        m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, ROW_SUM, UPCAST)
    return m, l, acc


@triton.jit
def _row_state(q, kc_ptr, vc_ptr, bt_row, n_tiles, split_tiles, key_stop, kv_off, s_cb, s_cs, d, d_ok, limit, scale,
               ROWS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr,
               ROW_SUM: tl.constexpr, UPCAST: tl.constexpr):
    """The serial launch: the row's folded state over KV tiles ``0 .. n_tiles - 1``.  One flat
    loop over the tiles (the loads of the next tile never wait for a split to close): each
    split's state is built from scratch exactly as ``_split_state`` builds it, and when the
    split's last tile is done it becomes the running state (split 0) or is folded into it
    (``_fold``), in split order."""
    key_end = tl.minimum(key_stop, n_tiles * BLOCK_N)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc_i = tl.zeros((ROWS, D_PAD), tl.float32)
    for t in range(0, n_tiles):
        blk = _tile_blocks(bt_row, t, key_end, BLOCK_N, CACHE_BLOCK)
        kt, v = _tile_kv(kc_ptr, vc_ptr, blk, t, key_end, kv_off, s_cb, s_cs, d, d_ok, BLOCK_N, CACHE_BLOCK)
        m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, ROW_SUM, UPCAST)
        # when the split is complete: split 0 becomes the running state, a later one is folded
        # into it; then the split state starts again.  Selects, not a branch: on the H200 the
        # branch was slower (prefill 4k: 1208 vs 887 us; 2-warp decode at batch 64 about 3%)
        done = ((t + 1) % split_tiles == 0) | (t + 1 == n_tiles)
        first = t < split_tiles
        m_f, l_f, acc_f = _fold(m, l, acc, m_i, l_i, acc_i, ROWS)
        m = tl.where(done, tl.where(first, m_i, m_f), m)
        l = tl.where(done, tl.where(first, l_i, l_f), l)
        acc = tl.where(done, tl.where(first, acc_i, acc_f), acc)
        m_i = tl.where(done, float("-inf"), m_i)
        l_i = tl.where(done, 0.0, l_i)
        acc_i = tl.where(done, 0.0, acc_i)
    return m, l, acc


@triton.jit
def _fold(m, l, acc, m_i, l_i, acc_i, ROWS: tl.constexpr):
    """The left-fold step ``state (+) state_i`` in fp32: ``M = max(m, m_i)``, ``a = e^(m-M)``,
    ``b = e^(m_i-M)``, ``l = fma(l, a, l_i*b)``, ``acc = fma(acc, a, acc_i*b)``.  Written with
    explicit FMAs so that no compiler contracts it differently in the merge kernel (one row,
    ``ROWS = 0``: scalars and a ``(D,)`` vector) and in the serial split kernel (a tile of rows)."""
    m_new = tl.maximum(m, m_i)
    a = tl.exp(m - m_new)
    b = tl.exp(m_i - m_new)
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
                       QPK: tl.constexpr, QPK_PAD: tl.constexpr, Q_TILE: tl.constexpr,
                       BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, ROW_SUM: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr,
                       UPCAST: tl.constexpr):
    """Parallel (``SERIAL`` false): program (query tile, kv head, split) writes the split's fp32
    state (acc, m, l) for the tile's valid rows; the merge kernel folds them.  Serial: program
    (query tile, kv head) computes the states of all the row's splits in order, folds each into
    the running state with the merge kernel's left fold (``_fold``) and writes ``acc / l``:
    the same operations in the same order, so the same bits, without the workspace or the merge
    launch (the launch picks the mode; the bits never depend on it)."""
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
    # gave the 64-row prefill program 184 instead of 96 bytes of spill stack, and H200 run 31
    # measured prefill 4k at 1090 us, run 29 at 890)
    row_ok = (tok < tok0 + n_tok) & (hh < QPK)
    pos = (pos0 - tok0) + tok
    head = kvh * QPK + hh
    # every valid row of the tile has the same diagonal KV tile (the chunk alignment rule);
    # keys past the tile's last row are masked for all its rows and never loaded
    key_stop = pos0 + n_tok  # the tile's last row's position + 1
    diag = (key_stop - 1) // BLOCK_N
    limit = tl.where(row_ok, pos + 1, 1)  # keys < limit are visible to the row

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = to_f32(q)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bts
    kv_off = kvh * s_ch
    if SERIAL:
        m, l, acc = _row_state(q, kc_ptr, vc_ptr, bt_row, diag + 1, split_tiles, key_stop, kv_off, s_cb, s_cs, d,
                               d_ok, limit, scale, Q_TILE * QPK_PAD, D_PAD, BLOCK_N, CACHE_BLOCK, ROW_SUM, UPCAST)
        o = acc / l[:, None]
        o_ptr = out_ptr + tok.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(o_ptr, from_f32(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        t_lo = split * split_tiles
        t_hi = tl.minimum(t_lo + split_tiles, diag + 1)
        m, l, acc = _split_state(q, kc_ptr, vc_ptr, bt_row, t_lo, t_hi, key_stop, kv_off, s_cb, s_cs, d, d_ok, limit,
                                 scale, Q_TILE * QPK_PAD, D_PAD, BLOCK_N, CACHE_BLOCK, ROW_SUM, UPCAST)
        keep = row_ok & ((rows * 0 + t_lo) < t_hi)
        # the workspace holds the states of the launch's parallel tokens only (tok_ws: a token's rank)
        w0 = (tl.load(tok_ws_ptr + tok, mask=row_ok, other=0).to(tl.int64) * q_heads + head) * max_splits
        w = w0 + split
        tl.store(ws_acc_ptr + w[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
        tl.store(ws_ml_ptr + w * 2, m, mask=keep)
        tl.store(ws_ml_ptr + w * 2 + 1, l, mask=keep)


@triton.jit(do_not_specialize=["max_splits", "q_heads"])
def _attn_merge_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, merge_tok_ptr, tok_pos_ptr, tok_split_ptr, max_splits,
                       q_heads, s_ot, s_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_BLK: tl.constexpr,
                       TREE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (token of a parallel launch, q head, block of ``D_BLK`` columns): the merge of
    the row's split states in fp32 in a fixed order: ``TREE`` the max-then-chunked-pairwise-sums
    of the module docstring (``D_BLK == D_PAD``), else the left fold of states 0, 1, 2, ...
    (``_fold``); then ``out = acc / l`` rounded once to out's dtype.

    The fold is column-wise: every column carries its own copy of ``m`` and ``l`` (the same
    operations on the same values, so the same bits in every column) and folds its ``acc``
    element, so the columns can be split among programs and a thread folds its own columns
    with no data from other threads (no shuffles, no extraction).  The loop body holds CHUNK
    states, unrolled: their loads do not wait for the fold."""
    rank = tl.program_id(0)  # the token's place in the workspace
    tok = tl.load(merge_tok_ptr + rank)
    h = tl.program_id(1)
    pos = tl.load(tok_pos_ptr + tok)
    n = pos // tl.load(tok_split_ptr + tok) + 1  # the splits a row has: ceil((pos + 1) / split)
    d = tl.program_id(2) * D_BLK + tl.arange(0, D_BLK)
    w = (rank.to(tl.int64) * q_heads + h) * max_splits
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel's states
        gdc_wait()
    if TREE:
        idx = tl.arange(0, CHUNK)
        # the row max over its n splits (max is exact in any order), then
        # l = sum_i l_i e^(m_i - M), acc likewise, chunk by chunk of CHUNK splits; inside a chunk a
        # fixed pairwise tree, chunks added in order: the order depends on n only
        mx = tl.max(tl.load(ws_ml_ptr + (w + idx) * 2, mask=idx < n, other=float("-inf")), 0)
        for c in range(CHUNK, n, CHUNK):
            mx = tl.maximum(mx, tl.max(tl.load(ws_ml_ptr + (w + c + idx) * 2, mask=c + idx < n,
                                               other=float("-inf")), 0))
        l = tl.zeros((1,), tl.float32)
        acc = tl.zeros((D_BLK,), tl.float32)
        for c in range(0, n, CHUNK):
            ok = c + idx < n
            m_c = tl.load(ws_ml_ptr + (w + c + idx) * 2, mask=ok, other=float("-inf"))
            l_c = tl.load(ws_ml_ptr + (w + c + idx) * 2 + 1, mask=ok, other=0.0)
            acc_c = tl.load(ws_acc_ptr + (w + c + idx)[:, None] * D_PAD + d[None, :], mask=ok[:, None], other=0.0)
            wgt = tl.where(ok, tl.exp(m_c - mx), 0.0)
            l = l + _row_sum(tl.reshape(l_c * wgt, (1, CHUNK)), True, 1, CHUNK)
            acc = acc + _row_sum(tl.trans(acc_c * wgt[:, None]), True, D_BLK, CHUNK)
        o = acc / tl.sum(l, 0)  # (a sum of one element: exact)
    else:  # the left fold (((s0 + s1) + s2) + ...), column by column
        col = d * 0
        m = tl.load(ws_ml_ptr + w * 2 + col)
        l = tl.load(ws_ml_ptr + w * 2 + 1 + col)
        acc = tl.load(ws_acc_ptr + w * D_PAD + d)
        for c in range(1, n, CHUNK):  # CHUNK states per step: their loads are independent of the fold
            for j in tl.static_range(CHUNK):
                live = col + c + j < n  # states past the row's last leave it as it is (a select)
                m_j = tl.load(ws_ml_ptr + (w + c + j) * 2 + col, mask=live, other=float("-inf"))
                l_j = tl.load(ws_ml_ptr + (w + c + j) * 2 + 1 + col, mask=live, other=0.0)
                acc_j = tl.load(ws_acc_ptr + (w + c + j) * D_PAD + d, mask=live, other=0.0)
                m_f, l_f, acc_f = _fold(m, l, acc, m_j, l_j, acc_j, 0)
                m = tl.where(live, m_f, m)
                l = tl.where(live, l_f, l)
                acc = tl.where(live, acc_f, acc)
        o = acc / l
    tl.store(out_ptr + tok.to(tl.int64) * s_ot + h * s_oh + d, from_f32(o, out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# --------------------------------------------------------------------------------------------
# Validation and metadata
# --------------------------------------------------------------------------------------------

def _validate(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out, cfg):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    checks.tensor("q", q, dim=3, contiguous=False)
    if q.stride(2) != 1:
        raise ValueError(f"q must have unit stride in its last dim, got strides {q.stride()}")
    checks.tensor("k_cache", k_cache, dim=4)
    checks.tensor("v_cache", v_cache, dim=4)
    checks.same_dtype("k_cache", k_cache, "q", q)
    checks.same_dtype("v_cache", v_cache, "q", q)
    checks.same_device("k_cache", k_cache, "q", q)
    checks.same_device("v_cache", v_cache, "q", q)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
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
    lens = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != T:
        raise ValueError(f"query_start_loc must start at 0 and end at num_tokens={T}, got {qsl[0]}..{qsl[-1]}")
    cap = block_table.shape[1] * bs
    for s in range(S):
        ql = qsl[s + 1] - qsl[s]
        if ql < 1:
            raise ValueError(f"query_start_loc must increase: sequence {s} has {ql} query tokens")
        if ql > lens[s]:
            raise ValueError(f"seq_lens[{s}]={lens[s]} is shorter than its {ql} query tokens")
        if lens[s] > cap:
            raise ValueError(f"seq_lens[{s}]={lens[s]} is longer than the cache can hold for it: block_table has "
                             f"{block_table.shape[1]} blocks of {bs}")
        start = lens[s] - ql
        if ql > 1 and start % cfg.block_n and impl in ("invariant", "variant"):  # the kit kernels' rule
            raise ValueError(f"query_start_loc/seq_lens: sequence {s} starts a {ql}-token chunk at position {start}, "
                             f"not a multiple of the KV tile block_n={cfg.block_n} (chunked prefill and prefix-cache "
                             "hits must start chunks at multiples of block_n)")
        used = block_table[s, :triton.cdiv(lens[s], bs)]
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= nb:
            j = int(((used < 0) | (used >= nb)).nonzero()[0])
            raise ValueError(f"block_table[{s}, {j}] = {int(used[j])} is out of range: the cache has {nb} blocks")
    if out is not None:
        checks.tensor("out", out, dtypes=(q.dtype,), dim=3, contiguous=False)
        checks.same_device("out", out, "q", q)
        if out.shape != q.shape:
            raise ValueError(f"out must have shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if out.stride(2) != 1:
            raise ValueError(f"out must have unit stride in its last dim, got strides {out.stride()}")
    return lens, qsl


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
        k, v = gather_kv(k_cache, v_cache, block_table, s, lens[s])
        pos = torch.arange(lens[s] - (b - a), lens[s], device=q.device)
        mask = torch.arange(lens[s], device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k.transpose(0, 1).repeat_interleave(hq // hkv, 0),
                                           v.transpose(0, 1).repeat_interleave(hq // hkv, 0), attn_mask=mask,
                                           scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------

def attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, scale=None, impl="invariant",
              config=None, out=None) -> torch.Tensor:
    """Causal GQA attention of a varlen batch over the paged cache; returns ``out``
    ``(num_tokens, q_heads, head_dim)`` in q's dtype.  See the module docstring for the
    arguments, the reduction schedule and the chunk alignment rule."""
    cfg = _cfg(config)
    lens, qsl = _validate(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out, cfg)
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else checks.positive_float("scale", scale)
    if out is None:
        out = torch.empty_like(q)
    if impl == "reference":
        return _reference(q, k_cache, v_cache, block_table, lens, qsl, scale, out)
    if impl == "sdpa":
        return _sdpa(q, k_cache, v_cache, block_table, lens, qsl, scale, out)
    return launch(make_plan(q, hkv, lens, qsl, impl=impl, config=cfg), q, k_cache, v_cache, block_table,
                  seq_lens, query_start_loc, scale, out)


@dataclass
class AttnPlan:
    """Everything a launch needs besides the tensors: built on the host from the sequence
    lengths (:func:`make_plan`), so that :func:`launch` does no host work (CUDA graphs)."""

    config: AttnConfig
    q_tile: int
    qpk_pad: int
    max_splits: int
    #: keys per split of each sequence's last position (:func:`split_plan`)
    split: list
    tile_seq: torch.Tensor
    tile_tok: torch.Tensor
    #: keys per split of each query tile (all its rows share it) and of each token
    tile_split: torch.Tensor
    tok_pos: torch.Tensor
    tok_split: torch.Tensor
    ws_acc: torch.Tensor
    ws_ml: torch.Tensor
    #: the one-token steps' tiles when the config has a ``decode_block_m`` (else empty)
    dec_q_tile: int
    dec_tile_seq: torch.Tensor
    dec_tile_tok: torch.Tensor
    dec_tile_split: torch.Tensor
    #: whether the multi-token tiles / the decode tiles run serially (``serial_programs``)
    serial: bool = False
    dec_serial: bool = False
    #: the tokens of the parallel launches (the workspace's rows, in this order; the merge
    #: kernel folds them), and each token's rank among them (0 for serial tokens: unused)
    merge_tok: torch.Tensor | None = None
    tok_ws: torch.Tensor | None = None
    #: per query tile: its valid tokens and the position of its first token (the kernel's
    #: prologue reads what it needs from the tile's own entries: no chain of dependent loads)
    tile_rows: torch.Tensor | None = None
    tile_pos: torch.Tensor | None = None
    dec_tile_rows: torch.Tensor | None = None
    dec_tile_pos: torch.Tensor | None = None


def make_plan(q, kv_heads: int, seq_lens: list, query_start_loc: list, *, impl: str = "invariant",
              config: AttnConfig | None = None) -> AttnPlan:
    """Query tiles, per-token positions, split sizes (per tile and per token) and the fp32
    workspace of a launch (``seq_lens``/``query_start_loc`` as Python lists; not validated
    here).  Invariant: a tile's or a token's split size is :func:`split_size_at` of its
    position; variant: the batch-chosen split of its sequence."""
    cfg = _cfg(config)
    T, hq, d = q.shape
    q_tile, qpk_pad = query_tile(hq, kv_heads, cfg)
    dec_q_tile, _ = query_tile(hq, kv_heads, cfg, decode=True)
    split = split_plan(seq_lens, kv_heads, impl=impl, config=cfg)
    if impl == "invariant":
        size_at = lambda s, pos: split_size_at(pos, cfg)  # noqa: E731
    else:
        size_at = lambda s, pos: split[s]  # noqa: E731
    tiles = ([], [], [], [], [])  # multi-token tiles: sequence, first token, split size, tokens, first position
    dec = ([], [], [], [], [])  # one-token (decode) tiles
    tok_pos, tok_split = [], []
    for s in range(len(seq_lens)):
        a, b = query_start_loc[s], query_start_loc[s + 1]
        first = seq_lens[s] - (b - a)  # position of token a
        if b - a == 1 and cfg.decode_block_m is not None:  # a one-token step: a decode tile
            starts, group = [a], dec
        else:
            starts, group = range(a, b, q_tile), tiles
        for t0 in starts:
            rows = min(t0 + q_tile, b) - t0
            group[0].append(s)
            group[1].append(t0)
            group[2].append(size_at(s, first + t0 - a + rows - 1))  # its last row's position
            group[3].append(rows)
            group[4].append(first + t0 - a)
        for pos in range(first, seq_lens[s]):
            tok_pos.append(pos)
            tok_split.append(size_at(s, pos))
    serial = [impl == "invariant" and cfg.serial_programs is not None and len(g[0]) * kv_heads >= cfg.serial_programs
              for g in (tiles, dec)]
    # the tokens of the parallel launches: their split states go through the workspace, which
    # is indexed by their rank here (serial tokens take no room in it)
    merge_tok = []
    for g, q_t, ser in ((tiles, q_tile, serial[0]), (dec, 1, serial[1])):
        if not ser:
            for s, t0 in zip(g[0], g[1]):
                merge_tok += range(t0, min(t0 + q_t, query_start_loc[s + 1]))
    merge_tok.sort()
    tok_ws = [0] * T
    for r, t in enumerate(merge_tok):
        tok_ws[t] = r
    max_splits = max([tok_pos[t] // tok_split[t] + 1 for t in merge_tok] or [1])
    i32 = dict(dtype=torch.int32, device=q.device)
    d_pad = max(16, triton.next_power_of_2(d))
    ws_rows = max(1, len(merge_tok) * hq * max_splits)
    ts, ds = [torch.tensor(x, **i32) for x in tiles], [torch.tensor(x, **i32) for x in dec]
    return AttnPlan(cfg, q_tile, qpk_pad, max_splits, split, *ts[:3], torch.tensor(tok_pos, **i32),
                    torch.tensor(tok_split, **i32),
                    torch.empty((ws_rows, d_pad), dtype=torch.float32, device=q.device),
                    torch.empty((ws_rows, 2), dtype=torch.float32, device=q.device),
                    dec_q_tile, *ds[:3], serial[0], serial[1],
                    torch.tensor(merge_tok, **i32), torch.tensor(tok_ws, **i32),
                    tile_rows=ts[3], tile_pos=ts[4], dec_tile_rows=ds[3], dec_tile_pos=ds[4])


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


def launch(plan: AttnPlan, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out, *,
           merge: bool = True):
    """The kernel launches of :func:`attention` for a prepared plan: the split kernel over the
    multi-token tiles and over the decode tiles (each launched when it has tiles), then the
    merge (no validation, no host synchronisation: the benchmark times this, and it can be
    captured in a CUDA graph; ``seq_lens`` / ``query_start_loc`` are not read: the plan carries
    what the kernels need).  ``merge=False`` leaves the merge out (the output of parallel
    launches is then unfinished): the benchmark times the split kernels alone with it."""
    cfg = plan.config
    T, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    d_pad = plan.ws_acc.shape[1]
    # the decode-tile launch: its own warps / stages where the config sets them (serial or not)
    dec_warps = cfg.num_warps if cfg.decode_num_warps is None else cfg.decode_num_warps
    dec_stages = cfg.num_stages if cfg.decode_num_stages is None else cfg.decode_num_stages
    if plan.dec_serial:
        dec_warps = dec_warps if cfg.serial_decode_warps is None else cfg.serial_decode_warps
        dec_stages = dec_stages if cfg.serial_decode_stages is None else cfg.serial_decode_stages
    merging = merge and plan.merge_tok.shape[0] > 0
    pdl = merging and _pdl(q.device)
    for tile_seq, tile_tok, tile_rows, tile_pos, tile_split, q_tile, warps, stages, serial in (
            (plan.tile_seq, plan.tile_tok, plan.tile_rows, plan.tile_pos, plan.tile_split, plan.q_tile, cfg.num_warps,
             cfg.num_stages, plan.serial),
            (plan.dec_tile_seq, plan.dec_tile_tok, plan.dec_tile_rows, plan.dec_tile_pos, plan.dec_tile_split,
             plan.dec_q_tile, dec_warps, dec_stages, plan.dec_serial)):
        if tile_seq.shape[0] == 0:
            continue
        _attn_split_kernel[(tile_seq.shape[0], hkv, 1 if serial else plan.max_splits)](
            q, k_cache, v_cache, block_table, tile_seq, tile_tok, tile_rows, tile_pos, tile_split, plan.tok_ws,
            plan.ws_acc, plan.ws_ml, out, scale, plan.max_splits, hq,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1),
            QPK=hq // hkv, QPK_PAD=plan.qpk_pad, Q_TILE=q_tile, BLOCK_N=cfg.block_n, CACHE_BLOCK=bs, HEAD_DIM=d,
            D_PAD=d_pad, ROW_SUM=ROW_SUMS.index(cfg.row_sum), SERIAL=serial, PDL=pdl, UPCAST=INTERPRET,
            num_warps=warps, num_stages=stages)
    if merging:
        d_blk = d_pad if cfg.tree_merge else min(d_pad, MERGE_COLUMNS)
        _attn_merge_kernel[(plan.merge_tok.shape[0], hq, d_pad // d_blk)](
            plan.ws_acc, plan.ws_ml, out, plan.merge_tok, plan.tok_pos, plan.tok_split, plan.max_splits, hq,
            out.stride(0), out.stride(1), HEAD_DIM=d, D_PAD=d_pad, D_BLK=d_blk, TREE=cfg.tree_merge,
            CHUNK=MERGE_CHUNK if cfg.tree_merge else FOLD_CHUNK, PDL=pdl, num_warps=2 if cfg.tree_merge else 1,
            **({"launch_pdl": True} if pdl else {}))
    return out


prefill = attention


def decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, impl="invariant", config=None,
           out=None) -> torch.Tensor:
    """One new token per sequence: ``q`` ``(num_seqs, q_heads, head_dim)``, the token of
    sequence ``s`` at position ``seq_lens[s] - 1`` (its key already written to the cache)."""
    checks.tensor("q", q, dim=3, contiguous=False)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale=scale, impl=impl, config=config,
                     out=out)
