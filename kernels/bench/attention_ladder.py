"""What each invariance rule costs in attention, rule by rule: an ablation ladder.

One Triton kernel, :func:`_ladder_kernel`, computes causal prefill attention over the same
keys and values; compile-time switches add the kit's rules one at a time, from a plain
flash-attention forward to the kit's schedule:

====================  =====================================================================
rung                  what it adds
====================  =====================================================================
``flash``             a plain flash forward: K/V contiguous, a program holds ``BLOCK_M``
                      tokens of one q head, scores in the base-2 domain
                      (``exp2(s * scale * log2 e - m)``), ``tl.sum`` row sums
``paged``             K/V read through the block table of the paged cache (16-token blocks)
``grid``              the fixed tile grid: 64-key KV tiles on absolute positions, a program
                      holds ``q_tile`` tokens times the q heads of one kv head
``row-sum``           the row sum by the fixed pairwise tree (layout-free order)
``exp``               the arithmetic prefill shares with decode: ``exp(fma(s, scale, -m))``
``splits``            splits of 64-512 keys graded by position, folded in order into the
                      running state (two fp32 accumulators: the split's and the total)
====================  =====================================================================

The last rung's arithmetic is the kit's (the ladder checks its output bitwise against
:func:`batch_invariance_kit.ops.attention.launch`), and the shipping kernel is timed beside it.
Every rung is timed at the prefill cells of the attention benchmark against cuDNN SDPA in the
same run (CUDA-graph replays), with its registers and spills from the compiled kernel.  The
same switches build the candidates a faster schedule could use (a row sum on the tensor cores,
the running total in an L2-resident scratch instead of registers), each checked for the bits it
must keep.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import triton
import triton.language as tl

from ..ops import attention as A
from ..ops.attention.kernels import _fold, _row_sum
from .timing import median_us_graph_or_plain
from ..verify.harness import bitwise_equal

HQ, HKV, D, BS = 32, 8, 128, 16
LOG2E = 1.4426950408889634


@triton.jit
def _ladder_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                   EDGE: tl.constexpr, TREE: tl.constexpr, FUSED_EXP: tl.constexpr, DOT_SUM: tl.constexpr,
                   EXP2: tl.constexpr):
    s = tl.dot(q, kt)
    if EDGE:
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        vis = keys[None, :] < limit[:, None]
    if FUSED_EXP:  # the kit's: exp(fma(s, scale, -m)), as decode computes it
        x = s * scale
        if EDGE:
            x = tl.where(vis, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2:  # base 2: ``scale`` holds scale * log2(e), and m is in base-2 units
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(tl.fma(s, scale, -m_use[:, None]))
        else:
            alpha = tl.exp(m - m_use)
            p = tl.exp(tl.fma(s, scale, -m_use[:, None]))
        if EDGE:
            p = tl.where(vis, p, 0.0)
    else:  # base 2: scale * log2(e) folded into one multiply (``scale`` holds it)
        x = s * scale
        if EDGE:
            x = tl.where(vis, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(x - m_new[:, None])
    pb = p.to(v.dtype)
    if DOT_SUM:  # the row sum on the tensor cores: every column of p @ ones is the row's sum
        rs = tl.max(tl.dot(pb, tl.full((BLOCK_N, 16), 1.0, v.dtype)), 1)
    elif TREE:
        rs = _row_sum(p, ROWS, BLOCK_N)
    else:
        rs = tl.sum(p, 1)
    l = l * alpha + rs
    acc = acc * alpha[:, None] + tl.dot(pb, v)
    return m_new, l, acc


@triton.jit
def _ladder_fold(m, l, acc, m_i, l_i, acc_i, ROWS: tl.constexpr, EXP2: tl.constexpr):
    """The kit's fold (:func:`~batch_invariance_kit.ops.attention.kernels._fold`), in base 2 when ``EXP2``."""
    if EXP2:
        m_new = tl.maximum(m, m_i)
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_i - m_new)
        return m_new, tl.fma(l, a, l_i * b), tl.fma(acc, a[:, None], acc_i * b[:, None])
    else:
        return _fold(m, l, acc, m_i, l_i, acc_i, ROWS, False)


