"""MoE: a token's output is bitwise the same alone and inside batches of many sizes and
compositions (uniform, skewed and duplicated routing; expert counts crossing BLOCK_M edges;
every grouped-GEMM tile); the router, grouped-GEMM and combine variants fail the same check
(negative controls; the combine's on its own, fed the same expert outputs); an expert's GEMM
follows the kit matmul's K order (bitwise its matmul), over a long K too, where the variant is
caught again; accuracy against float64; guard regions; bad input refused naming the argument;
the tie rule; the dispatch layout.

Tiny shapes (8 experts, top-2, hidden 64, intermediate 32) keep the file short under the Triton
interpreter; the negative controls use fp32 and hidden 256 (more K blocks, so a different
split or K step shows in the bits); the long-K tests 4 experts and 16 columns.
"""
import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.checks import dtype_name
from batch_invariance_kit.ops import moe
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bitwise_equal, check_invariance, row_maker, seeded_normal

DEV = batch_invariance_kit.DEVICE
E, TOPK, H, INTER = 8, 2, 64, 32
SIZES = [1, 2, 7, 9, 17, 33, 65, 130, 260]


_name = dtype_name  # test ids: "bfloat16", ...


def _weights(dtype, e=E, h=H, inter=INTER, seed=10, hot=False):
    rw = seeded_normal((e, h), seed) * h ** -0.5
    if hot:  # experts 0 and 1 share a direction that the skewed tokens carry: most tokens go there
        u = _hot_direction(h)
        rw[0] += 3.0 * u
        rw[1] += 2.5 * u
    w13 = seeded_normal((e, 2 * inter, h), seed + 1) * h ** -0.5
    w2 = seeded_normal((e, h, inter), seed + 2) * inter ** -0.5
    return tuple(t.to(dtype=dtype, device=DEV) for t in (rw, w13, w2))


def _hot_direction(h):
    u = seeded_normal((h,), 99)
    return u / u.norm()


def _maker(kind, dtype, h=H):
    base = row_maker(h, dtype=torch.float64)
    shift = (2.0 * _hot_direction(h)).to(DEV)  # on the device of the rows (CPU or GPU)
    dup = base(3, 7)  # three distinct rows, repeated: one expert pair takes the whole batch

    def make(bs, seed=0):
        if kind == "uniform":
            x = base(bs, seed)
        elif kind == "skewed":
            x = base(bs, seed) + shift
        else:
            x = dup[torch.arange(bs) % 3]
        return x.to(dtype=dtype, device=DEV)
    return make


def _moe(dtype, impl="invariant", hot=False, h=H, inter=INTER, **kw):
    rw, w13, w2 = _weights(dtype, h=h, inter=inter, hot=hot)
    return lambda x: moe.fused_moe(x, rw, w13, w2, TOPK, impl=impl, **kw)


# ---------------------------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["uniform", "skewed", "duplicated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_invariant_token_alone_equals_token_in_batch(dtype, kind):
    f = _moe(dtype, hot=kind != "uniform")
    report = check_invariance(f, _maker(kind, dtype), SIZES)
    assert report.passed, report.summary()


def test_invariant_sigmoid_no_renorm_and_fp16():
    f = _moe(torch.float16, scoring="sigmoid", renormalize=False)
    report = check_invariance(f, _maker("uniform", torch.float16), [1, 9, 33, 130], seeds=(0, 1))
    assert report.passed, report.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_every_tile_gives_the_same_bits(dtype):
    """The M/N tile (and so the dispatch padding) never changes a row's bits."""
    rw, w13, w2 = _weights(dtype, hot=True)
    x = _maker("skewed", dtype)(130)
    default = moe.fused_moe(x, rw, w13, w2, TOPK)
    bk = moe.MM.block_k(dtype)
    bad = []
    for bm in (16, 32, 64):
        for bn in (32, 64, 128):
            cfg = moe.MoEConfig(f"t{bm}x{bn}", bm, bn, bk, 1, 4, 2)
            if not bitwise_equal(moe.fused_moe(x, rw, w13, w2, TOPK, config=cfg), default):
                bad.append((bm, bn))
    assert not bad, f"tiles whose bits differ from the default: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_tile_orders_give_the_same_bits(dtype, monkeypatch):
    """The grouped GEMM's program order (:data:`~batch_invariance_kit.ops.moe.TILE_ORDER`) decides
    which program computes a tile, never how: both orders give the same bits, with several N tiles
    a block (BLOCK_N 16 against widths of 32 and 64), and the launch grids differ."""
    rw, w13, w2 = _weights(dtype, hot=True)
    x = _maker("skewed", dtype)(130)
    cfg = moe.MoEConfig("t16x16", 16, 16, moe.MM.block_k(dtype), 1, 4, 2)
    outs, grids = {}, {}
    for order in moe.TILE_ORDERS:
        monkeypatch.setattr(moe, "TILE_ORDER", order)
        outs[order] = moe.fused_moe(x, rw, w13, w2, TOPK, config=cfg)
        grids[order] = moe._gemm_params(130 * TOPK, 9, 64, 64, dtype, "invariant", cfg, True, TOPK, order)[0]
    assert bitwise_equal(outs["m_fast"], outs["n_fast"])
    assert grids["m_fast"] == (9, 4, 1) and grids["n_fast"] == (36, 1, 1)
    monkeypatch.setattr(moe, "TILE_ORDER", "k_fast")
    with pytest.raises(ValueError, match="TILE_ORDER"):
        moe.fused_moe(x, rw, w13, w2, TOPK, config=cfg)


