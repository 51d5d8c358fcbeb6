"""batch_invariance_kit.report.cost on small synthetic result files (no GPU, no stored results needed)."""
import json

import pytest

from batch_invariance_kit.report import cost, results


def _write(folder, name, rows, commit="abc1234"):
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": {"git_commit": commit, "device": "test"}, "rows": rows, "checks": []}
    (folder / f"{name}.json").write_text(json.dumps(doc))


def _rms(op, impl, tokens, us, frac=0.5):
    return {"op": op, "impl": impl, "tokens": tokens, "hidden": 4096, "dtype": "bfloat16",
            "median_us": us, "fraction_of_copy": frac}


@pytest.fixture
def stored(tmp_path):
    d = tmp_path / "dev"
    _write(d, "rms_norm_bench", [
        _rms("rms_norm", "triton-invariant", 64, 10.0, 0.91),
        _rms("rms_norm", "cuda-invariant", 64, 11.0),          # slower invariant: not the one reported
        _rms("rms_norm", "triton-variant", 64, 8.0),           # the fastest non-invariant
        _rms("rms_norm", "cuda-variant", 64, 12.0),
        _rms("rms_norm", "torch.compile", 64, 9.0),
        _rms("rms_norm", "copy", 64, 5.0),                     # a ceiling, never a peer
    ], commit="1111111")
    _write(d, "moe_bench", [
        {"op": "moe", "impl": "kit-invariant", "tokens": 8, "median_us": 50.0},
        {"op": "moe", "impl": "kit-variant", "tokens": 8, "median_us": 100.0},
    ], commit="2222222")
    _write(d, "e2e_model", [
        {"op": "e2e_serve", "model": "dense", "impl": "kit-invariant", "copies": 4, "tokens_per_s": 100.0,
         "bs1_tokens_per_s": 10.0},
        {"op": "e2e_serve", "model": "dense", "impl": "kit-variant", "copies": 4, "tokens_per_s": 200.0,
         "bs1_tokens_per_s": 5.0},
    ])
    return tmp_path


def test_peer_is_fastest_non_invariant(stored):
    rows = [r for r in cost.summary("dev", root=stored) if r["family"] == "rms_norm"]
    assert len(rows) == 1
    r = rows[0]
    assert r["invariant"] == "triton-invariant" and r["invariant_value"] == 10.0
    assert r["peer"] == "triton-variant" and r["peer_value"] == 8.0
    assert "copy" not in r["peers"] and "cuda-invariant" not in r["peers"]
    assert r["speed_ratio"] == pytest.approx(0.8)  # the invariant kernel is slower: < 1
    assert r["source"] == "rms_norm_bench.json" and r["commit"] == "1111111"


def test_ratio_direction_times_and_rates(stored):
    rows = cost.summary("dev", root=stored)
    moe = next(r for r in rows if r["family"] == "moe")
    assert moe["speed_ratio"] == pytest.approx(2.0)  # invariant takes half the time: twice as fast
    load = next(r for r in rows if r["family"] == "e2e kit serve" and r["params"]["measure"] == "tokens_per_s")
    bs1 = next(r for r in rows if r["family"] == "e2e kit serve" and r["params"]["measure"] == "bs1_tokens_per_s")
    assert load["unit"] == "tok/s" and load["speed_ratio"] == pytest.approx(0.5)  # half the rate
    assert bs1["speed_ratio"] == pytest.approx(2.0)


def test_missing_files_are_skipped(stored):
    rows = cost.summary("dev", root=stored)
    assert {r["family"] for r in rows} == {"rms_norm", "moe", "e2e kit serve"}
    (stored / "dev" / "moe_bench.json").unlink()
    assert "moe" not in {r["family"] for r in cost.summary("dev", root=stored)}
    assert set(cost.sources("dev", root=stored)) == {"rms_norm_bench.json", "e2e_model.json"}