@triton.jit
def _ladder_kv(k_ptr, v_ptr, bt_row, t, seq_off, kv_off, s_kb, s_ks, d, blk, BLOCK_N: tl.constexpr,
               CACHE_BLOCK: tl.constexpr, PAGED: tl.constexpr, BT: tl.constexpr):
    """K (as ``(D, BLOCK_N)``) and V of tile ``t``.  ``BT``: how the block table is read: 0 one
    entry per key (the kit's), 1 one entry per cache block then broadcast, 2 the entries ``blk``
    given (read one tile ahead by the caller)."""
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    if PAGED:
        if BT == 1:
            nb: tl.constexpr = BLOCK_N // CACHE_BLOCK
            b4 = tl.load(bt_row + t * nb + tl.arange(0, nb)).to(tl.int64)
            base = tl.reshape(b4[:, None] * s_kb + tl.arange(0, CACHE_BLOCK)[None, :] * s_ks, (BLOCK_N,)) + kv_off
        else:
            if BT == 0:
                blk = tl.load(bt_row + keys // CACHE_BLOCK)
            base = blk.to(tl.int64) * s_kb + (keys % CACHE_BLOCK) * s_ks + kv_off
    else:
        base = seq_off + keys.to(tl.int64) * s_ks + kv_off
    kt = tl.load(k_ptr + base[None, :] + d[:, None])
    v = tl.load(v_ptr + base[:, None] + d[None, :])
    return kt, v


@triton.jit
def _ladder_tile(k_ptr, v_ptr, bt_row, q, m, l, acc, t, n_tiles, blk, limit, scale, seq_off, kv_off, s_kb, s_ks, d,
                 BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, ROWS: tl.constexpr, PAGED: tl.constexpr,
                 BT: tl.constexpr, EDGE: tl.constexpr, TREE: tl.constexpr, FUSED_EXP: tl.constexpr,
                 DOT_SUM: tl.constexpr, EXP2: tl.constexpr):
    """Tile ``t``'s online-softmax step; with ``BT == 2`` the block-table entries of tile ``t + 1``
    are read here (returned for the next step) and tile ``t``'s come in ``blk``."""
    nxt = blk
    if BT == 2:
        keys = (t + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nxt = tl.load(bt_row + keys // CACHE_BLOCK, mask=keys < n_tiles * BLOCK_N, other=0)
    kt, v = _ladder_kv(k_ptr, v_ptr, bt_row, t, seq_off, kv_off, s_kb, s_ks, d, blk, BLOCK_N, CACHE_BLOCK, PAGED, BT)
    m, l, acc = _ladder_update(q, kt, v, m, l, acc, t, limit, scale, BLOCK_N, ROWS, EDGE, TREE, FUSED_EXP, DOT_SUM,
                               EXP2)
    return m, l, acc, nxt


@triton.jit
def _ladder_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, tile_seq_ptr, tile_tok_ptr, tile_pos_ptr, tile_split_ptr, scratch_ptr,
                   out_ptr, scale, s_qt, s_qh, s_kb, s_ks, s_kh, s_bts, s_ot, s_oh,
                   QPK: tl.constexpr, Q_TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PACK: tl.constexpr,
                   TREE: tl.constexpr, FUSED_EXP: tl.constexpr, SPLITS: tl.constexpr, SCRATCH: tl.constexpr,
                   DOT_SUM: tl.constexpr, EXP2: tl.constexpr, BT: tl.constexpr):
    """Program (query tile, kv head when ``PACK`` else q head): causal attention of the tile's
    rows (every tile full; a sequence's tokens are its positions ``0 ..``)."""
    tile = tl.program_id(0)
    hp = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    rows = tl.arange(0, ROWS)  # Q_TILE * QPK when PACK, else Q_TILE
    if PACK:
        tok = tok0 + rows // QPK
        head = hp * QPK + rows % QPK
        kvh = hp
    else:
        tok = tok0 + rows
        head = rows * 0 + hp
        kvh = hp // QPK
    pos = pos0 + (tok - tok0)
    limit = pos + 1
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :])
    bt_row = bt_ptr + seq.to(tl.int64) * s_bts
    seq_off = seq.to(tl.int64) * s_kb
    kv_off = kvh * s_kh
    n_full = pos0 // BLOCK_N  # tiles every row of the program sees whole
    n_tiles = (pos0 + Q_TILE - 1) // BLOCK_N + 1
    blk = tl.arange(0, BLOCK_N) * 0
    if BT == 2:
        blk = tl.load(bt_row + tl.arange(0, BLOCK_N) // CACHE_BLOCK)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    if SPLITS:
        split_tiles = tl.load(tile_split_ptr + tile) // BLOCK_N
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        acc_i = tl.zeros((ROWS, HEAD_DIM), tl.float32)
        ws = scratch_ptr + ((tile * tl.num_programs(1) + hp).to(tl.int64) * ROWS * HEAD_DIM
                            + rows[:, None] * HEAD_DIM + d[None, :])
        folds = 0
        for t in range(0, n_tiles - 1):
            m_i, l_i, acc_i, blk = _ladder_tile(k_ptr, v_ptr, bt_row, q, m_i, l_i, acc_i, t, n_tiles, blk, limit, scale,
                                                seq_off, kv_off, s_kb, s_ks, d, BLOCK_N, CACHE_BLOCK, ROWS, PAGED, BT,
                                                False, TREE, FUSED_EXP, DOT_SUM, EXP2)
            if (t + 1) % split_tiles == 0:
                if SCRATCH:
                    prev = tl.load(ws, mask=(rows[:, None] * 0 + folds) > 0, other=0.0)
                    m, l, tot = _ladder_fold(m, l, prev, m_i, l_i, acc_i, ROWS, EXP2)
                    tl.store(ws, tot)
                else:
                    m, l, acc = _ladder_fold(m, l, acc, m_i, l_i, acc_i, ROWS, EXP2)
                folds += 1
                m_i = tl.full((ROWS,), float("-inf"), tl.float32)
                l_i = tl.zeros_like(l_i)
                acc_i = tl.zeros_like(acc_i)
        for t in range(n_tiles - 1, n_tiles):
            m_i, l_i, acc_i, blk = _ladder_tile(k_ptr, v_ptr, bt_row, q, m_i, l_i, acc_i, t, n_tiles, blk, limit, scale,
                                                seq_off, kv_off, s_kb, s_ks, d, BLOCK_N, CACHE_BLOCK, ROWS, PAGED, BT,
                                                True, TREE, FUSED_EXP, DOT_SUM, EXP2)
        if SCRATCH:
            acc = tl.load(ws, mask=(rows[:, None] * 0 + folds) > 0, other=0.0)
        m, l, acc = _ladder_fold(m, l, acc, m_i, l_i, acc_i, ROWS, EXP2)
    else:
        for t in range(0, n_full):
            m, l, acc, blk = _ladder_tile(k_ptr, v_ptr, bt_row, q, m, l, acc, t, n_tiles, blk, limit, scale, seq_off,
                                          kv_off, s_kb, s_ks, d, BLOCK_N, CACHE_BLOCK, ROWS, PAGED, BT, False, TREE,
                                          FUSED_EXP, DOT_SUM, EXP2)
        for t in range(n_full, n_tiles):
            m, l, acc, blk = _ladder_tile(k_ptr, v_ptr, bt_row, q, m, l, acc, t, n_tiles, blk, limit, scale, seq_off,
                                          kv_off, s_kb, s_ks, d, BLOCK_N, CACHE_BLOCK, ROWS, PAGED, BT, True, TREE,
                                          FUSED_EXP, DOT_SUM, EXP2)
    o = acc / l[:, None]
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty))


