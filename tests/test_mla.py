"""MLA over the paged latent cache: a token's output bits do not depend on (a) the batch around it
or (b) whether it was computed by prefill or decode, at any chunk start; the split-KV variant
(splits from the batch) fails (a); the "two forms" variant (prefill expanded to per-head keys
and values, decode absorbed) fails (b); the absorbed kernel, the per-head projections and the
layer agree with float64; outputs stay inside guard regions; bad input is refused naming the
argument.

Sizes follow the kit attention's config (``A.default_config()``: 32-key tiles and 32-64-key
splits under the interpreter), so contexts of up to 100 positions cross tiles, splits and
cache blocks (16); 4 heads, latent 32, rope 16, nope 16, values 16.
"""
import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops import mla as M
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bitwise_equal, check_invariance, seeded_normal

DEV = batch_invariance_kit.DEVICE
CFG = A.default_config()
SPLIT = CFG.split_size
H, LORA, ROPE, NOPE, V, BS = 4, 32, 16, 16, 16, 16
SHAPE = M.MLAShape(H, LORA, ROPE, NOPE, V)
DT = torch.bfloat16
#: a prompt that crosses tiles, cache blocks and a split edge
N = SPLIT + 6


def _seq(seed, r, n, dtype=DT):
    """Latents, rope keys and per-head queries of positions 0..n-1 of sequence ``r``."""
    g = seed * 1_000_003 + r * 7919
    lat = seeded_normal((n, LORA), g + 1, dtype=dtype, device=DEV)
    kpe = seeded_normal((n, ROPE), g + 2, dtype=dtype, device=DEV)
    qn = seeded_normal((n, H, NOPE), g + 3, dtype=dtype, device=DEV)
    qp = seeded_normal((n, H, ROPE), g + 4, dtype=dtype, device=DEV)
    return lat, kpe, qn, qp


def _weights(dtype=DT):
    wkc = (seeded_normal((H, NOPE, LORA), 5) * NOPE ** -0.5).to(dtype=dtype, device=DEV)
    wvc = (seeded_normal((H, LORA, V), 6) * LORA ** -0.5).to(dtype=dtype, device=DEV)
    return wkc, wvc


def _cache(dtype=DT, seed=0, num_blocks=64):
    return M.LatentCache(num_blocks, BS, LORA, ROPE, dtype, device=DEV, seed=seed)


def _layer(c, steps, impl, w):
    """``mla`` of one step ``[(name, q_nope, q_pe, seq_len)]`` over the cache ``c``."""
    _, bt, lens, qsl = c.args([(n, qn, L) for n, qn, _, L in steps])
    qn = torch.cat([s[1] for s in steps])
    qp = torch.cat([s[2] for s in steps])
    return M.mla(qn, qp, c.cache, bt, lens, qsl, *w, impl=impl)


