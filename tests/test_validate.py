"""The validation command: one registry of parts, one loop, a report on the present device."""
import inspect
import json

import pytest
import torch

from batch_invariance_kit import validate
from batch_invariance_kit.bench import parts


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
    # each device's default set is non-empty and the two sets cover the registry
    on_gpu, on_cpu = parts.default_parts(True), parts.default_parts(False)
    assert on_gpu and on_cpu and sorted(on_gpu + on_cpu) == sorted(parts.PARTS)


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