#: The rungs, in order: (name, switches); each adds one rule to the one before.  The last one
#: is the kit's compiled arithmetic and schedule.
RUNGS = [
    ("flash", dict(PAGED=False, PACK=False)),
    ("paged", dict(PAGED=True, PACK=False)),
    ("grid", dict(PAGED=True, PACK=True)),
    ("row-sum", dict(PAGED=True, PACK=True, DOT_SUM=True)),
    ("exp", dict(PAGED=True, PACK=True, DOT_SUM=True, FUSED_EXP=True, EXP2=True)),
    ("splits", dict(PAGED=True, PACK=True, DOT_SUM=True, FUSED_EXP=True, EXP2=True, SPLITS=True)),
]

#: Candidate schedules beside the ladder: (name, switches, bits): ``bits`` "kit" = must equal
#: the kit's output bitwise (the same arithmetic, another load or register schedule); "own" =
#: another arithmetic that prefill and decode would share (a function of the position only).
_KIT = dict(RUNGS[-1][1])
_TREE = dict(PAGED=True, PACK=True, TREE=True, FUSED_EXP=True, SPLITS=True)  # pairwise-tree row sum, base e
CANDIDATES = [
    ("splits+bt-block", dict(_KIT, BT=1), "kit"),
    ("splits+bt-ahead", dict(_KIT, BT=2), "kit"),
    ("splits+scratch", dict(_KIT, SCRATCH=True), "kit"),
    ("tree+exp", dict(_TREE, SPLITS=False), "own"),
    ("tree+exp+splits", _TREE, "own"),
    ("tree+exp+splits+scratch", dict(_TREE, SCRATCH=True), "own"),
    ("tree+exp2+splits", dict(_TREE, EXP2=True), "own"),
    ("dot-sum+exp+splits", dict(_TREE, TREE=False, DOT_SUM=True), "own"),
    ("paged+bt-block", dict(PAGED=True, BT=1), "own"),
    ("paged+bt-ahead", dict(PAGED=True, BT=2), "own"),
]

