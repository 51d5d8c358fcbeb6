"""The Triton kernels of attention: one online-softmax step per KV tile (:func:`_tile_update`),
a split's state (:func:`_split_state`), the serial program's loop that folds each split as it
closes (:func:`_row_state`), the left fold of two states (:func:`_fold`), and the two launched
kernels: :func:`_attn_split_kernel` (one program per query tile, kv head and split, or per
query tile and kv head when serial) and :func:`_attn_merge_kernel` (the fold of a row's split
states from the workspace).  The schedule they follow, the row sum and the two number bases
(base 2 compiled, base e under the interpreter) are described in
:mod:`batch_invariance_kit.ops.attention`; the launches are :func:`~.launcher.launch`'s.

Plain pointer loads, but for the whole KV tiles of a step's own keys and values, which the
tensor memory accelerator copies through descriptors where their layout allows
(:func:`~.launcher.step_descriptors`; the same values either way);
``tl.dot`` with ``input_precision``; on Hopper the merge launch uses
``triton.language.extra.cuda``'s grid dependency control (present in Triton 3.6 and in newer
Triton, where the interpreter never takes that branch).
"""
from __future__ import annotations

import triton  # (batch_invariance_kit.ops imported batch_invariance_kit.device first: the interpreter is chosen)
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # (Hopper's PDL)
from ..tl_numerics import from_f32, to_f32  # (exact bf16 moves on the interpreter)

#: columns of ``p @ ones``, the compiled kernels' row sum of 16-bit probabilities (the narrowest
#: tensor-core product that every tile height takes)
ROW_SUM_COLUMNS = 16

#: ``log2(e)``: the compiled kernels keep their softmax state in base 2 (scores scaled by
#: ``scale * LOG2E``, ``exp2``)
LOG2E = 1.4426950408889634


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
             kd, vd, row0, col0,
             BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, EDGE: tl.constexpr, EVEN_D: tl.constexpr,
             NEW: tl.constexpr, TMA: tl.constexpr):
    """K (as ``(D, BLOCK_N)``) and V (``(BLOCK_N, D)``) of KV tile ``t``: from the paged cache
    through the block table, or (``NEW``) from the step's own keys and values, which hold the
    same values as the cache: key position ``p`` is token ``p`` of ``kn_row`` / ``vn_row``
    (pointers already moved to the sequence's token at position 0 and the kv head), rows
    ``s_knt`` / ``s_vnt`` apart.  Only the addresses differ, never the values.  ``EDGE``: the
    tile may reach ``key_end`` (keys ``>= key_end`` read as zeros, neither their block-table
    entries nor their rows are read); otherwise every key of the tile is below it and the loads
    carry no key mask.  ``TMA`` (with ``NEW``): such a whole tile of the step's keys is copied
    through the descriptors ``kd`` / ``vd`` instead, at row ``row0 + t * BLOCK_N`` (the token of
    the tile's first key) and column ``col0`` (the kv head's first); the same values."""
    if NEW and TMA and not EDGE:  # a whole tile of the step's keys: one tensor-memory copy each
        kt = tl.trans(kd.load([row0 + t * BLOCK_N, col0]))
        v = vd.load([row0 + t * BLOCK_N, col0])
        return kt, v
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
                 scale, kn_row, vn_row, s_knt, s_vnt,
                 kd, vd, row0, col0, t_new, ROWS: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr,
                 LCOLS: tl.constexpr, EVEN_D: tl.constexpr, NEW: tl.constexpr, TMA: tl.constexpr):
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
                             s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, False, EVEN_D, False, TMA)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, False, LCOLS)
        if NEW:
            for t in range(tl.maximum(t_lo, t_pg), t_mid):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, False, EVEN_D, True, TMA)
                m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, False, LCOLS)
        t_dg = tl.maximum(t_lo, n_tiles - 1)
        for t in range(t_dg, tl.minimum(t_hi, t_new) if NEW else t_hi):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False, TMA)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
        if NEW:
            for t in range(tl.maximum(t_dg, t_new), t_hi):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, True, EVEN_D, True, TMA)
                m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
    else:  # one loop, every tile masked
        for t in range(t_lo, t_hi):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False, TMA)
            m, l, acc = _tile_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, UPCAST, True, LCOLS)
    return m, l, acc


