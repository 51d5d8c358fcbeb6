"""Attention steps as a serving engine issues them: a multi-token step may start at any position
(chunked prefill cut anywhere, prefix-cache hits on 16-token blocks, speculative verify steps)
and a token's bits stay those of one-chunk prefill and of decoding it alone; the variant is
still caught.  The plan of a step is built once from host metadata and reused by every layer;
a fixed-size (padded) plan for CUDA graphs gives the same bits.

Query tiles sit on the absolute grid of ``q_tile`` (which divides ``block_n``), so every tile
lies inside one KV tile; the planner tests check that property directly.
"""
import random

import numpy as np
import pytest
import torch

from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops.attention.testing import (BLOCK_SIZE as BS, HEAD_DIM as D, KV_HEADS as HKV,
                                                        Q_HEADS as HQ, Cache, seq_data)
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bitwise_equal

from test_attention import BN, CFG, DEV, LENS, SPLIT


def _cuts(n, seed, k):
    """``k`` chunk boundaries in 1..n-1 drawn with a seeded generator (no multiple of anything)."""
    rng = random.Random(seed)
    return [0] + sorted(rng.sample(range(1, n), k)) + [n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_random_chunk_boundaries_equal_one_chunk(dtype):
    """A prompt prefilled in chunks cut at random positions (each chunk beside a decode step of
    another sequence) == the prompt prefilled in one chunk, bitwise."""
    n = 2 * SPLIT + BN + 11
    q, k, v = seq_data(21, 0, n, dtype)
    one = Cache(dtype, seed=11)
    one.write("s", k, v, 0)
    ref = one.run([("s", q, n)])[0]
    cuts = _cuts(n, 5, 4)
    assert any(c % 2 for c in cuts[1:-1]), cuts  # starts that are not tile, split or block edges
    c = Cache(dtype, seed=12)
    qo, ko, vo = seq_data(21, 1, SPLIT + 5, dtype)
    c.write("o", ko, vo, 0)
    got = []
    for a, b in zip(cuts, cuts[1:]):
        c.write("s", k[a:b], v[a:b], a)
        got.append(c.run([("o", qo[-1:], SPLIT + 5), ("s", q[a:b], b)])[1])
    assert bitwise_equal(torch.cat(got), ref), cuts


def test_prefix_hit_on_cache_blocks_equals_recompute():
    """Sequence B shares A's first P keys, P a multiple of the cache block (16) but not of
    ``block_n``: B's own tokens computed over the shared blocks == B prefilled from scratch."""
    dtype = torch.float16
    for p_len in (3 * BS, SPLIT + BS):
        assert p_len % BN
        own = BN + 7
        qa, ka, va = seq_data(23, 0, p_len + 9, dtype)
        qb, kb, vb = seq_data(23, 1, p_len + own, dtype)
        kb[:p_len], vb[:p_len], qb[:p_len] = ka[:p_len], va[:p_len], qa[:p_len]
        c = Cache(dtype, seed=13)
        c.write("a", ka, va, 0)
        c.table("b", p_len + own, shared=c.tables["a"][:p_len // BS])
        c.write("b", kb[p_len:], vb[p_len:], p_len)
        cached = c.run([("b", qb[p_len:], p_len + own)])[0]
        fresh = Cache(dtype, seed=14)
        fresh.write("b", kb, vb, 0)
        assert bitwise_equal(cached, fresh.run([("b", qb, p_len + own)])[0][p_len:]), p_len


def test_token_at_a_time_and_verify_steps_equal_one_chunk():
    """Positions decoded one step at a time, and speculative-style verify steps of 2-4 tokens
    starting wherever decoding stands (across a KV tile and a split edge), give the bits of
    one-chunk prefill."""
    dtype = torch.bfloat16
    n = SPLIT + 9
    q, k, v = seq_data(25, 0, n, dtype)
    one = Cache(dtype, seed=15)
    one.write("s", k, v, 0)
    ref = one.run([("s", q, n)])[0]
    c = Cache(dtype, seed=16)
    start = BN - 5
    c.write("s", k[:start], v[:start], 0)
    c.run([("s", q[:start], start)])
    got, p, sizes = [], start, [1, 3, 1, 1, 4, 2]
    while p < n:
        b = min(n, p + sizes[len(got) % len(sizes)])
        c.write("s", k[p:b], v[p:b], p)
        got.append(c.run([("s", q[p:b], b)])[0])
        p = b
    assert bitwise_equal(torch.cat(got), ref[start:])


def test_variant_still_caught_at_any_start():
    """A 3-token step starting at an odd position of a long context: the invariant kernel gives
    the same bits alone and beside seven decode steps, the split-KV variant does not."""
    dtype = torch.float32
    n = LENS[0]
    q, k, v = seq_data(27, 0, n, dtype)
    c = Cache(dtype, seed=17)
    c.write("s", k, v, 0)
    others = []
    for r in range(1, 8):
        qr, kr, vr = seq_data(27, r, LENS[r], dtype)
        c.write(r, kr, vr, 0)
        others.append((r, qr[-1:], LENS[r]))
    step = ("s", q[n - 3:], n)
    assert (n - 3) % 2
    for impl, same in (("invariant", True), ("variant", False)):
        alone = c.run([step], impl=impl)[0]
        batched = c.run(others + [step], impl=impl)[-1]
        assert bitwise_equal(alone, batched) is same, impl


def test_plan_tiles_cover_every_token_once_inside_one_kv_tile():
    """For random steps (chunks of 0..70 tokens at random starts, one-token steps), the plan's
    tiles cover each token exactly once, each tile lies inside one KV tile, and a tile's split
    size is the position's own (the invariant) for every row."""
    rng = random.Random(3)
    for trial in range(40):
        lens, qls = [], []
        for _ in range(rng.randint(1, 6)):
            ql = rng.choice([0, 1, 1, rng.randint(2, 70)])
            lens.append(ql + rng.randint(0, 200))
            qls.append(ql)
        qsl = [0]
        for ql in qls:
            qsl.append(qsl[-1] + ql)
        plan = A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, device=DEV)
        seen = []
        for g in (plan.tiles, plan.decode):
            for s, t0, rows, p0, sp in zip(*(x.tolist() for x in g[1:6])):
                assert 1 <= rows <= g.q_tile
                assert p0 // CFG.block_n == (p0 + rows - 1) // CFG.block_n, (p0, rows)
                assert all(sp == A.split_size_at(p, CFG) for p in range(p0, p0 + rows))
                assert p0 == lens[s] - (qsl[s + 1] - qsl[s]) + (t0 - qsl[s])
                seen += range(t0, t0 + rows)
        assert sorted(seen) == list(range(qsl[-1])), (trial, lens, qsl)


def _layers_steps(dtype):
    """Two "layers" (their own caches and queries) of one mixed step: decode rows, a chunk
    starting at an odd position, and a zero-token (padding) sequence."""
    layers = []
    for layer in range(2):
        c = Cache(dtype, seed=30 + layer)
        steps = []
        for r, n in enumerate(LENS[:5]):
            q, k, v = seq_data(40 + layer, r, n, dtype)
            c.write(r, k, v, 0)
            steps.append((r, q[-1:], n))
        q, k, v = seq_data(40 + layer, 9, 2 * BN + 3, dtype)
        c.write("p", k, v, 0)
        steps.append(("p", q[BN - 7:], 2 * BN + 3))
        layers.append((c, steps))
    return layers


def _args(c, steps):
    """The step's tensors (:meth:`PagedCache.args`) and its host ``seq_lens`` and ``query_start_loc``."""
    q, bt, lens, qsl = c.args(steps)
    return q, bt, lens, qsl, lens.tolist(), qsl.tolist()


def test_one_plan_per_step_shared_by_layers():
    """The plan is built once from host lists and reused by every layer: the same bits as each
    layer planning for itself; a sequence of zero new tokens takes no work; a plan for another
    step shape is refused."""
    dtype = torch.bfloat16
    layers = _layers_steps(dtype)
    c0, steps0 = layers[0]
    q, bt, lens_t, qsl_t, lens, qsl = _args(c0, steps0)
    # a padding sequence (0 new tokens, 0 context) at the end of the batch
    lens_p, qsl_p = lens + [0], qsl + [qsl[-1]]
    plan = A.make_plan(torch.tensor(lens_p), torch.tensor(qsl_p), q_heads=HQ, kv_heads=HKV, head_dim=D, device=DEV)
    for c, steps in layers:
        q, bt, lens_t, qsl_t, _, _ = _args(c, steps)
        want = A.attention(q, c.k, c.v, bt, lens_t, qsl_t)
        bt_p = torch.cat([bt, torch.zeros_like(bt[:1])])
        i32 = dict(dtype=torch.int32, device=DEV)
        got = A.attention(q, c.k, c.v, bt_p, torch.tensor(lens_p, **i32), torch.tensor(qsl_p, **i32), plan=plan)
        assert bitwise_equal(got, want)
    with pytest.raises(ValueError, match="plan was built for"):
        A.attention(q[:-1], c.k, c.v, bt_p, torch.tensor(lens_p, **i32), torch.tensor(qsl_p, **i32), plan=plan)
    with pytest.raises(ValueError, match="query_start_loc must not decrease"):
        A.make_plan([5, 5], [0, 3, 2], q_heads=HQ, kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match="decode_capacity"):
        A.make_plan([5, 5], [0, 1, 2], q_heads=HQ, kv_heads=HKV, head_dim=D, decode_capacity=1)


@pytest.mark.parametrize("serial", [False, True], ids=["parallel", "serial"])
def test_fixed_size_decode_plan_for_cuda_graphs(serial):
    """A decode plan padded to ``decode_capacity`` tiles with a workspace for ``max_seq_len``:
    the same bits as the exact plan, nothing written for the padding (guarded output).  Viewed
    over one persistent buffer laid out by :class:`PlanLayout` (16-byte aligned, as on a GPU),
    the host plan of another decode step written into that buffer replays that step with the
    same plan object (the same tensors and pointers: what a CUDA graph records)."""
    dtype = torch.float32
    cfg = CFG.__class__(**{**CFG.as_dict(), "serial_programs": 1 if serial else None})
    c = Cache(dtype, seed=50)
    steps_a, steps_b = [], []
    for r, n in enumerate(LENS[:5]):
        q, k, v = seq_data(51, r, n + 3, dtype)
        c.write(r, k, v, 0)
        steps_a.append((r, q[n - 1:n], n))
        steps_b.append((r, q[n + 2:n + 3], n + 3))
    kw = dict(q_heads=HQ, kv_heads=HKV, head_dim=D, config=cfg, device="cpu")  # host plans, as an engine builds them
    padded = None
    for steps in (steps_a, steps_b):
        q, bt, lens_t, qsl_t, lens, qsl = _args(c, steps)
        want = A.attention(q, c.k, c.v, bt, lens_t, qsl_t, config=cfg)
        plan = A.make_plan(lens, qsl, decode_capacity=8, max_seq_len=4 * SPLIT, **kw)
        assert plan.decode.seq.numel() == 8 and plan.decode.serial is serial
        if padded is None:
            layout = A.PlanLayout.of(plan)
            assert all(at % layout.ALIGN == 0 for at in layout.offsets)
            host = np.zeros(layout.size, dtype=np.int32)
            buf = torch.zeros(layout.size, dtype=torch.int32, device=DEV)
            padded = layout.over(buf, plan, acc=plan.merge.acc.to(DEV), ml=plan.merge.ml.to(DEV))
            pointers = [t.data_ptr() for t in padded.tensors()]
        layout.write(host, plan)
        buf.copy_(torch.from_numpy(host))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(padded.tensors(), plan.tensors()))
        g = Guarded(tuple(q.shape), dtype, DEV)
        A.launch(padded, q, c.k, c.v, bt, D ** -0.5, g.tensor)
        g.check()
        assert g.unwritten() == 0
        assert bitwise_equal(g.tensor, want)
    assert [t.data_ptr() for t in padded.tensors()] == pointers
    with pytest.raises(ValueError, match="this layout holds"):  # an unpadded plan: 5 decode tiles, not 8
        layout.write(host, A.make_plan(lens, qsl, **kw))


@pytest.mark.parametrize("align", [False, True], ids=["end-to-end", "aligned"])
def test_plan_layout_packs_and_views_one_buffer(align):
    """The plan's one layout: the buffer the planner packs from host arrays (:meth:`PlanLayout.pack`)
    is the buffer a plan is written into (:meth:`PlanLayout.write`), and its views
    (:meth:`PlanLayout.over`) are the plan's index tensors, in :attr:`PlanLayout.FIELDS` order;
    aligned, every tensor starts on a 16-byte boundary.  A mixed step (decode rows, a chunk,
    a padding entry) fills every group."""
    lens, qsl = [*LENS[:4], 2 * BN + 3, 0], [0, 1, 2, 3, 4, 4 + BN + 6, 4 + BN + 6]
    plan = A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D,
                       config=CFG.__class__(**{**CFG.as_dict(), "serial_programs": None}), device="cpu")
    tensors = plan.tensors()
    assert [t.numel() > 0 for t in tensors] == [True] * len(A.PlanLayout.FIELDS)
    assert all(t is getattr(getattr(plan, g), f) for t, (g, f) in zip(tensors, A.PlanLayout.FIELDS))
    layout = A.PlanLayout.of(plan, align=align)
    packed = layout.pack([t.numpy() for t in tensors])
    written = np.full(layout.size, 7, dtype=np.int32)
    layout.write(written, plan)
    gaps = np.ones(layout.size, dtype=bool)
    for at, t in zip(layout.offsets, tensors):
        assert at % (layout.ALIGN if align else 1) == 0
        gaps[at:at + t.numel()] = False
    assert layout.size == sum(t.numel() for t in tensors) + int(gaps.sum())
    assert (packed[gaps] == 0).all() and np.array_equal(packed[~gaps], written[~gaps])
    again = layout.over(torch.from_numpy(packed), plan)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(again.tensors(), tensors))
    assert all(x == y for x, y in zip(again.tiles[6:], plan.tiles[6:])) and again.merge.acc is plan.merge.acc
