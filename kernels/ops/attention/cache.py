"""The paged KV cache and its allocator.

``k_cache``, ``v_cache``: ``(num_blocks, block_size, kv_heads, head_dim)`` (fp32, fp16 or bf16).
A sequence's key at position ``p`` lives in physical block ``block_table[s, p // block_size]``,
row ``p % block_size``.  :func:`write_kv` stores new keys/values at *slots*
(``slot = block * block_size + row``, ``-1`` = skip, vLLM's convention) with a Triton kernel
that copies bits (16-bit and fp32 values travel as integers: no rounding anywhere).
:class:`PagedCache` is the cache with its allocator, for tests, benchmarks and the book: a
seeded shuffled free list, block lists grown on demand (:func:`grow_blocks`), writes through
the slot mapping (:func:`slots`) and a step's padded :func:`block_table` and metadata.
"""
from __future__ import annotations

import torch

from ... import checks
from ...device import DEVICE
from .ops import attention
from .validate import check_caches, host_list, index_arg

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from ..direct_launch import DirectLaunch  # noqa: E402

__all__ = ["new_cache", "block_table", "grow_blocks", "allocate_blocks", "slots", "write_kv", "PagedCache"]


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


def block_table(tables, device=None) -> torch.Tensor:
    """The block table ``(num_seqs, max_blocks)`` int32 of per-sequence block lists (host lists
    of physical block ids, one a sequence), padded with 0 (at least one column)."""
    if isinstance(tables, torch.Tensor) or not hasattr(tables, "__iter__"):
        raise TypeError(f"tables must be a list of block lists, got {type(tables).__name__}")
    rows = [host_list(f"tables[{s}]", t) for s, t in enumerate(tables)]
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


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, check_slots: bool = True, validate: bool = True) -> None:
    """Store ``key``/``value`` ``(num_tokens, kv_heads, head_dim)`` at ``slot_mapping``
    ``(num_tokens,)`` (int64 or int32; ``-1`` skips a token) of the paged caches.
    ``check_slots=False`` skips the range check of the slots (it reads them back to the host:
    an engine whose scheduler made the slots passes False, so no layer waits on the device).
    ``validate=False`` also skips the checks of the tensors' dtypes, shapes, devices and strides
    (no error names a bad argument then): for an engine layer that passed them once for its
    cache and calls again with tensors of the same layout (the vLLM backend), since the checks
    cost more host time than the launch."""
    if validate:
        _check_write(key, value, k_cache, v_cache, slot_mapping)
    n = key.shape[0]
    if n == 0:
        return
    nb, bs, hkv, d = k_cache.shape
    if check_slots:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}]; the cache has {nb * bs} slots (-1 = skip)")
    iv = _INT_VIEW[key.dtype]
    _WRITE_KV((-(-n // _WRITE_T),),
        key.view(iv), value.view(iv), k_cache.view(iv), v_cache.view(iv),
        slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long(), n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), CACHE_BLOCK=bs,
        BLOCK_T=_WRITE_T, KV_HEADS=hkv, H_PAD=_pow2(hkv), HEAD_DIM=d, D_PAD=_pow2(d))


#: tokens per program of :func:`write_kv`'s kernel
_WRITE_T = 16


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def _check_write(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The checks of :func:`write_kv`'s tensors (no value is read)."""
    check_caches(k_cache, v_cache)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
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
        n = index_arg("n", n)
        if shared is not None:
            if name in self.tables:
                raise ValueError(f"shared: sequence {name!r} already has blocks; only a new sequence starts "
                                 f"with shared blocks")
            shared = host_list("shared", shared)
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
        start = index_arg("start", start)
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
            n = index_arg(f"steps[{i}] seq_len", n)
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


#: the eager launch of :func:`_write_kv_kernel` (:mod:`..direct_launch`)
_WRITE_KV = DirectLaunch(_write_kv_kernel)
