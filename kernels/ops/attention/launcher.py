"""The launches of a planned step: the split kernel over the multi-token tiles and over the
decode tiles, then the merge kernel over the workspace of the parallel launches' split states
(:func:`launch`), and that workspace (:func:`workspace`).  Which launch computes what never
changes the bits; the load schedule of the merge (:data:`MERGE_COLUMNS`, :data:`FOLD_CHUNK`)
moves work, never the arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch

from ...device import INTERPRET
from ..tma import descriptor
from ..direct_launch import DirectLaunch
from .kernels import LOG2E, ROW_SUM_COLUMNS, _attn_merge_kernel, _attn_split_kernel

__all__ = ["MERGE_COLUMNS", "FOLD_CHUNK", "workspace", "step_descriptors", "launch"]


#: columns of the output per program of the left-fold merge (one warp: a column per lane);
#: the fold is column-wise, so this moves work between programs, never the arithmetic.  Under
#: the interpreter a program takes the whole row (its cost is per operation, not per element)
MERGE_COLUMNS = 1 << 30 if INTERPRET else 32
#: states per step of the left-fold merge (unrolled: their loads are in flight together); a
#: load schedule, never the arithmetic.  Under the interpreter one state per step (states past
#: a row's last are selected away, so a longer step only adds operations)
FOLD_CHUNK = 1 if INTERPRET else 16


def workspace(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An uninitialised fp32 ``(rows, cols)`` tensor on ``device``: below 4 MiB on the CPU a
    NumPy allocation (fewer host calls than ``torch.empty``; larger ones NumPy advises into huge
    pages, a system call more), else ``torch.empty`` (and its error where NumPy cannot allocate)."""
    if device.type == "cpu" and rows * cols < 1 << 20:
        try:
            return torch.from_numpy(np.empty((rows, cols), dtype=np.float32))
        except MemoryError:
            pass
    return torch.empty((rows, cols), dtype=torch.float32, device=device)


def step_descriptors(key, value, block_n: int):
    """Tensor descriptors of the step's own keys and values as ``(tokens, kv_heads * head_dim)``
    matrices with ``(block_n, head_dim)`` boxes (the whole KV tiles of a chunk are copied by the
    tensor memory accelerator), or ``None`` where the layout does not allow them: heads not
    adjacent in memory, a head dim that is not a power of two of at least 16 bytes, a token
    stride or base not 16-byte aligned.  Where ``None``, the same tiles are read with pointer
    loads: the same values, so the same bits."""
    if key is None:
        return None
    t, hkv, d = key.shape
    es = key.element_size()
    for x in (key, value):
        if (x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * es) % 16 or x.data_ptr() % 16
                or x.shape != key.shape or x.dtype != key.dtype):
            return None
    if t == 0 or d & (d - 1) or d * es < 16 or d > 256 or block_n > 256:
        return None
    return tuple(descriptor(x, [t, hkv * d], [x.stride(0), 1], [block_n, d]) for x in (key, value))


#: per CUDA device index: whether it takes programmatic dependent launch (:func:`_pdl`)
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


def launch(plan, q, k_cache, v_cache, block_table, scale, out, *, merge: bool = True, key=None,
           value=None, query_start_loc=None):
    """The kernel launches of :func:`~.ops.attention` for a prepared plan (an
    :class:`~.plan.AttnPlan`): the split kernel over the multi-token tiles and over the decode
    tiles (each launched when it has tiles), then the merge (no validation, no host
    synchronisation: the benchmark times this, and it can be captured in a CUDA graph).
    ``merge=False`` leaves the merge out (the output of parallel launches is then unfinished):
    the benchmark times the split kernels alone with it.
    ``key``, ``value`` (the step's new keys and values as written to the cache) with
    ``query_start_loc`` on the device: the multi-token tiles read the keys of their own chunk
    from them (:func:`~.ops.attention`)."""
    T, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    mp = plan.merge
    d_pad = mp.acc.shape[1]
    merging = merge and mp.tokens.shape[0] > 0
    pdl = merging and _pdl(q.device)
    descs = step_descriptors(key, value, plan.config.block_n) if key is not None and plan.tiles.seq.shape[0] else None
    for g in (plan.tiles, plan.decode):
        if g.seq.shape[0] == 0:
            continue
        new = key is not None and g is plan.tiles
        kn, vn, qsl = (key, value, query_start_loc) if new else (q, q, g.seq)
        kd, vd = descs if new and descs is not None else (kn, vn)
        _ATTN_SPLIT((g.seq.shape[0], hkv, 1 if g.serial else mp.max_splits),
            q, k_cache, v_cache, block_table, g.seq, g.tok, g.rows, g.pos, g.split, mp.rank,
            mp.acc, mp.ml, out, scale if INTERPRET else scale * LOG2E, mp.max_splits, hq,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), kn, vn, qsl, *((kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1))
                                                         if new else (0, 0, 0, 0)), kd, vd,
            QPK=hq // hkv, QPK_PAD=plan.qpk_pad, Q_TILE=g.q_tile, BLOCK_N=plan.config.block_n, CACHE_BLOCK=bs,
            HEAD_DIM=d, D_PAD=d_pad, SERIAL=g.serial, PDL=pdl, UPCAST=INTERPRET, WIDE=g is plan.tiles,
            LCOLS=0 if INTERPRET or q.dtype == torch.float32 or g is plan.tiles else ROW_SUM_COLUMNS, NEW=new,
            TMA=new and descs is not None,
            num_warps=g.num_warps, num_stages=g.num_stages)
    if merging:
        d_blk = min(d_pad, MERGE_COLUMNS)
        _ATTN_MERGE((mp.tokens.shape[0], hq, d_pad // d_blk),
            mp.acc, mp.ml, out, mp.tokens, mp.pos, mp.split, mp.max_splits, hq,
            out.stride(0), out.stride(1), HEAD_DIM=d, D_PAD=d_pad, D_BLK=d_blk, CHUNK=FOLD_CHUNK, PDL=pdl,
            BASE2=not INTERPRET,
            num_warps=1, **({"launch_pdl": True} if pdl else {}))
    return out


#: the eager launches of the attention kernels (:mod:`..direct_launch`)
_ATTN_SPLIT, _ATTN_MERGE = DirectLaunch(_attn_split_kernel), DirectLaunch(_attn_merge_kernel)