def test_default_root_follows_results_module(stored, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", stored)
    assert len(cost.summary("dev")) == 4


@pytest.mark.parametrize("where", ["nope", "", "..", "dev/x", 3])
def test_bad_where(stored, where):
    with pytest.raises(ValueError):
        cost.summary(where, root=stored)


def test_goals(stored):
    rows = cost.summary("dev", root=stored)
    goals = {g["family"]: g for g in cost.check_goals(rows)}
    assert goals["moe"]["met"] and goals["moe"]["worst"] == pytest.approx(2.0)
    # T=64 is outside the large-T scope of the copy goal; the torch.compile goal covers every T
    norm = [g for g in cost.check_goals(rows) if g["family"] == "rms_norm"]
    assert [g["metric"] for g in norm] == ["torch.compile"]
    assert not norm[0]["met"] and norm[0]["worst"] == pytest.approx(0.9)  # 9 us compiled vs 10 us kit
    slow = [dict(r, speed_ratio=0.5, peers={"kit-variant": 25.0}) if r["family"] == "moe" else r for r in rows]
    g = next(g for g in cost.check_goals(slow) if g["family"] == "moe")
    assert not g["met"] and g["worst"] == pytest.approx(0.5) and g["cells_met"] == 0


def test_vllm_engine_mismatch_is_flagged(tmp_path):
    eng = {"enforce_eager": False, "compilation_mode": "3", "cudagraph_mode": "FULL"}
    _write(tmp_path / "dev", "vllm_check", [
        {"op": "vllm_throughput", "impl": "default", "model": "dense", "output_tokens_per_s": 100.0, "engine": eng},
        {"op": "vllm_throughput", "impl": "invariant", "model": "dense", "output_tokens_per_s": 90.0, "engine": eng},
        {"op": "vllm_throughput", "impl": "kit", "model": "dense", "output_tokens_per_s": 50.0,
         "engine": dict(eng, enforce_eager=True, cudagraph_mode="NONE")},
        {"op": "vllm_bs", "impl": "kit", "model": "dense"},
    ])
    rows = {r["params"]["mode"]: r for r in cost.summary("dev", root=tmp_path)}
    assert set(rows) == {"invariant", "kit"}
    assert rows["invariant"]["like_for_like"] and rows["invariant"]["speed_ratio"] == pytest.approx(0.9)
    assert not rows["kit"]["like_for_like"] and set(rows["kit"]["engine_differs"]) == {"enforce_eager", "cudagraph_mode"}


def test_matmul_uses_the_table_pick(tmp_path):
    from batch_invariance_kit.ops import matmul as MM

    pick = MM.select_config(1, 4096, 4096, compiled=True).name  # cost reads GPU results: the GPU rule
    other = next(c.name for c in MM.CONFIGS if c.name != pick)
    mk = lambda impl, us: {"op": "mm", "impl": impl, "dtype": "bfloat16", "M": 1, "N": 4096, "K": 4096,
                           "median_us": us}
    _write(tmp_path / "dev", "matmul_sweep", [mk("kit-invariant:" + pick, 20.0), mk("kit-invariant:" + other, 1.0),
                                              mk("cublas", 10.0), mk("kit-variant-splitk", 16.0)])
    (r,) = cost.summary("dev", root=tmp_path)
    assert r["invariant"] == "kit-invariant:" + pick and r["peer"] == "cublas"
    assert r["speed_ratio"] == pytest.approx(0.5)
    assert cost.goal_value(r, "kit-variant-splitk") == pytest.approx(0.8)


def test_a_row_flagged_invariant_is_never_a_peer(tmp_path):
    """FlashAttention-3 with one split is invariant (the bench flags it): it is not the peer even
    when it is the fastest, and it is not reported as the kit's kernel either."""
    d = tmp_path / "dev"

    def dec(impl, us, invariant):
        return {"op": "attention_decode", "impl": impl, "batch": 1, "context": 1024, "median_us": us,
                "invariant": invariant}

    _write(d, "attention_bench", [dec("kit-invariant", 10.0, True), dec("fa3-num_splits1", 5.0, True),
                                  dec("fa3-auto-splits", 8.0, False), dec("sdpa-gathered", 9.0, False)])
    (r,) = [r for r in cost.summary("dev", root=tmp_path) if r["family"] == "attention decode"]
    assert r["invariant"] == "kit-invariant" and r["peer"] == "fa3-auto-splits"
    assert "fa3-num_splits1" not in r["peers"] and r["speed_ratio"] == pytest.approx(0.8)
