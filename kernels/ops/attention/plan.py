"""The plan of a step: built once on the host from the step's metadata, reused by every layer.

:func:`make_plan` builds everything a launch needs besides the tensors (query tiles, per-token
positions and split sizes, the workspace) from the step's *host* metadata (``seq_lens`` and
``query_start_loc`` as lists or CPU tensors: vLLM keeps such copies).  It works on whole NumPy
arrays of the step's sequences, tiles and tokens (the split size of a position is a table
lookup, :func:`~.schedule.split_sizes`), with no Python loop over any of them, and moves the
plan's index tensors to the device in one copy: tens of microseconds for a decode step of
hundreds of sequences (``python -m batch_invariance_kit.bench.host``).

The plan's index tensors live in one flat int32 buffer laid out by :class:`PlanLayout`, the
one place that knows their order and alignment: the planner packs and views with it, and a
persistent plan (a decode step captured in a CUDA graph and replayed with its buffers
refilled: the vLLM backend's ``DecodePlanBuffers``) writes each step's plan into a buffer laid
out for the largest step and views that buffer as the plan.  With ``decode_capacity`` and
``max_seq_len`` the decode part of a plan has fixed sizes (padding tiles of zero rows run no
loop iteration and store nothing; padding merge entries are skipped), so such a buffer holds
any decode step of up to ``decode_capacity`` sequences.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ... import checks
from ...device import DEVICE
from .launcher import workspace
from .schedule import (AttnConfig, cdiv, head_layout, max_splits_upto, resolve_config, seq_splits,
                       split_sizes)
from .validate import check_metadata, host_ints

__all__ = ["TileGroup", "MergePlan", "AttnPlan", "PlanLayout", "make_plan"]


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
    """Everything a launch needs besides the tensors (:func:`make_plan`): :func:`~.launcher.launch`
    does no host work, and every layer of a step reuses the plan."""

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
        """The plan's index tensors, in :class:`PlanLayout` order."""
        return PlanLayout.tensors(self)


#: where the index tensors sit among the fields of a tile group and of the merge plan
_TILE_INDEX, _MERGE_INDEX = slice(1, 6), slice(0, 4)
_TILE_FIELDS, _MERGE_FIELDS = TileGroup._fields[_TILE_INDEX], MergePlan._fields[_MERGE_INDEX]
_N_TILE = len(_TILE_FIELDS)
#: index tensors with one entry per token of the step (the merge plan's last three)
_PER_TOKEN = 3
#: int32 entries per 16 bytes: an aligned layout starts every tensor at a multiple of this
_ALIGN = 4


