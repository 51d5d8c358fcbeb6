"""CPU tests of :mod:`batch_invariance_kit.vllm.records`, what both vLLM checks share: the modes,
the seeded prompts, the bitwise comparison, and the typed records with their validation (a
malformed result file or server reply names the field).  Every stored H200 result file of the
vLLM check reads back into records and out again unchanged."""
import json
import math
from pathlib import Path

import pytest

from batch_invariance_kit.vllm import records as RC

ROOT = Path(__file__).resolve().parent.parent
STORED = sorted((ROOT / "results" / "h200").rglob("vllm_*.json")) + sorted(
    (ROOT / "results" / "h200" / "explorations" / "vllm_kit_compiled").glob("*.json"))


def test_modes_and_prompts():
    assert RC.MODES == ("default", "invariant", "kit", "kit+attention") and set(RC.KIT_MODES) < set(RC.MODES)
    assert set(RC.ROLE) == set(RC.MODES) == set(RC.DESCRIPTION)
    assert RC.attention_backend("kit+attention", "FLASH_ATTN", gpu=True) == RC.KIT_ATTENTION_BACKEND
    assert RC.attention_backend("kit+attention", None, gpu=False) is None
    assert RC.attention_backend("kit", "TRITON_ATTN", gpu=True) == "TRITON_ATTN"
    assert RC.informational("default", "cuda") and RC.informational("invariant", "cpu")
    assert not RC.informational("invariant", "cuda") and not RC.informational("kit+attention", "cpu")
    with pytest.raises(ValueError, match="mode must be one of"):
        RC.check_mode("vllm-invariant")
    with pytest.raises(TypeError, match="mode"):
        RC.check_mode(3)
    t = RC.TARGET.tokens()
    assert t == RC.random_prompt(100, 1234) and len(RC.NEEDLE.tokens(500)) == 257
    assert all(2 <= x < 500 for x in RC.NEEDLE.tokens(500)) and RC.TARGET.tokens(500) != t
    with pytest.raises(ValueError, match="length"):
        RC.random_prompt(0, 1)


def test_the_kit_alone_label_and_variants():
    """``--vllm-mode-under-kit``: one set of variants, labels and refusals for the check and the benchmark."""
    assert RC.variants(list(RC.MODES), "on") == [("default", None), ("invariant", True), ("kit", True),
                                                 ("kit+attention", True)]
    assert RC.variants(["default", "kit+attention"], "both") == [("default", None), ("kit+attention", True),
                                                                 ("kit+attention", False)]
    assert RC.variants(["kit+attention"], "off") == [("kit+attention", False)]
    labels = [RC.label(m, on) for m, on in RC.variants(["default", "invariant", "kit+attention"], "both")]
    assert labels == ["default", "invariant", "kit+attention", "kit+attention alone"]
    assert [RC.variant_of(x) for x in labels] == [("default", None), ("invariant", True), ("kit+attention", True),
                                                  ("kit+attention", False)]
    assert RC.label("invariant", False) == "invariant"                       # only kit modes stand alone
    assert RC.informational("kit+attention alone", "cuda") is False
    assert "KIT_VLLM_INVARIANT=0" in RC.describe("kit+attention alone") and RC.describe("kit") == RC.DESCRIPTION["kit"]
    for bad in ("default alone", "kit alone alone", "turbo"):
        with pytest.raises(ValueError, match="mode must be one of"):
            RC.variant_of(bad)
    with pytest.raises(ValueError, match="--vllm-mode-under-kit must be one of"):
        RC.variants(["kit+attention"], "sometimes")
    with pytest.raises(ValueError, match="--vllm-mode-under-kit off/both needs the kit's attention.*kit\\+attention"):
        RC.check_under_kit("both", ["default", "kit"])
    assert RC.check_under_kit("on", ["kit"]) == "on"
    # a row of the kit alone is a record like any other; a made-up label is refused naming the row
    row = RC.parse(RC.FailedRow, {"op": "vllm_bs", "impl": "kit+attention alone", "model": "m", "skipped": "x"}, "r")
    assert row.impl == "kit+attention alone"
    with pytest.raises(ValueError, match="^r: mode must be one of"):
        RC.parse(RC.FailedRow, {"op": "vllm_bs", "impl": "default alone", "model": "m", "skipped": "x"}, "r")


