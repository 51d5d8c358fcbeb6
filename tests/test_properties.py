"""Property tests of the host-side planners (``hypothesis``; bounded and derandomized, so a CI
run is reproducible): the plans that decide which program sums what, in which order.

* attention: a row's split size is a function of its position (never of the batch); the
  plan's tiles cover every token exactly once; the merge workspace ranks are a permutation;
  decode plans of one capacity have one size (a CUDA graph replays any of them); the planner's
  whole-array construction gives the plan of the loop planner (``attention_plan_reference``),
  field by field, for decode, prefill and mixed steps;
* matmul: the config is a function of (N, K, dtype, M's table row); the K chunks of the
  invariant order cover K exactly once, in order, the same chunks for every M and config;
* MoE: ``dispatch`` is a permutation of the (token, rank) rows, every pair exactly once, each
  under its own expert;
* the reduction-order emulator: its thread schedule sums every element exactly once.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops.attention.schedule import max_splits_upto, split_sizes
from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.ops import moe
from batch_invariance_kit.device import DEVICE
from batch_invariance_kit import emulator

from attention_plan_reference import (assert_same_plan, reference_make_plan, reference_max_splits_upto,
                                      reference_split_plan)

PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Attention: split sizes and the launch plan
# --------------------------------------------------------------------------------------------

def _attn_configs():
    """The schedule this process launches and the dataclass default (the GPU's schedule)."""
    cfgs = [A.default_config(), A.AttnConfig()]
    return [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]


ATTN_CONFIGS = _attn_configs()


@st.composite
def varlen_batches(draw, block_n):
    """A varlen step: each sequence has a context of ``seq_len`` tokens, the last ``q_len`` of
    them new (0: a padding entry, 1: a decode step, more: a prefill chunk starting anywhere)."""
    seq_lens, q_lens = [], []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 6 * block_n))
        seq_lens.append(n)
        q_lens.append(draw(st.sampled_from([0, 1, 1, n, min(n, 1 + n // 3)]) if n > 1 else st.integers(0, 1)))
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    heads = draw(st.sampled_from([(4, 4), (8, 2), (8, 1), (6, 2)]))
    return seq_lens, qsl, heads


def _plan(seq_lens, qsl, heads, cfg, impl="invariant"):
    return A.make_plan(seq_lens, qsl, q_heads=heads[0], kv_heads=heads[1], head_dim=16, impl=impl, config=cfg,
                       device="cpu")


def _tiles(plan):
    """Every query tile of a plan with rows: (sequence, first token, tokens, first position,
    split size, tokens per tile of its launch)."""
    out = []
    for g in (plan.tiles, plan.decode):
        for seq, tok, rows, pos, split in zip(g.seq.tolist(), g.tok.tolist(), g.rows.tolist(), g.pos.tolist(),
                                              g.split.tolist()):
            if rows:  # 0 rows: a padding tile
                out.append((seq, tok, rows, pos, split, g.q_tile))
    return out


@pytest.mark.parametrize("cfg", ATTN_CONFIGS, ids=lambda c: f"block_n{c.block_n}")
@PROPS
@given(pos=st.integers(0, 1 << 16))
def test_split_size_at_is_a_graded_multiple_of_the_tile(cfg, pos):
    s = A.split_size_at(pos, cfg)
    assert s % cfg.block_n == 0 and cfg.block_n <= s <= cfg.split_size
    assert A.split_size_at(pos + 1, cfg) >= s  # longer contexts never get shorter splits
    if cfg.split_target is not None and s < cfg.split_size:  # below the cap: at most split_target splits
        assert math.ceil((pos // cfg.block_n + 1) * cfg.block_n / s) <= cfg.split_target
    # every position of a KV tile has the same size (a tile's rows share their diagonal tile)
    first = pos - pos % cfg.block_n
    assert A.split_size_at(first, cfg) == s == A.split_size_at(first + cfg.block_n - 1, cfg)


@pytest.mark.parametrize("cfg", ATTN_CONFIGS, ids=lambda c: f"block_n{c.block_n}")
@PROPS
@given(data=st.data())
def test_split_size_of_a_row_never_depends_on_the_batch(cfg, data):
    seq_lens, qsl, heads = data.draw(varlen_batches(cfg.block_n))
    full = _plan(seq_lens, qsl, heads, cfg)
    assert A.split_plan(seq_lens, heads[1], config=cfg) == [A.split_size_at(n - 1, cfg) for n in seq_lens]
    tok_pos, tok_split = full.merge.pos.tolist(), full.merge.split.tolist()
    tiles = _tiles(full)
    for s in range(len(seq_lens)):
        a, b = qsl[s], qsl[s + 1]
        alone = _plan([seq_lens[s]], [0, b - a], heads, cfg)
        assert tok_pos[a:b] == alone.merge.pos.tolist() == list(range(seq_lens[s] - (b - a), seq_lens[s]))
        assert tok_split[a:b] == alone.merge.split.tolist() == [A.split_size_at(p, cfg) for p in tok_pos[a:b]]
        # the sequence's query tiles, relative to its first token: the same alone and in the batch
        mine = sorted((t - a, r, p, sp, qt) for q, t, r, p, sp, qt in tiles if q == s)
        assert mine == sorted(x[1:] for x in _tiles(alone))


@pytest.mark.parametrize("cfg", ATTN_CONFIGS, ids=lambda c: f"block_n{c.block_n}")
@PROPS
@given(data=st.data())
def test_plan_tiles_cover_every_token_once_and_ranks_are_a_permutation(cfg, data):
    seq_lens, qsl, heads = data.draw(varlen_batches(cfg.block_n))
    impl = data.draw(st.sampled_from(["invariant", "variant"]))
    plan = _plan(seq_lens, qsl, heads, cfg, impl)
    T = qsl[-1]
    mp = plan.merge
    tok_split = mp.split.tolist()
    covered = []
    for s, t0, rows, pos0, split, q_tile in _tiles(plan):
        a, b = qsl[s], qsl[s + 1]
        assert a <= t0 and t0 + rows <= b  # a tile never mixes sequences
        assert pos0 == seq_lens[s] - (b - a) + (t0 - a)
        # on the absolute grid of q_tile, which divides block_n: one diagonal KV tile per query tile
        assert cfg.block_n % q_tile == 0 and pos0 // q_tile == (pos0 + rows - 1) // q_tile
        assert split % cfg.block_n == 0 and split == tok_split[t0 + rows - 1]
        covered += range(t0, t0 + rows)
    assert sorted(covered) == list(range(T))  # every token exactly once
    # the workspace: the parallel launches' tokens, ranked 0..n-1, with room for every split of each
    serial_tok = {t for g in (plan.tiles, plan.decode) if g.serial
                  for t0, r in zip(g.tok.tolist(), g.rows.tolist()) for t in range(t0, t0 + r)}
    merge = [t for t in mp.tokens.tolist() if t >= 0]
    assert merge == sorted(set(range(T)) - serial_tok)
    rank = mp.rank.tolist()
    assert [rank[t] for t in merge] == list(range(len(merge)))
    pos = mp.pos.tolist()
    assert mp.max_splits >= max([pos[t] // tok_split[t] + 1 for t in merge] or [1])
    assert mp.acc.shape[0] == mp.ml.shape[0] >= len(merge) * heads[0] * mp.max_splits


@pytest.mark.parametrize("cfg", ATTN_CONFIGS, ids=lambda c: f"block_n{c.block_n}")
@PROPS
@given(capacity=st.integers(1, 12), max_len=st.integers(1, 400), data=st.data())
def test_decode_plans_of_one_capacity_are_interchangeable(cfg, capacity, max_len, data):
    """Decode steps of one size, planned with one ``decode_capacity`` and ``max_seq_len``, have
    plans of the same sizes and launch modes whatever their contexts (a CUDA graph captured
    with one replays the others)."""
    n = data.draw(st.integers(1, capacity))
    steps = [data.draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n)) for _ in range(2)]
    plans = [A.make_plan(lens, list(range(len(lens) + 1)), q_heads=8, kv_heads=2, head_dim=16, config=cfg,
                         device="cpu", decode_capacity=capacity, max_seq_len=max_len) for lens in steps]
    for p, lens in zip(plans, steps):
        assert sorted(t for _, t, r, *_ in _tiles(p) for t in range(t, t + r)) == list(range(len(lens)))
        assert p.decode.seq.shape[0] == capacity and (p.decode.rows[len(lens):] == 0).all()
        merge = p.merge.tokens.tolist()
        # a decode token sits at position n - 1 of its sequence: (n - 1) // split + 1 splits (the planner's rule)
        assert p.merge.max_splits >= max((n - 1) // A.split_size_at(n - 1, cfg) + 1 for n in lens) or p.decode.serial
        assert len(merge) == (0 if p.decode.serial else capacity) and set(merge[len(lens):]) <= {-1}
    # one persistent buffer holds either: the second written into the first's layout, viewed as the first
    layout = A.PlanLayout.of(plans[0])
    buf = np.zeros(layout.size, dtype=np.int32)
    layout.write(buf, plans[1])
    assert all(torch.equal(a, b) for a, b in zip(layout.over(torch.from_numpy(buf), plans[0]).tensors(),
                                                  plans[1].tensors()))


#: The planner's configs: the shipped ones, one-token steps in the multi-token tiles, one split
#: size and never serial, and splits that are not powers of two with a low serial threshold.
PLANNER_CONFIGS = [pytest.param(c, id=f"shipped-block_n{c.block_n}") for c in ATTN_CONFIGS] + [
    pytest.param(A.AttnConfig(decode_block_m=None), id="no-decode-tiles"),
    pytest.param(A.AttnConfig(split_target=None, serial_programs=None), id="one-split-size"),
    pytest.param(A.AttnConfig(block_n=32, block_m=128, split_size=96, split_target=3, serial_programs=64),
                 id="split96-serial64"),
]


@st.composite
def planner_steps(draw, cfg):
    """A step for the planner: decode only, prefill only or mixed, sequences in any order with
    padding entries (0 new tokens) among them; contexts that cross every split-size edge; the
    head layout, impl, fixed sizes (``decode_capacity``, ``max_seq_len``) and the form of the
    metadata (lists, int32 or int64 tensors) drawn too."""
    top = 24 * cfg.split_size
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    counts = {"decode": ((1, 96), (0, 0), (0, 4)), "prefill": ((0, 0), (1, 3), (0, 1)),
              "mixed": ((1, 24), (1, 4), (0, 3))}[kind]
    roles = [r for r, (lo, hi) in zip(("decode", "chunk", "pad"), counts) for _ in range(draw(st.integers(lo, hi)))]
    lens, qls = [], []
    for role in draw(st.permutations(roles)):
        n = draw(st.integers(0 if role == "pad" else 1, top))
        if role == "chunk":  # a whole prompt from position 0, or a chunk ending anywhere
            q = n if n <= 1500 and draw(st.booleans()) else draw(st.integers(1, min(n, 1500)))
        else:
            q = 1 if role == "decode" else 0
        lens.append(n)
        qls.append(q)
    qsl = [0]
    for q in qls:
        qsl.append(qsl[-1] + q)
    heads = draw(st.sampled_from([(32, 8), (8, 2), (4, 4), (6, 2), (8, 1), (16, 16)]))
    kw = dict(q_heads=heads[0], kv_heads=heads[1], head_dim=draw(st.sampled_from([16, 64, 80, 128, 256])),
              impl=draw(st.sampled_from(["invariant", "variant"])))
    if draw(st.booleans()):
        kw["decode_capacity"] = max(1, sum(q == 1 for q in qls) + draw(st.integers(0, 8)))
    if draw(st.booleans()):
        kw["max_seq_len"] = max(lens + [1]) + draw(st.integers(0, top))
    form = draw(st.sampled_from([list, torch.int32, torch.int64]))
    return lens, qsl, kw, form


@pytest.mark.parametrize("cfg", PLANNER_CONFIGS)
@PROPS
@given(data=st.data())
def test_make_plan_equals_the_loop_planner(cfg, data):
    """The planner builds, from whole-array operations, exactly the plan of the loop planner:
    every tensor bitwise (dtype, device, values), every size, flag and launch setting."""
    lens, qsl, kw, form = data.draw(planner_steps(cfg))
    ref = reference_make_plan(lens, qsl, config=cfg, device="cpu", **kw)
    meta = (lens, qsl) if form is list else (torch.tensor(lens, dtype=form), torch.tensor(qsl, dtype=form))
    assert_same_plan(A.make_plan(*meta, config=cfg, device="cpu", **kw), ref)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("decodes, chunk", [(3, 40), (3, 600), (60, 40), (60, 600)])
def test_make_plan_equals_the_loop_planner_in_every_launch_mode(decodes, chunk, padded):
    """Mixed steps whose multi-token and decode launches are each parallel or serial (all four
    pairs), so the workspace holds every token, those of one launch, or none."""
    cfg = A.AttnConfig(block_n=32, block_m=128, split_size=96, split_target=3, serial_programs=32)
    rng = np.random.default_rng(decodes + chunk)
    lens = [int(n) for n in rng.integers(1, 4000, decodes)] + [chunk + 77]
    qls = [1] * decodes + [chunk]
    qsl = [0] + np.cumsum(qls).tolist()
    kw = dict(q_heads=8, kv_heads=1, head_dim=64, config=cfg, device="cpu")
    if padded:
        kw.update(decode_capacity=decodes + 5, max_seq_len=4000)
    ref = reference_make_plan(lens, qsl, **kw)
    assert (ref.tiles.serial, ref.decode.serial) == (chunk > 100, decodes > 10)
    assert_same_plan(A.make_plan(torch.tensor(lens), torch.tensor(qsl), **kw), ref)


@pytest.mark.parametrize("cfg", PLANNER_CONFIGS)
@PROPS
@given(pos=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=40), n=st.integers(1, 1 << 15),
       kv_heads=st.integers(1, 8), impl=st.sampled_from(["invariant", "variant"]))
def test_vectorised_split_rules_equal_the_scalar_rule(cfg, pos, n, kv_heads, impl):
    """The planner's whole-array split sizes are :func:`split_size_at` at every position; its
    workspace bound (the most splits below a context) and :func:`split_plan` those of the loops."""
    assert split_sizes(np.array(pos), cfg).tolist() == [A.split_size_at(p, cfg) for p in pos]
    assert max_splits_upto(n, cfg) == reference_max_splits_upto(n, cfg)
    assert A.split_plan(pos, kv_heads, impl=impl, config=cfg) == reference_split_plan(pos, kv_heads, impl, cfg)


# --------------------------------------------------------------------------------------------
# Matmul: the config table and the K chunks
# --------------------------------------------------------------------------------------------

def _k_order(M, N, K, dt, cfg, compiled):
    """The K blocks of one output element in the order the invariant launch adds them: a list of
    chunks, each summed from zero, the chunk sums added in order.  From the plan the launch
    hands the kernels (``_k_plan``: programs along K, blocks per program, blocks per chunk),
    walked as the kernels walk it: one loop, a chunk loop inside one program, or one program
    per chunk whose sums a second kernel adds in program order."""
    cfg = MM._resolve_config(cfg, M, N, K, dt, compiled)
    programs, per_program, chunk = MM._k_plan("invariant", cfg, M, N, K, dt, compiled)
    kb = -(-K // MM.block_k(dt))
    info = MM.launch_info(M, N, K, dt, config=cfg, compiled=compiled)
    assert info["grid"][1] == programs and info["k_blocks"] == kb
    if programs > 1:
        return [list(range(p * per_program, min((p + 1) * per_program, kb))) for p in range(programs)]
    step = chunk or kb
    return [list(range(c, min(c + step, kb))) for c in range(0, kb, step)]


shapes = st.tuples(st.integers(1, 5000), st.integers(1, 200000), st.integers(1, 20000), st.sampled_from(DTYPES))


@PROPS
@given(shape=shapes, sms=st.integers(1, 200))
def test_matmul_config_is_a_function_of_the_shape_and_the_sm_count(shape, sms):
    M, N, K, dt = shape
    for compiled in (True, False):
        c1 = MM.select_config(M, N, K, dt, compiled=compiled, sms=sms)
        ranked = MM.rank_configs(M, N, K, dt, compiled=compiled, sms=sms)
        assert c1 is ranked[0][1] and c1 in MM.CONFIGS  # the model's fastest, one of the shipped configs
        assert [u for u, _ in ranked] == sorted(u for u, _ in ranked)
        MM._select.cache_clear()
        assert MM.select_config(M, N, K, dt, compiled=compiled, sms=sms) is c1  # recomputed: the same
        if dt == torch.float32:  # fp32 tiles: at most 128 x 128 (twice the bytes per element)
            assert c1.block_m * c1.block_n <= 128 * 128


@PROPS
@given(shape=shapes, m2=st.integers(1, 5000))
def test_matmul_k_chunks_cover_k_once_in_order_for_every_m_and_config(shape, m2):
    M, N, K, dt = shape
    bk = MM.block_k(dt)
    for compiled in (True, False):
        chunk = MM.k_chunk(K, dt, compiled=compiled)
        assert chunk == K or chunk % bk == 0
        kb = -(-K // bk)
        # the chunks of k_chunk: whole blocks of ``chunk`` keys from 0 upward (one chunk when K is not long)
        want = [list(range(c, min(c + chunk // bk, kb))) for c in range(0, kb, chunk // bk)] if chunk < K \
            else [list(range(kb))]
        for m in (M, m2):
            for cfg in [None] + MM.CONFIGS:
                order = _k_order(m, N, K, dt, cfg, compiled)
                assert all(order) and [b for c in order for b in c] == list(range(kb))  # once, in order
                assert order == want  # the same chunks whatever M and the config


# --------------------------------------------------------------------------------------------
# MoE: dispatch
# --------------------------------------------------------------------------------------------

@PROPS
@given(T=st.integers(1, 40), E=st.integers(1, 12), block_m=st.sampled_from([1, 2, 16, 32, 64]), data=st.data())
def test_moe_dispatch_is_a_permutation_with_each_pair_once(T, E, block_m, data):
    k = data.draw(st.integers(1, E))
    # each token's k distinct experts (a router's top-k), or any ids (duplicates allowed)
    if data.draw(st.booleans()):
        ids = [data.draw(st.permutations(range(E)))[:k] for _ in range(T)]
    else:
        ids = [data.draw(st.lists(st.integers(0, E - 1), min_size=k, max_size=k)) for _ in range(T)]
    topk = torch.tensor(ids, dtype=torch.int32, device=DEVICE).reshape(T, k)
    d = moe.dispatch(topk, E, block_m)
    n = T * k
    sid = d.sorted_ids.tolist()
    be = d.block_expert.tolist()
    assert len(sid) == d.num_blocks * block_m and d.num_valid == n
    valid = [(p, i) for p, i in enumerate(sid) if i != n]
    assert sorted(i for _, i in valid) == list(range(n))  # a permutation: every (token, rank) row once
    flat = topk.reshape(-1).tolist()
    for p, i in valid:  # each row sits in a block of its own expert
        assert be[p // block_m] == flat[i]
    pairs = [(i // k, flat[i]) for _, i in valid]
    assert sorted(pairs) == sorted((t, e) for t in range(T) for e in ids[t])  # every (token, expert) pair once
    # grouped by expert in expert order, each expert's rows in row-id order (stable), padded to block_m
    assert [flat[i] for _, i in valid] == sorted(flat)
    for e in range(E):
        mine = [i for _, i in valid if flat[i] == e]
        assert mine == sorted(mine)
    assert d.counts.tolist() == [flat.count(e) for e in range(E)]
    assert d.padded_counts.tolist() == [-(-c // block_m) * block_m for c in d.counts.tolist()]
    used = sum(d.padded_counts.tolist()) // block_m
    assert all(x >= 0 for x in be[:used]) and all(x == -1 for x in be[used:])
    assert be[:used] == sorted(be[:used])


# --------------------------------------------------------------------------------------------
# The reduction-order emulator: the thread schedule
# --------------------------------------------------------------------------------------------

launches = st.tuples(st.integers(1, 3000), st.sampled_from([32, 64, 96, 128, 256, 512, 1024]),
                     st.sampled_from([1, 2, 4, 8, 16]), st.data())


@PROPS
@given(launch=launches)
def test_emulator_thread_schedule_sums_every_element_once(launch):
    n, block, vec, data = launch
    misalign = data.draw(st.integers(0, vec - 1))
    sched = emulator.thread_schedule(n, block, vec, misalign)
    assert sched.shape[0] == block
    idx = sched[sched >= 0]
    assert sorted(idx.tolist()) == list(range(n))  # every element exactly once
    for row in sched:  # a thread walks its elements in increasing order; padding only at the end
        mine = row[row >= 0]
        assert (np.diff(mine) > 0).all() and (row[len(mine):] == -1).all()
    # and the block reduction adds exactly those: distinct integers sum exactly in fp32
    x = np.arange(1, n + 1, dtype=np.float32)
    assert emulator.block_reduce(x, block, vec, misalign=misalign)[0] == np.float32(n * (n + 1) // 2)