@triton.jit
def _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles, key_end, kv_off, s_cb, s_cs, d, d_ok, limit,
                 scale, m, l, acc, m_i, l_i, acc_i, kn_row, vn_row, s_knt, s_vnt,
                 kd, vd, row0, col0, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, EDGE: tl.constexpr,
                 BRANCH: tl.constexpr, LCOLS: tl.constexpr, EVEN_D: tl.constexpr, NEW: tl.constexpr, TMA: tl.constexpr):
    """Tile ``t`` of the serial launch: the split state's online-softmax step, then, when the
    split is complete, it is folded into the running state (``_fold``) and the split state
    starts again."""
    kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt, s_vnt,
                     kd, vd, row0, col0,
                     BLOCK_N, CACHE_BLOCK, EDGE, EVEN_D, NEW, TMA)
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
               kn_row, vn_row, s_knt, s_vnt,
               kd, vd, row0, col0, t_new, ROWS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               CACHE_BLOCK: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr, LCOLS: tl.constexpr,
               EVEN_D: tl.constexpr, NEW: tl.constexpr, TMA: tl.constexpr):
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
                                                      acc_i, kn_row, vn_row, s_knt, s_vnt,
                                                      kd, vd, row0, col0, ROWS, BLOCK_N, CACHE_BLOCK,
                                                      UPCAST, False, True, LCOLS, EVEN_D, False, TMA)
        if NEW:
            for t in range(tl.maximum(t_pg, 0), t_mid):
                m, l, acc, m_i, l_i, acc_i = _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles,
                                                          key_end, kv_off, s_cb, s_cs, d, d_ok, limit, scale, m, l,
                                                          acc, m_i, l_i, acc_i, kn_row, vn_row, s_knt, s_vnt,
                                                          kd, vd, row0, col0, ROWS,
                                                          BLOCK_N, CACHE_BLOCK, UPCAST, False, True, LCOLS, EVEN_D,
                                                          True, TMA)
        t_dg = tl.maximum(t_mid, 0)
        # the diagonal tile, which closes the last split
        for t in range(t_dg, tl.minimum(n_tiles, t_new) if NEW else n_tiles):
            kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row, s_knt,
                             s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, True, EVEN_D, False, TMA)
            m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, UPCAST, True,
                                           LCOLS)
        if NEW:
            for t in range(tl.maximum(t_dg, t_new), n_tiles):
                kt, v = _tile_kv(kc_ptr, vc_ptr, bt_row, t, key_end, kv_off, s_cb, s_cs, d, d_ok, kn_row, vn_row,
                                 s_knt, s_vnt, kd, vd, row0, col0, BLOCK_N, CACHE_BLOCK, True, EVEN_D, True, TMA)
                m_i, l_i, acc_i = _tile_update(q, kt, v, m_i, l_i, acc_i, t, limit, scale, BLOCK_N, ROWS, UPCAST,
                                               True, LCOLS)
        m, l, acc = _fold(m, l, acc, m_i, l_i, acc_i, ROWS, not UPCAST, LCOLS)
    else:
        for t in range(0, n_tiles):
            m, l, acc, m_i, l_i, acc_i = _serial_step(q, kc_ptr, vc_ptr, bt_row, t, n_tiles, split_tiles, key_end,
                                                      kv_off, s_cb, s_cs, d, d_ok, limit, scale, m, l, acc, m_i, l_i,
                                                      acc_i, kn_row, vn_row, s_knt, s_vnt,
                                                      kd, vd, row0, col0, ROWS, BLOCK_N, CACHE_BLOCK,
                                                      UPCAST, True, False, LCOLS, EVEN_D, False, TMA)
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
                       kn_ptr, vn_ptr, qsl_ptr, s_knt, s_knh, s_vnt, s_vnh, kd, vd,
                       QPK: tl.constexpr, QPK_PAD: tl.constexpr, Q_TILE: tl.constexpr,
                       BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr,
                       WIDE: tl.constexpr, LCOLS: tl.constexpr, NEW: tl.constexpr, TMA: tl.constexpr):
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
    # (written so that no per-row token index stays live through the loops: one more live
    # vector per row costs the 64-row prefill program registers it spills; the offline sm_90
    # compile, python -m batch_invariance_kit.verify.sm90, reports each program's spill stack)
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
    # with TMA, the whole tiles of the step's keys are read through the descriptors kd / vd of
    # the (tokens, kv_heads * head_dim) matrices: key position p is row tok0 - pos0 + p, the kv
    # head's columns start at kvh * HEAD_DIM
    row0 = (tok0 - pos0).to(tl.int32)
    col0 = kvh * HEAD_DIM
    if SERIAL:
        m, l, acc = _row_state(q, kc_ptr, vc_ptr, bt_row, n_tiles, split_tiles, key_stop, kv_off, s_cb, s_cs, d,
                               d_ok, limit, scale, kn_row, vn_row, s_knt, s_vnt,
                               kd, vd, row0, col0, t_new, Q_TILE * QPK_PAD, D_PAD,
                               BLOCK_N, CACHE_BLOCK, UPCAST, WIDE, LCOLS, HEAD_DIM == D_PAD, NEW, TMA)
        o = acc / _l_row(l, LCOLS)[:, None]
        o_ptr = out_ptr + tok.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(o_ptr, from_f32(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        t_lo = split * split_tiles
        t_hi = tl.minimum(t_lo + split_tiles, n_tiles)
        m, l, acc = _split_state(q, kc_ptr, vc_ptr, bt_row, t_lo, t_hi, n_tiles, key_stop, kv_off, s_cb, s_cs, d,
                                 d_ok, limit, scale, kn_row, vn_row, s_knt, s_vnt,
                                 kd, vd, row0, col0, t_new, Q_TILE * QPK_PAD, D_PAD,
                                 BLOCK_N, CACHE_BLOCK, UPCAST, WIDE, LCOLS, HEAD_DIM == D_PAD, NEW, TMA)
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