def _prefill_vs_decode(impl, chunks):
    """Positions of one prompt computed in chunks starting at ``chunks`` vs decoded (one decode
    step of every position: each a one-token sequence reading the prompt's blocks): the list of
    positions whose outputs differ bitwise."""
    lat, kpe, qn, qp = _seq(1, 0, N)
    w = _weights()
    c = _cache(seed=3, num_blocks=N // BS + 2)
    c.write("s", lat, kpe, 0)
    edges = list(chunks) + [N]
    pre = torch.cat([_layer(c, [("s", qn[a:b], qp[a:b], b)], impl, w) for a, b in zip(edges, edges[1:])])
    for p in range(N):
        c.tables[p] = c.tables["s"]
    dec = _layer(c, [(p, qn[p:p + 1], qp[p:p + 1], p + 1) for p in range(N)], impl, w)
    return [p for p in range(N) if not bitwise_equal(pre[p], dec[p])]


@pytest.mark.parametrize("chunks", [(0,), (0, 37, 50)], ids=["one_prefill", "chunks_at_37_50"])
def test_prefill_equals_decode_at_every_position(chunks):
    assert _prefill_vs_decode("invariant", chunks) == []


def test_two_forms_break_prefill_equals_decode():
    """The negative control: prefill expanded to per-head K/V, decode absorbed."""
    differ = _prefill_vs_decode("two_forms", (0,))
    assert len(differ) > N // 4, differ


LENS = [SPLIT + 45, 1, 2 * SPLIT + 1, SPLIT, CFG.block_n - 1, 3 * SPLIT - 7, CFG.block_n + 1, 17]


def _decode_op(impl):
    """(f, make_batch): row r = the last query of sequence r (context ``LENS[r % 8]``); ``f``
    writes a fresh cache (blocks shuffled by the batch size) and decodes the batch at once."""
    lmax = max(LENS)

    def make(bs, seed=0):
        rows = []
        for r in range(bs):
            n = LENS[r % len(LENS)]
            lat, kpe, qn, qp = _seq(seed, r, n)
            pad = lmax - n
            rows.append((torch.cat([lat, lat.new_zeros((pad, LORA))]), torch.cat([kpe, kpe.new_zeros((pad, ROPE))]),
                         qn[-1], qp[-1], n))
        return (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                torch.stack([r[2] for r in rows]), torch.stack([r[3] for r in rows]),
                torch.tensor([r[4] for r in rows], device=DEV))

    w = _weights()

    def f(lat, kpe, qn, qp, lens):
        c = _cache(seed=lat.shape[0], num_blocks=sum(-(-int(n) // BS) for n in lens) + 8)
        steps = []
        for i in range(lat.shape[0]):
            n = int(lens[i])
            c.write(i, lat[i, :n], kpe[i, :n], 0)
            steps.append((i, qn[i:i + 1], qp[i:i + 1], n))
        return _layer(c, steps, impl, w)
    return f, make


def test_decode_batch_invariant():
    f, make = _decode_op("invariant")
    rep = check_invariance(f, make, [1, 3, 8], positions="all")
    assert rep.passed and rep.checks == 12, rep.summary()


@pytest.fixture
def eight_sms(monkeypatch):
    """The split-KV variant plans for 8 SMs on every device, as under the interpreter.  With a
    GPU's count (132 on an H200: 264 splits for one sequence, 33 for eight) every context of
    ``LENS`` gets one-tile splits at both batch sizes, the same plan, and the negative control
    would prove nothing."""
    monkeypatch.setattr(A, "num_sms", lambda: 8)


def test_split_kv_variant_caught(eight_sms):
    """The negative control: split sizes from the number of sequences."""
    alone = [M.mla_split_sizes([n], [0, 1], impl="variant")[0] for n in LENS]
    in_batch = M.mla_split_sizes(LENS, list(range(len(LENS) + 1)), impl="variant")
    assert alone != in_batch, (alone, in_batch)   # the variant plans a sequence alone otherwise
    f, make = _decode_op("variant")
    rep = check_invariance(f, make, [1, 8], positions="all")
    assert rep.checks == 9 and not rep.passed, rep.summary()


@pytest.mark.parametrize("sms, n", [(8, 200), (132, 264 * 64)], ids=["8_sms", "132_sms"])
def test_variant_split_sizes_follow_the_batch_and_invariant_ones_do_not(monkeypatch, sms, n):
    """At 132 SMs (264 splits alone, 33 among 8) the variant's split moves with the batch only for
    contexts of more than 33 tiles (shorter ones get one-tile splits either way); the invariant
    split never moves."""
    monkeypatch.setattr(A, "num_sms", lambda: sms)
    one = M.mla_split_sizes([n], [0, 1], impl="variant")
    many = M.mla_split_sizes([n] * 8, list(range(9)), impl="variant")
    assert one[0] != many[0]
    assert (M.mla_split_sizes([n], [0, 1])[0] == M.mla_split_sizes([n] * 8, list(range(9)))[0]
            == A.split_size_at(n - 1, CFG))
    short = [M.mla_split_sizes([200] * b, list(range(b + 1)), impl="variant")[0] for b in (1, 8)]
    assert (short[0] == short[1]) is (sms == 132), short   # 200 keys: one tile per split at 132 SMs


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bfloat16"])
def test_layer_and_kernel_match_float64(dtype):
    lat, kpe, qn, qp = _seq(4, 0, 70, dtype)
    w = _weights(dtype)
    c = _cache(dtype, seed=5, num_blocks=6)
    c.write("s", lat, kpe, 0)
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for impl in ("invariant", "two_forms"):
        got = _layer(c, [("s", qn, qp, 70)], impl, w)
        ref = _layer(c, [("s", qn, qp, 70)], "reference", w)
        assert (got.double() - ref.double()).abs().max() < tol * 4, impl
    q = torch.cat([M.head_matmul(qn, w[0]), qp], dim=2)
    _, bt, lens, qsl = c.args([("s", q, 70)])
    got = M.mla_attention(q, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=SHAPE.scale)
    ref = M.mla_attention(q, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=SHAPE.scale, impl="reference")
    assert (got.double() - ref.double()).abs().max() < tol


def test_head_matmul_invariant_and_variant_caught():
    w = (seeded_normal((H, 96, 32), 7, device=DEV) * 0.1).to(torch.float32)

    def rows(bs, seed=0):  # row r is the same in every batch
        return torch.stack([seeded_normal((H, 96), 1000 * seed + r, device=DEV) for r in range(bs)])
    good = check_invariance(lambda x: M.head_matmul(x, w), rows, [1, 5, 20], positions="all")
    bad = check_invariance(lambda x: M.head_matmul(x, w, impl="variant"), rows, [1, 20], positions="all")
    assert good.passed and good.checks == 26 and bad.checks == 21 and not bad.passed, (good.summary(), bad.summary())
    x = rows(5)
    assert (M.head_matmul(x, w).double() - M.head_matmul(x, w, impl="reference").double()).abs().max() < 1e-5


def test_outputs_inside_guard_regions():
    lat, kpe, qn, qp = _seq(6, 0, 40)
    w = _weights()
    c = _cache(seed=2)
    c.cache = Guarded(c.cache.shape, DT, DEV).tensor.zero_()
    c.write("a", lat, kpe, 0)
    c.write("b", lat[:9], kpe[:9], 0)
    q = torch.cat([M.head_matmul(qn, w[0]), qp], dim=2)
    g = Guarded((41, H, LORA), DT, DEV)
    c.run([("a", q[:40], 40), ("b", q[8:9], 9)], scale=SHAPE.scale, out=g.tensor)
    g.check()
    assert g.unwritten() == 0
    gm = Guarded((20, H, 32), DT, DEV)
    M.head_matmul(qn[:20], w[0], out=gm.tensor)
    gm.check()
    assert gm.unwritten() == 0


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="rope_dim"):
        M.MLAShape(4, 32, 15, 16, 16)
    with pytest.raises(ValueError, match="heads"):
        M.MLAShape(0, 32, 16, 16, 16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        M.new_latent_cache(4, 16, -1, 16)
    lat, kpe, qn, qp = _seq(0, 0, 8)
    wkc, wvc = _weights()
    c = _cache(num_blocks=4)
    c.write("s", lat, kpe, 0)
    _, bt, lens, qsl = c.args([("s", qn, 8)])
    with pytest.raises(ValueError, match="w_kc"):
        M.mla(qn, qp, c.cache, bt, lens, qsl, wkc[:2], wvc)
    with pytest.raises(ValueError, match="w_vc"):
        M.mla(qn, qp, c.cache, bt, lens, qsl, wkc, wvc[:, :8])
    with pytest.raises(ValueError, match="rope_dim"):
        M.mla(qn, qp[:, :, :8], c.cache, bt, lens, qsl, wkc, wvc)
    with pytest.raises(ValueError, match="q_pe"):
        M.mla(qn, qp[:, :2], c.cache, bt, lens, qsl, wkc, wvc)
    with pytest.raises(ValueError, match="impl"):
        M.mla(qn, qp, c.cache, bt, lens, qsl, wkc, wvc, impl="fast")
    q = torch.cat([M.head_matmul(qn, wkc), qp], dim=2)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        M.mla_attention(q, c.cache, bt, lens, qsl, kv_lora_rank=LORA + ROPE, scale=0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        M.mla_attention(q, c.cache, bt, lens + 100, qsl, kv_lora_rank=LORA, scale=0.1)
    with pytest.raises(TypeError, match="cache"):
        M.mla_attention(q, c.cache.float(), bt, lens, qsl, kv_lora_rank=LORA, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        M.mla_attention(q, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=0.0)
    with pytest.raises(ValueError, match="latent"):
        M.write_latent(lat[:, :8], kpe, c.cache, torch.zeros(8, dtype=torch.int64))


def test_launch_shape_moves_work_only(monkeypatch):
    """``MLA_LAUNCH`` (heads per program, warps, stages) moves work, never a row's arithmetic: a
    step of 32 heads (a prefill chunk and decode rows) gives the same bits with 16 or 32 heads
    per program (two programs per token or one), and the launch takes fewer heads per program
    for a step of few tokens."""
    heads = 32
    c = _cache(seed=9, num_blocks=N // BS + 2)
    lat, kpe, _, _ = _seq(4, 0, N)
    c.write("s", lat, kpe, 0)
    q = seeded_normal((N, heads, LORA + ROPE), 11, dtype=DT, device=DEV)
    for p in range(N - 3, N):
        c.tables[p] = c.tables["s"]
    steps = [("s", q[N - 20:], N)] + [(p, q[p - 1:p], p) for p in range(N - 3, N)]
    qq, bt, lens, qsl = c.args(steps)
    outs = []
    for bh in (16, 32):
        monkeypatch.setitem(M.MLA_LAUNCH, "block_h", bh)
        monkeypatch.setitem(M.MLA_LAUNCH, "small_block_h", bh)
        outs.append(M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=0.2))
    assert bitwise_equal(outs[0], outs[1])
    monkeypatch.setitem(M.MLA_LAUNCH, "small_block_h", 16)
    assert (M.mla_block_h(1, 128), M.mla_block_h(64, 128), M.mla_block_h(4, 8)) == (16, 32, 16)


def test_parallel_splits_and_merge_give_the_serial_bits(monkeypatch):
    """A step of few tokens runs one program per split plus a merge launch, a larger one folds
    each row's splits in one program (``MLA_LAUNCH["parallel_below_per_sm"]``): the same operations in
    the same order, so the same bits, for decode rows across tiles and splits and a prefill chunk."""
    c = _cache(seed=12, num_blocks=N // BS + 2)
    lat, kpe, _, _ = _seq(5, 0, N)
    c.write("s", lat, kpe, 0)
    q = seeded_normal((N, H, LORA + ROPE), 13, dtype=DT, device=DEV)
    ends = [1, 5, CFG.block_n, CFG.block_n + 3, SPLIT, N]
    for p in ends:
        c.tables[p] = c.tables["s"]
    steps = [("s", q[N - 9:], N)] + [(p, q[p - 1:p], p) for p in ends]
    qq, bt, lens, qsl = c.args(steps)
    outs = {}
    for name, below in (("serial", 0), ("parallel", 10 ** 9)):
        monkeypatch.setitem(M.MLA_LAUNCH, "parallel_below_per_sm", below)
        outs[name] = M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=0.2)
    assert bitwise_equal(outs["serial"], outs["parallel"])
    ref = M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=LORA, scale=0.2, impl="reference")
    assert (outs["parallel"].double() - ref.double()).abs().max() < 3e-2
