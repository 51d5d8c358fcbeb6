"""What attention's tests and chapter 6 share: one small head layout, seeded data, a paged cache
at those sizes, the decode operator the invariance harness checks, and the two batch cases
that the tests assert and the chapter shows (a prompt in a mixed batch, a prompt in chunks).

Sizes follow the config (:func:`~.schedule.default_config`: 32-key tiles and 64-key splits
under the interpreter, 64-key tiles and 64-512-key splits on a GPU), so the same cases cross
tile, split and cache-block (16) boundaries on both.
"""
from __future__ import annotations

import torch

from ...device import DEVICE
from ...bitwise import seeded_normal
from .cache import PagedCache
from .schedule import AttnConfig, resolve_config

__all__ = ["Q_HEADS", "KV_HEADS", "HEAD_DIM", "BLOCK_SIZE", "seq_data", "Cache", "decode_lens", "decode_op",
           "mixed_batch_case", "chunked_prefill_case"]

#: the head layout and cache blocks of the cases: 4 q heads over 2 kv heads, head dim 32,
#: 16-token cache blocks
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16


def seq_data(seed: int, r: int, n: int, dtype: torch.dtype) -> tuple:
    """Queries, keys and values of positions ``0..n-1`` of sequence ``r``: the same bits on
    every machine and in every batch (a row's data depends only on ``(seed, r)``)."""
    g = seed * 1_000_003 + r * 7919
    return (seeded_normal((n, Q_HEADS, HEAD_DIM), g + 1, dtype=dtype, device=DEVICE),
            seeded_normal((n, KV_HEADS, HEAD_DIM), g + 2, dtype=dtype, device=DEVICE),
            seeded_normal((n, KV_HEADS, HEAD_DIM), g + 3, dtype=dtype, device=DEVICE))


class Cache(PagedCache):
    """The paged KV cache (:class:`~.cache.PagedCache`) at these sizes, its blocks shuffled by
    ``seed``: ``write(name, k, v, start)`` stores a sequence's keys and values at positions
    ``start..``, growing its block list; ``run(steps)``, ``steps`` a list of ``(name, q of the
    new tokens, seq_len after the step)``, is one launch.  By default it holds 16 sequences of
    four of the config's largest splits (at least 256 blocks)."""

    def __init__(self, dtype: torch.dtype, num_blocks: int | None = None, seed: int = 0,
                 config: AttnConfig | None = None):
        if num_blocks is None:
            num_blocks = max(256, 16 * 4 * resolve_config(config).split_size // BLOCK_SIZE)
        super().__init__(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, device=DEVICE, seed=seed)


def decode_lens(config: AttnConfig | None = None) -> list:
    """Context lengths of the rows of a decode batch: across one key, a tile, a split and
    several splits of ``config``."""
    cfg = resolve_config(config)
    bn, split = cfg.block_n, cfg.split_size
    return [3 * split + 44, 1, 3 * split + 1, 2 * split, bn - 1, 4 * split - 7, bn + 1, 2 * split + 9]


def decode_op(dtype: torch.dtype, impl: str, config: AttnConfig | None = None) -> tuple:
    """``(f, make_batch)`` for the invariance harness: row ``r`` is one sequence (context
    ``decode_lens(config)[r % 8]``: its keys and values, and the query of its last position);
    ``f`` writes the batch's keys into a fresh cache whose blocks are shuffled by the batch
    size and decodes the whole batch in one launch."""
    lens = decode_lens(config)
    lmax = max(lens)

    def make(bs, seed=0):
        qs, ks, vs, ls = [], [], [], []
        for r in range(bs):
            n = lens[r % len(lens)]
            q, k, v = seq_data(seed, r, n, dtype)
            pad = torch.zeros((lmax - n, KV_HEADS, HEAD_DIM), dtype=dtype, device=DEVICE)
            qs.append(q[-1])
            ks.append(torch.cat([k, pad]))
            vs.append(torch.cat([v, pad]))
            ls.append(n)
        return torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.tensor(ls, device=DEVICE)

    def f(q, k, v, seq_lens):
        c = Cache(dtype, seed=q.shape[0], config=config)
        steps = []
        for i in range(q.shape[0]):
            n = int(seq_lens[i])
            c.write(i, k[i, :n], v[i, :n], 0)
            steps.append((i, q[i:i + 1], n))
        return torch.cat(c.run(steps, impl=impl, config=config))

    return f, make


def mixed_batch_case(dtype: torch.dtype = torch.float32, config: AttnConfig | None = None) -> tuple:
    """``(in_batch, alone)``: a prompt of ``3 * block_n + 5`` tokens prefilled in one launch
    between another sequence's decode step and a third sequence's prefill, and the same prompt
    prefilled alone in a cache of its own (property (a) across step kinds)."""
    cfg = resolve_config(config)
    bn, split = cfg.block_n, cfg.split_size
    n = 3 * bn + 5
    q, k, v = seq_data(3, 0, n, dtype)
    alone = Cache(dtype, seed=1, config=cfg)
    alone.write("x", k, v, 0)
    ref = alone.run([("x", q, n)], config=cfg)[0]
    c = Cache(dtype, seed=2, config=cfg)
    qy, ky, vy = seq_data(3, 1, split + 7, dtype)
    qz, kz, vz = seq_data(3, 2, bn + 3, dtype)
    for name, kk, vv in (("y", ky, vy), ("x", k, v), ("z", kz, vz)):
        c.write(name, kk, vv, 0)
    mixed = c.run([("y", qy[-1:], split + 7), ("x", q, n), ("z", qz, bn + 3)], config=cfg)
    return mixed[1], ref


def chunked_prefill_case(dtype: torch.dtype, config: AttnConfig | None = None) -> tuple:
    """``(chunked, one)``: a prompt of ``2 * split_size + block_n + 5`` tokens fed as three
    chunks that start at multiples of ``block_n`` (the second crosses a split boundary), each
    writing its keys and then attending to everything cached so far, and the same prompt
    prefilled in one chunk (property (b))."""
    cfg = resolve_config(config)
    bn, split = cfg.block_n, cfg.split_size
    n = 2 * split + bn + 5
    q, k, v = seq_data(5, 0, n, dtype)
    one = Cache(dtype, seed=3, config=cfg)
    one.write("s", k, v, 0)
    ref = one.run([("s", q, n)], config=cfg)[0]
    c = Cache(dtype, seed=4, config=cfg)
    got = []
    for a, b in ((0, bn), (bn, split + bn), (split + bn, n)):
        c.write("s", k[a:b], v[a:b], a)
        got.append(c.run([("s", q[a:b], b)], config=cfg)[0])
    return torch.cat(got), ref
