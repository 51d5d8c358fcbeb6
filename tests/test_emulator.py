"""The reduction-order emulator: exact fp32 arithmetic, the schedule it models, bad input."""
import numpy as np
import pytest
import torch

from batch_invariance_kit import emulator as E


def _rows(n_rows, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, n, generator=g).to(dtype)


@pytest.mark.parametrize("n", [1, 31, 100, 1000, 2048, 4096, 5120])
@pytest.mark.parametrize("block, vec", [(256, 1), (1024, 1), (256, 8), (1024, 8), (512, 4)])
def test_agrees_with_float64_within_fp32_rounding(n, block, vec):
    x = _rows(32, n, seed=n)
    got = E.block_reduce(x, block, vec, square=True).astype(np.float64)
    ref = (x.double() ** 2).sum(1).numpy()
    # each fp32 addition errs by at most 2^-24 relative; a sum of n non-negative terms by n * 2^-24
    bound = n * 2.0 ** -24 * ref
    assert np.all(np.abs(got - ref) <= bound)
    assert np.all(got == got.astype(np.float32))


def test_known_row_gives_different_bits_for_two_block_sizes():
    # vLLM's RMSNorm block-size switch: block 1024 (< 256 tokens) vs 256 (>= 256 tokens), bf16, hidden 4096.
    x = _rows(64, 4096, seed=1234)
    s1024 = E.block_reduce(x, 1024, 8, square=True)
    s256 = E.block_reduce(x, 256, 8, square=True)
    differ = np.flatnonzero(s1024.view(np.int32) != s256.view(np.int32))
    assert differ.size > 0
    r = int(differ[0])
    # the same row, the same arithmetic except for the tree: deterministic bits
    assert E.block_reduce(x[r], 1024, 8, square=True)[0] == s1024[r]
    assert E.block_reduce(x[r], 256, 8, square=True)[0] == s256[r]


def test_hand_sized_example_matches_explicit_tree():
    # 64 elements, block of 64 threads: each thread holds one value; the tree is
    # warp 0: ((x0+x1)+(x2+x3))+... ; warp 1 likewise; then w0 + w1.
    vals = np.array([1.0] + [2.0 ** -24] * 63, dtype=np.float32)
    total, partials, warps = E.block_reduce(vals, 64, 1, return_partials=True)
    lanes = vals.reshape(2, 32)
    while lanes.shape[1] > 1:
        lanes = (lanes[:, 0::2] + lanes[:, 1::2]).astype(np.float32)
    assert np.array_equal(warps[0], lanes[:, 0])
    assert total[0] == np.float32(lanes[0, 0] + lanes[1, 0])
    # sequential left-to-right addition of the same 64 values gives other bits:
    seq = np.float32(0)
    for v in vals:
        seq = np.float32(seq + v)
    assert seq == np.float32(1.0)  # every 1 + 2^-24 is a tie, rounded to even: 1.0
    assert total[0] > seq  # the tree adds the small values among themselves first


def test_schedule_covers_every_element_once():
    for n, b, v, m in [(4096, 1024, 8, 0), (5120, 256, 8, 3), (17, 32, 4, 1), (3, 64, 8, 2)]:
        s = E.thread_schedule(n, b, v, m)
        got = np.sort(s[s >= 0])
        assert np.array_equal(got, np.arange(n))


def test_fma_is_single_rounding():
    # a*b + c where the float64 sum would double-round: compare with exact rational arithmetic
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = (rng.standard_normal(2000) * 1e-3).astype(np.float32)
    got = E.fma_f32(a, b, c)
    for i in range(0, 2000, 37):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))
        cand = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cand, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert got[i] == best


def test_rms_norm_trace_and_block_dependence():
    x = _rows(300, 4096, seed=5)
    w = _rows(1, 4096, seed=6)[0]
    a = E.rms_norm(x, w, 1e-6, 1024, 8)
    b = E.rms_norm(x, w, 1e-6, 256, 8)
    assert a.out.dtype == torch.bfloat16 and a.out.shape == x.shape
    assert (a.sum_sq != b.sum_sq).any()
    ref = x.double() * torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6) * w.double()
    rel = (a.out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2


@pytest.mark.parametrize("call, match", [
    (lambda: E.block_reduce(np.zeros((2, 8), np.float32), 100, 1), "block_size"),
    (lambda: E.block_reduce(np.zeros((2, 8), np.float32), 2048, 1), "block_size"),
    (lambda: E.block_reduce(np.zeros((2, 8), np.float32), 64, 3), "vec_width"),
    (lambda: E.block_reduce(np.zeros((2, 8), np.float32), 64, 4, misalign=4), "misalign"),
    (lambda: E.block_reduce(np.zeros((2, 0), np.float32), 64, 1), "non-empty"),
    (lambda: E.block_reduce(np.zeros((2, 2, 2), np.float32), 64, 1), "1-D"),
    (lambda: E.block_reduce(torch.zeros(2, 8, dtype=torch.int32), 64, 1), "floating"),
    (lambda: E.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-6, 64), "weight must have shape"),
    (lambda: E.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), 1e-6, 64), "weight dtype"),
    (lambda: E.rms_norm(torch.zeros(2, 8), torch.zeros(8), 0.0, 64), "eps"),
    (lambda: E.rms_norm(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(8), 1e-6, 64), "x must be"),
])
def test_bad_input(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