def test_tile_grid_of_the_tiles_part_gives_the_same_bits():
    """Every tile the ``moe_tiles`` part times (up to 128 x 256) gives the default's bits; the
    part's summary picks the fastest tile per cell and keeps vLLM's time beside it."""
    from batch_invariance_kit.bench import moe as MB

    dtype = torch.bfloat16
    rw, w13, w2 = _weights(dtype, hot=True)
    x = _maker("skewed", dtype)(130)
    default = moe.fused_moe(x, rw, w13, w2, TOPK)
    cfgs = MB.tile_configs(dtype)
    assert len(cfgs) == len(MB.TILE_GRID) and {c.block_k for c in cfgs} == {moe.MM.block_k(dtype)}
    bad = [c.name for c in cfgs if not bitwise_equal(moe.fused_moe(x, rw, w13, w2, TOPK, config=c), default)]
    assert not bad, f"tiles whose bits differ from the default: {bad}"
    row = lambda name, us, pick=False, impl="kit-invariant": {  # noqa: E731
        "op": "moe_tile", "model": "m", "tokens": 8, "impl": impl, "is_pick": pick, "median_us": us,
        "config": {"name": name}}
    best = MB.best_tiles([row("invariant<=16", 10.0, True), row("a", 12.0), row("b", 8.0),
                          row(None, 9.0, impl="vllm-fused_moe"), {"op": "other"}])
    assert best == [{"model": "m", "tokens": 8, "pick_us": 10.0, "best": "b", "best_us": 8.0, "vllm_us": 9.0,
                     "pick_over_best": 1.25}]


def test_invariant_table_matches_the_stored_tile_sweep():
    """The invariant table's tile is within 5 % of the fastest tile of the stored ``moe_tiles``
    sweep (H100) at every token count of both models: the claim of ``INVARIANT_TABLE``'s comment."""
    from batch_invariance_kit.bench import moe as MB
    from batch_invariance_kit.bench import moe_vllm as MV
    from batch_invariance_kit.report import results

    doc = results.load("moe_tiles", "h100")
    assert doc["checks"] and all(c["passed"] for c in doc["checks"])  # every tile gave the pick's bits
    cells = MB.table_against_sweep(doc["rows"])
    assert {c["model"] for c in cells} == set(MV.MODELS) and len(cells) >= 2 * 14
    slow = [c for c in cells if c["table_over_fastest"] is None or c["table_over_fastest"] > 1.05]
    assert not slow, slow
    assert MB.tile_name(moe.select_config(1, 8, 128)) == "m16n64w4s4"


def test_tables_and_launches():
    for t in (1, 7, 65, 300, 10 ** 5):
        assert moe.router_launch(t, 128) == moe.router_launch(1, 128)
        for dt in (torch.bfloat16, torch.float32):
            c = moe.select_config(t, 8, 128, dt)
            assert c.block_k == moe.MM.block_k(dt) and c.split_k == 1
    assert moe.router_launch(1, 128, "variant") != moe.router_launch(300, 128, "variant")
    v = [moe.select_config(t, 8, 128, torch.bfloat16, "variant") for t in (1, 256, 4096, 8192)]
    assert [c.split_k for c in v] == [4, 2, 1, 1] and len({c.block_k for c in v}) > 1
    assert [moe.select_config(t, 8, 128).block_m for t in (1, 256, 2048, 8192)] == [16, 64, 128, 128]
    with pytest.raises(ValueError, match="config"):
        moe.fused_moe(*_args(torch.float32), config=moe.MoEConfig("x", 16, 32, 64, 1, 4, 2))
    with pytest.raises(TypeError, match="config"):
        moe.fused_moe(*_args(torch.float32), config="small")


# ---------------------------------------------------------------------------------------------
# negative controls
# ---------------------------------------------------------------------------------------------

def test_variant_router_fails():
    route = lambda lg: moe.route(lg, TOPK, renormalize=False, impl="variant")  # noqa: E731
    make = row_maker(64, dtype=torch.float32, scale=2.0)
    report = check_invariance(route, make, [1, 40, 100], seeds=(0, 1))
    assert not report.passed, "the router variant should change the softmax sum with the batch"
    for scoring in ("softmax", "sigmoid"):
        inv = lambda lg: moe.route(lg, TOPK, scoring=scoring, renormalize=False)  # noqa: E731
        report = check_invariance(inv, make, [1, 40, 100], seeds=(0, 1))
        assert report.passed, report.summary()


def _pieces(dtype, gemm_impl, h=256, inter=64):
    """Invariant gating and router, ``gemm_impl`` grouped GEMMs: isolates the GEMM variant."""
    rw, w13, w2 = _weights(dtype, h=h, inter=inter)

    def f(x):
        w, ids = moe.route(moe.MM.linear(x, rw), TOPK)
        cfg = moe.select_config(x.shape[0], TOPK, E, dtype, gemm_impl)
        d = moe.dispatch(ids, E, cfg.block_m)
        act = moe.grouped_gemm(x, w13, d, activation="silu_mul", gather_tokens=True, impl=gemm_impl)
        return moe.combine(moe.grouped_gemm(act, w2, d, impl=gemm_impl), w)
    return f


def test_variant_grouped_gemm_fails():
    make = _maker("uniform", torch.float32, h=256)
    report = check_invariance(_pieces(torch.float32, "variant"), make, [1, 130], stop_at_first=True)
    assert not report.passed, "the grouped-GEMM variant (split-K / BLOCK_K by load) should depend on the batch"
    report = check_invariance(_pieces(torch.float32, "invariant"), make, [1, 130])
    assert report.passed, report.summary()


#: A long K: over 4096, so K is cut into matmul's fixed chunks under the GPU's rule (2048 keys) and
#: the interpreter's (64) alike; 4160 = 2 x 2048 + 64 leaves a short last chunk.  4 experts and
#: 16 columns keep the interpreter quick.
LONG_K, LONG_N, LONG_E = 4160, 16, 4