def test_compare():
    t, lp = [5, 6, 7], [-1.5, -2.25, -0.125]
    c = RC.compare(t, lp, list(t), list(lp))
    assert c.bitwise and c.logprobs_unequal == 0 and c.max_abs_diff == 0.0 and c.top_equal is None
    assert c.first_token_diff is None and c.first_logprob_diff is None
    lp2 = [-1.5, -2.25 + 2 ** -20, -0.125]
    c = RC.compare(t, lp, t, lp2)
    assert c.tokens_equal and not c.logprobs_equal and c.first_logprob_diff == 1 and not c.bitwise
    assert c.logprobs_unequal == 1 and c.max_abs_diff == 2 ** -20
    c = RC.compare(t, lp, [5, 9, 7], lp)
    assert not c.tokens_equal and c.first_token_diff == 1 and c.logprobs_equal
    c = RC.compare(t, lp, t[:2], lp[:2])  # a shorter completion is a difference
    assert not c.tokens_equal and c.first_token_diff == 2 and c.logprobs_unequal == 1
    nan = float("nan")
    assert not RC.compare([1], [nan], [1], [nan]).logprobs_equal
    # the online check's literals and top-k
    c = RC.compare([1], ["-0.5"], [1], ["-0.5"], [((1, "-0.5"),)], [((1, "-0.5"),)])
    assert c.bitwise and c.top_equal
    c = RC.compare([1], ["-0.5"], [1], ["-0.50000006"], [((1, "-0.5"),)], [((2, "-0.5"),)])
    assert not c.logprobs_equal and c.top_equal is False and 0 < c.max_abs_diff < 1e-6


def test_distinct():
    a = ([1, 2], [-0.5, -0.25])
    b = ([1, 2], [-0.5, -0.25 - 2 ** -30])
    assert RC.distinct([a, a, b]) == {"n": 3, "unique_token_sequences": 1, "unique_logprob_sequences": 2}
    assert RC.distinct([a, ([3, 2], [-0.5, -0.25])])["unique_token_sequences"] == 2


def _contains(a, b):
    """Every key of ``b`` in ``a`` with the same value (NaN equal to NaN)."""
    if isinstance(b, dict):
        return isinstance(a, dict) and all(k in a and _contains(a[k], v) for k, v in b.items())
    if isinstance(b, list):
        return len(a) == len(b) and all(_contains(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(b, float) and math.isnan(b) and math.isnan(a))


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.name)
def test_stored_results_read_into_records(path):
    doc = json.loads(path.read_text())
    res = RC.read(doc, path.name)
    assert len(res.rows) == len(doc["rows"]) and all(isinstance(r, RC.Row) for r in res.rows)
    assert all(_contains(RC.to_dict(r), d) for r, d in zip(res.rows, doc["rows"]))
    assert [c.name for c in res.checks] == [c["name"] for c in doc["checks"]]
    assert res.keys() and set(m for _, m in res.keys()) <= set(RC.MODES)


def test_a_malformed_file_names_the_field():
    doc = json.loads((ROOT / "results" / "h200" / "vllm_check.json").read_text())
    bad = json.loads(json.dumps(doc))
    bad["rows"][0]["runs"][1]["batch_size"] = "9"
    with pytest.raises(ValueError, match=r"^f\.rows\[0\]\.runs\[1\]\.batch_size: expected int, got str '9'"):
        RC.read(bad, "f")
    bad = json.loads(json.dumps(doc))
    del bad["rows"][1]["n"]
    with pytest.raises(ValueError, match=r"f\.rows\[1\]: missing field 'n' of NeedleRow"):
        RC.read(bad, "f")
    bad = json.loads(json.dumps(doc))
    bad["rows"][2]["positons"] = 3
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['positons'\]"):
        RC.read(bad, "f")
    bad = json.loads(json.dumps(doc))
    bad["rows"][3]["impl"] = "vllm-invariant"
    with pytest.raises(ValueError, match=r"f\.rows\[3\]: mode must be one of"):
        RC.read(bad, "f")
    bad = json.loads(json.dumps(doc))
    bad["rows"][4]["op"] = "vllm_speed"
    with pytest.raises(ValueError, match=r"f\.rows\[4\]\.op: expected one of"):
        RC.read(bad, "f")
    with pytest.raises(ValueError, match=r"f\.checks\[0\]\.passed: expected bool"):
        RC.read({**doc, "checks": [{"name": "x", "passed": "yes"}]}, "f")
    with pytest.raises(ValueError, match=r"f\.rows: expected a list"):
        RC.read({**doc, "rows": {}}, "f")