class PlanLayout:
    """Where the index tensors of a plan lie in one flat int32 buffer: their order and the
    alignment rule, in one place.  :func:`make_plan` packs the step's host arrays with it and
    views the buffer it moved to the device as the plan's tensors (:meth:`load`: one buffer,
    one copy); a persistent plan is a buffer laid out for the largest step (:meth:`of`),
    refilled with each step's plan (:meth:`write`) and viewed as that plan (:meth:`over`): the
    same pointers at every step.

    The order (:attr:`FIELDS`): the five index tensors of :attr:`AttnPlan.tiles`, the five of
    :attr:`AttnPlan.decode`, the merge's tokens, then its three per-token tensors (one entry
    per token of the step: the only ones whose lengths differ between decode steps planned
    with one ``decode_capacity``).  With ``align``, each tensor starts on a 16-byte boundary
    (zeros fill the gaps), as a tensor of its own would: Triton specialises a compiled kernel
    on its pointer arguments' alignment.  The interpreter takes no alignment into account:
    without ``align`` the tensors lie end to end.  An empty tensor is the device's one shared
    empty int32 tensor."""

    #: ``(group, field)`` of each index tensor, in buffer order
    FIELDS = (*(("tiles", f) for f in _TILE_FIELDS), *(("decode", f) for f in _TILE_FIELDS),
              *(("merge", f) for f in _MERGE_FIELDS))
    #: the last ``PER_TOKEN`` of them hold one entry per token of the step
    PER_TOKEN = _PER_TOKEN
    #: int32 entries per 16 bytes: with ``align`` every tensor starts at a multiple of this
    ALIGN = _ALIGN

    __slots__ = ("sizes", "align")

    def __init__(self, sizes, *, align: bool = True):
        if len(sizes) != len(self.FIELDS):
            raise ValueError(f"sizes must have one entry per index tensor ({len(self.FIELDS)}), got {len(sizes)}")
        #: entries of each index tensor
        self.sizes = tuple(sizes)
        self.align = align

    @classmethod
    def of(cls, plan: AttnPlan, *, align: bool = True) -> "PlanLayout":
        """The layout of ``plan``'s index tensors (aligned: a persistent buffer for a device)."""
        return cls([t.shape[0] for t in cls.tensors(plan)], align=align)

    @staticmethod
    def tensors(plan: AttnPlan) -> list:
        """``plan``'s index tensors, in buffer order."""
        return [*plan.tiles[_TILE_INDEX], *plan.decode[_TILE_INDEX], *plan.merge[_MERGE_INDEX]]

    @property
    def offsets(self) -> list:
        """Where each index tensor starts in the buffer."""
        out, at = [], 0
        for n in _spans(self.sizes, self.align):
            out.append(at)
            at += n
        return out

    @property
    def size(self) -> int:
        """Entries (int32) of the whole buffer."""
        return sum(_spans(self.sizes, self.align))

    def pack(self, pieces: list) -> np.ndarray:
        """The host buffer (int32) of the index tensors whose entries are the host integer
        arrays ``pieces`` laid end to end in buffer order (a tensor may span several pieces)."""
        return _pack(pieces, self.sizes, self.align)

    def views(self, buffer: torch.Tensor) -> list:
        """The index tensors as views of ``buffer`` (this layout's flat buffer, on any device),
        in buffer order; every empty one the shared empty tensor of ``buffer``'s device."""
        return _views(buffer, self.sizes, self.align)

    @staticmethod
    def load(pieces: list, tiles: int, decode: int, merge: int, tokens: int, device: torch.device) -> tuple:
        """The planner's step: ``pieces`` packed in the layout of a plan with ``tiles``
        multi-token tiles, ``decode`` decode tiles, ``merge`` merge entries and ``tokens`` tokens
        (aligned off the CPU), moved to ``device`` in one copy and viewed: ``(tiles, decode,
        merge)``, each group's index tensors in its fields' order (no layout object is built:
        host time)."""
        sizes = (tiles,) * _N_TILE + (decode,) * _N_TILE + (merge,) + (tokens,) * _PER_TOKEN
        align = device.type != "cpu"
        whole = torch.from_numpy(_pack(pieces, sizes, align))
        if align:
            whole = whole.to(device)
        return _groups(_views(whole, sizes, align))

    def _check(self, plan: AttnPlan) -> list:
        """``plan``'s index tensors, which must fit this layout: each of this layout's size, the
        per-token ones at most."""
        ts = self.tensors(plan)
        have = [t.shape[0] for t in ts]
        k = len(self.sizes) - self.PER_TOKEN
        if have[:k] != list(self.sizes[:k]) or any(h > n for h, n in zip(have[k:], self.sizes[k:])):
            raise ValueError(f"the plan's index tensors have {have} entries, this layout holds {list(self.sizes)} "
                             f"(only the last {self.PER_TOKEN}, one entry per token, may be shorter): plan both "
                             f"steps with the same decode_capacity and max_seq_len")
        return ts

    def write(self, out: np.ndarray, plan: AttnPlan) -> None:
        """Write the index tensors of ``plan`` (built on the CPU) into the host buffer ``out`` at
        their places; entries past a per-token tensor's length keep what they held."""
        for at, t in zip(self.offsets, self._check(plan)):
            if t.shape[0]:
                out[at:at + t.shape[0]] = t.numpy()

    def over(self, buffer: torch.Tensor, plan: AttnPlan, **merge) -> AttnPlan:
        """``plan`` with each index tensor a view of ``buffer`` at its place, of the plan's own
        length; ``merge``: other fields of the merge plan to replace (a persistent workspace)."""
        tiles, decode, mt = _groups([v[:x.shape[0]] for v, x in zip(self.views(buffer), self._check(plan))])
        return dataclasses.replace(plan, tiles=plan.tiles._replace(**dict(zip(_TILE_FIELDS, tiles))),
                                   decode=plan.decode._replace(**dict(zip(_TILE_FIELDS, decode))),
                                   merge=plan.merge._replace(**dict(zip(_MERGE_FIELDS, mt)), **merge))


def _spans(sizes, align: bool) -> list:
    """Entries each index tensor takes in a buffer of :class:`PlanLayout`: its own, then (with
    ``align``) the gap up to the next 16-byte boundary."""
    return [n + (-n % _ALIGN if align else 0) for n in sizes]