def _long_k_gemms(impl):
    """``impl``'s grouped GEMMs over ``LONG_K`` in fp32, a token's two experts taken from its own
    first features (so they are the same alone and in a batch): gate/up with SiLU (the
    variant's split-K pass of its own) and a plain GEMM (matmul's split-K pass); a token's
    outputs side by side in one row."""
    w13 = seeded_normal((LONG_E, 2 * LONG_N, LONG_K), 21, device=DEV) * LONG_K ** -0.5
    w = seeded_normal((LONG_E, LONG_N, LONG_K), 22, device=DEV) * LONG_K ** -0.5

    def f(x):
        T = x.shape[0]
        _, ids = moe.route(x[:, :LONG_E].contiguous(), TOPK)
        d = moe.dispatch(ids, LONG_E, moe.select_config(T, TOPK, LONG_E, x.dtype, impl).block_m)
        act = moe.grouped_gemm(x, w13, d, activation="silu_mul", gather_tokens=True, impl=impl)
        y = moe.grouped_gemm(x, w, d, gather_tokens=True, impl=impl)
        return torch.cat([act.view(T, -1), y.view(T, -1)], 1)
    return f


def test_long_k_expert_gemm_invariant_and_its_variant_caught():
    """K over 4096 (matmul's chunked K order): a token's expert outputs are the same bits alone
    (a load of 1 token per expert) and in a batch of 33 (17 per expert: another row of both
    tables); the variant twin (split 4 then 2, K step 64 then 32) fails the same check."""
    assert moe.MM.k_chunk(LONG_K, torch.float32) < LONG_K
    assert moe.MM.k_chunk(LONG_K, torch.float32, compiled=True) < LONG_K
    assert [moe.select_config(t, TOPK, LONG_E, torch.float32, "variant").split_k for t in (1, 33)] == [4, 2]
    make = _maker("uniform", torch.float32, h=LONG_K)
    report = check_invariance(_long_k_gemms("invariant"), make, [33], positions=[0, -1])
    assert report.passed, report.summary()
    report = check_invariance(_long_k_gemms("variant"), make, [33], positions=[0, -1], stop_at_first=True)
    assert not report.passed, "the variant's split-K and K step by load should show over a long K"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("K", [H, LONG_K])
def test_expert_gemm_follows_the_matmul_k_order(dtype, K):
    """One K order for every weight of the kit: each row of the invariant grouped GEMM is
    bitwise the kit's matmul of that token by its expert's weight, for a K summed in one loop
    and for a long K (chunks of ``matmul.k_chunk``)."""
    x = seeded_normal((3, K), 23, dtype=dtype, device=DEV)
    w = seeded_normal((LONG_E, LONG_N, K), 24, dtype=dtype, device=DEV) * K ** -0.5
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32, device=DEV)
    y = moe.grouped_gemm(x, w, moe.dispatch(ids, LONG_E, 16), gather_tokens=True).view(3, TOPK, LONG_N)
    for e in range(3):
        ref = moe.MM.mm(x, w[e].t())  # every token through expert e (a matmul's rows are invariant)
        for t, r in (ids == e).nonzero().tolist():
            assert bitwise_equal(y[t, r], ref[t]), (e, t, r)


#: The combine on its own: top-8 (Qwen3-MoE, DeepSeek-V3; with top-2 a lane tree is the chain
#: again), 256 columns; at these batch sizes the variant's lanes are 4, 4, 2, 2, 1, 1.
CK, CH, COMBINE_SIZES = 8, 256, [1, 5, 20, 64, 65, 300]


def _combine_maker(dtype):
    """Expert outputs ``y`` (T, k, H) and positive fp32 router weights (T, k) summing to ~1 per
    token: full-precision rows sliced from one fixed tensor per seed, so a token's inputs are the
    same in every batch."""
    cache = {}

    def make(bs, seed=0):
        if seed not in cache:
            n = max(COMBINE_SIZES)
            y = seeded_normal((n, CK, CH), 40 + seed, dtype=dtype, device=DEV)
            a = seeded_normal((n, CK), 50 + seed, dtype=torch.float64).abs() + 0.05
            cache[seed] = (y, (a / a.sum(1, keepdim=True)).float().to(DEV))
        y, w = cache[seed]
        return y[:bs], w[:bs]
    return make


def _combine(impl):
    return lambda y, w: moe.combine(y.reshape(-1, CH), w, impl=impl)


