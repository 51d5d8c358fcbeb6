"""The host-path benchmark (:mod:`batch_invariance_kit.bench.host`) runs and reports its rows.
It times nothing here that a test could assert: speed is measured, never asserted."""
from batch_invariance_kit.bench import host


def test_plan_times_table_has_a_row_per_step():
    rows = host.plan_times(reps=3, budget_s=0.0)
    cases = [name for name, *_ in host.plan_steps()]
    assert [r["case"] for r in rows] == cases
    assert all(r["median_us"] > 0 and r["calls"] == 3 and r["target_us"] > 0 for r in rows)
    text = host.table(rows)
    assert all(case in text for case in cases) and "target" in text.splitlines()[0]


def test_call_times_rows_beside_torch_and_a_results_file(tmp_path):
    """Every op has a row for the kit and for torch's nearest op at every shape, one speed goal
    per (op, shape) with the ratio (a goal: never a failed check), and the rows make a results file."""
    from batch_invariance_kit.report.results import kind, save

    rows, checks = host.call_times(calls=2, batches=1, budget_s=0.0)
    ops = {"linear", "rms_norm", "fused_add_rms_norm", "attention", "fused_moe"}
    assert {r["op"] for r in rows} == ops and {r["impl"] for r in rows} == {"kit-invariant", "torch"}
    assert len(rows) == 2 * len(checks) and {c["op"] for c in checks} == ops
    assert all(r["median_us"] > 0 and r["calls"] == 2 for r in rows)
    assert all(c["ratio"] > 0 and isinstance(c["passed"], bool) for c in checks)
    assert {kind(c) for c in checks} == {"goal"}
    text = host.call_table(rows)
    assert all(op in text for op in ops) and "kit/torch" in text
    assert save("host_calls", rows, checks, folder=tmp_path).exists()
