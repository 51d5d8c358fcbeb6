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

