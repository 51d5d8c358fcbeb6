"""The RMSNorm family: invariant kernels pass the 255-vs-300-token check bitwise, variant twins fail it,
all agree with the float64 reference, write every output element and nothing else, and
refuse bad input with errors that name the argument.

The 255-vs-300-token check (the test of vLLM's RMSNorm block-size fix): a 255-token and a 300-token batch whose first 255 rows are identical;
the first 255 rows of both outputs must be bit-identical (the variant switches its reduction
block from 1024 to 256 between the two, the invariant kernel does not).

Where the variant shows (measured under the Triton interpreter, numpy 2, this kit's inputs):
its row sums of squares differ in ~37% of rows and ``s`` in ~14%; fp32 outputs expose that
(~13% of rows differ), fp16 outputs ~1.5% of rows, bf16 outputs almost never (0-1 rows of
4080 at hidden 1024 and 4096: a bf16 ``x`` has 8 significant bits, so ``(bf16)(x*s)`` rarely
sits close enough to a rounding edge for a 1-ulp change of ``s`` to show).  fp8 outputs
(3 mantissa bits) hide it almost always (1 row in 12 seeds at fp32, hidden 4096).  So the
negative controls use fp32 (and fp16), and for the static fp8 ops a weight that puts one
element on an fp8 rounding edge on purpose; the invariant kernel is checked on exactly the
same inputs, and on bf16 with 16 seeds.
"""
import functools
import math

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import rms_norm as R
from batch_invariance_kit.verify.guard import Guarded
from batch_invariance_kit.verify.harness import bits, check_invariance, row_maker, ulp_distance

DEV = batch_invariance_kit.DEVICE
OP_NAMES = list(R.OPS)
SMALL, LARGE = 255, 300  # 255 < 256 <= 300 crosses vLLM's block-size threshold
H_MAIN = 1024
STATIC_SCALE = 0.0125  # |y| up to ~5 -> |y/scale| up to ~400: most of the fp8 range, some clamping


# ---------------------------------------------------------------------------------------------
# helpers: one calling convention for the five ops
# ---------------------------------------------------------------------------------------------

def _weight(hidden, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype=dtype, device=DEV)


def _scale(v=STATIC_SCALE):
    return torch.tensor([v], dtype=torch.float32, device=DEV)


def _call(op, x, residual, weight, impl, scale=None, **outs):
    """Run ``op``; always returns a tuple of its outputs (main output first)."""
    scale = _scale() if scale is None else scale
    if op == "rms_norm":
        r = R.rms_norm(x, weight, 1e-6, impl=impl, **outs)
    elif op == "fused_add_rms_norm":
        r = R.fused_add_rms_norm(x, residual, weight, 1e-6, impl=impl, **outs)
    elif op == "rms_norm_static_fp8_quant":
        r = R.rms_norm_static_fp8_quant(x, weight, scale, 1e-6, impl=impl, **outs)
    elif op == "fused_add_rms_norm_static_fp8_quant":
        r = R.fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, 1e-6, impl=impl, **outs)
    else:
        r = R.rms_norm_per_block_quant(x, weight, 1e-6, 128, impl=impl, **outs)
    return r if isinstance(r, tuple) else (r,)


