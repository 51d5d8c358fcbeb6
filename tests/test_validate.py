"""The validation command: one registry of parts, one loop, a report on the present device."""
import inspect
import json

import pytest
import torch

from batch_invariance_kit import validate
from batch_invariance_kit.bench import parts
from batch_invariance_kit.report import results


def test_validate_quick_writes_json_and_report(tmp_path):
    name = "rms_norm_invariance" if torch.cuda.is_available() else "cpu_matmul"  # GPU parts take minutes
    rc = validate.main(["--quick", "--only", name, "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc["checks"] and all(c["passed"] for c in doc["checks"])
    # the output folder is recorded without the machine's folders above it
    assert doc["provenance"]["command"] == \
        f"python -m batch_invariance_kit.validate --quick --only {name} --out <dir>/{tmp_path.name}"
    report = (tmp_path / "report.md").read_text()
    assert f"| {name} |" in report and "checks passed" in report


def test_every_part_resolves_to_a_function_of_quick():
    assert parts.PARTS and all(n == p.name for n, p in parts.PARTS.items())
    for p in parts.PARTS.values():
        f = p.function()
        params = list(inspect.signature(f).parameters)
        assert params[0] == "quick", p.name
        assert ("save" in params) == p.incremental, p.name
    # each device's default set is non-empty; the two sets and the parts run by name only cover the registry
    on_gpu, on_cpu = parts.default_parts(True), parts.default_parts(False)
    by_name = [n for n, p in parts.PARTS.items() if not p.default]
    assert on_gpu and on_cpu and sorted(on_gpu + on_cpu + by_name) == sorted(parts.PARTS)
    # measurements behind a table or a fit, and a breakdown: run by name
    assert all(n.startswith("matmul_refit_") or n in ("moe_tiles", "moe_stages") for n in by_name)


def test_list_names_every_part(capsys):
    assert validate.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in parts.PARTS)


def test_validate_rejects_unknown_part(tmp_path, capsys):
    with pytest.raises(SystemExit):
        validate.main(["--only", "no_such_part", "--out", str(tmp_path)])
    assert "unknown part" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_validate_refuses_cuda_parts_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        validate.main(["--only", "matmul_sweep", "--out", str(tmp_path)])
    assert "need a CUDA GPU" in capsys.readouterr().err


def test_part_rejects_an_unknown_device():
    with pytest.raises(ValueError, match="device"):
        parts.Part("x", "matmul:sweep", "tpu", "nothing")


class _FakePart:
    """A CPU part returning fixed checks: one required check and one speed goal."""

    device, what, incremental = "cpu", "a part of the test", False

    def __init__(self, required_passed, goal_met):
        self.checks = [{"name": "the invariance check", "passed": required_passed},
                       results.goal("kit >= 1.0x the peer", goal_met, speed_ratio=0.5),
                       {"name": "an observation", "passed": False, "informational": True}]

    def run(self, quick, save=None):
        return [], list(self.checks)


@pytest.mark.parametrize("required_passed", [True, False])
def test_speed_goals_never_set_the_exit_status(tmp_path, monkeypatch, required_passed):
    """A missed speed goal is reported in report.md as a goal, not a failure: the exit status is
    1 only when the required (invariance) check fails."""
    monkeypatch.setitem(parts.PARTS, "fake_part", _FakePart(required_passed, goal_met=False))
    rc = validate.main(["--only", "fake_part", "--out", str(tmp_path)])
    assert rc == (0 if required_passed else 1)
    report = (tmp_path / "report.md").read_text()
    assert "| fake_part |" in report and "0 of 1 |" in report  # goals met: 0 of 1
    assert "## Speed goals" in report and "| fake_part | kit >= 1.0x the peer | not met |" in report
    assert ("the invariance check" in report) == (not required_passed)  # only a failed required check is listed


def test_check_kinds():
    assert results.kind(results.goal("g", True)) == "goal"
    assert results.kind({"name": "i", "passed": True, "informational": True}) == "informational"
    assert results.kind({"name": "r", "passed": False}) == "required"
    checks = [results.goal("g", False), {"name": "r", "passed": True}]
    assert [c["name"] for c in results.of_kind(checks, "required")] == ["r"]
    with pytest.raises(ValueError, match="which"):
        results.of_kind(checks, "speed")
