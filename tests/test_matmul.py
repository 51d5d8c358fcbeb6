"""Matmul: the invariant kernel passes the harness bitwise for every M and every config, the
split-K variant fails it (negative control), all agree with the float64 reference, every
output element is written and nothing else, and bad input is refused naming the argument.

Shapes are small (N = 144, K = 160: partial tiles along N for every BLOCK_N, along K for
both BLOCK_K) so the file runs in well under a minute or two under the Triton interpreter.
"""
import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.checks import dtype_name
from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bitwise_equal, check_invariance, row_maker, seeded_normal

DEV = batch_invariance_kit.DEVICE
MS = [1, 2, 3, 17, 64, 65, 127, 128, 129, 300]
N, K = 144, 160
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
OPS = ["mm", "addmm", "linear", "bmm"]


#: a persistent grid (one program per SM walks the tiles): not a shipped config, the same bits
PERSISTENT = MM.MMConfig("persistent", 128, 128, num_warps=8, num_stages=3, group_m=8, persistent=True)


_name = dtype_name  # test ids: "bfloat16", ...


def _weights(dtype, n=N, k=K, seed=2):
    b = (seeded_normal((k, n), seed, dtype=torch.float64) * k ** -0.5).to(dtype=dtype, device=DEV)
    bias = seeded_normal((n,), seed + 1, dtype=dtype, device=DEV)
    return b, bias