#: Launch shapes tried for each rung: (tokens per program or tile rows, block_n, warps, stages).
#: A packed program holds ``q_tile`` tokens times 4 q heads; an unpacked one ``block_m`` tokens.
SHAPES = {
    False: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3)],
    True: [(16, 64, 4, 2), (16, 64, 4, 3), (32, 64, 8, 2), (16, 128, 4, 2), (32, 128, 8, 2)],
}


def _tiles(seqs: int, n: int, q_tile: int, reverse: bool, device) -> list:
    """Per-tile sequence, first token, first position and split size (the kit's, of the tile's
    last row) of ``seqs`` prompts of ``n`` tokens cut into ``q_tile``-token tiles, on the GPU
    (longest tiles first when ``reverse``)."""
    per = n // q_tile
    seq = np.repeat(np.arange(seqs), per)
    pos = np.tile(np.arange(per) * q_tile, seqs)
    tok = seq * n + pos
    split = np.array([A.split_size_at(int(p) + q_tile - 1) for p in pos])
    order = np.argsort(-pos, kind="stable") if reverse else np.arange(len(pos))
    return [torch.tensor(a[order], dtype=torch.int32, device=device) for a in (seq, tok, pos, split)]


def make_launch(switches: dict, shape: tuple, cell: dict, out: torch.Tensor, *, reverse: bool = False):
    """A zero-argument launch of :func:`_ladder_kernel` over ``cell`` (:func:`make_cell`) with
    everything prepared (so that it can be captured in a CUDA graph); it returns the compiled
    kernel."""
    sw = dict(PAGED=False, PACK=False, TREE=False, FUSED_EXP=False, SPLITS=False, SCRATCH=False, DOT_SUM=False,
              EXP2=False, BT=0)
    sw.update(switches)
    q_tile, block_n, warps, stages = shape
    qpk = HQ // HKV
    seq, tok, pos, split = _tiles(cell["seqs"], cell["n"], q_tile, reverse, cell["q"].device)
    scale = D ** -0.5 * (LOG2E if sw["EXP2"] or not sw["FUSED_EXP"] else 1.0)
    q, bt = cell["q"], cell["bt"]
    k, v = (cell["kc"], cell["vc"]) if sw["PAGED"] else (cell["k"], cell["v"])
    rows = q_tile * (qpk if sw["PACK"] else 1)
    grid = (len(seq), HKV if sw["PACK"] else HQ)
    scratch = torch.empty(grid[0] * grid[1] * rows * D if sw["SCRATCH"] else 1, dtype=torch.float32, device=q.device)

    def run():
        return _ladder_kernel[grid](q, k, v, bt, seq, tok, pos, split, scratch, out, scale, q.stride(0), q.stride(1),
                                    k.stride(0), k.stride(1), k.stride(2), bt.stride(0), out.stride(0), out.stride(1),
                                    QPK=qpk, Q_TILE=q_tile, ROWS=rows, BLOCK_N=block_n, CACHE_BLOCK=BS, HEAD_DIM=D,
                                    num_warps=warps, num_stages=stages, **sw)
    return run


