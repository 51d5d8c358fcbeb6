"""The validation command runs on the present device and writes a report."""
import json

import torch

from batch_invariance_kit import validate


def test_validate_cpu_quick(tmp_path):
    if torch.cuda.is_available():  # on a GPU box the command runs the GPU parts (minutes): not here
        rc = validate.main(["--quick", "--only", "rms_norm_invariance", "--out", str(tmp_path)])
        name = "rms_norm_invariance"
    else:
        rc = validate.main(["--quick", "--only", "cpu_matmul", "--out", str(tmp_path)])
        name = "cpu_matmul"
    assert rc == 0
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc["checks"] and all(c["passed"] for c in doc["checks"])
    assert "provenance" in doc and doc["provenance"]["command"].startswith("python -m batch_invariance_kit.validate")
    report = (tmp_path / "report.md").read_text()
    assert name in report and "checks passed" in report


def test_validate_rejects_unknown_part(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        validate.main(["--only", "no_such_part", "--out", str(tmp_path)])
    assert "unknown part" in capsys.readouterr().err