def test_targets_result_and_its_consistency():
    alone = [{"tokens": [1, 2], "logprobs": [-0.5, -1.0]}]
    b = {"seed": 1, "positions": [3], "requests": 9, "prompt_tokens": 90, "seconds": 0.1,
         "targets": [{"tokens": [1, 2], "logprobs": [-0.5, -1.5]}]}
    res = RC.parse(RC.TargetsResult, {"alone": alone, "alone_s": 0.1, "batches": [b, b], "decode_vs_prefill": []}, "r")
    (_, c), _ = res.against_alone(0)
    assert c.tokens_equal and not c.logprobs_equal and c.first_logprob_diff == 1
    assert res.distinct(0) == {"n": 3, "unique_token_sequences": 1, "unique_logprob_sequences": 2}
    assert res.distinct(0, batches=[]) == {"n": 1, "unique_token_sequences": 1, "unique_logprob_sequences": 1}
    with pytest.raises(ValueError, match=r"r\.alone\[0\]: 2 tokens but 1 logprobs"):
        RC.parse(RC.TargetsResult, {"alone": [{"tokens": [1, 2], "logprobs": [-0.5]}], "alone_s": 0.1, "batches": [],
                                    "decode_vs_prefill": []}, "r")
    with pytest.raises(ValueError, match=r"r: batches\[0\] answers 2 targets, alone 1"):
        RC.parse(RC.TargetsResult, {"alone": alone, "alone_s": 0.1, "batches": [{**b, "targets": alone * 2}],
                                    "decode_vs_prefill": []}, "r")


def test_failure_is_the_recorded_fact():
    tb = ('Traceback (most recent call last):\n  File "/x/lib/python3.11/site-packages/vllm/a/b.py", line 7, in f\n'
          '    g()\n  File "/x/lib/python3.11/site-packages/vllm/model_executor/c.py", line 755, in mean_dim\n'
          '    mean_kernel[grid](\nTypeError: \'function\' object is not subscriptable\n')
    f = RC.failure(tb)
    assert f == {"error": "TypeError: 'function' object is not subscriptable",
                 "call": "vllm/model_executor/c.py:755 in mean_dim", "code": "mean_kernel[grid]("}
    assert RC.failure("RuntimeError: the server exited") == {"error": "RuntimeError: the server exited", "call": None,
                                                             "code": None}
    assert RC.failure(None)["error"] is None


def test_kit_calls_check():
    c = RC.kit_calls_check("m kit", {"linear": 2, "rms_norm": 1}, RC.KIT_CALLS_NEEDED["cpu"])
    assert c["passed"] and "linear, rms_norm" in c["name"]
    assert not RC.kit_calls_check("m kit", {"linear": 2}, RC.KIT_CALLS_NEEDED["cpu"])["passed"]


def test_mode_style_for_every_mode_and_its_alone_label():
    """One colour per mode in the figures (``plots.mode_style``); a kit mode's ``<mode> alone``
    label keeps its mode's colour and marker, dash-dotted; a name that is no mode is refused."""
    from batch_invariance_kit.report import plots

    styles = {m: plots.mode_style(m) for m in RC.MODES}
    assert len({s["color"] for s in styles.values()}) == len(RC.MODES)
    for m in RC.KIT_MODES:
        alone = plots.mode_style(RC.label(m, False))
        assert (alone["color"], alone["marker"]) == (styles[m]["color"], styles[m]["marker"])
        assert alone["ls"] == "-." and styles[m]["ls"] == "-"
    with pytest.raises(ValueError):
        plots.mode_style("fast")