def make_cell(seqs: int, n: int, dtype=torch.bfloat16, device="cuda") -> dict:
    """A prefill cell: ``seqs`` prompts of ``n`` tokens, K/V both contiguous ``(seqs, n, HKV,
    D)`` and in a shuffled paged cache (the kit's :class:`~batch_invariance_kit.ops.attention.PagedCache`)."""
    gen = torch.Generator(device=device).manual_seed(n * seqs)
    q = torch.randn((seqs * n, HQ, D), generator=gen, device=device).to(dtype)
    k = torch.randn((seqs, n, HKV, D), generator=gen, device=device).to(dtype)
    v = torch.randn((seqs, n, HKV, D), generator=gen, device=device).to(dtype)
    c = A.PagedCache(seqs * n // BS + 64, BS, HKV, D, dtype, device=device, seed=n)
    for i in range(seqs):
        c.write(i, k[i], v[i], 0)
    _, bt, lens, qsl = c.args([(i, q[i * n:(i + 1) * n], n) for i in range(seqs)])
    return {"seqs": seqs, "n": n, "q": q, "k": k, "v": v, "kc": c.k, "vc": c.v, "bt": bt, "cache": c,
            "lens": lens, "qsl": qsl}


def _causal_flops(seqs: int, n: int) -> float:
    return 4.0 * seqs * n * (n + 1) / 2 * HQ * D


def _compiled_stats(kernel) -> dict:
    """Registers, spilled bytes and shared memory of a compiled kernel (what the GPU's compile reports)."""
    out = {}
    for name in ("n_regs", "n_spills"):
        v = getattr(kernel, name, None)
        if v is not None:
            out[name] = int(v)
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    if shared is not None:
        out["shared"] = int(shared)
    return out


def ladder(quick: bool, cells=None, rungs=None, candidates=None, shapes=None, reverses=(False,)) -> tuple:
    """Every rung of :data:`RUNGS` and every candidate of :data:`CANDIDATES` at every launch
    shape of :data:`SHAPES`, at the prefill cells (``quick``: 1k and 4k), beside cuDNN SDPA and
    the kit's shipping kernel in the same run.  Checks: every rung computes attention (within
    bf16 tolerance of SDPA), the last rung and the "kit" candidates give the kit's bits."""
    F = torch.nn.functional
    cells = cells or (((1, 1024), (1, 4096)) if quick else ((1, 1024), (1, 4096), (1, 16384), (8, 2048)))
    rungs = RUNGS if rungs is None else rungs
    candidates = CANDIDATES if candidates is None else candidates
    shapes = SHAPES if shapes is None else shapes
    rows, checks = [], []
    cfg = A.default_config()
    for seqs, n in cells:
        cell = make_cell(seqs, n)
        q = cell["q"]
        out = torch.empty_like(q)
        name = f"prefill {seqs}x{n}"
        flops = _causal_flops(seqs, n)
        base = {"op": "attention_prefill", "cell": name, "seqs": seqs, "prompt": n, "dtype": "bfloat16"}
        q4 = q.view(seqs, n, HQ, D).transpose(1, 2)
        k4, v4 = cell["k"].transpose(1, 2), cell["v"].transpose(1, 2)
        torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default; importing vLLM switches it off
        sd = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=D ** -0.5, enable_gqa=True)
        ref = sd().transpose(1, 2).reshape(seqs * n, HQ, D).clone()
        t, g = median_us_graph_or_plain(sd, warmup=3, reps=30, budget_s=0.6)
        rows.append({**base, "impl": "sdpa", "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), **t,
                     "cuda_graph": g, "tflops": flops / t["median_us"] * 1e-6})
        sdpa_us = t["median_us"]
        plan = A.make_plan([n] * seqs, [i * n for i in range(seqs + 1)], q_heads=HQ, kv_heads=HKV, head_dim=D,
                           config=cfg, device=q.device)
        kit_out = torch.empty_like(q)
        kit = lambda: A.launch(plan, q, cell["kc"], cell["vc"], cell["bt"], D ** -0.5, kit_out)
        kit()
        kit_bits = kit_out.clone()
        t, g = median_us_graph_or_plain(kit, warmup=3, reps=30, budget_s=0.6)
        rows.append({**base, "impl": "kit-invariant", **t, "cuda_graph": g, "tflops": flops / t["median_us"] * 1e-6,
                     "speed_ratio_vs_sdpa": sdpa_us / t["median_us"]})
        print(f"  {name}: sdpa {sdpa_us:.1f}us kit {t['median_us']:.1f}us ({sdpa_us / t['median_us']:.2f})",
              flush=True)
        kn, vn = cell["k"].view(seqs * n, HKV, D), cell["v"].view(seqs * n, HKV, D)
        kit_kv = lambda: A.launch(plan, q, cell["kc"], cell["vc"], cell["bt"], D ** -0.5, kit_out,  # noqa: E731
                                  key=kn, value=vn, query_start_loc=cell["qsl"])
        t, g = median_us_graph_or_plain(kit_kv, warmup=3, reps=30, budget_s=0.6)
        rows.append({**base, "impl": "kit-invariant-step-kv", **t, "cuda_graph": g,
                     "tflops": flops / t["median_us"] * 1e-6, "speed_ratio_vs_sdpa": sdpa_us / t["median_us"],
                     "bitwise_equal_to_kit": bitwise_equal(kit_out, kit_bits)})
        print(f"  {name}: kit with the step's keys and values {t['median_us']:.1f}us ({sdpa_us / t['median_us']:.2f}) "
              f"kit-bits {rows[-1]['bitwise_equal_to_kit']}", flush=True)
        entries = [(r, sw, "ladder", None) for r, sw in rungs] + [(c, sw, "candidate", b) for c, sw, b in candidates]
        for label, sw, kind, want in entries:
            for shape in shapes[bool(sw.get("PACK"))]:
                if kind == "ladder" and sw.get("PACK") and shape[1] != cfg.block_n:
                    continue  # the ladder's packed rungs keep the kit's 64-key tiles
                for reverse in reverses:
                    out.fill_(float("nan"))
                    try:
                        run = make_launch(sw, shape, cell, out, reverse=reverse)
                        kernel = run()
                        torch.cuda.synchronize()
                        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                        same = bitwise_equal(out, kit_bits)
                        t, g = median_us_graph_or_plain(run, warmup=3, reps=30, budget_s=0.6)
                    except Exception as e:  # a shape that does not compile or fit: recorded
                        rows.append({**base, "impl": label, "kind": kind, "shape": list(shape), "reverse": reverse,
                                     "error": repr(e)[:300]})
                        print(f"    {label} {shape} failed: {e!r:.200}", flush=True)
                        continue
                    rows.append({**base, "impl": label, "kind": kind, "switches": sw, "shape": list(shape),
                                 "q_tile_or_block_m": shape[0], "block_n": shape[1], "num_warps": shape[2],
                                 "num_stages": shape[3], "reverse": reverse, **_compiled_stats(kernel), **t,
                                 "cuda_graph": g, "tflops": flops / t["median_us"] * 1e-6,
                                 "speed_ratio_vs_sdpa": sdpa_us / t["median_us"], "rel_err_vs_sdpa": err,
                                 "bitwise_equal_to_kit": same, "must_equal_kit": want == "kit" or label == "splits"})
                    r = rows[-1]
                    print(f"    {label:<24} {str(shape):<16} rev={int(reverse)} {t['median_us']:9.1f}us "
                          f"{sdpa_us / t['median_us']:.2f}x  regs {r.get('n_regs')} spill {r.get('n_spills')} "
                          f"err {err:.1e} kit-bits {same}", flush=True)
        del cell, q4, k4, v4, ref
        torch.cuda.empty_cache()
    checks += ladder_checks(rows, cfg.block_n)
    return rows, checks