def _op(op, dtype, impl="invariant", config=None, n=N, k=K):
    """(f, make_batch): ``f`` maps a batch whose dim 0 is M to the op's output (dim 0 = M)."""
    b, bias = _weights(dtype, n, k)
    kw = dict(impl=impl, config=config)
    if op == "mm":
        return (lambda x: MM.mm(x, b, **kw)), row_maker(k, dtype=dtype)
    if op == "addmm":
        return (lambda x: MM.addmm(bias, x, b, **kw)), row_maker(k, dtype=dtype)
    if op == "linear":  # x (M, 2, K) -> (M, 2, N); weight (N, K) is read transposed in place
        w = b.t().contiguous()
        return (lambda x: MM.linear(x, w, bias, **kw)), row_maker((2, k), dtype=dtype)
    # bmm over a strided view: rows (M, 2, K) -> a (2, M, K) -> out (2, M, N) -> (M, 2, N)
    b3 = torch.stack([b, b.flip(0)])
    return (lambda x: MM.bmm(x.transpose(0, 1), b3, **kw).transpose(0, 1)), row_maker((2, k), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# invariance: the row alone == the row in a batch of M, for every M; every config, same bits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("op", OPS)
def test_invariant_rows(op, dtype):
    f, make = _op(op, dtype)
    report = check_invariance(f, make, MS)
    assert report.passed, report.summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_every_config_gives_the_default_bits(dtype):
    """For every M and every config of invariant_candidates() and a persistent grid:
    addmm(A[:M]) with the config forced == the default (table) result for the largest batch,
    rows 0..M-1, bitwise."""
    b, bias = _weights(dtype)
    a = row_maker(K, dtype=dtype)(max(MS))
    full = MM.addmm(bias, a, b)
    bad = []
    for cfg in MM.invariant_candidates() + [PERSISTENT]:
        for m in MS:
            if not bitwise_equal(MM.addmm(bias, a[:m], b, config=cfg), full[:m]):
                bad.append((cfg.name, m))
    assert not bad, f"configs/M whose bits differ from the default: {bad}"


def test_long_k_is_the_in_order_sum_of_fixed_chunks():
    """A long K (over 128 under the interpreter, over 4096 on a GPU) is summed as fixed chunks
    (64 keys under the interpreter, 2048 on a GPU), each from zero, the fp32 chunk sums added in order:
    fp32 ``mm`` equals ``((0 + mm(chunk 0)) + mm(chunk 1)) + ...`` of the kit's own chunk
    products, bitwise, for every config (one program per tile, one per chunk, TMA).  A short K
    is one loop, again the same bits for every config."""
    dtype = torch.float32
    chunk = MM.k_chunk(10 ** 6, dtype)
    k = 2 * chunk + 32  # long here and on a GPU (160 under the interpreter, 4128 compiled)
    b, _ = _weights(dtype, k=k)
    a = row_maker(k, dtype=dtype)(65)
    assert MM.k_chunk(k, dtype) == chunk < k and MM.k_chunk(chunk, dtype) == chunk
    want = torch.zeros((65, N), dtype=dtype, device=DEV)
    for k0 in range(0, k, chunk):
        want = want + MM.mm(a[:, k0:k0 + chunk].contiguous(), b[k0:k0 + chunk].contiguous())
    for cfg in ("m16c", "midc", "mid", "mid_tma", PERSISTENT, "wide_tma_ws"):
        assert bitwise_equal(MM.mm(a, b, config=cfg), want), cfg
    short = MM.mm(a[:, :chunk], b[:chunk])
    for cfg in ("m16c", "mid_tma", "t64n32s8"):
        assert bitwise_equal(MM.mm(a[:, :chunk], b[:chunk], config=cfg), short), cfg


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_tma_configs_read_both_layouts(dtype, monkeypatch):
    """The TMA configs read B as (K, N) rows (mm/addmm) and as a linear weight's (N, K) rows,
    persistent or not; each gives the bits of a pointer-load config ("mid"), and the TMA
    launch really ran.  Operands TMA cannot read (rows not 16-byte aligned, a misaligned base,
    expanded stride-0 rows) fall back to pointer loads, again with the same bits."""
    calls = []
    real = MM._launch_tma
    monkeypatch.setattr(MM, "_launch_tma", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    b, bias = _weights(dtype)
    w = b.t().contiguous()
    a = row_maker(K, dtype=dtype)(65)
    ref = MM.linear(a, w, bias, config="mid")
    assert MM._tma_layout(a, b) is True and MM._tma_layout(a, w.t()) is False
    tma = [c for c in MM.CONFIGS if c.tma] + [MM.MMConfig("p", 64, 64, 4, 2, 8, persistent=True, tma=True)]
    assert any(c.warp_spec for c in tma)
    for cfg in tma:
        calls.clear()
        assert bitwise_equal(MM.linear(a, w, bias, config=cfg), ref), cfg.name
        assert bitwise_equal(MM.addmm(bias, a, b, config=cfg), ref), cfg.name
        assert calls == [False, True], (cfg.name, calls)  # (N, K) weight, then (K, N) rows
    calls.clear()
    k = 157  # 314- or 628-byte rows: no TMA
    b2, _ = _weights(dtype, k=k)
    a2 = row_maker(k, dtype=dtype)(17)
    buf = row_maker(K, dtype=dtype)(18).flatten()
    a3 = buf[1:1 + 17 * K].view(17, K)  # a base 2 or 4 bytes past an aligned one
    a4 = a[:1].expand(9, K)  # nine views of one row: stride 0
    assert MM._tma_layout(a2, b2) is None and MM._tma_layout(a3, b) is None and MM._tma_layout(a4, b) is None
    for x, y in ((a2, b2), (a3, b), (a4, b)):
        want = MM.mm(x, y, config="mid")
        for cfg in tma:
            assert bitwise_equal(MM.mm(x, y, config=cfg), want), cfg.name
    assert calls == []


def test_config_table():
    names = {c.name for c in MM.CONFIGS}
    assert {c.name for c in MM.invariant_candidates()} == names
    assert set(MM.COST_MODEL.coef) == names  # the cost model weighs every config
    for m in (1, 16, 17, 64, 65, 256, 257, 10 ** 6):
        for n in (4096, 12288, 151936):
            assert MM.select_config(m, n, 4096) in MM.CONFIGS
    assert MM.select_config(300, 4096, 4096, torch.float32).block_m * \
        MM.select_config(300, 4096, 4096, torch.float32).block_n <= 128 * 128  # fp32: no 128x256 tile
    assert MM.select_config(1, 4096, 100, torch.float32) in MM.CONFIGS  # a short K
    assert MM.block_k(torch.bfloat16) == MM.block_k(torch.float16) == 64 and MM.block_k(torch.float32) == 32
    for m in MS:  # K order fixed: BLOCK_K and split_k never depend on M for the invariant impl
        info = MM.launch_info(m, N, 4096, torch.bfloat16)
        assert info["block_k"] == 64 and info["split_k"] == 1
    assert MM.launch_info(1, N, 4096, torch.bfloat16, impl="variant")["split_k"] == 8
    assert MM.launch_info(300, N, 4096, torch.bfloat16, impl="variant")["split_k"] == 1
    assert MM.launch_info(300, N, K, torch.float32, config=PERSISTENT)["persistent"]
    # a long K: fixed chunks (a function of K only); thin M runs them as programs (split_chunks)
    chunk = MM.k_chunk(10 ** 6, torch.bfloat16)
    long_k = 4 * chunk + 1
    assert MM.k_chunk(chunk, torch.bfloat16) == chunk and MM.k_chunk(2 * chunk, torch.bfloat16) == 2 * chunk
    for m in MS:
        info = MM.launch_info(m, N, long_k, torch.bfloat16)
        assert info["k_chunk"] == chunk and info["split_k"] == 1
        assert info["chunk_programs"] == (5 if MM._BY_NAME[info["config"]].split_chunks else 1)
        info = MM.launch_info(m, N, long_k, torch.bfloat16, config="m16c")
        assert info["chunk_programs"] == 5 and info["grid"][1] == 5
        assert info["grid"][1] == info["chunk_programs"]
    assert MM.launch_info(1, N, chunk, torch.bfloat16, config="m16c")["chunk_programs"] == 1  # not long
    assert MM.launch_info(1, N, long_k, torch.bfloat16, config="t64n32s8")["chunk_programs"] == 1
    with pytest.raises(ValueError, match="config"):
        MM.mm(torch.ones(2, 2, device=DEV), torch.ones(2, 2, device=DEV), config="nope")
    with pytest.raises(TypeError, match="config"):
        MM.mm(torch.ones(2, 2, device=DEV), torch.ones(2, 2, device=DEV), config=3)


# ---------------------------------------------------------------------------------------------
# negative controls: the split-K variant must fail the same check
# ---------------------------------------------------------------------------------------------

def test_variant_splitk_fails():
    dtype = torch.float32
    f, make = _op("mm", dtype, impl="variant", k=512)
    report = check_invariance(f, make, MS, stop_at_first=True)
    assert not report.passed, "the split-K variant should depend on M (negative control)"
    assert MM.variant_split_k(1, N, 512, dtype) > 1 == MM.variant_split_k(300, N, 512, dtype)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=_name)
def test_variant_splitk_fails_16bit_on_cancelling_sums(dt):
    """16-bit outputs hide most 1-ulp fp32 differences (bf16 keeps 8 significant bits, fp16
    11; seen: fp16 and bf16 rows of this file's plain inputs did not differ): the split shows
    when the row's partial sums cancel (the second half of K undoes the first half, but for a
    small perturbation), so the result is small beside the partials.  The invariant kernel
    is checked on the same inputs."""
    h = 256
    b = seeded_normal((h, N), 5)
    b = torch.cat([b, -b]).to(dtype=dt, device=DEV)
    base, pert = row_maker(h), row_maker(h, scale=2.0 ** -9)

    def make(bs, seed=0):
        x = base(bs, seed)
        return torch.cat([x, x + pert(bs, seed + 100)], 1).to(dt)

    variant = check_invariance(lambda x: MM.mm(x, b, impl="variant"), make, MS, stop_at_first=True)
    assert not variant.passed, "the split-K variant should depend on M (negative control)"
    invariant = check_invariance(lambda x: MM.mm(x, b), make, MS)
    assert invariant.passed, invariant.summary()


# ---------------------------------------------------------------------------------------------
# accuracy, strides, empty inputs, guards
# ---------------------------------------------------------------------------------------------

def _rel_err(got, ref):
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("op", OPS)
def test_accuracy_vs_float64(op, dtype):
    for impl in ("invariant", "variant"):
        f, make = _op(op, dtype, impl=impl)
        g, _ = _op(op, dtype, impl="reference")
        for m in (1, 129):
            x = make(m)
            ref = g(x)
            assert ref.dtype == dtype
            err = _rel_err(f(x), ref)
            assert err < TOL[dtype], f"{impl} {op} M={m}: relative error {err:.2e}"


def test_cublas_impl_is_torch():
    b, bias = _weights(torch.float32)
    a = row_maker(K)(7)
    assert bitwise_equal(MM.mm(a, b, impl="cublas"), torch.mm(a, b))
    assert bitwise_equal(MM.addmm(bias, a, b, impl="cublas"), torch.addmm(bias, a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_strided_inputs_and_outputs_give_the_same_bits(dtype):
    b, bias = _weights(dtype)
    a = row_maker(K, dtype=dtype)(65)
    want = MM.addmm(bias, a, b)
    a_t = a.t().contiguous().t()                       # column-major a
    b_t = b.t().contiguous().t()                       # column-major b (a transposed weight)
    a_s = torch.empty(65, 2 * K, dtype=dtype, device=DEV)[:, ::2]  # every other column
    a_s.copy_(a)
    bias_row = bias.view(1, N)                         # broadcast bias, stride 0 along M
    out_s = torch.empty(N, 65, dtype=dtype, device=DEV).t()
    assert bitwise_equal(MM.addmm(bias, a_t, b_t), want)
    assert bitwise_equal(MM.addmm(bias_row, a_s, b), want)
    assert bitwise_equal(MM.addmm(bias.expand(65, N), a, b, out=out_s), want)
    assert bitwise_equal(out_s, want)
    full_bias = bias.expand(65, N).contiguous()
    assert bitwise_equal(MM.addmm(full_bias, a, b), want)
    assert bitwise_equal(MM.linear(a[3], b.t(), bias), want[3])  # 1-D x, as F.linear allows


@pytest.mark.parametrize("impl", ["invariant", "variant"])
def test_guards_every_element_written_nothing_else(impl):
    dt = torch.bfloat16
    b, bias = _weights(dt)
    for cfg in MM.invariant_candidates() + [PERSISTENT]:
        for m in (1, 129):
            a = row_maker(K, dtype=dt)(m)
            g = Guarded((m, N), dt, DEV)
            MM.addmm(bias, a, b, impl=impl, config=cfg, out=g.tensor)
            g.check()
            assert g.unwritten() == 0, f"{cfg.name} M={m}: {g.unwritten()} elements not written"
            assert bitwise_equal(g.tensor, MM.addmm(bias, a, b, impl=impl, config=cfg))
    a3 = row_maker((3, K), dtype=dt)(2)                  # bmm (2, 3, K) @ (2, K, N)
    b3 = torch.stack([b, b])
    g = Guarded((2, 3, N), dt, DEV)
    MM.bmm(a3, b3, impl=impl, out=g.tensor)
    g.check()
    assert g.unwritten() == 0
    g = Guarded((2, 3, N), dt, DEV)                      # linear with N-D x and N-D out
    MM.linear(a3, b.t(), bias, impl=impl, out=g.tensor)
    g.check()
    assert g.unwritten() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_empty_inputs(dtype):
    b, bias = _weights(dtype)
    a = row_maker(K, dtype=dtype)(3)
    assert MM.mm(a[:0], b).shape == (0, N)
    assert MM.addmm(bias, a[:0], b).shape == (0, N)
    assert MM.mm(a, b[:, :0]).shape == (3, 0)
    assert MM.bmm(a[None, :0], b[None]).shape == (1, 0, N)
    assert MM.bmm(a[None][:0], b[None][:0]).shape == (0, 3, N)
    assert MM.linear(a[:0], b.t(), bias).shape == (0, N)
    a0, b0 = a[:, :0], b[:0]                           # K = 0: zeros, or 0 + bias
    for impl in ("invariant", "variant", "reference"):
        assert bitwise_equal(MM.mm(a0, b0, impl=impl), torch.zeros(3, N, dtype=dtype, device=DEV))
        assert bitwise_equal(MM.addmm(bias, a0, b0, impl=impl), (0 + bias).expand(3, N))
        assert bitwise_equal(MM.linear(a0, b0.t(), bias, impl=impl), (0 + bias).expand(3, N))


# ---------------------------------------------------------------------------------------------
# bad input: clear errors naming the argument
# ---------------------------------------------------------------------------------------------

def test_bad_inputs_raise_naming_the_argument():
    f32 = dict(dtype=torch.float32, device=DEV)
    a, b, bias = torch.ones(4, 8, **f32), torch.ones(8, 5, **f32), torch.ones(5, **f32)
    cases = [
        (TypeError, "b dtype", lambda: MM.mm(a, b.to(torch.bfloat16))),
        (TypeError, "a must have dtype", lambda: MM.mm(a.double(), b.double())),
        (TypeError, "a must have dtype", lambda: MM.mm(a.int(), b.int())),
        (TypeError, "b must be a torch.Tensor", lambda: MM.mm(a, [[1.0]])),
        (ValueError, "b has 7 rows", lambda: MM.mm(a, b[:7])),
        (ValueError, "a must be 2-D", lambda: MM.mm(a[None], b)),
        (ValueError, "b is on meta", lambda: MM.mm(a, b.to("meta"))),
        (ValueError, "impl", lambda: MM.mm(a, b, impl="fast")),
        (ValueError, "out must have shape", lambda: MM.mm(a, b, out=torch.empty(5, 4, **f32))),
        (TypeError, "out must have dtype", lambda: MM.mm(a, b, out=torch.empty(4, 5, dtype=torch.float16))),
        (ValueError, "out must not share memory with a", lambda: MM.mm(a[:, :5], b[:5], out=a[:, 3:8])),
        (TypeError, "bias dtype", lambda: MM.addmm(bias.half(), a, b)),
        (ValueError, "bias of shape", lambda: MM.addmm(torch.ones(3, **f32), a, b)),
        (ValueError, "weight has 8 columns", lambda: MM.linear(torch.ones(2, 3, 7, **f32), b.t())),
        (ValueError, "weight must be 2-D", lambda: MM.linear(a, b.t()[None])),
        (ValueError, "bias has 4 elements", lambda: MM.linear(a, b.t(), bias[:4])),
        (ValueError, "b has batch size 1", lambda: MM.bmm(a[None].expand(2, 4, 8), b[None])),
        (ValueError, "b has 4 rows per batch", lambda: MM.bmm(a[None], a[None])),
        (ValueError, "a must be 3-D", lambda: MM.bmm(a, b)),
        (ValueError, "M must be", lambda: MM.select_config(-1, 8, 8)),
        (ValueError, "N must be", lambda: MM.select_config(1, 2.0, 8)),
        (ValueError, "sms must be", lambda: MM.select_config(1, 8, 8, sms=0)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


# ---------------------------------------------------------------------------------------------
# GPU: the real sizes (skipped on CPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gpu_invariant_rows_and_configs(dtype):
    for n, k in ((4096, 4096), (1024, 12288)):  # one K loop; a long K (fixed chunks)
        f, make = _op("addmm", dtype, n=n, k=k)
        report = check_invariance(f, make, MS + [1024, 2049, 4096])
        assert report.passed, report.summary()
    from batch_invariance_kit.bench.matmul import config_sweep

    rows, results = config_sweep([(1024, 4096)], [1, 17, 64, 65, 129, 300, 1025], dtype, reps=3, graph=False,
                                 rotate=False)
    failed = [r for r in results if not r["passed"]]
    assert not failed, failed
    assert {r["impl"] for r in rows} >= {"cublas", "kit-variant-splitk"}


@pytest.mark.gpu
def test_gpu_variant_fails():
    f, make = _op("mm", torch.float32, impl="variant", n=1024, k=4096)
    assert not check_invariance(f, make, MS, stop_at_first=True).passed


# ---------------------------------------------------------------------------------------------
# trial configs (measured by a refit sweep, not shipped): the same K order, the same bits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_trial_configs_give_the_shipped_bits_for_every_m(dtype):
    """Each trial config, as mm and as linear, over a K summed in one loop and a long K (cut
    into the fixed chunks): rows 0..M-1 equal the default's rows of the largest batch, bitwise,
    for every M.  So a refit may ship any of them without touching a bit."""
    assert MM.TRIAL_CONFIGS and not {c.name for c in MM.TRIAL_CONFIGS} & {c.name for c in MM.CONFIGS}
    long_k = 3 * MM.k_chunk(10 ** 6, dtype) + 8  # three full chunks and a partial one
    ms = [1, 3, 17, 65, 129]
    bad = []
    for k in (K, long_k):
        b, bias = _weights(dtype, k=k)
        w = b.t().contiguous()
        a = row_maker(k, dtype=dtype)(max(ms))
        full, full_lin = MM.mm(a, b), MM.linear(a, w, bias)
        for cfg in MM.TRIAL_CONFIGS:
            for m in ms:
                if not bitwise_equal(MM.mm(a[:m], b, config=cfg.name), full[:m]):
                    bad.append(("mm", k, cfg.name, m))
                if not bitwise_equal(MM.linear(a[:m], w, bias, config=cfg), full_lin[:m]):
                    bad.append(("linear", k, cfg.name, m))
    assert not bad, f"trial configs whose bits differ from the default: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_stream_k_cuts_tiles_and_keeps_the_bits(dtype, monkeypatch):
    """Stream-K over a long K's chunks: programs whose runs start or end inside a tile (a run
    inside one tile too: a chain of three programs handing one running sum on) give the bits
    of the one-program chunk loop, as mm and as linear, for every M; the stream-K kernel ran."""
    launched = []
    real = MM._MM_STREAM_K.fn

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid[0])
            return real[grid]

    monkeypatch.setattr(MM._MM_STREAM_K, "fn", Spy())  # the kernel its eager launches go through
    chunk = MM.k_chunk(10 ** 6, dtype)
    long_k = 3 * chunk + 8  # four chunks, the last partial
    sk = [c for c in MM.TRIAL_CONFIGS if c.stream_k] + [MM.MMConfig("sk16", 16, 32, 2, 3, 1, tma=True, stream_k=True)]
    bad = []
    for n in (N, 40):
        b, bias = _weights(dtype, n=n, k=long_k)
        w = b.t().contiguous()
        a = row_maker(long_k, dtype=dtype)(300)
        full, full_lin = MM.mm(a, b, config="large_tma"), MM.linear(a, w, bias, config="large_tma")
        for cfg in sk:
            for m in (1, 17, 129, 300):
                if not bitwise_equal(MM.mm(a[:m], b, config=cfg), full[:m]):
                    bad.append(("mm", n, cfg.name, m))
                if not bitwise_equal(MM.linear(a[:m], w, bias, config=cfg), full_lin[:m]):
                    bad.append(("linear", n, cfg.name, m))
    assert not bad, f"stream-K launches whose bits differ from the chunk loop: {bad}"
    assert launched and max(launched) == 5
    # the runs these launches used: tiles cut at chunk edges, and one tile over three programs
    runs = MM.stream_k_runs(1, 4, 4)
    assert runs == [(0, 1), (1, 2), (2, 3), (3, 4)]  # N = 40, M = 1, 128-wide tiles: a chain of four
    cut = MM.stream_k_runs(6, 4, 5)  # M = 300, N = 144 in 128 x 128 tiles
    assert any(lo % 4 for lo, _ in cut) and cut[-1][1] == 24
    with pytest.raises(ValueError, match="programs"):
        MM.stream_k_runs(1, 4, 5)


def test_stream_k_cost_terms_have_no_partial_wave():
    """M 1024 x N 5120 x K 5120 in 128 x 128 tiles: 320 tiles on 132 SMs are three rounds of
    one-tile programs; stream-K spreads the 960 (tile, chunk) units over the 132 programs, the
    busiest 8 units of 80 / 3 K steps on average (the chunks of 2048 keys, the last one 1024)."""
    large = MM.CONFIGS[[c.name for c in MM.CONFIGS].index("large_tma")]
    sk = MM.MMConfig("sk", 128, 128, 8, 4, 8, tma=True, stream_k=True)
    plain = MM.cost_terms(large, 1024, 5120, 5120, sms=132, compiled=True)
    st = MM.cost_terms(sk, 1024, 5120, 5120, sms=132, compiled=True)
    assert (plain["programs"], plain["rounds"], plain["steps"]) == (320, 3, 3 * 80)
    assert (st["programs"], st["rounds"], st["launches"]) == (132, 1, 2) and st["steps"] == pytest.approx(8 * 80 / 3)
    one_loop = MM.cost_terms(sk, 1024, 5120, 4096, sms=132, compiled=True)  # one unit per tile
    assert (one_loop["programs"], one_loop["steps"]) == (132, 3 * 64)


def test_trial_configs_are_weighed_only_when_asked():
    """select_config never picks a trial config (it has no coefficients); rank_configs weighs
    them when given them with a model that has coefficients for them (a refit)."""
    for m in (1, 64, 4096):
        assert MM.select_config(m, 5120, 5120) in MM.CONFIGS
    coef = dict(MM.COST_MODEL.coef, **{c.name: (0.001, 9000.0) for c in MM.TRIAL_CONFIGS})
    model = MM.CostModel(MM.COST_MODEL.launch_us, coef, MM.COST_MODEL.sms)
    ranked = MM.rank_configs(256, 5120, 5120, sms=132, compiled=True, model=model,
                             configs=MM.CONFIGS + MM.TRIAL_CONFIGS)
    assert ranked[0][1] in MM.TRIAL_CONFIGS
    info = MM.launch_info(1, N, 3 * MM.k_chunk(10 ** 6, torch.bfloat16), torch.bfloat16, config="t16n32c")
    assert info["chunk_programs"] == 3 and info["split_k"] == 1


# ---------------------------------------------------------------------------------------------
# one home for the K order; the launch record; the planted fault switch
# ---------------------------------------------------------------------------------------------

def test_the_k_order_has_one_home():
    """matmul and moe take the K order from ops.k_order (matmul re-exports its names), reach
    no private name of each other, and the ops import nothing from verify."""
    import inspect

    from batch_invariance_kit.ops import k_order, moe

    assert MM.block_k is k_order.block_k and MM.k_chunk is k_order.k_chunk
    assert MM.k_chunk_blocks is k_order.k_chunk_blocks and MM.LONG_K is k_order.LONG_K
    for mod in (MM, moe, k_order):
        src = inspect.getsource(mod)
        assert "from ..verify" not in src and "import verify" not in src, mod.__name__
    assert "MM._" not in inspect.getsource(moe)
    assert "ptr_step(" in inspect.getsource(moe._grouped_gemm_kernel.fn)


@pytest.mark.parametrize("bias", [False, True])
def test_launch_takes_a_product_record(bias):
    """MM.launch with a k_order.Product (sizes and element strides) gives linear's bits."""
    from batch_invariance_kit.ops.k_order import Product

    b, bvec = _weights(torch.float32)
    w = b.t().contiguous()
    x = row_maker(K, dtype=torch.float32)(17)
    bvec = bvec if bias else None
    out = torch.empty((17, N), device=DEV)
    p = Product.linear(x, w, out, bvec)
    assert p == Product(1, 17, N, K, (0, K, 1), (0, 1, K), (0, N, 1), (0, 1) if bias else (0, 0))
    for impl in ("invariant", "variant"):
        MM.launch(x, w, out, bvec, p, impl=impl)
        assert bitwise_equal(out, MM.linear(x, w, bvec, impl=impl)), impl


def test_planted_variant_is_a_switch_that_verify_registers():
    """plant_variant(True) makes invariant launches run the split-K twin (so the harness must
    catch them); verify.planted.register switches it by op name; off again, the bits are back."""
    from batch_invariance_kit.verify import planted

    b, _ = _weights(torch.float32)
    a = row_maker(K, dtype=torch.float32)(3)
    inv, var = MM.mm(a, b), MM.mm(a, b, impl="variant")
    assert not bitwise_equal(inv, var)
    try:
        assert planted.register(["matmul", "no_such_op"]) == ["matmul"]
        assert bitwise_equal(MM.mm(a, b), var)
    finally:
        MM.plant_variant(False)
    assert bitwise_equal(MM.mm(a, b), inv)
    with pytest.raises(TypeError, match="on"):
        MM.plant_variant("yes")


def test_refit_fits_shipped_and_trial_configs_and_reports_goals(capsys):
    """The refit of stored sweeps (CPU: reads JSON): a trial config timed in the sweep is fit
    and weighed beside the shipped ones; the leave-one-shape-out rows and the goals over the
    shapes named as unseen come back; the command prints a COST_MODEL literal."""
    import json

    from batch_invariance_kit.bench import matmul as BM
    from batch_invariance_kit.report.results import RESULTS

    doc = json.loads((RESULTS / "h200" / BM.FIT_SOURCES[0]).read_text())
    trial = MM.TRIAL_CONFIGS[0].name  # rows of "mid" under a trial's name: the plumbing, not a measurement
    doc["rows"] += [dict(r, impl=f"kit-invariant:{trial}") for r in doc["rows"] if r["impl"] == "kit-invariant:mid"]
    shapes = sorted({(r["N"], r["K"]) for r in doc["rows"]})
    out = BM.refit([doc], new_shapes=shapes[:1])
    assert trial in out["configs"] and trial in out["model"].coef
    assert {(r["N"], r["K"]) for r in out["loso"]} == set(shapes)
    assert out["goals"] and all(g["goal"] and g["cells"] > 0 for g in out["goals"])
    path = RESULTS / "h200" / BM.FIT_SOURCES[0]
    assert BM._refit_main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("COST_MODEL = CostModel(") and "trial configs fastest in some cell" in printed


def test_tma_descriptor_is_the_constructors_object():
    """``ops.tma.descriptor`` (no re-validation) builds what ``TensorDescriptor(...)`` builds: the
    same type, fields and defaults, for the operand layouts the TMA launches use."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from batch_invariance_kit.ops.tma import descriptor

    a = torch.zeros(64, 96, dtype=torch.bfloat16, device=DEV)
    for t, shape, strides, block in ((a, [64, 96], [96, 1], [16, 32]), (a, [64, 96], [96, 1], [128, 64]),
                                     (a[8:], [56, 96], [96, 1], [64, 64])):
        want = TensorDescriptor(t, shape, strides, block)
        got = descriptor(t, shape, strides, block)
        assert type(got) is TensorDescriptor and got == want and vars(got).keys() == vars(want).keys()