def _pack(pieces: list, sizes, align: bool) -> np.ndarray:
    """:meth:`PlanLayout.pack` of the layout of ``sizes``."""
    buf = np.concatenate(pieces, dtype=np.int32)
    if not align:
        return buf
    spans = _spans(sizes, align)
    out = np.zeros(sum(spans), dtype=np.int32)
    src = at = 0
    for n, span in zip(sizes, spans):  # one slice per tensor of the plan
        out[at:at + n] = buf[src:src + n]
        src, at = src + n, at + span
    return out


def _views(buffer: torch.Tensor, sizes, align: bool) -> list:
    """:meth:`PlanLayout.views` of the layout of ``sizes``."""
    filled = [n for n in sizes if n]
    if align:  # each tensor, then its gap
        parts = iter(buffer.split_with_sizes([x for n, span in zip(filled, _spans(filled, align))
                                              for x in (n, span - n)])[::2])
    else:
        parts = iter(buffer.split_with_sizes(filled))
    empty = _no_ints(buffer.device)
    return [next(parts) if n else empty for n in sizes]


def _groups(t: list) -> tuple:
    """The index tensors ``t`` (buffer order) as ``(tiles, decode, merge)``, each group's in its
    fields' order."""
    return t[:_N_TILE], t[_N_TILE:2 * _N_TILE], t[2 * _N_TILE:]


@functools.lru_cache(maxsize=None)
def _no_ints(device: torch.device) -> torch.Tensor:
    """The empty int32 tensor on ``device`` (an index device: ``cuda:0``, never ``cuda``) that
    stands for every empty index tensor of the plans there: no entry to read or write."""
    return torch.empty(0, dtype=torch.int32, device=device)


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