def _out_specs(op, n, h, dtype):
    """(keyword, shape, dtype) of every output of ``op``, in the order ``_call`` returns them."""
    q = op in ("rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant", "rms_norm_per_block_quant")
    specs = [("out", (n, h), R.FP8_DTYPE if q else dtype)]
    if op == "rms_norm_per_block_quant":
        specs.append(("scales_out", (n, h // 128), torch.float32))
    if op in R._RESIDUAL:
        specs.append(("residual_out", (n, h), dtype))
    return specs


class _Batches:
    """x and residual streams whose row r is the same at every batch size (the 255-vs-300-token method)."""

    def __init__(self, hidden, dtype):
        self.x = row_maker(hidden, dtype=dtype, device=DEV)
        self.r = row_maker(hidden, dtype=dtype, device=DEV, scale=0.5)

    def __call__(self, n, seed):
        return self.x(n, seed), self.r(n, seed + 10_000)


def _rows_differing(a, b, n=SMALL):
    """Rows among the first ``n`` where any output of ``a`` and ``b`` differs in its bits."""
    rows = torch.zeros(n, dtype=torch.bool)
    for p, q in zip(a, b):
        rows |= (bits(p[:n].cpu()) != bits(q[:n].cpu())).reshape(n, -1).any(1)
    return int(rows.sum())


def _seed002(op, batches, weight, impl, seed, scale=None):
    """Rows of the first 255 that differ between the 255- and the 300-token batch."""
    xs, rs = batches(LARGE, seed)
    small = _call(op, xs[:SMALL], rs[:SMALL], weight, impl, scale)
    large = _call(op, xs, rs, weight, impl, scale)
    return _rows_differing(small, large)


# ---------------------------------------------------------------------------------------------
# launch policy
# ---------------------------------------------------------------------------------------------

def test_launch_info_variant_follows_the_batch_invariant_does_not():
    for op in OP_NAMES:
        per_block = op == "rms_norm_per_block_quant"
        v = [R.launch_info(n, 4096, torch.bfloat16, op, invariant=False)["block"] for n in (1, 255, 256, 257, 300)]
        assert v == ([512, 512, 512, 256, 256] if per_block else [1024, 1024, 256, 256, 256]), (op, v)
        inv = {tuple(sorted((k, c[k]) for k in ("block", "num_chunks", "rows_per_program", "num_warps")))
               for n in (1, 255, 256, 300, 4097)
               for c in [R.launch_info(n, 4096, torch.bfloat16, op, invariant=True)]}
        assert len(inv) == 1, (op, inv)
    c = R.launch_info(300, 4096, torch.bfloat16, "rms_norm", invariant=True)
    assert (c["block"], c["num_chunks"]) == (4096, 1)
    assert c["grid"] == math.ceil(300 / c["rows_per_program"])
    c = R.launch_info(3, 12288, torch.float32, "rms_norm", invariant=True)
    assert (c["block"], c["num_chunks"]) == (4096, 3)
    c = R.launch_info(300, 4096, torch.bfloat16, "rms_norm", invariant=False)
    assert (c["block"], c["num_chunks"]) == (256, 16)
    with pytest.raises(ValueError, match="op"):
        R.launch_info(3, 64, torch.float32, "layer_norm")
    with pytest.raises(ValueError, match="num_tokens"):
        R.launch_info(0, 64, torch.float32)


# ---------------------------------------------------------------------------------------------
# exact conversions inside the kernels (the interpreter's own casts are not IEEE)
# ---------------------------------------------------------------------------------------------

def test_in_kernel_conversions_are_ieee_round_to_nearest_even():
    """Both roundings of the kernel to bf16 (integer arithmetic, and on a GPU the hardware's
    conversion that compiled kernels use) against torch's casts, bit for bit."""
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(x_ptr, o_ptr, N: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr):
        c = tl.arange(0, N)
        v = R._to_f32(tl.load(x_ptr + c))
        if FP8:
            v = R._round_fp8e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
            tl.store(o_ptr + c, v.to(o_ptr.dtype.element_ty))
        else:
            tl.store(o_ptr + c, R._from_f32(R._round(v, o_ptr.dtype.element_ty, HW), o_ptr.dtype.element_ty, HW))

    def run(x, dtype, fp8=False, hw=False):
        n = triton.next_power_of_2(x.numel())
        x = torch.nn.functional.pad(x, (0, n - x.numel())).to(DEV)
        o = torch.empty(n, dtype=dtype, device=DEV)
        _convert[(1,)](x, o, N=n, FP8=fp8, HW=hw)
        return o.cpu(), x.cpu().float()

    g = torch.Generator().manual_seed(0)
    rnd = torch.cat([torch.randn(1 << 14, generator=g) * s for s in (1e-40, 1e-3, 1.0, 300.0)])
    # every bf16 pattern widens exactly (subnormals included)
    allbf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    o, _ = run(allbf16, torch.float32)
    ref = allbf16.float()
    assert bool(((bits(o[:65536]) == bits(ref)) | (ref.isnan() & o[:65536].isnan())).all())
    # fp32 -> bf16 / fp16: random values, subnormals and exact ties
    ties = (torch.randn(4096, generator=g).to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    for hw in (False, True) if DEV == "cuda" else (False,):  # the interpreter's own cast truncates
        for dt, extra in ((torch.bfloat16, ties), (torch.float16, ties.clamp(-6e4, 6e4))):
            src = torch.cat([rnd, extra, torch.tensor([0.0, -0.0])])
            o, xs = run(src, dt, hw=hw)
            assert torch.equal(bits(o), bits(xs.to(dt))), (dt, hw)
    # fp32 -> fp8 e4m3fn: every code, every midpoint (ties), random values, subnormal range
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(R.FP8_DTYPE).float()
    codes = codes[~codes.isnan()].sort().values
    src = torch.cat([codes, (codes[1:] + codes[:-1]) / 2, rnd.clamp(-448, 448),
                     torch.rand(1 << 12, generator=g) * 0.04 - 0.02])
    o, xs = run(src, R.FP8_DTYPE, fp8=True)
    assert torch.equal(bits(o), bits(xs.to(R.FP8_DTYPE)))


# ---------------------------------------------------------------------------------------------
# invariance: the 255-vs-300-token check
# ---------------------------------------------------------------------------------------------

_INV_CASES = [(torch.bfloat16, 16), (torch.float16, 8), (torch.float32, 8)]


@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype,nseeds", _INV_CASES, ids=["bf16x16seeds", "fp16x8seeds", "fp32x8seeds"])
def test_invariant_first_255_rows_bit_identical(op, dtype, nseeds):
    batches, w = _Batches(H_MAIN, dtype), _weight(H_MAIN, dtype)
    differing = [_seed002(op, batches, w, "invariant", seed) for seed in range(nseeds)]
    assert differing == [0] * nseeds, f"{op}: rows differing per seed {differing}"


# The negative controls: where the variant's schedule switch shows in the outputs (fp32/fp16;
# see the module docstring for bf16).  Each searches seeds until the first difference.
_NEG_CASES = [
    ("rms_norm", torch.float32), ("rms_norm", torch.float16),
    ("fused_add_rms_norm", torch.float32), ("fused_add_rms_norm", torch.float16),
    ("rms_norm_per_block_quant", torch.float32),
]


@pytest.mark.parametrize("op,dtype", _NEG_CASES, ids=[f"{o}-{str(d)[6:]}" for o, d in _NEG_CASES])
def test_variant_first_255_rows_differ(op, dtype):
    batches, w = _Batches(H_MAIN, dtype), _weight(H_MAIN, dtype)
    for seed in range(8):
        n = _seed002(op, batches, w, "variant", seed)
        if n:
            break
    assert n > 0, f"{op}/{dtype}: the variant never diverged in 8 seeds: the check would be blind"
    assert _seed002(op, batches, w, "invariant", seed) == 0  # same inputs, invariant kernel


def test_variant_bf16_sighting():
    """bf16 outputs rarely show the switch (module docstring); 16 seeds of the fused op do
    (under the interpreter: 1 row, seed 2).  Same inputs: the invariant kernel stays put."""
    dtype = torch.bfloat16
    batches, w = _Batches(H_MAIN, dtype), _weight(H_MAIN, dtype)
    for seed in range(16):
        if _seed002("fused_add_rms_norm", batches, w, "variant", seed):
            break
    else:
        raise AssertionError("no bf16 row flipped in 16 seeds")
    assert _seed002("fused_add_rms_norm", batches, w, "invariant", seed) == 0


def _fp8_edge_weight(op, op_plain, batches, dtype, seed=0, max_rows=8):
    """A weight that puts row ``r`` of the 255-row batch on fp8 rounding edges, so that ``op``'s
    (a static-fp8 op) variant must quantize that row differently in the two batches.

    ``op_plain`` (the op's non-quantized twin, w = 1) gives ``o = x * s`` of the rows whose
    ``s`` differs between the variant's two schedules.  The static-fp8 kernel has its own
    reduction tree (compiled, its layout can differ from the plain kernel's), so its ``s`` may
    sit a few ulps from the plain twin's: column ``k`` of the weight is
    ``midpoint / o[r, k]`` moved by ``k % 256 - 128`` fp32 ulps (midpoint 1.0625, the fp8
    e4m3 tie between 1 and 1.125), a sweep that brackets the edge for any ``s`` within
    ~100 ulps.  Rows are tried in turn; the weight returned is one with which ``op``'s
    variant output has been seen to differ between the batches (the negative control).
    Returns ``(weight, r)``; ``dtype`` is float32 (the ulp sweep works on its bits)."""
    ones = torch.ones(H_MAIN, dtype=dtype, device=DEV)
    xs, rs = batches(LARGE, seed)
    a = _call(op_plain, xs[:SMALL], rs[:SMALL], ones, "variant")[0].cpu()
    b = _call(op_plain, xs, rs, ones, "variant")[0][:SMALL].cpu()
    rows = (bits(a) != bits(b)).any(1).nonzero().flatten().tolist()
    assert rows, "no row of this seed changed: pick another seed"
    one = _scale(1.0)
    steps = (torch.arange(H_MAIN) % 256 - 128).to(torch.int32)
    for r in rows[:max_rows]:
        o = a[r].float()
        ok = o.abs() > 1e-3
        w = (1.0625 * torch.sign(o) / torch.where(ok, o, 1.0)).float()
        w = (w.view(torch.int32) + steps).view(torch.float32)  # |w[k]| moved by steps[k] ulps
        w = torch.where(ok, w, 1.0).to(dtype=dtype, device=DEV)
        if _seed002(op, batches, w, "variant", seed, scale=one) >= 1:
            return w, r
    raise AssertionError(f"{op}: no weight put one of rows {rows[:max_rows]} on an fp8 rounding edge")


@pytest.mark.parametrize("op", ["rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant"])
def test_variant_static_fp8_differs_on_a_rounding_edge(op):
    """Negative control of the static-fp8 ops: a weight that puts a row on fp8 rounding edges
    makes the variant differ between the 255- and the 300-token batch (the search above fails
    if it cannot); the invariant gives the same bits with that weight."""
    dtype = torch.float32
    plain = "fused_add_rms_norm" if op.startswith("fused") else "rms_norm"
    batches = _Batches(H_MAIN, dtype)
    w, r = _fp8_edge_weight(op, plain, batches, dtype)  # the variant's row r differs with w
    assert _seed002(op, batches, w, "invariant", 0, scale=_scale(1.0)) == 0, f"row {r}"


@pytest.mark.parametrize("op", OP_NAMES)
def test_invariant_row_alone_equals_row_in_any_batch(op):
    """The harness's question: row p of f(batch) == f(row p alone), at sizes around 256."""
    dtype = torch.float32
    batches, w = _Batches(H_MAIN, dtype), _weight(H_MAIN, dtype)
    res = op in R._RESIDUAL

    def f(x, r):
        return _call(op, x, r if res else None, w, "invariant")

    rep = check_invariance(f, batches, [1, 2, 255, 256, 257, 300], positions=[0, 1, 128, 254, -1], seeds=[3])
    assert rep.passed, rep.summary()
    if op == "rms_norm":  # ... and the same harness catches the variant
        g = lambda x, r: _call(op, x, None, w, "variant")  # noqa: E731
        assert not check_invariance(g, batches, [300], positions=range(0, 300, 3), seeds=[3]).passed


@pytest.mark.parametrize("op", OP_NAMES)
def test_invariant_long_rows_chunked_path(op):
    """hidden > 8192: the invariant kernel sums in fixed 4096-column chunks (still batch-free)."""
    h, dtype = 9216, torch.float32
    batches, w = _Batches(h, dtype), _weight(h, dtype)
    assert R.launch_info(LARGE, h, dtype, op)["num_chunks"] == 3
    xs, rs = batches(LARGE, 0)
    rows = [0, 1, 130, 254]
    small = _call(op, xs[:SMALL], rs[:SMALL], w, "invariant")
    large = _call(op, xs, rs, w, "invariant")
    alone = [_call(op, xs[i:i + 1], rs[i:i + 1], w, "invariant") for i in rows]
    for out_s, out_l, *out_a in zip(small, large, *alone):
        assert torch.equal(bits(out_s.cpu()), bits(out_l[:SMALL].cpu()))
        for i, a in zip(rows, out_a):
            assert torch.equal(bits(a[0].cpu()), bits(out_l[i].cpu())), i


@pytest.mark.skipif(not batch_invariance_kit.INTERPRET, reason="rows per program is 1 when compiled: nothing to vary")
def test_rows_per_program_does_not_change_bits(monkeypatch):
    """Under the interpreter a program handles a tile of rows; its size must not matter."""
    dtype = torch.float32
    batches, w = _Batches(H_MAIN, dtype), _weight(H_MAIN, dtype)
    xs, rs = batches(70, 5)
    ref = {(op, impl): _call(op, xs, rs, w, impl) for op in OP_NAMES for impl in ("invariant", "variant")}
    assert R.launch_info(70, H_MAIN, dtype)["rows_per_program"] > 4
    for max_rows in (1, 4):
        monkeypatch.setattr(R, "_INTERPRET_MAX_ROWS", max_rows)
        assert R.launch_info(70, H_MAIN, dtype)["rows_per_program"] == max_rows
        for (op, impl), outs in ref.items():
            for a, b in zip(outs, _call(op, xs, rs, w, impl)):
                assert torch.equal(bits(a), bits(b)), (op, impl, max_rows)


# ---------------------------------------------------------------------------------------------
# accuracy, guards, every element written
# ---------------------------------------------------------------------------------------------

_REL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2e-7}  # ~2 unit roundoffs
_SCALE_REL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}
_SHAPES = [(300, 768), (5, 1000), (3, 9216)]  # masked tail; variant 3 chunks; invariant chunked


@pytest.mark.parametrize("impl", ["invariant", "variant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("op", OP_NAMES)
def test_guarded_outputs_fully_written_and_accurate(op, dtype, impl):
    g = torch.Generator().manual_seed(11)
    for n, h in _SHAPES:
        if op == "rms_norm_per_block_quant" and h % 128:
            continue
        x = torch.randn(n, h, generator=g).to(dtype=dtype, device=DEV)
        r = (0.5 * torch.randn(n, h, generator=g)).to(dtype=dtype, device=DEV)
        w = _weight(h, dtype)
        x0, r0 = x.clone(), r.clone()
        guards = {k: Guarded(shape, dt, DEV) for k, shape, dt in _out_specs(op, n, h, dtype)}
        got = _call(op, x, r, w, impl, **{k: gd.tensor for k, gd in guards.items()})
        for k, gd in guards.items():
            gd.check()
            assert gd.unwritten() == 0, f"{op} {impl} {n}x{h}: {gd.unwritten()} elements of {k} not written"
        assert torch.equal(bits(x), bits(x0)) and torch.equal(bits(r), bits(r0)), "inputs modified"
        ref = _call(op, x, r, w, "reference")
        for (k, _, _), o, e in zip(_out_specs(op, n, h, dtype), got, ref):
            o, e = o.cpu(), e.cpu()
            if k == "residual_out":  # z = (dtype)(x + residual): exactly defined
                assert torch.equal(bits(o), bits(e)), f"{op} {n}x{h} residual"
            elif k == "scales_out":
                rel = ((o.double() - e.double()) / e.double()).abs().max().item()
                assert rel <= _SCALE_REL[dtype], f"{op} {n}x{h} scales rel err {rel}"
            elif o.dtype == R.FP8_DTYPE:  # one rounding edge away at most, and rarely
                u = ulp_distance(o, e)
                assert int(u.max()) <= 1 and float((u > 0).float().mean()) < 0.05, (op, n, h, int(u.max()))
            else:
                u = ulp_distance(o, e)
                rel = ((o.double() - e.double()).norm() / e.double().norm()).item()
                assert rel <= _REL[dtype] and int(u.max()) <= (2 if dtype != torch.float32 else 8), \
                    f"{op} {n}x{h}: rel {rel:.3e}, max {int(u.max())} ulp"


@pytest.mark.parametrize("impl", ["invariant", "variant", "reference"])
@pytest.mark.parametrize("h", [768, 9216])
def test_in_place_apis_match_functional(impl, h):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, h, generator=g).to(dtype=dtype, device=DEV)
    r = torch.randn(6, h, generator=g).to(dtype=dtype, device=DEV)
    w = _weight(h, dtype)
    out, z = R.fused_add_rms_norm(x, r, w, impl=impl)
    xi, ri = x.clone(), r.clone()
    got = R.fused_add_rms_norm_(xi, ri, w, impl=impl)
    assert got[0] is xi and got[1] is ri
    assert torch.equal(bits(xi), bits(out)) and torch.equal(bits(ri), bits(z))
    # the fp8 twin with residual_out aliasing residual (vLLM's in-place residual)
    q, z2 = R.fused_add_rms_norm_static_fp8_quant(x, r, w, _scale(), impl=impl)
    ri = r.clone()
    q2, z3 = R.fused_add_rms_norm_static_fp8_quant(x, ri, w, _scale(), impl=impl, residual_out=ri)
    assert z3 is ri and torch.equal(bits(ri), bits(z2)) and torch.equal(bits(q2), bits(q))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def _bad_cases(impl):
    bf = torch.bfloat16
    P = {op: functools.partial(fn, impl=impl) for op, fn in R.OPS.items()}
    rms_norm, fused_add_rms_norm = P["rms_norm"], P["fused_add_rms_norm"]
    rms_norm_static_fp8_quant = P["rms_norm_static_fp8_quant"]
    fused_add_rms_norm_static_fp8_quant = P["fused_add_rms_norm_static_fp8_quant"]
    rms_norm_per_block_quant = P["rms_norm_per_block_quant"]
    x = torch.randn(4, 256, dtype=bf, device=DEV)
    w = torch.ones(256, dtype=bf, device=DEV)
    r = torch.randn(4, 256, dtype=bf, device=DEV)
    s = _scale()
    other_dev = torch.device("meta")
    return [
        ("x not a tensor", lambda: rms_norm(x.tolist(), w), TypeError, "x"),
        ("x int", lambda: rms_norm(x.to(torch.int32), w), TypeError, "x"),
        ("x float64", lambda: rms_norm(x.double(), w.double()), TypeError, "x"),
        ("x 1-D", lambda: rms_norm(x[0], w), ValueError, "x"),
        ("x 3-D", lambda: rms_norm(x[None], w), ValueError, "x"),
        ("x empty", lambda: rms_norm(x[:0], w), ValueError, "x"),
        ("x non-contiguous", lambda: rms_norm(torch.randn(256, 4, dtype=bf, device=DEV).t(), w), ValueError, "x"),
        ("x on another device", lambda: rms_norm(x.to(other_dev), w.to(other_dev)), ValueError, "x"),
        ("weight dtype", lambda: rms_norm(x, w.float()), TypeError, "weight"),
        ("weight hidden", lambda: rms_norm(x, w[:128].contiguous()), ValueError, "weight"),
        ("weight 2-D", lambda: rms_norm(x, w[None]), ValueError, "weight"),
        ("weight device", lambda: rms_norm(x, w.to(other_dev)), ValueError, "weight"),
        ("residual shape", lambda: fused_add_rms_norm(x, r[:, :128].contiguous(), w), ValueError, "residual"),
        ("residual rows", lambda: fused_add_rms_norm(x, r[:3], w), ValueError, "residual"),
        ("residual dtype", lambda: fused_add_rms_norm(x, r.half(), w), TypeError, "residual"),
        ("residual non-contiguous", lambda: fused_add_rms_norm(x, r.t().contiguous().t(), w), ValueError, "residual"),
        ("weight hidden (fused)", lambda: fused_add_rms_norm(x, r, w[:128].contiguous()), ValueError, "weight"),
        ("eps zero", lambda: rms_norm(x, w, 0.0), ValueError, "eps"),
        ("eps negative", lambda: rms_norm(x, w, -1e-6), ValueError, "eps"),
        ("eps nan", lambda: rms_norm(x, w, float("nan")), ValueError, "eps"),
        ("eps inf", lambda: rms_norm(x, w, float("inf")), ValueError, "eps"),
        ("eps str", lambda: rms_norm(x, w, "1e-6"), ValueError, "eps"),
        ("impl", lambda: R.rms_norm(x, w, impl="fast"), ValueError, "impl"),
        ("scale dtype", lambda: rms_norm_static_fp8_quant(x, w, s.to(bf)), TypeError, "scale"),
        ("scale numel", lambda: rms_norm_static_fp8_quant(x, w, torch.ones(2, device=DEV)), ValueError, "scale"),
        ("scale zero", lambda: rms_norm_static_fp8_quant(x, w, torch.zeros(1, device=DEV)), ValueError, "scale"),
        ("scale float", lambda: rms_norm_static_fp8_quant(x, w, 0.5), TypeError, "scale"),
        ("scale (fused)", lambda: fused_add_rms_norm_static_fp8_quant(x, r, w, s.double()), TypeError, "scale"),
        ("group_size 0", lambda: rms_norm_per_block_quant(x, w, 1e-6, 0), ValueError, "group_size"),
        ("group_size 96", lambda: rms_norm_per_block_quant(x, w, 1e-6, 96), ValueError, "group_size"),
        ("group_size 512", lambda: rms_norm_per_block_quant(x, w, 1e-6, 512), ValueError, "group_size"),
        ("group_size float", lambda: rms_norm_per_block_quant(x, w, 1e-6, 128.0), ValueError, "group_size"),
        ("group_size !| hidden", lambda: rms_norm_per_block_quant(x[:, :192].contiguous(), w[:192].contiguous(),
                                                                    1e-6, 128), ValueError, "group_size"),
        ("out shape", lambda: rms_norm(x, w, out=torch.empty(4, 128, dtype=bf, device=DEV)), ValueError, "out"),
        ("out dtype", lambda: rms_norm(x, w, out=torch.empty(4, 256, device=DEV)), TypeError, "out"),
        ("out fp8 dtype", lambda: rms_norm_static_fp8_quant(x, w, s, out=torch.empty_like(x)), TypeError, "out"),
        ("out non-contiguous", lambda: rms_norm(x, w, out=torch.empty(256, 4, dtype=bf, device=DEV).t()),
         ValueError, "out"),
        ("residual_out shape", lambda: fused_add_rms_norm(x, r, w, residual_out=r[:2]), ValueError, "residual_out"),
        ("scales_out shape", lambda: rms_norm_per_block_quant(x, w, scales_out=torch.empty(4, 3, device=DEV)),
         ValueError, "scales_out"),
    ]


@pytest.mark.parametrize("impl", ["invariant", "variant", "reference"])
def test_bad_input_raises_naming_the_argument(impl):
    for name, fn, exc, arg in _bad_cases(impl):
        with pytest.raises(exc) as ei:
            fn()
        assert arg in str(ei.value), f"{name}: {exc.__name__} does not name {arg!r}: {ei.value}"


# ---------------------------------------------------------------------------------------------
# GPU only: production-size hidden dims, compiled kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h", [2048, 4096, 8192, 14336])
@pytest.mark.parametrize("op", OP_NAMES)
def test_gpu_invariant_large_hidden(op, h):
    dtype = torch.bfloat16
    batches, w = _Batches(h, dtype), _weight(h, dtype)
    differing = [_seed002(op, batches, w, "invariant", seed) for seed in range(16)]
    assert differing == [0] * 16, differing
    res = op in R._RESIDUAL
    rep = check_invariance(lambda x, r: _call(op, x, r if res else None, w, "invariant"), batches,
                           [1, 7, 64, 255, 256, 1000, 4097], seeds=[0, 1])
    assert rep.passed, rep.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16),
                                     (256, torch.float16), (128, torch.float32)])
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "rms_norm_static_fp8_quant"])
def test_gpu_head_dim_rows_one_warp_each(op, h, dtype, monkeypatch):
    """Head-dim rows, one warp each and four to a program: batch-invariant (batches that end in
    every slot of a program), and bitwise equal to one row per one-warp program."""
    batches, w = _Batches(h, dtype), _weight(h, dtype)
    assert R.launch_info(7, h, dtype, op)["rows_per_program"] == R._WARP_ROWS
    res = op in R._RESIDUAL
    rep = check_invariance(lambda x, r: _call(op, x, r if res else None, w, "invariant"), batches,
                           [1, 2, 3, 5, 7, 64, 255, 1001, 32768], seeds=[0, 1])
    assert rep.passed, rep.summary()
    x, r = batches(1001, 3)
    packed = _call(op, x, r.clone(), w, "invariant")
    monkeypatch.setitem(R.NUM_WARPS_OVERRIDE, h, 1)  # one row per program of one warp
    assert R.launch_info(7, h, dtype, op)["rows_per_program"] == 1
    alone = _call(op, x, r.clone(), w, "invariant")
    assert all(torch.equal(bits(a.cpu()), bits(b.cpu())) for a, b in zip(packed, alone))