def test_combine_launch_invariant_ignores_tokens_variant_picks_lanes_by_tokens():
    for h in (64, 256, 4096):
        assert all(moe.combine_launch(t, CK, h) == moe.combine_launch(1, CK, h) for t in (5, 65, 300, 10 ** 5))
        assert moe.combine_launch(1, CK, h)["lanes"] == 1
    assert [moe.combine_launch(t, CK, CH, "variant")["lanes"] for t in COMBINE_SIZES] == [4, 4, 2, 2, 1, 1]
    assert moe.combine_launch(1, 2, CH, "variant")["lanes"] == 2  # capped at top_k
    for bad, msg in (((0, CK, CH), "num_tokens"), ((3, 0, CH), "top_k"), ((3, CK, -1), "hidden")):
        with pytest.raises(ValueError, match=msg):
            moe.combine_launch(*bad)
    with pytest.raises(ValueError, match="impl"):
        moe.combine_launch(3, CK, CH, "fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
def test_variant_combine_fails_on_the_same_expert_outputs(dtype):
    """The combine isolated: the same ``y`` and weights into both impls.  The invariant gives a
    token the same bits alone and in every batch; the variant's lane tree (4 lanes for 1..8
    tokens, 2 up to 64, one chain above) must show.  Negative control in fp32 only: rounding
    the fp32 sum to 16 bits nearly always absorbs a 1-ulp change of the tree."""
    make = _combine_maker(dtype)
    check = dict(positions=lambda bs: {*range(0, bs, max(1, bs // 6)), bs - 1}, seeds=(0, 1))
    report = check_invariance(_combine("invariant"), make, COMBINE_SIZES, **check)
    assert report.passed, report.summary()
    if dtype != torch.float32:
        return
    report = check_invariance(_combine("variant"), make, COMBINE_SIZES, **check)
    assert not report.passed, "the combine variant should change a token's sum with the batch"
    assert set(report.diverging_batch_sizes) == {20, 64, 65, 300}, report.diverging_batch_sizes
    y, w = make(300)
    ref = moe.combine(y.reshape(-1, CH), w, impl="reference").double()
    for impl in ("invariant", "variant"):  # both accurate: only the variant's bits move
        for n in (1, 20, 300):
            got = moe.combine(y[:n].reshape(-1, CH), w[:n], impl=impl).double()
            torch.testing.assert_close(got, ref[:n], rtol=0, atol=2e-6)


def _shared_maker(dtype):
    """:func:`_combine_maker`'s rows plus a shared experts' output (T, H) per token."""
    base, cache = _combine_maker(dtype), {}

    def make(bs, seed=0):
        if seed not in cache:
            cache[seed] = seeded_normal((max(COMBINE_SIZES), CH), 60 + seed, dtype=dtype, device=DEV)
        return (*base(bs, seed), cache[seed][:bs])
    return make


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_combine_adds_the_shared_output_inside_its_one_rounding(dtype):
    """With a DeepSeek layer's shared experts' output the combine stays invariant (and its
    variant is still caught in fp32), agrees with the float64 sum, gives zeros' bits equal to no
    shared output at all, and rounds once: in bf16 some elements differ from rounding the routed
    sum first and adding the shared output after (the two-rounding form)."""
    make = _shared_maker(dtype)
    check = dict(positions=lambda bs: {*range(0, bs, max(1, bs // 6)), bs - 1}, seeds=(0, 1))

    def fn(impl):
        return lambda y, w, s: moe.combine(y.reshape(-1, CH), w, shared=s, impl=impl)
    report = check_invariance(fn("invariant"), make, COMBINE_SIZES, **check)
    assert report.passed, report.summary()
    if dtype == torch.float32:
        report = check_invariance(fn("variant"), make, COMBINE_SIZES, **check)
        assert not report.passed, "the combine variant should change a token's sum with the batch"
    y, w, s = make(300)
    y = y.reshape(-1, CH)
    got = moe.combine(y, w, shared=s)
    ref = moe.combine(y, w, shared=s, impl="reference")
    tol = 2e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
    assert bitwise_equal(moe.combine(y, w, shared=torch.zeros_like(s)), moe.combine(y, w))
    if dtype == torch.bfloat16:
        two_roundings = (moe.combine(y, w).float() + s.float()).to(dtype)
        assert not bitwise_equal(got, two_roundings), "the shared output must be added before the one rounding"


@pytest.mark.skipif(not batch_invariance_kit.INTERPRET, reason="the interpreter's fp32 arithmetic rounds every "
                    "operation, as torch's does: a GPU compile may fuse w * y + acc into one FMA")
def test_combine_order_routed_ranks_then_shared():
    """The combine's order, bitwise: ``((w_0 y_0 + w_1 y_1) + ...) + shared`` in fp32, each
    operation rounded; the shared term first gives other bits (so the check can fail)."""
    y, w, s = _shared_maker(torch.float32)(300)
    got = moe.combine(y.reshape(-1, CH), w, shared=s)
    acc = torch.zeros_like(s)
    for r in range(CK):
        acc = acc + w[:, r:r + 1] * y[:, r]
    assert bitwise_equal(got, acc + s)
    first = s.clone()
    for r in range(CK):
        first = first + w[:, r:r + 1] * y[:, r]
    assert not bitwise_equal(got, first), "adding the shared output first must give other bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_silu_mul_rows_alone_and_in_batches(dtype):
    """The dense activation kernel: ``silu(gate) * up`` per element, the same bits for a row
    alone and in every batch (one launch shape), within one rounding of float64; bad input
    refused naming the argument."""
    I = 300  # not a multiple of the kernel's column block: the masked edge is checked too
    rows = seeded_normal((260, 2 * I), 70, dtype=dtype, device=DEV) * 3

    def make(bs, seed=0):
        return (rows[:bs],)
    report = check_invariance(lambda gu: moe.silu_mul(gu), make, [1, 2, 7, 65, 260], positions="all")
    assert report.passed, report.summary()
    got = moe.silu_mul(rows).double()
    g, u = rows[:, :I].double(), rows[:, I:].double()
    want = g / (1 + torch.exp(-g)) * u
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    out = torch.empty((260, I), dtype=dtype, device=DEV)
    assert moe.silu_mul(rows, out=out) is out and bitwise_equal(out, moe.silu_mul(rows))
    with pytest.raises(ValueError, match="gu must have an even"):
        moe.silu_mul(rows[:, 1:].contiguous())
    with pytest.raises(ValueError, match="gu must be contiguous"):
        moe.silu_mul(rows.t())
    with pytest.raises((TypeError, ValueError), match="out"):
        moe.silu_mul(rows, out=torch.empty((260, I + 1), dtype=dtype, device=DEV))


def test_variant_fused_moe_fails():
    f = _moe(torch.float32, impl="variant", h=256, inter=64)
    report = check_invariance(f, _maker("uniform", torch.float32, h=256), [1, 130], stop_at_first=True)
    assert not report.passed


# ---------------------------------------------------------------------------------------------
# accuracy, guards
# ---------------------------------------------------------------------------------------------

TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("scoring,renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
def test_matches_float64_reference(dtype, scoring, renorm):
    rw, w13, w2 = _weights(dtype)
    x = _maker("uniform", dtype)(50)
    kw = dict(scoring=scoring, renormalize=renorm)
    logits = moe.MM.linear(x, rw)
    w, ids = moe.route(logits, TOPK, **kw)
    rwt, rids = moe.reference_route(logits, TOPK, **kw)
    assert torch.equal(ids.cpu(), rids.cpu())
    assert torch.allclose(w.cpu(), rwt.cpu(), rtol=1e-6, atol=1e-7)
    ref = moe.fused_moe(x, rw, w13, w2, TOPK, impl="reference", **kw).double().cpu()
    for impl in ("invariant", "variant"):
        got = moe.fused_moe(x, rw, w13, w2, TOPK, impl=impl, **kw).double().cpu()
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < TOL[dtype], f"{impl}: relative error {err}"


@pytest.mark.parametrize("impl", ["invariant", "variant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_guard_regions(dtype, impl):
    rw, w13, w2 = _weights(dtype)
    x = _maker("skewed", dtype)(45)
    T = x.shape[0]
    gw, gi = Guarded((T, TOPK), torch.float32, DEV), Guarded((T, TOPK), torch.int32, DEV)
    w, ids = moe.route(moe.MM.linear(x, rw), TOPK, impl=impl, out=(gw.tensor, gi.tensor))
    cfg = moe.select_config(T, TOPK, E, dtype, impl)
    d = moe.dispatch(ids, E, cfg.block_m)
    ga = Guarded((T * TOPK, INTER), dtype, DEV)
    moe.grouped_gemm(x, w13, d, activation="silu_mul", gather_tokens=True, impl=impl, out=ga.tensor)
    gy = Guarded((T * TOPK, H), dtype, DEV)
    moe.grouped_gemm(ga.tensor, w2, d, impl=impl, out=gy.tensor)
    go = Guarded((T, H), dtype, DEV)
    moe.combine(gy.tensor, gw.tensor, impl=impl, out=go.tensor)
    for g in (gw, gi, ga, gy, go):
        g.check()
        assert g.unwritten() == 0


# ---------------------------------------------------------------------------------------------
# tie rule, dispatch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["invariant", "variant", "reference"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_tie_rule_lower_expert_wins(impl, scoring):
    lg = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                       [0.0, 2.0, 0.5, 2.0, 0.0, 2.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                       [-1.0, 3.0, 3.0, -1.0, 5.0, 3.0, 0.0, 0.0]], device=DEV)
    w, ids = moe.route(lg, 3, scoring=scoring, impl=impl)
    assert ids.tolist() == [[0, 1, 2], [1, 3, 5], [0, 1, 2], [4, 1, 2]]
    assert torch.allclose(w.sum(1).cpu(), torch.ones(4))


def test_dispatch_layout_across_block_edges():
    bm = 16
    for counts in ([15, 16, 17, 0, 31, 32, 33, 1], [0] * 7 + [40], [1] * 8):
        # every expert appears counts[e] times across the rows of a top-2 id table
        flat = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
        flat = flat[torch.from_numpy(__import__("numpy").random.default_rng(3).permutation(flat.numel()))]
        if flat.numel() % 2:
            continue
        ids = flat.view(-1, 2).to(torch.int32).to(DEV)
        d = moe.dispatch(ids, 8, bm)
        n = ids.numel()
        assert d.counts.tolist() == counts
        assert d.padded_counts.tolist() == [-(-c // bm) * bm for c in counts]
        s = d.sorted_ids.cpu().tolist()
        be = d.block_expert.cpu().tolist()
        pos = 0
        for e, c in enumerate(counts):
            want = [i for i in range(n) if int(flat[i]) == e]  # by expert, then by row id (token, rank)
            blocks = -(-c // bm)
            assert s[pos:pos + c] == want and all(v == n for v in s[pos + c:pos + blocks * bm])
            assert be[pos // bm:pos // bm + blocks] == [e] * blocks
            pos += blocks * bm
        assert all(v == n for v in s[pos:]) and all(b == -1 for b in be[pos // bm:])
        assert len(be) * bm == len(s) >= pos


def _sorted_dispatch(topk_ids, num_experts, block_m):
    """The dispatch layout by a stable sort and searches in torch (a sort by expert, each
    expert's rows padded to block_m, the blocks' experts by a search of the padded ends): the
    layout the dispatch kernel must reproduce exactly."""
    dev = topk_ids.device
    T, k = topk_ids.shape
    n = T * k
    sorted_e, order = torch.sort(topk_ids.reshape(-1).long(), stable=True)
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=dev))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    dest = (pend - padded)[sorted_e] + torch.arange(n, device=dev) - bounds[sorted_e]
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    be = torch.searchsorted(pend, torch.arange(num_blocks, device=dev) * block_m, right=True)
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    return moe.Dispatch(sorted_ids, block_expert, counts, padded, n, num_experts, k, block_m)


@pytest.mark.parametrize("tile", ["default", 64])
def test_dispatch_kernel_equals_the_stable_sort(tile, monkeypatch):
    """The dispatch kernel's layout is the stable sort's, field by field: in one launch (the
    whole id table in one tile) and in two (tiles of 64 one-hot elements: many tiles, many
    block programs), with hot experts, idle experts and counts across block edges.  A MoE layer
    on the sort's layout gives bitwise the output of ``fused_moe``."""
    if tile != "default":
        monkeypatch.setattr(moe, "_DISPATCH_TILE", tile)
    g = torch.Generator().manual_seed(5)
    for T, k, e, bm in [(1, 2, 8, 16), (9, 2, 8, 16), (130, 2, 8, 32), (33, 8, 128, 16), (70, 4, 60, 64)]:
        ids = torch.randint(0, e, (T, k), generator=g, dtype=torch.int32)
        ids[: T // 2, 0] = 3  # a hot expert
        ids = ids.to(DEV)
        got, want = moe.dispatch(ids, e, bm), _sorted_dispatch(ids, e, bm)
        for field in ("sorted_ids", "block_expert", "counts", "padded_counts"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (T, k, e, bm, field)
        assert (got.num_valid, got.num_experts, got.top_k, got.block_m) == (T * k, e, k, bm)
    impl = "invariant" if tile == "default" else "variant"
    rw, w13, w2 = _weights(torch.float32)
    x = _maker("skewed", torch.float32)(45)
    w, ids = moe.route(moe.MM.linear(x, rw, impl=impl), TOPK, impl=impl)
    cfg = moe.select_config(45, TOPK, E, x.dtype, impl)
    d = _sorted_dispatch(ids, E, cfg.block_m)
    h = moe.grouped_gemm(x, w13, d, activation="silu_mul", gather_tokens=True, impl=impl, config=cfg)
    y = moe.combine(moe.grouped_gemm(h, w2, d, impl=impl, config=cfg), w, impl=impl)
    assert bitwise_equal(moe.fused_moe(x, rw, w13, w2, TOPK, impl=impl), y)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def _args(dtype=torch.float32):
    rw, w13, w2 = _weights(dtype)
    return _maker("uniform", dtype)(3), rw, w13, w2, TOPK


def test_bad_inputs_name_the_argument():
    x, rw, w13, w2, k = _args()
    cases = [
        (dict(top_k=9), ValueError, "top_k"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(x=x.to(torch.int32)), TypeError, "x"),
        (dict(x=x[:, :32].contiguous()), ValueError, "router_weight"),
        (dict(x=x.t().contiguous().t()), ValueError, "x must be contiguous"),
        (dict(x=x[:0]), ValueError, "x must not be empty"),
        (dict(x=x[0]), ValueError, "x must be 2-D"),
        (dict(router_weight=rw.to(torch.bfloat16)), TypeError, "router_weight"),
        (dict(w_gate_up=w13[:, :-1]), ValueError, "w_gate_up"),
        (dict(w_gate_up=w13[:4]), ValueError, "w_gate_up"),
        (dict(w_down=w2[..., :16].contiguous()), ValueError, "w_down"),
        (dict(w_down=w2.transpose(1, 2)), ValueError, "w_down"),
        (dict(w_down="w"), TypeError, "w_down"),
        (dict(scoring="tanh"), ValueError, "scoring"),
        (dict(renormalize=1), TypeError, "renormalize"),
        (dict(impl="fast"), ValueError, "impl"),
    ]
    for change, exc, msg in cases:
        kw = dict(x=x, router_weight=rw, w_gate_up=w13, w_down=w2, top_k=k)
        kw.update(change)
        with pytest.raises(exc, match=msg):
            moe.fused_moe(kw.pop("x"), kw.pop("router_weight"), kw.pop("w_gate_up"), kw.pop("w_down"),
                          kw.pop("top_k"), **kw)
    if DEV.type == "cpu" and torch.cuda.is_available() is False:
        with pytest.raises(ValueError, match="x must be on cpu"):
            moe.fused_moe(x.to("meta"), rw.to("meta"), w13.to("meta"), w2.to("meta"), k)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.dispatch(torch.tensor([[0, 8]], device=DEV), 8, 16)
    with pytest.raises(TypeError, match="topk_ids"):
        moe.dispatch(torch.tensor([[0.0, 1.0]], device=DEV), 8, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe.dispatch(torch.tensor([[0, 1]], device=DEV), 8, 0)
    d = moe.dispatch(torch.tensor([[0, 1]], device=DEV), 8, 32)
    with pytest.raises(ValueError, match="block_m"):
        moe.grouped_gemm(x[:1], w13, d, activation="silu_mul", gather_tokens=True)
    with pytest.raises(ValueError, match="a must have"):
        moe.grouped_gemm(x, w13, moe.dispatch(torch.tensor([[0, 1]], device=DEV), 8, 16), gather_tokens=True)
    with pytest.raises(TypeError, match="disp"):
        moe.grouped_gemm(x, w13, None)
    with pytest.raises(TypeError, match="topk_weights"):
        moe.combine(torch.zeros(6, H, device=DEV), torch.zeros(3, 2, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="y must have"):
        moe.combine(torch.zeros(5, H, device=DEV), torch.zeros(3, 2, device=DEV))
    with pytest.raises(ValueError, match="impl"):
        moe.combine(torch.zeros(6, H, device=DEV), torch.zeros(3, 2, device=DEV), impl="fast")
    with pytest.raises(ValueError, match="y must have"):
        moe.combine(torch.zeros(5, H, device=DEV), torch.zeros(3, 2, device=DEV), impl="variant")
    y6, w3 = torch.zeros(6, H, device=DEV), torch.zeros(3, 2, device=DEV)
    with pytest.raises(ValueError, match="shared must have shape"):
        moe.combine(y6, w3, shared=torch.zeros(3, H + 1, device=DEV))
    with pytest.raises(TypeError, match="shared"):
        moe.combine(y6, w3, shared=torch.zeros(3, H, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="shared must be contiguous"):
        moe.combine(y6, w3, shared=torch.zeros(H, 3, device=DEV).t())
    with pytest.raises(ValueError, match="shared must have shape"):
        moe.fused_moe(x, rw, w13, w2, k, shared=torch.zeros(x.shape[0] + 1, x.shape[1], dtype=x.dtype, device=DEV))
    with pytest.raises(ValueError, match="logits"):
        moe.route(torch.zeros(3, device=DEV), 1)
    with pytest.raises(ValueError, match="out"):
        moe.route(torch.zeros(3, 8, device=DEV), 2, out=(torch.zeros(3, 3, device=DEV),
                                                          torch.zeros(3, 2, dtype=torch.int32, device=DEV)))


# ---------------------------------------------------------------------------------------------
# GPU (compiled Triton): Qwen3-30B-A3B-like routing at a reduced width
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_invariant_and_variant_bf16():
    e, k, h, inter = 128, 8, 1024, 256
    rw = (torch.randn(e, h, device=DEV) * h ** -0.5).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device=DEV) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEV) * inter ** -0.5).bfloat16()
    make = row_maker(h, dtype=torch.bfloat16)
    sizes = [1, 3, 16, 64, 255, 256, 1024, 4096]
    inv = lambda x: moe.fused_moe(x, rw, w13, w2, k)  # noqa: E731
    report = check_invariance(inv, make, sizes, seeds=(0, 1))
    assert report.passed, report.summary()
    var = lambda x: moe.fused_moe(x, rw, w13, w2, k, impl="variant")  # noqa: E731
    assert not check_invariance(var, make, sizes, stop_at_first=True).passed


# ---------------------------------------------------------------------------------------------
# the comparison with vLLM's fused_moe: its stored results, its cost rows and chapter 5's figure
# ---------------------------------------------------------------------------------------------

def _store_vs_vllm(folder):
    """A moe_vs_vllm.json of made-up times (the file's shape, not a measurement)."""
    from batch_invariance_kit.bench.moe_vllm import MODELS, VLLM_IMPL
    from batch_invariance_kit.report import results

    rows = []
    for model, spec in MODELS.items():
        for n, (kit, vllm) in zip((1, 64, 4096), ((50.0, 40.0), (80.0, 80.0), (900.0, 1000.0))):
            for impl, us in (("kit-invariant", kit), (VLLM_IMPL, vllm)):
                rows.append({"op": "moe", "impl": impl, "model": model, "tokens": n, "experts": spec["experts"],
                             "top_k": spec["top_k"], "median_us": us})
    results.save("moe_vs_vllm", rows, [results.goal("moe example", False)], command="test", folder=folder)


def test_vs_vllm_rows_read_as_a_cost_family_and_plot(tmp_path, capsys):
    """The stored comparison becomes the "moe vs vLLM" family of the cost summary (speed ratio =
    vLLM's time / the kit's, the goal checked over it), and chapter 5's figure draws it; with no
    stored file the figure function prints its fixed message and returns None."""
    import matplotlib

    matplotlib.use("Agg")
    from batch_invariance_kit.report import cost, plots

    (tmp_path / "none").mkdir()
    assert plots.moe_vs_vllm("none", root=tmp_path) is None
    assert capsys.readouterr().out.strip() == plots.NO_MOE_VS_VLLM
    _store_vs_vllm(tmp_path / "gpu")
    rows = [r for r in cost.summary("gpu", root=tmp_path) if r["family"] == "moe vs vLLM"]
    assert len(rows) == 6 and {r["peer"] for r in rows} == {"vllm-fused_moe"}
    ratio = {(r["params"]["model"], r["params"]["tokens"]): r["speed_ratio"] for r in rows}
    assert ratio[("Qwen3-30B-A3B", 1)] == pytest.approx(0.8) and ratio[("DeepSeek-V2-Lite", 4096)] == pytest.approx(1000 / 900)
    goal = [g for g in cost.check_goals(rows) if g["family"] == "moe vs vLLM"]
    assert goal and goal[0]["cells"] == 6 and goal[0]["cells_met"] == 4 and not goal[0]["met"]
    fig = plots.moe_vs_vllm("gpu", root=tmp_path)
    assert fig is not None and len(fig.axes) == 2


def _deepseek_like(h=H):
    """A small layer of DeepSeek-V2-Lite's kind: softmax top-k without renormalisation, two shared experts."""
    return dict(experts=E, top_k=TOPK, hidden=h, inter=INTER, renormalize=False, shared=2)


def test_vs_vllm_kit_layer_with_shared_experts_invariant_accurate_variant_caught():
    """The kit's side of the comparison with vLLM (bench.moe_vllm.kit_layer, shared experts added
    in fp32): a token alone == the token in every batch, bitwise; close to float64 (the routed
    reference plus the shared SwiGLU MLP); the same layer with variant kernels is caught."""
    import torch.nn.functional as F

    from batch_invariance_kit.bench import moe_vllm as V

    spec = _deepseek_like()
    w = V.layer_weights(spec, device=DEV)
    assert w["shared_gate_up"].shape == (2 * 2 * INTER, H) and w["shared_down"].shape == (H, 2 * INTER)
    make = _maker("uniform", V.DTYPE)
    assert check_invariance(lambda x: V.kit_layer(x, w, spec), make, [1, 7, 33, 130]).passed
    x = make(50)
    gu = x.double() @ w["shared_gate_up"].double().t()
    shared = (F.silu(gu[:, :2 * INTER]) * gu[:, 2 * INTER:]) @ w["shared_down"].double().t()
    ref = moe.fused_moe(x, w["router"], w["w13"], w["w2"], TOPK, renormalize=False, impl="reference",
                        shared=shared.to(x.dtype)).double().cpu()  # the routed sum and shared output, rounded once
    err = float((V.kit_layer(x, w, spec).double().cpu() - ref).abs().max() / ref.abs().max())
    assert err < TOL[torch.bfloat16], f"relative error {err}"
    wide = _deepseek_like(h=256)
    w = V.layer_weights(wide, device=DEV, dtype=torch.float32)
    variant = check_invariance(lambda x: V.kit_layer(x, w, wide, impl="variant"), _maker("uniform", torch.float32, h=256),
                               [1, 130], stop_at_first=True)
    assert not variant.passed


def test_vs_vllm_command_stops_with_a_message_before_measuring(tmp_path, monkeypatch):
    """``python -m batch_invariance_kit.bench.moe_vllm``: vLLM's own invariant mode on, or no CUDA
    device, ends the command with a message naming why, and nothing is written."""
    from batch_invariance_kit.bench import moe_vllm as V

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(SystemExit, match="default mode"):
        V.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        V.main(["--out", str(tmp_path), "--models", "Qwen3-8B"])  # not a model of the comparison
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="GPU box"):
            V.main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def _small_comparison(monkeypatch, V) -> dict:
    """``bench.moe_vllm`` on the CPU: two small fp32 layers (a Qwen-like and a DeepSeek-like one)
    in place of its models, and the kit's variant layer standing in for vLLM's.  Returns the models."""
    small = {"qwen-like": dict(experts=E, top_k=TOPK, hidden=H, inter=INTER, renormalize=True, shared=0),
             "deepseek-like": _deepseek_like(h=256)}
    make_weights = V.layer_weights
    monkeypatch.setattr(V, "MODELS", small)
    monkeypatch.setattr(V, "layer_weights", lambda spec: make_weights(spec, device=DEV, dtype=torch.float32))
    monkeypatch.setattr(V, "vllm_layer", lambda: (lambda x, w, spec: V.kit_layer(x, w, spec, impl="variant"),
                                                  "stand-in"))
    return small


def test_vs_vllm_rows_and_checks_with_stand_ins(monkeypatch):
    """vs_vllm's bookkeeping on the CPU, with stand-ins for what needs the GPU (small fp32 layers,
    a fixed timer, the kit's variant layer standing in for vLLM): one row per (model, tokens,
    implementation), the kit's bitwise check required and passed, the stand-in's differences
    observed, one goal per cell with the ratio of the two medians."""
    import itertools

    from batch_invariance_kit.bench import moe_vllm as V

    small = _small_comparison(monkeypatch, V)
    medians = itertools.cycle([40.0, 30.0])  # the kit's cell first, then the peer's

    def timer(fn, **kw):
        t = next(medians)
        return {"median_us": t, "p25_us": t - 1, "p75_us": t + 1}, False
    monkeypatch.setattr(V, "median_us_graph_or_plain", timer)
    rows, checks = V.vs_vllm(True, tokens=[1, 130])
    assert [(r["model"], r["tokens"], r["impl"]) for r in rows] == [
        (m, n, impl) for m in small for n in (1, 130) for impl in (V.KIT_IMPL, V.VLLM_IMPL)]
    assert all(r["rows_differing_from_alone"] == 0 for r in rows if r["impl"] == V.KIT_IMPL)
    required = [c for c in checks if not c.get("goal") and not c.get("informational")]
    assert len(required) == 2 and all(c["passed"] for c in required)
    observed = [c for c in checks if "tokens_differing" in c]
    assert len(observed) == 2 and any(c["tokens_differing"] for c in observed)  # the variant stand-in differs
    goals = [c for c in checks if c.get("goal")]
    assert len(goals) == 4 and all(c["speed_ratio_vs_vllm"] == 30.0 / 40.0 and not c["passed"] for c in goals)


def test_stages_time_every_step_and_the_kit_steps_give_the_layer_bits(monkeypatch):
    """``moe_stages`` on the CPU with stand-ins for what needs the GPU (small fp32 layers, a fixed
    timer, the kit's variant layer as vLLM's): one row per step of each layer and one for the
    whole layer; the kit's steps, run one by one from the inputs the steps before them made, give
    the layer's bits (a required check), and a step that changes the arithmetic fails it."""
    from batch_invariance_kit.bench import moe_vllm as V

    small = _small_comparison(monkeypatch, V)
    monkeypatch.setattr(V, "vllm_steps", lambda x, w, spec: {
        "experts": (lambda a: V.kit_layer(a, w, spec, impl="variant"), (x,))})

    def timer(fn, **kw):  # runs the step once, returns a fixed time
        fn()
        return {"median_us": 5.0, "p25_us": 4.0, "p75_us": 6.0}, False
    monkeypatch.setattr(V, "median_us_graph_or_plain", timer)
    rows, checks = V.stages(True, tokens=[1, 9])
    kit = [(r["model"], r["tokens"], r["stage"]) for r in rows if r["impl"] == V.KIT_IMPL]
    assert kit == [(m, n, s) for m in small for n in (1, 9)
                   for s in ("layer",) + V.KIT_STAGES[(0 if small[m]["shared"] else 1):]]
    assert {r["stage"] for r in rows if r["impl"] == V.VLLM_IMPL} == {"layer", "experts"}
    assert len(checks) == 2 and all(c["passed"] for c in checks)

    steps = V.kit_steps

    def off(x, w, spec):  # the combine step with its weights scaled: no longer the layer's arithmetic
        s = steps(x, w, spec)
        fn, (y, wts, shared) = s["combine"]
        s["combine"] = (fn, (y, wts * 1.5, shared))
        return s
    monkeypatch.setattr(V, "kit_steps", off)
    _, checks = V.stages(True, tokens=[3], models=["qwen-like"])
    assert len(checks) == 1 and not checks[0]["passed"]
    with pytest.raises(ValueError, match="models"):
        V.stages(True, models=["Qwen3-8B"])