def make_plan(seq_lens, query_start_loc, *, q_heads: int, kv_heads: int, head_dim: int, impl: str = "invariant",
              config: AttnConfig | None = None, device=None, decode_capacity: int | None = None,
              max_seq_len: int | None = None) -> AttnPlan:
    """The launch plan of one step from its host metadata (``seq_lens``, ``query_start_loc`` as
    lists or CPU tensors; no device is read).  Query tiles sit on the absolute grid of
    ``q_tile`` (see "Query tiles sit on an absolute grid" in
    :mod:`batch_invariance_kit.ops.attention`); a tile's and a token's split size is
    :func:`~.schedule.split_size_at` of its position (invariant) or its sequence's batch-chosen
    split (variant).  ``decode_capacity``: pad the one-token tiles to this many (and the merge
    to as many tokens) and ``max_seq_len``: size the workspace for contexts up to it, so that
    plans of steps with up to ``decode_capacity`` one-token sequences have the same sizes (a
    persistent plan, :class:`PlanLayout`; CUDA graphs).

    Built from whole-array NumPy operations on the step's sequences, tiles and tokens (no
    Python loop over any of them) and moved to ``device`` in one copy: one int32 buffer whose
    views are the index tensors (:meth:`PlanLayout.load`).  The per-call host work is a fixed
    few dozen NumPy calls: the head layout, the split-size table and the padded workspace bound
    are cached per config (:func:`~.schedule.head_layout`, :func:`~.schedule.split_steps`,
    :func:`~.schedule.max_splits_upto`), the runs of consecutive ints, zeros and ones are
    slices of cached read-only arrays (:func:`_run`), an int32 CPU tensor of metadata is read
    without a check of its range, and a decode step (one token per sequence) is told apart by
    one reduction and builds no tile arrays."""
    cfg = resolve_config(config)
    if impl not in ("invariant", "variant"):
        raise ValueError(f"make_plan: impl must be 'invariant' or 'variant', got {impl!r}")
    checks.positive_int("q_heads", q_heads)
    checks.positive_int("kv_heads", kv_heads)
    checks.positive_int("head_dim", head_dim)
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (GQA)")
    for name, v in (("decode_capacity", decode_capacity), ("max_seq_len", max_seq_len)):
        if v is not None:
            checks.positive_int(name, v)
    lens, qsl = host_ints("seq_lens", seq_lens), host_ints("query_start_loc", query_start_loc)
    ql, first = check_metadata(lens, qsl)
    if max_seq_len is not None and lens.size and lens[lens.argmax()] > max_seq_len:
        raise ValueError(f"seq_lens holds {lens.max()} > max_seq_len={max_seq_len}")
    dev = DEVICE if device is None else device if type(device) is torch.device else torch.device(device)
    S, T = len(lens), int(qsl[-1])
    q_tile, qpk_pad, dec_q_tile, d_pad = head_layout(q_heads, kv_heads, head_dim, cfg)
    invariant = impl == "invariant"
    seq_split = None if invariant else seq_splits(lens, kv_heads, impl, cfg)
    start = qsl[:-1]  # per sequence: its first token (at position ``first``)
    # one-token steps: in decode tiles (one tile each) when the config has them
    if cfg.decode_block_m is None:
        d_seq = _run(0, 0)
    elif T == S and S and ql[ql.argmin()] == 1:  # a decode step: S tokens, each sequence at least one
        d_seq = _run(0, S)
    else:
        d_seq = np.flatnonzero(ql == 1)
    n_dec = len(d_seq)
    if n_dec == S:  # every sequence (a decode step)
        d_tok, d_pos = start, first
    else:
        d_tok, d_pos = start[d_seq], first[d_seq]
    d_split = split_sizes(d_pos, cfg) if invariant else seq_split[d_seq]
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
        tiles = [seq, tok, hi - lo, lo, split_sizes(hi - 1, cfg) if invariant else seq_split[seq]]
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
            tok_split = split_sizes(tok_pos, cfg) if invariant else np.repeat(seq_split, ql)
    n_pad = 0
    if decode_capacity is not None:
        if n_dec > decode_capacity:
            raise ValueError(f"the step has {n_dec} one-token sequences, more than decode_capacity={decode_capacity}")
        n_pad = decode_capacity - n_dec  # padding tiles: 0 rows, and (parallel) merge entries -1
    serial_at = cfg.serial_programs if invariant else None
    ser_t = serial_at is not None and len(tiles[0]) * kv_heads >= serial_at
    ser_d = serial_at is not None and (n_dec + n_pad) * kv_heads >= serial_at
    # the tokens of the parallel launches: their split states go through the workspace, which
    # is indexed by their rank here (serial tokens take no room in it); with each one's position
    # and split size
    dec_merge, tile_merge = not ser_d and n_dec > 0, not ser_t and n_dec < T
    if (dec_merge or n_dec == 0) and (tile_merge or n_dec == T):  # every token
        merge = rank = _run(0, T)
        m_pos, m_split = tok_pos, tok_split
    else:
        if dec_merge:  # the decode tokens
            merge, m_pos, m_split = d_tok, d_pos, d_split
        elif tile_merge:  # the tokens of the multi-token tiles
            merge = np.flatnonzero(np.repeat(multi, ql))
            m_pos, m_split = tok_pos[merge], tok_split[merge]
        else:
            merge = _run(1, 0)
        rank = _run(1, T)
        if len(merge):
            rank = rank.copy()
            rank[merge] = _run(0, len(merge))
    if max_seq_len is not None and cfg.split_target is not None and invariant:
        max_splits = max_splits_upto(max_seq_len, cfg)
    elif max_seq_len is not None:  # every split is a multiple of block_n
        max_splits = cdiv(max_seq_len, cfg.block_n)
    elif len(merge):
        max_splits = int((m_pos // m_split).max()) + 1
    else:
        max_splits = 1
    n_merge = len(merge) + (0 if ser_d else n_pad)  # with the padding entries of a parallel decode launch
    ws_rows = max(1, n_merge * q_heads * max_splits)
    dec_warps, dec_stages = (cfg.serial_decode_warps, cfg.serial_decode_stages) if ser_d else \
        (cfg.num_warps, cfg.num_stages)
    merge_pad = []
    if n_pad:  # padding tiles and merge entries
        zeros = _run(1, n_pad)
        decode = [d_seq, zeros, d_tok, zeros, decode[2], zeros, d_pos, zeros, d_split,
                  np.full(n_pad, cfg.block_n, dtype=np.int32)]
        if not ser_d:
            merge_pad = [np.full(n_pad, -1, dtype=np.int32)]
    t_tiles, t_decode, t_merge = PlanLayout.load([*tiles, *decode, merge, *merge_pad, rank, tok_pos, tok_split],
                                                 len(tiles[0]), n_dec + n_pad, n_merge, T, dev)
    return AttnPlan(cfg, impl, T, q_heads, kv_heads, head_dim, qpk_pad,
                    TileGroup(q_tile, *t_tiles, ser_t, cfg.num_warps, cfg.num_stages),
                    TileGroup(dec_q_tile, *t_decode, ser_d, dec_warps, dec_stages),
                    MergePlan(*t_merge, max_splits, workspace(ws_rows, d_pad, dev), workspace(ws_rows, 2, dev)))
