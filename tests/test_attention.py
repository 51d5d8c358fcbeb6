"""Attention over a paged KV cache: a token's output bits do not depend on (a) the batch around
it, (b) how its prompt was chunked, (c) whether its prefix came from the prefix cache, (d)
whether it was computed by prefill or by decode; the split-KV variant (splits chosen from the
batch) fails (a); all agree with a float64 reference; outputs stay inside guard regions; bad
input is refused naming the argument.

Sizes follow the config (``A.default_config()``: 32-key tiles and splits of 32 or 64 keys by
position under the interpreter, 64-key tiles and 64-512-key splits on a GPU), so the same tests
cross tile, split and cache-block (16) boundaries on both; head dim 32, 4 q heads over 2 kv heads.
The sizes, data, cache and cases are :mod:`batch_invariance_kit.ops.attention.testing`'s, which
chapter 6 runs too.
"""
import dataclasses

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops.attention import launcher
from batch_invariance_kit.ops.attention.testing import (BLOCK_SIZE as BS, HEAD_DIM as D, KV_HEADS as HKV,
                                                        Q_HEADS as HQ, Cache, chunked_prefill_case, decode_lens,
                                                        decode_op, mixed_batch_case, seq_data)
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bitwise_equal, check_invariance, seeded_normal

DEV = batch_invariance_kit.DEVICE
CFG = A.default_config()
BN, SPLIT = CFG.block_n, CFG.split_size
#: context lengths of the rows of a decode batch: across 1, a tile, a split, several splits
LENS = decode_lens(CFG)
#: the tests' paged caches grow with the config's split size (the GPU config's contexts are longer)
CACHE_SCALE = max(1, SPLIT // 64)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _name(dt):
    return str(dt).replace("torch.", "")


# ---------------------------------------------------------------------------------------------
# (a) batch composition
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_a_decode_row_alone_equals_row_in_batch(dtype):
    f, make = decode_op(dtype, "invariant")
    report = check_invariance(f, make, [1, 3, 8])
    assert report.passed, report.summary()


def test_a_variant_split_kv_fails_the_same_check():
    """Negative control: the split count comes from the batch (2*SMs // (batch*kv_heads)), so a
    long row's split boundaries, and its merge, change with the batch size."""
    f, make = decode_op(torch.float32, "variant")
    plans = {bs: A.split_plan([LENS[0]] * bs, HKV, impl="variant", config=CFG)[0] for bs in (1, 2, 8)}
    assert len(set(plans.values())) > 1, plans
    report = check_invariance(f, make, [1, 2, 8], positions=[0], stop_at_first=True)
    assert not report.passed, "the variant split-KV decode was expected to depend on the batch"
    assert report.rows_differing >= 1


def test_a_prefill_chunk_in_a_mixed_batch():
    """A prompt prefilled alone == prefilled beside another prompt and a decode step."""
    assert bitwise_equal(*mixed_batch_case(torch.float32))


# ---------------------------------------------------------------------------------------------
# (b) chunked prefill, (c) prefix cache, (d) prefill == decode
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_b_chunked_prefill_equals_one_chunk(dtype):
    """Chunks starting at tile edges (any start: test_attention_steps) == one chunk."""
    assert bitwise_equal(*chunked_prefill_case(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
def test_c_prefix_cache_hit_equals_recompute(dtype):
    """Sequence B shares A's first P keys (P a multiple of block_n here; any P: test_attention_steps): B computed from the cached
    blocks of A (only its own tokens run) == B prefilled from scratch, bitwise."""
    p_len, own = SPLIT + BN, BN + 11
    qa, ka, va = seq_data(7, 0, p_len + 20, dtype)
    qb, kb, vb = seq_data(7, 1, p_len + own, dtype)
    kb[:p_len], vb[:p_len] = ka[:p_len], va[:p_len]  # the shared prefix (same tokens -> same K/V)
    qb[:p_len] = qa[:p_len]
    c = Cache(dtype, seed=5)
    c.write("a", ka, va, 0)
    c.run([("a", qa, p_len + 20)])
    hit = c.table("b", p_len + own, shared=c.tables["a"][:p_len // BS])
    assert hit[:p_len // BS] == c.tables["a"][:p_len // BS]
    c.write("b", kb[p_len:], vb[p_len:], p_len)
    cached = c.run([("b", qb[p_len:], p_len + own)])[0]
    fresh = Cache(dtype, seed=6)
    fresh.write("b", kb, vb, 0)
    recomputed = fresh.run([("b", qb, p_len + own)])[0]
    assert bitwise_equal(cached, recomputed[p_len:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
def test_d_prefill_equals_decode_at_every_position(dtype):
    """Prefill of n tokens; then positions t decoded (as one-token sequences sharing the blocks,
    seq_len = t + 1, one launch; every position for fp32, every 5th and the boundaries for
    16-bit) and a few positions decoded alone: the same bits."""
    n = 2 * SPLIT + BN + 3
    q, k, v = seq_data(11, 0, n, dtype)
    c = Cache(dtype, seed=7)
    c.write("s", k, v, 0)
    pre = c.run([("s", q, n)])[0]
    edges = {0, BN - 1, BN, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT, n - 1}
    ts = list(range(n)) if dtype == torch.float32 else sorted(edges | set(range(0, n, 5)))
    for t in ts:
        c.tables[("d", t)] = c.tables["s"]
    dec = torch.cat(c.run([(("d", t), q[t:t + 1], t + 1) for t in ts]))
    bad = [t for i, t in enumerate(ts) if not bitwise_equal(dec[i], pre[t])]
    assert not bad, f"positions where decode differs from prefill: {bad}"
    for t in sorted({0, BN, SPLIT + 1, n - 1}):
        one = c.run([(("d", t), q[t:t + 1], t + 1)])[0]
        assert bitwise_equal(one[0], pre[t]), t


def _plan(steps, config, **kw):
    q = torch.cat([s[1] for s in steps])
    lens = [s[2] for s in steps]
    qsl = [0] + torch.tensor([s[1].shape[0] for s in steps]).cumsum(0).tolist()
    return q, lens, qsl, A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, config=config, device=DEV, **kw)


def test_config_is_the_shipped_schedule():
    """``AttnConfig()`` is the GPU default; the interpreter's config differs only in sizes; bad
    fields are refused naming them."""
    assert A.AttnConfig() == A.DEFAULT_CONFIG
    assert (CFG.decode_block_m, CFG.serial_decode_warps, CFG.serial_decode_stages) == (16, 2, 3)
    assert CFG.serial_programs is not None and CFG.split_target is not None
    for kw, match in ((dict(decode_block_m=24), "decode_block_m"), (dict(block_n=512, split_size=512), "block_n"),
                      (dict(serial_decode_stages=0), "serial_decode_stages"), (dict(num_warps=0), "num_warps"),
                      (dict(serial_programs=0), "serial_programs"), (dict(split_target=0), "split_target"),
                      (dict(split_size=48), "split_size")):
        with pytest.raises(ValueError, match=match):
            A.AttnConfig(**kw)
    with pytest.raises(ValueError, match="pos"):
        A.split_size_at(-1, CFG)


def test_decode_tiles_give_the_bits_of_one_tile_shape():
    """The default sends one-token steps (decode) to 16-row tiles (``decode_block_m``): one-token
    steps go to the decode group of the plan, multi-token steps stay in prefill tiles, and the
    two tile shapes give the same bits as one shape for all (the row sum is a fixed pairwise
    tree: no layout enters; see the module docstring)."""
    single = dataclasses.replace(CFG, decode_block_m=None)
    dtype = torch.bfloat16
    c = Cache(dtype, seed=3)
    steps = []
    for r, n in enumerate(LENS):
        q, k, v = seq_data(5, r, n, dtype)
        c.write(r, k, v, 0)
        steps.append((r, q[-1:], n))
    qp, kp, vp = seq_data(5, 99, 2 * BN, dtype)  # a 2-tile prefill chunk in the same launch
    c.write("p", kp, vp, 0)
    steps.append(("p", qp, 2 * BN))
    q, lens, qsl, plan = _plan(steps, CFG)
    assert plan.decode.seq.tolist() == list(range(len(LENS))), "one-token steps must be decode tiles"
    assert _plan(steps, single)[3].decode.seq.numel() == 0
    assert plan.tiles.seq.tolist() == [len(LENS)] * (2 * BN // plan.tiles.q_tile)
    assert bitwise_equal(torch.cat(c.run(steps)), torch.cat(c.run(steps, config=single)))


def test_left_fold_over_many_splits():
    """The left fold over many split states (32-key splits, 560 keys: up to 18 splits, more
    than one step of the merge's schedule on a GPU and under the interpreter): prefill == decode
    at split edges, serial == per split, close to float64."""
    cfg = A.AttnConfig(block_n=32, block_m=32, split_size=32, split_target=None, serial_programs=None)
    n, dtype = 560, torch.bfloat16
    q, k, v = seq_data(12, 0, n, dtype)
    c = Cache(dtype, seed=8)
    c.write("s", k, v, 0)
    pre = c.run([("s", q[480:], n)], config=cfg)[0]  # a chunk from key 480: rows with 16-18 splits
    ts = [480, 511, 512, 527, 543, n - 1]
    for t in ts:
        c.tables[("d", t)] = c.tables["s"]
    dec = torch.cat(c.run([(("d", t), q[t:t + 1], t + 1) for t in ts], config=cfg))
    assert bitwise_equal(dec, pre[[t - 480 for t in ts]])
    ref = c.run([("s", q[-48:], n)], impl="reference")[0]
    assert (pre[-48:].double() - ref.double()).abs().max().item() < TOL[dtype]
    serial = c.run([("s", q[-48:], n)], config=dataclasses.replace(cfg, serial_programs=1))[0]
    assert bitwise_equal(serial, pre[-48:])


def _mixed_steps(c, seed, dtype):
    """Decode rows of LENS (across tiles and splits) plus a prefill chunk from key BN (rows in
    3 tiles, 1-2 splits), written to cache ``c``: the steps of one mixed launch."""
    steps = []
    for r, n in enumerate(LENS):
        q, k, v = seq_data(seed, r, n, dtype)
        c.write(r, k, v, 0)
        steps.append((r, q[-1:], n))
    qp, kp, vp = seq_data(seed, 99, 3 * BN + 5, dtype)
    c.write("p", kp, vp, 0)
    steps.append(("p", qp[BN:], 3 * BN + 5))
    return steps


def test_workspace_holds_the_parallel_tokens_only():
    """The fp32 split states of a launch go to a workspace indexed by the rank of the tokens of
    its parallel (one program per split) launches: serial tokens take no room, and its number
    of splits per row is that of the parallel tokens.  A launch with serial decode rows and a
    parallel prefill chunk gives the bits of the all-parallel launch."""
    c = Cache(torch.bfloat16, seed=5)
    steps = _mixed_steps(c, 8, torch.bfloat16)
    par = dataclasses.replace(CFG, serial_programs=None)
    mixed = dataclasses.replace(CFG, serial_programs=len(LENS) * HKV)  # decode tiles serial, the chunk not
    q, lens, qsl, p_par = _plan(steps, par)
    p_mix = _plan(steps, mixed)[3]
    assert (p_mix.tiles.serial, p_mix.decode.serial) == (False, True)
    chunk = list(range(qsl[-2], qsl[-1]))
    m_par, m_mix = p_par.merge, p_mix.merge
    assert m_mix.tokens.tolist() == chunk and m_mix.rank[chunk].tolist() == list(range(len(chunk)))
    splits = lambda toks: max(int(m_par.pos[t]) // int(m_par.split[t]) + 1 for t in toks)  # noqa: E731
    assert m_par.max_splits == splits(range(len(q))) and m_mix.max_splits == splits(chunk)
    assert m_mix.acc.shape[0] == len(chunk) * HQ * m_mix.max_splits < m_par.acc.shape[0]
    assert bitwise_equal(torch.cat(c.run(steps, config=mixed)), torch.cat(c.run(steps, config=par)))


def test_serial_and_parallel_launches_give_the_same_bits():
    """``serial_programs``: a launch with enough (query tile, kv head) programs folds each row's
    splits inside one program and writes the output; a smaller one runs a program per split and
    the merge kernel.  A mixed launch (decode rows across splits, a prefill chunk) gives the
    same bits with every launch serial, none serial, or only the decode tiles serial; and with
    position-graded splits too."""
    c = Cache(torch.bfloat16, seed=4)
    steps = _mixed_steps(c, 7, torch.bfloat16)
    _, _, qsl, _ = _plan(steps, CFG)
    fold = dataclasses.replace(CFG, serial_programs=None)
    for kw in ({}, dict(split_size=4 * BN, split_target=2)):
        par = dataclasses.replace(fold, **kw)
        want = torch.cat(c.run(steps, config=par))
        dec_tiles = len(LENS) * HKV
        for sp, modes in ((1, (True, True)), (dec_tiles, (False, True)), (10 ** 6, (False, False))):
            cfg = dataclasses.replace(par, serial_programs=sp)
            plan = _plan(steps, cfg)[3]
            assert (plan.tiles.serial, plan.decode.serial) == modes, (sp, plan.tiles.serial, plan.decode.serial)
            assert plan.merge.tokens.numel() == (0 if modes[0] else qsl[-1] - qsl[-2]) + (0 if modes[1] else len(LENS))
            assert bitwise_equal(torch.cat(c.run(steps, config=cfg)), want), (kw, sp)


def test_merge_load_schedule_gives_the_same_bits(monkeypatch):
    """The merge kernel folds column by column: the columns per program (``MERGE_COLUMNS``) and
    the states per unrolled step (``FOLD_CHUNK``) move work and loads, never the arithmetic.
    A mixed launch (decode rows over 1..7 splits, a prefill chunk) run per split gives the bits
    of the serial launch (no merge kernel) with several column blocks and several steps."""
    c = Cache(torch.bfloat16, seed=6)
    steps = _mixed_steps(c, 9, torch.bfloat16)
    serial = torch.cat(c.run(steps, config=dataclasses.replace(CFG, serial_programs=1)))
    par = dataclasses.replace(CFG, serial_programs=None)
    # this device's schedule, the GPU's, another
    for cols, chunk in ((launcher.MERGE_COLUMNS, launcher.FOLD_CHUNK), (32, 16), (8, 2)):
        monkeypatch.setattr(launcher, "MERGE_COLUMNS", cols)
        monkeypatch.setattr(launcher, "FOLD_CHUNK", chunk)
        assert bitwise_equal(torch.cat(c.run(steps, config=par)), serial), (cols, chunk)


def test_graded_splits_keep_a_and_d():
    """``split_target``: a row's split size grows with its own position (32, 64, then 128 keys
    here), never with the batch.  (d) prefill == decode at every bucket edge, (a) rows alone ==
    rows in a batch; close to float64."""
    cfg = dataclasses.replace(CFG, split_size=4 * BN, split_target=2)
    assert [A.split_size_at(p, cfg) for p in (0, 2 * BN - 1, 2 * BN, 4 * BN - 1, 4 * BN, 50 * BN)] == \
        [BN, BN, 2 * BN, 2 * BN, 4 * BN, 4 * BN]
    assert {A.split_plan([5 * BN] * bs, HKV, config=cfg)[0] for bs in (1, 2, 8)} == {4 * BN}
    with pytest.raises(ValueError, match="split_target"):
        dataclasses.replace(CFG, split_target=0)
    n, dtype = 9 * BN + 7, torch.bfloat16
    q, k, v = seq_data(13, 0, n, dtype)
    c = Cache(dtype, seed=9)
    c.write("s", k, v, 0)
    pre = c.run([("s", q, n)], config=cfg)[0]
    edges = {t + e for t in (BN, 2 * BN, 4 * BN, 8 * BN) for e in (-1, 0, 1)}
    ts = sorted(edges | set(range(0, n, 7)) | {n - 1})
    for t in ts:
        c.tables[("d", t)] = c.tables["s"]
    dec = torch.cat(c.run([(("d", t), q[t:t + 1], t + 1) for t in ts], config=cfg))
    bad = [t for i, t in enumerate(ts) if not bitwise_equal(dec[i], pre[t])]
    assert not bad, f"positions where decode differs from prefill: {bad}"
    # (a): the rows of a batch of three contexts, alone and together
    c.tables[("d", 4 * BN + 3)] = c.tables["s"]
    steps = [(("d", t), q[t:t + 1], t + 1) for t in (BN - 1, 4 * BN + 3, n - 1)]
    together = c.run(steps, config=cfg)
    for st, got in zip(steps, together):
        assert bitwise_equal(c.run([st], config=cfg)[0], got)
    ref = c.run([("s", q[-40:], n)], impl="reference")[0]
    assert (pre[-40:].double() - ref.double()).abs().max().item() < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# accuracy, guards, bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
def test_accuracy_vs_float64_and_sdpa(dtype):
    c = Cache(dtype, seed=8)
    steps = []
    for r, (n, ql) in enumerate([(SPLIT + 9, 1), (2 * SPLIT + 3, 2 * SPLIT + 3), (3 * BN, BN), (5, 5)]):
        q, k, v = seq_data(13, r, n, dtype)
        c.write(r, k, v, 0)
        steps.append((r, q[n - ql:], n))
    for impl in ("invariant", "variant", "sdpa"):
        got, ref = torch.cat(c.run(steps, impl=impl)), torch.cat(c.run(steps, impl="reference"))
        err = (got.double() - ref.double()).abs().max().item()
        assert err <= TOL[dtype], (impl, err)


@pytest.mark.parametrize("impl", ["invariant", "variant"])
def test_guards_every_element_written_nothing_else(impl):
    dt = torch.bfloat16
    nb = 64 * CACHE_SCALE
    gk, gv = Guarded((nb, BS, HKV, D), dt, DEV), Guarded((nb, BS, HKV, D), dt, DEV)
    c = Cache(dt, num_blocks=nb, seed=9)
    c.k, c.v = gk.tensor, gv.tensor
    steps = []
    for r, (n, ql) in enumerate([(SPLIT + BN + 3, SPLIT + BN + 3), (2 * SPLIT + 1, 1), (BN + 2, 2)]):
        q, k, v = seq_data(17, r, n, dt)
        if n > ql:
            c.write(r, k[:n - ql], v[:n - ql], 0)
        c.write(r, k[n - ql:], v[n - ql:], n - ql)
        steps.append((r, q[n - ql:], n))
    gk.check()
    gv.check()
    T = sum(s[1].shape[0] for s in steps)
    g = Guarded((T, HQ, D), dt, DEV)
    c.run(steps, impl=impl, out=g.tensor)
    g.check()
    assert g.unwritten() == 0


def test_write_kv_copies_bits_and_skips_minus_one():
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        k, v = A.new_cache(4, BS, HKV, D, dt)
        key = seeded_normal((3, HKV, D), 1, dtype=dt, device=DEV)
        val = seeded_normal((3, HKV, D), 2, dtype=dt, device=DEV)
        A.write_kv(key, val, k, v, torch.tensor([5, -1, 63], device=DEV))
        assert bitwise_equal(k.view(-1, HKV, D)[5], key[0]) and bitwise_equal(v.view(-1, HKV, D)[63], val[2])
        assert int((k != 0).sum()) == int((key[[0, 2]] != 0).sum())


def test_paged_cache_hands_out_blocks_and_assembles_steps():
    """:class:`A.PagedCache`: the seeded free list is taken from its end (``seed=None``: blocks
    in order), a block list grows on demand, keys land at their slots, a prefix hit starts a
    sequence with shared blocks, and a step gets a padded block table and its metadata on the
    cache's device; bad input is refused naming the argument, with no block taken."""
    dt = torch.float32
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(5)).tolist()
    c = A.PagedCache(8, BS, HKV, D, dt, device=DEV, seed=5)
    q, k, v = seq_data(31, 0, BS + 3, dt)
    c.write("a", k[:5], v[:5], 0)
    assert c.tables["a"] == perm[-1:]
    c.write("a", k[5:], v[5:], 5)  # a chunk across a block edge: one more block
    assert c.tables["a"] == [perm[-1], perm[-2]] and c.free == perm[:-2]
    ka, va = A.gather_kv(c.k, c.v, A.block_table([c.tables["a"]], DEV), 0, BS + 3)
    assert bitwise_equal(ka, k) and bitwise_equal(va, v)
    c.write("b", k[BS:], v[BS:], BS, shared=c.tables["a"][:1])  # a prefix hit on a's first block
    assert c.tables["b"] == [perm[-1], perm[-3]]
    steps = [("a", q[-1:], BS + 3), ("b", q[BS:], BS + 3), ("a", q[:0], 0)]  # the last: a padding entry
    qq, bt, lens, qsl = c.args(steps)
    assert bitwise_equal(qq, torch.cat([q[-1:], q[BS:]]))
    assert all(t.dtype == torch.int32 and t.device.type == c.k.device.type for t in (bt, lens, qsl))
    assert bt.tolist() == [c.tables["a"], c.tables["b"], c.tables["a"]]
    assert lens.tolist() == [BS + 3, BS + 3, 0] and qsl.tolist() == [0, 1, 4, 4]
    outs = c.run(steps, impl="reference")
    assert [o.shape[0] for o in outs] == [1, 3, 0]
    assert bitwise_equal(torch.cat(outs), A.attention(qq, c.k, c.v, bt, lens, qsl, impl="reference"))
    assert A.PagedCache(8, BS, HKV, D, dt, device=DEV).table("x", 2 * BS + 1) == [0, 1, 2]
    assert A.grow_blocks([7], 3 * BS, BS, iter([4, 5, 6]).__next__) == [7, 4, 5]
    assert A.block_table([[3, 1], [], [2]], "cpu").tolist() == [[3, 1], [0, 0], [2, 0]]
    free = list(c.free)
    with pytest.raises(ValueError, match="out of blocks: sequence 'big' needs 6 more blocks"):
        c.table("big", 6 * BS)
    assert c.free == free and "big" not in c.tables
    for call, err, match in (
            (lambda: c.write("a", k, v, -1), ValueError, "start must be >= 0"),
            (lambda: c.write("a", k, v, 0.5), TypeError, "start must be an int"),
            (lambda: c.write("a", k.tolist(), v, 0), TypeError, "k must be a torch.Tensor"),
            (lambda: c.write("a", k, v, 0, shared=[0]), ValueError, "shared: sequence 'a' already has blocks"),
            (lambda: c.table("c", 1, shared=[8]), ValueError, "shared holds block 8"),
            (lambda: c.args([]), ValueError, "steps must hold"),
            (lambda: c.args([("zz", q, 1)]), ValueError, r"steps\[0\]: sequence 'zz' has no blocks"),
            (lambda: c.args([("a", q[-1:], 1), ("a", q)]), TypeError, r"steps\[1\] must be a"),
            (lambda: c.args([("a", q[-1:], 2 * BS + 1)]), ValueError, r"steps\[0\] seq_len=33 is longer"),
            (lambda: c.run("a"), TypeError, "steps must be a list"),
            (lambda: A.PagedCache(8, BS, HKV, D, dt, seed=1.5), TypeError, "seed"),
            (lambda: A.PagedCache(0, BS, HKV, D, dt), ValueError, "num_blocks"),
            (lambda: A.block_table(3), TypeError, "tables")):
        with pytest.raises(err, match=match):
            call()
    assert c.free == free and sorted(c.tables) == ["a", "b"]


def test_bad_inputs_raise_naming_the_argument():
    dt = torch.float32
    k, v = A.new_cache(8, BS, HKV, D, dt)
    q = torch.zeros((1, HQ, D), dtype=dt, device=DEV)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    ln = torch.tensor([20], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9"):
        A.decode(q, k, v, torch.tensor([[0, 9]], dtype=torch.int32, device=DEV), ln)
    with pytest.raises(ValueError, match="q has 3 heads"):
        A.decode(torch.zeros((1, 3, D), dtype=dt, device=DEV), k, v, bt, ln)
    with pytest.raises(ValueError, match="head_dim"):
        A.decode(torch.zeros((1, HQ, D + 1), dtype=dt, device=DEV), k, v, bt, ln)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=33 is longer"):
        A.decode(q, k, v, bt, torch.tensor([33], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="k_cache"):
        A.decode(q, k.half(), v, bt, ln)
    with pytest.raises(TypeError, match="seq_lens"):
        A.decode(q, k, v, bt, ln.long())
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        A.decode(torch.zeros((2, HQ, D), dtype=dt, device=DEV), k, v, bt, torch.tensor([3, 4], dtype=torch.int32,
                                                                                        device=DEV))
    with pytest.raises(ValueError, match="impl"):
        A.decode(q, k, v, bt, ln, impl="fast")
    with pytest.raises(ValueError, match="split_size"):
        A.AttnConfig(32, 32, 48)
    with pytest.raises(ValueError, match="slot_mapping"):
        A.write_kv(q[:, :HKV], q[:, :HKV], k, v, torch.tensor([8 * BS], device=DEV))
    with pytest.raises(ValueError, match="key has"):
        A.write_kv(q, q, k, v, torch.tensor([0], device=DEV))
    with pytest.raises(ValueError, match="out must have shape"):
        A.decode(q, k, v, bt, ln, out=torch.zeros((2, HQ, D), dtype=dt, device=DEV))
    kv = torch.zeros((1, HKV, D), dtype=dt, device=DEV)
    with pytest.raises(ValueError, match="key and value must be given together"):
        A.attention(q, k, v, bt, ln, _qsl1(), key=kv)
    with pytest.raises(TypeError, match="value must have dtype"):
        A.attention(q, k, v, bt, ln, _qsl1(), key=kv, value=kv.half())
    with pytest.raises(ValueError, match=r"key must have shape \(num_tokens, kv_heads, head_dim\)"):
        A.attention(q, k, v, bt, ln, _qsl1(), key=kv[:, :1], value=kv)
    with pytest.raises(ValueError, match="value must have unit stride"):
        A.attention(q, k, v, bt, ln, _qsl1(), key=kv, value=kv.transpose(1, 2).contiguous().transpose(1, 2))


def _qsl1():
    return torch.tensor([0, 1], dtype=torch.int32, device=DEV)


def test_step_keys_and_values_give_the_cache_bits():
    """``key``/``value``: the step's new keys and values, as written to the cache.  The KV tiles
    wholly inside a sequence's chunk are read from them instead of through the block table: the
    same values, so the same bits, for a chunk starting inside a tile (serial and per-split
    launches) and for a mixed launch.  The control: other values passed as the step's keys
    change the rows whose tiles lie in the chunk and leave the rows before the chunk's first
    whole tile alone, so the kernel does read them, only there."""
    dt = torch.bfloat16
    c = Cache(dt, seed=3)
    n = 2 * SPLIT + BN + 5
    q, k, v = seq_data(5, 0, n, dt)
    c.write("x", k, v, 0)
    start = BN + 3  # the chunk's first whole KV tile is tile 2
    step = [("x", q[start:], n)]
    for sp in (1, None):
        cfg = dataclasses.replace(CFG, serial_programs=sp)
        want = c.run(step, config=cfg)[0]
        assert bitwise_equal(c.run(step, config=cfg, new_kv=True)[0], want), sp
    q_, bt, lens, qsl = c.args(step)
    kn, vn = c.new_kv(step)
    assert bitwise_equal(kn, k[start:]) and bitwise_equal(vn, v[start:])
    other = A.attention(q_, c.k, c.v, bt, lens, qsl, key=kn, value=vn * 2)
    early = 2 * BN - start  # rows below position 2 * BN see no whole chunk tile
    assert bitwise_equal(other[:early], want[:early]) and not bitwise_equal(other[early:], want[early:])
    steps = _mixed_steps(c, 7, dt)
    assert bitwise_equal(torch.cat(c.run(steps, new_kv=True)), torch.cat(c.run(steps)))


def test_step_keys_by_tensor_copies_or_pointer_loads_give_the_same_bits():
    """The whole chunk tiles of the step's keys are copied through tensor descriptors where the
    layout allows it (heads adjacent, 16-byte aligned token stride) and read with pointer loads
    where it does not (here: heads interleaved with other columns, as in a padded projection):
    both give the cache's bits; a key layout the descriptors take is refused where it breaks
    their alignment rule."""
    dt = torch.bfloat16
    c = Cache(dt, seed=4)
    n = 2 * SPLIT + BN + 9
    q, k, v = seq_data(6, 0, n, dt)
    c.write("x", k, v, 0)
    step = [("x", q[BN + 1:], n)]
    want = c.run(step)[0]
    q_, bt, lens, qsl = c.args(step)
    kn, vn = c.new_kv(step)
    assert launcher.step_descriptors(kn, vn, CFG.block_n) is not None
    wide_k = torch.zeros((kn.shape[0], HKV, 2 * D), dtype=dt, device=kn.device)
    wide_v = torch.zeros_like(wide_k)
    wide_k[..., :D], wide_v[..., :D] = kn, vn
    kp, vp = wide_k[..., :D], wide_v[..., :D]  # heads 2 * D apart: no descriptor
    assert launcher.step_descriptors(kp, vp, CFG.block_n) is None
    odd = torch.zeros((kn.shape[0] * (HKV * D + 4),), dtype=dt, device=kn.device)[:kn.numel() + (kn.shape[0] - 1) * 4]
    ko = odd.as_strided(kn.shape, (HKV * D + 4, D, 1))  # a token stride of 8 bytes past 16-byte rows
    assert launcher.step_descriptors(ko, ko, CFG.block_n) is None
    for key, value in ((kn, vn), (kp, vp)):
        got = A.attention(q_, c.k, c.v, bt, lens, qsl, key=key, value=value)
        assert bitwise_equal(got, want)


def test_split_plan_depends_on_the_batch_only_for_the_variant():
    n = 4 * SPLIT + 44
    assert {A.split_plan([n] * bs, HKV, config=CFG)[0] for bs in (1, 2, 4, 8)} == {A.split_size_at(n - 1, CFG)}
    assert len({A.split_plan([n] * bs, HKV, impl="variant", config=CFG)[0] for bs in (1, 2, 4, 8)}) > 1


def test_attention_bench_imports():
    from batch_invariance_kit.bench import attention as attention_bench

    assert callable(attention_bench.consistency) and callable(attention_bench.bench)
    # the stored schedule comparison includes the shipped default
    assert A.DEFAULT_CONFIG in attention_bench.DECODE_TILE_CONFIGS
    assert all(isinstance(c, A.AttnConfig) for c in attention_bench.tune_configs())


def test_prefill_sweep_and_ladder_checks_fail_when_they_should():
    """The prefill sweep's work-only changes are exactly the launch fields; the ladder's checks
    pass on a run of the kit's rows alone, and fail on a step-key row with other bits and on a
    rung that missed the kit's bits."""
    from batch_invariance_kit.bench import attention as attention_bench
    from batch_invariance_kit.bench.attention_ladder import ladder_checks

    assert attention_bench.PREFILL_SWEEP[0] == {}
    for change in attention_bench.PREFILL_SWEEP:
        dataclasses.replace(A.DEFAULT_CONFIG, **change)  # every change is a valid schedule
    assert set(attention_bench.BIT_FIELDS) == {"block_n", "split_size", "split_target"}
    kit = [{"impl": "kit-invariant"}, {"impl": "kit-invariant-step-kv", "bitwise_equal_to_kit": True}]
    assert all(c["passed"] for c in ladder_checks(kit, BN)) and len(ladder_checks(kit, BN)) == 1
    assert not ladder_checks([dict(kit[1], bitwise_equal_to_kit=False)], BN)[0]["passed"]
    rung = {"impl": "splits", "kind": "ladder", "rel_err_vs_sdpa": 1e-3, "must_equal_kit": True, "block_n": BN,
            "bitwise_equal_to_kit": False, "cell": "c", "shape": [16, BN, 4, 2]}
    assert [c["passed"] for c in ladder_checks(kit + [rung], BN)] == [True, True, False]


@pytest.mark.gpu
def test_gpu_consistency_quick():
    from batch_invariance_kit.bench import attention as attention_bench

    rows, results = attention_bench.consistency(quick=True)
    bad = [c["name"] for c in results if not c["passed"]]
    assert not bad, bad
