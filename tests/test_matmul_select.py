"""The matmul's config selection: the shipped cost model is the fit of the stored H200 sweeps,
and on them it picks well even for a shape it was not fit on (leave one shape out).

Reads the sweeps of ``batch_invariance_kit.bench.matmul.FIT_SOURCES`` and launches nothing (a few
seconds on a CPU)."""

import pytest
import torch

from batch_invariance_kit.bench import matmul as BM
from batch_invariance_kit.ops import matmul as MM

@pytest.fixture(scope="module")
def doc():
    return BM.fit_doc()


def test_shipped_cost_model_is_the_fit_of_the_stored_sweeps(doc):
    fit = BM.fit_cost_model(doc)
    assert fit.launch_us == MM.COST_MODEL.launch_us and fit.sms == MM.COST_MODEL.sms
    assert set(fit.coef) == set(MM.COST_MODEL.coef) == {c.name for c in MM.CONFIGS}
    for name, (us, gbs) in fit.coef.items():
        assert MM.COST_MODEL.coef[name] == (pytest.approx(us, rel=1e-6), pytest.approx(gbs, rel=1e-6)), name


def test_leave_one_shape_out_picks_near_the_best(doc):
    """Fit on seven of the eight stored shapes, pick on the eighth: 3% from the fastest timed
    config on average, within 20% in all but two of the 64 cells, within 35% in every cell (the
    worst: N = 7168, K = 18432 at M = 16, whose long K nothing else in the data has)."""
    rows = BM.leave_one_shape_out(doc)
    assert len(rows) == 64
    ratios = sorted(r["pick_over_best"] for r in rows)
    assert ratios[-1] <= 1.35, max(rows, key=lambda r: r["pick_over_best"])
    assert sum(x > 1.20 for x in ratios) <= 2, ratios[-4:]
    assert sum(ratios) / len(ratios) <= 1.03
    # the shipped model (fit on all eight) on the same cells
    shipped = BM.leave_one_shape_out(doc, model_for=lambda train: MM.COST_MODEL)
    assert max(r["pick_over_best"] for r in shipped) <= 1.20


def test_the_model_sees_waves_and_long_k():
    """Thin M over a long K: one program per K chunk; large M: no second pass.  N = K = 5120 at
    M = 256: a pick whose tiles fit in one round on 132 SMs (64 x 128 tiles would need two)."""
    for m in (1, 16, 64):
        assert MM.select_config(m, 4096, 12288, compiled=True, sms=132).split_chunks
    for m in (1024, 4096):
        assert not MM.select_config(m, 4096, 12288, compiled=True, sms=132).split_chunks
    cfg = MM.select_config(256, 5120, 5120, compiled=True, sms=132)
    assert MM.cost_terms(cfg, 256, 5120, 5120, sms=132, compiled=True)["rounds"] == 1
    assert MM.cost_terms(MM._BY_NAME["mid_tma"], 256, 5120, 5120, sms=132, compiled=True)["rounds"] == 2


def test_selection_is_cheap_and_cached():
    MM._select.cache_clear()
    a = MM.select_config(333, 5120, 5120, compiled=True, sms=132)
    assert MM.select_config(333, 5120, 5120, compiled=True, sms=132) is a
    assert MM._select.cache_info().hits >= 1


def test_bad_arguments_are_named(doc):
    with pytest.raises(ValueError, match="K must be"):
        MM.select_config(1, 8, -1)
    with pytest.raises(TypeError, match="dtype"):
        MM.select_config(1, 8, 8, torch.int32)
    with pytest.raises(ValueError, match="sms must be"):
        MM.rank_configs(1, 8, 8, sms=True)
    with pytest.raises(ValueError, match="doc must be"):
        BM.fit_cost_model([])
    with pytest.raises(ValueError, match="no bf16 mm rows"):
        BM.fit_cost_model(doc, shapes=[(1, 1)])
