"""The reduction schedule: how a query row's keys are cut into KV tiles and splits, as a function
of the row's position, the head layout and the config, never of the batch (the one exception
is the variant's split, :func:`seq_splits`, chosen from the batch on purpose).

:class:`AttnConfig` holds the schedule and its launch; :func:`split_size_at` is the scalar rule
of a row's split size and :func:`split_sizes` the same rule over a whole array of positions
(a table lookup, tabulated once per config by :func:`split_steps`), which the planner uses.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields

import numpy as np

from ... import checks
from ...device import INTERPRET, sm_count
from .validate import host_ints

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)

__all__ = [
    "AttnConfig",
    "DEFAULT_CONFIG",
    "INTERPRETER_CONFIG",
    "default_config",
    "resolve_config",
    "query_tile",
    "head_layout",
    "num_sms",
    "split_size_at",
    "split_plan",
    "split_steps",
    "split_sizes",
    "seq_splits",
    "max_splits_upto",
    "cdiv",
]


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
            checks.positive_int(name, getattr(self, name))
        for name in ("split_target", "serial_programs"):  # None: off
            if getattr(self, name) is not None:
                checks.positive_int(name, getattr(self, name))
        if (isinstance(self.split_size, bool) or not isinstance(self.split_size, int) or self.split_size < 1
                or self.split_size % self.block_n):
            raise ValueError(f"split_size must be a positive multiple of block_n={self.block_n}, "
                             f"got {self.split_size!r}")
        # the planner's caches look the config up on every call: its hash is computed once
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

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


def resolve_config(config) -> AttnConfig:
    """``config``, or :func:`default_config` for ``None``; anything else is refused."""
    if config is None:
        return default_config()
    if not isinstance(config, AttnConfig):
        raise TypeError(f"config must be None or an AttnConfig, got {type(config).__name__}")
    return config


def query_tile(q_heads: int, kv_heads: int, config: AttnConfig | None = None, *, decode: bool = False) -> tuple:
    """``(q_tile, qpk_pad)``: tokens per program and padded q heads per kv head.  A function of
    the head layout, the config and whether the step is a one-token (decode) step: never of the
    batch.  ``q_tile`` divides ``block_n`` (both powers of two, ``q_tile <= block_n``)."""
    cfg = resolve_config(config)
    bm = cfg.decode_block_m if decode and cfg.decode_block_m is not None else cfg.block_m
    qpk_pad = triton.next_power_of_2(q_heads // kv_heads)
    q_tile = max(1, min(bm // qpk_pad, cfg.block_n)) if qpk_pad <= bm else 1
    return q_tile, qpk_pad


@functools.lru_cache(maxsize=256)
def head_layout(q_heads: int, kv_heads: int, head_dim: int, cfg: AttnConfig) -> tuple:
    """``(q_tile, qpk_pad, decode q_tile, d_pad)``: :func:`query_tile` of the head layout and
    config, and the head dim padded to a power of two (at least 16) as the workspace holds it;
    once per head layout and config."""
    return (*query_tile(q_heads, kv_heads, cfg), query_tile(q_heads, kv_heads, cfg, decode=True)[0],
            max(16, triton.next_power_of_2(head_dim)))


def num_sms() -> int:
    """SMs the variant plans for (8 under the interpreter: small batches cross its thresholds)."""
    return 8 if INTERPRET else sm_count()


def split_size_at(pos: int, config: AttnConfig | None = None) -> int:
    """Keys per split of the invariant schedule for a query row at position ``pos`` (a multiple
    of ``block_n``): position-graded with ``split_target``, else ``split_size``.  Depends on
    the row's diagonal KV tile and the config only, never on the batch."""
    cfg = resolve_config(config)
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
    cfg = resolve_config(config)
    if impl not in ("invariant", "variant"):
        raise ValueError(f"split_plan: impl must be 'invariant' or 'variant', got {impl!r}")
    return seq_splits(host_ints("seq_lens", seq_lens), kv_heads, impl, cfg).tolist()


@functools.lru_cache(maxsize=None)
def split_steps(cfg: AttnConfig) -> tuple:
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


def split_sizes(pos: np.ndarray, cfg: AttnConfig) -> np.ndarray:
    """:func:`split_size_at` of every position of ``pos`` (>= 0), vectorised (int32)."""
    edges, sizes, table = split_steps(cfg)
    if table is None:
        return sizes[np.searchsorted(edges, pos, side="right")]
    return table.take(pos, mode="clip")  # past the table: its last entry


def seq_splits(lens: np.ndarray, kv_heads: int, impl: str, cfg: AttnConfig) -> np.ndarray:
    """:func:`split_plan` of the host array ``lens`` (int64)."""
    if impl == "invariant":
        return split_sizes(np.maximum(lens - 1, 0), cfg)
    num_splits = max(1, (2 * num_sms()) // max(1, len(lens) * kv_heads))
    keys = lens if num_splits == 1 else cdiv(lens, num_splits)
    # rounded up to a multiple of block_n (a power of two), at least block_n (lens >= 0)
    return np.maximum((keys + (cfg.block_n - 1)) & -cfg.block_n, cfg.block_n)


@functools.lru_cache(maxsize=256)
def max_splits_upto(n: int, cfg: AttnConfig) -> int:
    """The most splits a row at a position ``< n`` has under the invariant schedule: where the
    split size holds (:func:`split_steps`), ``p // size + 1`` grows with ``p``, so the last
    position below ``n`` of each stretch has its most."""
    edges, sizes, _ = split_steps(cfg)
    starts, ends = [0, *edges.tolist()], [*edges.tolist(), n]
    return max([(min(e, n) - 1) // int(sz) + 1 for a, e, sz in zip(starts, ends, sizes) if a < n] or [1])


def cdiv(a, b):
    """``ceil(a / b)`` of integers or integer arrays."""
    return -(-a // b)