def test_compiled_rows_packed_only_when_one_warp_holds_them(monkeypatch):
    """The compiled launch rule (read with the interpreter switched off in this module): head-dim
    rows that one warp holds are packed four to a program of four warps; fp32 rows of 256 columns
    (two warps' worth), rows narrower than a warp's lanes, rows summed in chunks (the variant's
    4096-wide rows at 256 tokens) and a warp count set by hand keep one row per program."""
    monkeypatch.setattr(R, "INTERPRET", False)
    for h, dt in ((64, torch.bfloat16), (256, torch.bfloat16), (256, torch.float16), (128, torch.float32)):
        c = R.launch_info(7, h, dt)
        assert (c["rows_per_program"], c["num_warps"], c["grid"]) == (R._WARP_ROWS, R._WARP_ROWS, 2), (h, dt)
    assert R.launch_info(7, 16, torch.bfloat16)["rows_per_program"] == 1
    assert R.launch_info(7, 512, torch.bfloat16)["rows_per_program"] == 1
    assert R.launch_info(7, 256, torch.float32)["rows_per_program"] == 1
    assert R.launch_info(7, 256, torch.bfloat16)["rows_per_program"] == R._WARP_ROWS
    assert R.launch_info(300, 4096, torch.bfloat16, invariant=False)["block"] == 256
    assert R.launch_info(300, 4096, torch.bfloat16, invariant=False)["rows_per_program"] == 1
    monkeypatch.setitem(R.NUM_WARPS_OVERRIDE, 128, 1)
    assert R.launch_info(7, 128, torch.bfloat16)["rows_per_program"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h", [2048, 4096])
def test_gpu_variant_diverges(h):
    dtype = torch.float32
    batches, w = _Batches(h, dtype), _weight(h, dtype)
    assert sum(_seed002("rms_norm", batches, w, "variant", seed) for seed in range(4)) > 0