def ladder_checks(rows: list, block_n: int) -> list:
    """The ladder's checks over ``rows``: every rung and candidate computes causal attention
    (relative error vs SDPA under 1e-2); the last rung and the same-bits candidates give the
    kit's bits wherever they use the kit's ``block_n``."""
    ok = [r for r in rows if "rel_err_vs_sdpa" in r]
    must = [r for r in ok if r["must_equal_kit"] and r["block_n"] == block_n]
    step = [r for r in rows if r["impl"] == "kit-invariant-step-kv"]
    checks = [{"name": "the kit with the step's own keys and values gives the kit's bits",
               "passed": bool(step) and all(r["bitwise_equal_to_kit"] for r in step)}]
    if any(r.get("kind") in ("ladder", "candidate") for r in rows):  # a run of the kit's rows alone has none
        checks += [{"name": "every rung and candidate computes causal attention (relative error vs SDPA < 1e-2)",
                    "passed": bool(ok) and all(r["rel_err_vs_sdpa"] < 1e-2 for r in ok)}]
    if any(r.get("kind") == "ladder" for r in rows):
        checks += [{"name": "the last rung and the same-bits candidates give the kit's bits (64-key tiles)",
                    "passed": bool(must) and all(r["bitwise_equal_to_kit"] for r in must),
                    "failing": [(r["cell"], r["impl"], r["shape"]) for r in must if not r["bitwise_equal_to_kit"]]}]
    return checks


def main(argv=None) -> int:
    """``python -m batch_invariance_kit.bench.attention_ladder --out DIR [--quick]``: the ladder,
    saved as ``attention_ladder.json`` (provenance, rows, checks) after every cell."""
    import argparse
    from ..report import results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the result file")
    p.add_argument("--quick", action="store_true", help="the 1k and 4k cells only")
    p.add_argument("--candidates", default=None, help="comma-separated candidate names (default: all)")
    p.add_argument("--no-rungs", action="store_true", help="time the candidates only")
    args = p.parse_args(argv)
    cands = CANDIDATES if args.candidates is None else [c for c in CANDIDATES if c[0] in args.candidates.split(",")]
    cells = ((1, 1024), (1, 4096)) if args.quick else ((1, 1024), (1, 4096), (1, 16384), (8, 2048))
    rows, checks = [], []
    for c in cells:
        rows += ladder(args.quick, cells=(c,), rungs=[] if args.no_rungs else None, candidates=cands)[0]
        checks = ladder_checks(rows, A.default_config().block_n)
        results.save("attention_ladder", rows, checks, folder=args.out)
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
