"""The harness must catch a planted divergence, pass an invariant function, and refuse bad input."""
import pytest
import torch

from batch_invariance_kit.verify import harness as H


def _rowwise_sum(x):  # invariant: each row reduced alone, same order whatever the batch
    return torch.stack([r.sum() for r in x])[:, None]


def _planted(threshold):
    """Invariant below ``threshold`` rows; above it the reduction order changes (reversed)."""
    def f(x):
        if x.shape[0] < threshold:
            return _rowwise_sum(x)
        return torch.stack([r.flip(0).cumsum(0)[-1] for r in x])[:, None]
    return f


def test_invariant_function_passes():
    mk = H.row_maker(257, dtype=torch.float32)
    rep = H.check_invariance(_rowwise_sum, mk, [1, 2, 7, 64, 300], positions="all", seeds=range(3))
    assert rep.passed, rep.summary()
    assert rep.checks == 3 * (1 + 2 + 7 + 64 + 300)
    assert rep.first is None and rep.max_ulp == 0


def test_planted_divergence_is_caught_and_located():
    mk = H.row_maker(1000, dtype=torch.float32)
    rep = H.check_invariance(_planted(256), mk, [255, 300], positions="all", seeds=[0, 1])
    assert not rep.passed
    assert rep.diverging_batch_sizes == [300]
    m = rep.first
    assert m.batch_size == 300 and m.elements_differing == 1 and m.max_ulp >= 1
    assert m.got != m.alone


def test_first_divergence_search():
    mk = H.row_maker(1000, dtype=torch.float32)
    bs, rep = H.first_divergence(_planted(40), mk, [1, 2, 4, 8, 16, 32, 64, 128], positions="all", seeds=[0, 1, 2])
    assert bs == 64
    assert rep.first.batch_size == 64
    bs, rep = H.first_divergence(_rowwise_sum, mk, [1, 2, 4, 8, 16])
    assert bs is None and rep.passed


def test_ulp_distance_and_bits():
    a = torch.tensor([1.0, -0.0, 2.0, float("nan")], dtype=torch.float32)
    b = torch.nextafter(a, torch.tensor(float("inf")))
    assert H.ulp_distance(a[:3], b[:3]).tolist() == [1, 1, 1]
    assert H.ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [0]
    assert not H.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # bits, stricter than ==
    assert H.bitwise_equal(a, a.clone())  # NaN equals itself bitwise
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.tensor([1.0, -3.0], dtype=dt)
        assert H.ulp_distance(x, torch.nextafter(x, torch.zeros_like(x))).tolist() == [1, 1]
    # a bf16 step from -1 across zero to +1: one ulp per representable value
    assert int(H.ulp_distance(torch.tensor([-1.0]), torch.tensor([1.0]))) == 2 * 0x3F800000


def test_row_maker_is_prefix_stable():
    mk = H.row_maker((3, 5), dtype=torch.bfloat16)
    small, big = mk(255, 7).clone(), mk(300, 7)
    assert torch.equal(small, big[:255])
    assert not torch.equal(mk(4, 8), big[:4])


@pytest.mark.parametrize("bad, match", [
    (dict(f=None), "f must be callable"),
    (dict(make_batch=3), "make_batch must be callable"),
    (dict(batch_sizes=[]), "batch_sizes is empty"),
    (dict(batch_sizes=[0]), "batch_sizes must be positive"),
    (dict(batch_sizes=[2.0]), "batch_sizes must be positive"),
    (dict(seeds=[]), "seeds is empty"),
])
def test_bad_arguments(bad, match):
    args = dict(f=_rowwise_sum, make_batch=H.row_maker(4), batch_sizes=[1, 2], seeds=[0])
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        H.check_invariance(args.pop("f"), args.pop("make_batch"), args.pop("batch_sizes"), **args)


def test_contract_violations_are_named():
    with pytest.raises(ValueError, match="returned input 0 with 3 rows, expected 2"):
        H.check_invariance(_rowwise_sum, lambda bs, s: torch.zeros(3, 4), [2])
    with pytest.raises(ValueError, match="dim 0 must be the batch"):
        H.check_invariance(lambda x: x.sum(0, keepdim=True), H.row_maker(4), [2])
    with pytest.raises(TypeError, match="f must return tensors"):
        H.check_invariance(lambda x: 1.0, H.row_maker(4), [2])
    with pytest.raises(ValueError, match="row_shape"):
        H.row_maker(0)
    with pytest.raises(TypeError, match="dtypes differ"):
        H.ulp_distance(torch.zeros(1), torch.zeros(1, dtype=torch.float64))


def test_median_us_refuses_a_bad_calls_per_graph():
    """The benchmark helper names a bad ``calls_per_graph`` before it looks for a GPU."""
    from batch_invariance_kit.bench.timing import median_us

    for bad in (0, -3, 2.5, True, "20"):
        with pytest.raises(ValueError, match="calls_per_graph"):
            median_us(lambda: None, graph=True, calls_per_graph=bad)
