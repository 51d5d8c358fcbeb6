"""CPU tests of :mod:`batch_invariance_kit.vllm.bench` and :mod:`batch_invariance_kit.vllm.step_profile`.

Arguments (errors that name the argument), the statistics (median and spread of the repeats, the
refusal of a ratio the spread does not resolve), the worker's loop with a stand-in engine (warm-ups,
repeats, the deadline, a failing scenario, a failing engine), the driver with a stand-in launcher
(the JSON's shape, the goals, the budget), the online job with a stand-in server and client, the
parsing of ``vllm bench throughput``'s and ``vllm bench serve``'s results, the kit's client
against the stand-in OpenAI server, the merge of result files, the tokenizer's round trip, and the
profile's summary (synthetic traces and a CPU trace of the profiler).  One live run: the command
on vLLM's CPU build with the ``tiny`` model (eager, one small scenario)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batch_invariance_kit.vllm import bench as B
from batch_invariance_kit.vllm import runner as R
from batch_invariance_kit.vllm import step_profile as SP

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
HAS_VLLM = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                           "sys.exit(u.find_spec('vllm') is None)"]).returncode == 0


# ----------------------------------------------------------------------------- arguments

def test_defaults_and_variants():
    a = B.parse_args(["--out", "x"])
    assert a.models == ["dense"] and a.modes == list(B.MODES) and a.scenarios == ["prefill", "decode", "tm"]
    assert a.repeats == 3 and a.warmups == 1 and a.offline_runner == "inprocess" and a.weights == "kit"
    assert B.variants(["default", "invariant", "kit", "kit+attention"], "on") == [
        ("default", None), ("invariant", True), ("kit", True), ("kit+attention", True)]
    assert B.variants(["default", "kit+attention"], "both") == [("default", None), ("kit+attention", True),
                                                                 ("kit+attention", False)]
    assert [B.label(m, on) for m, on in B.variants(["kit+attention"], "both")] == ["kit+attention",
                                                                                  "kit+attention alone"]
    flags = B.engine_flags("/m", mode="kit+attention", max_len=2048, gpu=True, weights="dummy")
    assert flags[flags.index("--attention-backend") + 1] == "CUSTOM" and "--load-format" in flags
    assert "--no-enable-prefix-caching" in flags and flags[flags.index("--seed") + 1] == "0"
    assert "--attention-backend" not in B.engine_flags("/m", mode="kit", max_len=256, gpu=False)
    assert "--max-cudagraph-capture-size" not in flags and a.max_cudagraph_capture_size is None


def test_cudagraph_capture_size_reaches_every_mode():
    """``--max-cudagraph-capture-size`` is one engine setting for every mode, in the flags of
    ``vllm bench throughput`` and in ``LLM(...)``'s compilation config."""
    a = B.parse_args(["--out", "x", "--max-cudagraph-capture-size", "1024", "--modes", "default,kit+attention"])
    for mode in a.modes:
        job = B.worker_job(a, "dense", mode, None, [B.SCENARIOS["tm"]], None)
        f = job["flags"]
        assert f[f.index("--max-cudagraph-capture-size") + 1] == "1024"
        assert B._llm_kwargs(f)["compilation_config"] == {"max_cudagraph_capture_size": 1024}


@pytest.mark.parametrize("argv, needle", [
    (["--models", "dense,big"], "--models"),
    (["--modes", "kit,kit"], "--modes"),
    (["--modes", "fast"], "--modes"),
    (["--scenarios", "prefill,chat"], "--scenarios"),
    (["--repeats", "2"], "--repeats"),
    (["--warmups", "0"], "--warmups"),
    (["--scale", "0"], "--scale"),
    (["--length-scale", "nan"], "--length-scale"),
    (["--budget-s", "-1"], "--budget-s"),
    (["--vllm-mode-under-kit", "maybe"], "--vllm-mode-under-kit"),
    (["--vllm-mode-under-kit", "off", "--modes", "kit"], "--modes kit\\+attention"),
    (["--offline-runner", "docker"], "--offline-runner"),
    (["--max-cudagraph-capture-size", "0"], "--max-cudagraph-capture-size"),
    (["--max-cudagraph-capture-size", "1024", "--eager"], "--max-cudagraph-capture-size"),
    (["--weights", "zeros"], "--weights"),
    (["--moe-layers", "49"], "--moe-layers"),
    (["--gpu-memory-utilization", "0.99"], "--gpu-memory-utilization"),
    (["--offline-runner", "cli", "--scenarios", "profile"], "--scenarios profile"),
])
def test_args_errors_name_the_argument(argv, needle):
    with pytest.raises(ValueError, match=needle):
        B.parse_args(["--out", "x", *argv])


def test_args_errors_out_and_merge(tmp_path, capsys):
    with pytest.raises(ValueError, match="--out"):
        B.parse_args([])
    with pytest.raises(ValueError, match="--merge"):
        B.parse_args(["--out", "x", "--merge", str(tmp_path / "none.json")])
    assert B.main(["--out", "x", "--repeats", "1"]) == 2 and "--repeats" in capsys.readouterr().err


def test_imports_without_vllm_and_help():
    code = ("import sys, batch_invariance_kit.vllm.bench as B, batch_invariance_kit.vllm.step_profile; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(B.parser().format_help())")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--vllm-mode-under-kit" in r.stdout and "--scenarios" in r.stdout


def test_scenarios_and_dry_run(capsys):
    s = B.SCENARIOS["tm"]
    assert s.num_prompts == 1000 and s.output_len == 100 and B.SCENARIOS["decode"].output_len == 512
    assert B.SCENARIOS["online"].max_concurrency == 64 and B.SCENARIOS["online"].request_rate > 0
    half = s.scaled(0.5, 0.5)
    assert (half.num_prompts, half.input_len, half.output_len) == (500, 64, 50)
    assert B.max_model_len([B.SCENARIOS[n] for n in ("prefill", "decode", "tm", "online")]) == 1536
    assert B.main(["--out", "x", "--dry-run", "--modes", "default,kit+attention", "--vllm-mode-under-kit", "both",
                   "--scenarios", "decode,online"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(j["label"], j["kind"]) for j in plan["jobs"]] == [
        ("default", "offline"), ("kit+attention", "offline"), ("kit+attention alone", "offline"),
        ("default", "online"), ("kit+attention", "online"), ("kit+attention alone", "online")]
    assert plan["env"]["kit+attention alone"]["VLLM_BATCH_INVARIANT"] == "0"
    assert plan["estimate_s"] == sum(j["estimate_s"] for j in plan["jobs"]) + plan["build_estimate_s"]["dense"] > 0


# ----------------------------------------------------------------------------- statistics

def test_stats():
    s = B.stats([3.0, 1.0, 2.0, 10.0])
    assert s == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0, "spread": 9.0}
    for bad in ([], [1.0, float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="values"):
            B.stats(bad)


def test_compare_reports_a_ratio_only_when_resolved():
    # resolved: the difference (20) exceeds both spreads (2 and 4)
    c = B.compare([80, 81, 82], [100, 98, 102], names=("kit", "default"))
    assert c["resolved"] and c["ratio"] == pytest.approx(0.81) and c["better"] is False
    assert c["text"].startswith("0.810x")
    # unresolved: a spread (30) exceeds the difference (20): no ratio, both numbers in the text
    c = B.compare([80, 110, 81], [100, 98, 102], names=("kit", "default"))
    assert not c["resolved"] and c["ratio"] is None and c["better"] is None and c["nominal_ratio"] == pytest.approx(0.81)
    assert c["text"].startswith("unresolved (the spread exceeds the difference)")
    assert "kit 81 (spread 30" in c["text"] and "default 100 (spread 4" in c["text"]
    # fewer than three repeats: never resolved
    c = B.compare([50, 51], [100, 100, 100])
    assert not c["resolved"] and "fewer than 3 repeats" in c["text"]
    # a fraction of the reference, and a latency (lower is better)
    c = B.compare([92, 93, 92], [100, 100, 101], fraction=0.9)
    assert c["resolved"] and c["better"] and c["difference"] == pytest.approx(2.0)
    c = B.compare([12.0, 12.5, 12.2], [10.0, 10.1, 10.0], higher_is_better=False)
    assert c["resolved"] and c["better"] is False
    with pytest.raises(ValueError, match="fraction"):
        B.compare([1, 2, 3], [1, 2, 3], fraction=0)


def _row(model, impl, scen, values, kind="offline", measure="output_tokens_per_s"):
    reps = [{m: 1.0 for m, _ in B.MEASURES[kind]} | {measure: v} for v in values]
    return {"op": "vllm_bench", "model": model, "impl": impl, "scenario": scen, "kind": kind, "repeats": reps,
            "measures": {measure: B.stats(values)}}


def test_comparisons_goals_and_table():
    rows = [_row("dense", "default", "decode", [100, 101, 99]),
            _row("dense", "invariant", "decode", [70, 71, 70]),
            _row("dense", "kit+attention", "decode", [96, 97, 96]),
            _row("dense", "kit+attention alone", "decode", [80, 99, 90])]
    comps = B.comparisons(rows)
    by = {(c["impl"], c["against"]): c for c in comps}
    assert set(by) == {("invariant", "default"), ("kit+attention", "default"), ("kit+attention", "invariant"),
                       ("kit+attention alone", "default"), ("kit+attention alone", "invariant")}
    assert by[("kit+attention", "default")]["resolved"] and by[("kit+attention", "default")]["ratio"] == pytest.approx(0.96)
    assert not by[("kit+attention alone", "default")]["resolved"] and by[("kit+attention alone", "default")]["ratio"] is None
    goals = {g["name"]: g for g in B.goal_checks(rows)}
    g = goals["dense decode: kit+attention >= 0.9 x default (output_tokens_per_s)"]
    assert g["goal"] and g["passed"] and g["verdict"] == "met"
    # 96 against 0.95 x 100: a difference of 1 inside default's spread scaled (1.9)
    g = goals["dense decode: kit+attention >= 0.95 x default (output_tokens_per_s)"]
    assert g["verdict"] == "unresolved" and not g["passed"] and "unresolved" in g["text"]
    assert goals["dense decode: kit+attention >= vLLM's invariant mode (output_tokens_per_s)"]["verdict"] == "met"
    g = goals["dense decode: kit+attention alone >= 0.95 x default (output_tokens_per_s)"]
    assert g["verdict"] == "unresolved" and not g["passed"]
    assert goals["dense decode: kit+attention alone >= 0.9 x default (output_tokens_per_s)"]["verdict"] == "unresolved"
    text = B.table(rows, comps)
    lines = {ln[:25].strip(): ln for ln in text.splitlines()[1:]}
    assert "0.960x" in lines["kit+attention"] and "unresolved" not in lines["kit+attention"]
    alone = lines["kit+attention alone"]
    assert "unresolved" in alone and "x (" not in alone.split("vs default:")[1]


# ----------------------------------------------------------------------------- the worker

class FakeBench:
    """A stand-in engine: each run takes ``run_s`` on the fake clock and produces ``rate`` output
    tokens/s (times the run's index offset by ``jitter``)."""
    runner = "stand-in"

    def __init__(self, clock, run_s=10.0, fail=None):
        self.clock, self.run_s, self.fail, self.calls = clock, run_s, fail, []

    def run(self, s, seed):
        self.calls.append((s.name, seed))
        if self.fail == s.name:
            raise RuntimeError("the stand-in engine failed")
        self.clock.t += self.run_s
        out = s.num_prompts * s.output_len
        return B.offline_measures(self.run_s + 0.01 * len(self.calls), s.num_prompts * s.input_len, out, s.num_prompts)

    def profile(self, s, seed):
        return {"kernels": 3, "families": {}, "gaps": {}, "wall_s": 1.0}

    def info(self):
        return {"stand_in": True}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _job(scenarios, deadline=None, repeats=3, warmups=1):
    return {"model": "tiny", "mode": "kit+attention", "label": "kit+attention", "vllm_invariant": True,
            "attention_backend": "CUSTOM", "flags": [],
            "scenarios": [B.dataclasses.asdict(B.SCENARIOS[n]) for n in scenarios], "warmups": warmups,
            "repeats": repeats, "deadline": deadline}


def test_worker_warmups_repeats_and_rows(tmp_path):
    clock = Clock()
    eng = FakeBench(clock)
    part = tmp_path / "part.json"
    assert B.run_worker(_job(["decode", "tm", "profile"]), part, build=lambda j: eng, clock=clock) == 0
    doc = json.loads(part.read_text())
    assert doc["status"] == "done" and doc["runner"] == "stand-in" and doc["engine"] == {"stand_in": True}
    # warm-ups on the next seeds, repeats on the scenario's seed
    assert eng.calls[:4] == [("decode", 1), ("decode", 0), ("decode", 0), ("decode", 0)]
    assert [len(doc["scenarios"][n]["repeats"]) for n in ("decode", "tm")] == [3, 3]
    rows = B.part_rows(doc)
    assert [(r["op"], r["scenario"]) for r in rows] == [("vllm_bench", "decode"), ("vllm_bench", "tm"),
                                                        ("vllm_profile", "profile")]
    r = rows[0]
    assert r["impl"] == "kit+attention" and r["attention_backend"] == "CUSTOM" and len(r["warmups"]) == 1
    assert r["measures"]["output_tokens_per_s"]["n"] == 3 and set(r["measures"]) == {m for m, _ in B.MEASURES["offline"]}
    assert rows[2]["kernels"] == 3


def test_worker_deadline_failure_and_init_failure(tmp_path):
    clock = Clock()
    eng = FakeBench(clock, run_s=10.0)
    part = tmp_path / "part.json"
    # 35 s before the deadline: the warm-up (10 s) and two repeats fit, a third would not
    assert B.run_worker(_job(["decode"], deadline=clock.t + 35.0), part, build=lambda j: eng, clock=clock) == 0
    res = json.loads(part.read_text())["scenarios"]["decode"]
    assert len(res["repeats"]) == 2 and "2 of 3 repeats" in res["stopped"]
    row = B.part_rows(json.loads(part.read_text()))[0]
    assert "unresolved (fewer than 3 repeats)" in B.compare([r["output_tokens_per_s"] for r in row["repeats"]],
                                                            [1.0, 1.0, 1.0])["text"]
    # a scenario that raises is recorded, the next one runs
    clock = Clock()
    assert B.run_worker(_job(["decode", "tm"]), part, build=lambda j: FakeBench(clock, fail="decode"), clock=clock) == 4
    doc = json.loads(part.read_text())
    assert "the stand-in engine failed" in doc["scenarios"]["decode"]["error"] and len(doc["scenarios"]["tm"]["repeats"]) == 3
    assert doc["status"] == "failed"

    def no_engine(job):
        raise RuntimeError("no GPU here")

    assert B.run_worker(_job(["decode"]), part, build=no_engine) == 3
    doc = json.loads(part.read_text())
    assert doc["status"] == "init_failed" and "no GPU here" in doc["errors"][0]["traceback"]


# ----------------------------------------------------------------------------- the driver

def _fake_launch(clock, rates, calls):
    """Runs the build as a no-op and each worker in-process with a stand-in engine whose output
    tokens/s is ``rates[label]``."""
    def launch(kind, cmd, env, timeout, log):
        calls.append((kind, env.get("KIT_BATCH_INVARIANT"), env.get("VLLM_BATCH_INVARIANT"),
                      env.get("KIT_VLLM_INVARIANT"), env))
        if kind == "build":
            return {"rc": 0, "seconds": 1.0, "timed_out": False, "log_tail": ""}
        job = json.loads(Path(cmd[cmd.index("--worker") + 1]).read_text())
        eng = FakeBench(clock, run_s=100.0 / rates[job["label"]])
        rc = B.run_worker(job, cmd[cmd.index("--part") + 1], build=lambda j: eng, clock=clock)
        return {"rc": rc, "seconds": 1.0, "timed_out": False, "log_tail": ""}
    return launch


def test_driver_writes_the_result_file(tmp_path):
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default,invariant,kit+attention",
                      "--vllm-mode-under-kit", "both", "--scenarios", "decode", "--budget-s", "100000",
                      "--model-dir", str(tmp_path / "m")])
    clock, calls = Clock(), []
    rates = {"default": 10.0, "invariant": 5.0, "kit+attention": 9.8, "kit+attention alone": 9.9}
    extra = B.run_driver(a, launch=_fake_launch(clock, rates, calls), clock=clock, gpu=True)
    assert [c[0] for c in calls] == ["build"] + ["worker"] * 4
    assert calls[3][1:4] == ("1", "1", None) and calls[4][1:4] == ("1", "0", "0")  # kit+attention, then alone
    envs = [c[4] for c in calls[1:]]
    assert all("VLLM_ENABLE_V1_MULTIPROCESSING" not in e for e in envs)  # vLLM's own process layout
    assert ["KIT_PLUGIN_REPORT" in e for e in envs] == [False, False, True, True]
    assert all(e["KIT_JIT_LOG"].endswith(".jsonl") for e in envs)  # every engine logs its Triton compiles
    doc = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert {"provenance", "rows", "checks", "plan", "jobs", "comparisons"} <= set(doc)
    assert doc["provenance"]["git_commit"] and "command" in doc["provenance"]
    assert [r["impl"] for r in doc["rows"]] == ["default", "invariant", "kit+attention", "kit+attention alone"]
    for r in doc["rows"]:
        assert r["op"] == "vllm_bench" and r["model"] == "tiny" and r["scenario"] == "decode" and len(r["repeats"]) == 3
        assert r["measures"]["output_tokens_per_s"]["median"] > 0 and r["runner"] == "stand-in"
    assert all(j["status"] == "ran" and j["worker_status"] == "done" for j in extra["jobs"])
    goals = [c for c in doc["checks"] if c.get("goal")]
    assert goals and all(c["verdict"] in ("met", "not met", "unresolved") for c in goals)
    required = [c for c in doc["checks"] if not c.get("goal")]
    assert len(required) == 4 and all(c["passed"] for c in required)
    assert all(c["measure"] == "output_tokens_per_s" for c in doc["comparisons"])


def test_driver_profile_jobs_run_the_engine_in_the_worker(tmp_path):
    """The profile scenario gets its own worker per mode, with the engine in the worker's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the profiler sees its kernels); its row is a
    ``vllm_profile`` row."""
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default,kit+attention",
                      "--scenarios", "decode,profile", "--budget-s", "100000", "--model-dir", str(tmp_path / "m")])
    assert [(j["label"], j["kind"]) for j in B.plan(a)] == [("default", "offline"), ("kit+attention", "offline"),
                                                            ("default", "profile"), ("kit+attention", "profile")]
    clock, calls = Clock(), []
    B.run_driver(a, launch=_fake_launch(clock, {"default": 1.0, "kit+attention": 1.0}, calls), clock=clock, gpu=True)
    assert [c[4].get("VLLM_ENABLE_V1_MULTIPROCESSING") for c in calls[1:]] == [None, None, "0", "0"]
    doc = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert [r["op"] for r in doc["rows"]] == ["vllm_bench", "vllm_bench", "vllm_profile", "vllm_profile"]


def test_driver_rows_name_the_capture_limit_and_a_join_keeps_both_settings(tmp_path):
    """A run with ``--max-cudagraph-capture-size`` records the limit in its plan and names it in
    every row's scenario: its comparisons pair only rows of that setting, and joined with a run
    of vLLM's own limit both sets of rows stay."""
    runs = {}
    for sub, extra_args in (("own", []), ("g", ["--max-cudagraph-capture-size", "1024"])):
        a = B.parse_args(["--out", str(tmp_path / sub), "--models", "tiny", "--modes", "default,kit+attention",
                          "--scenarios", "decode", "--budget-s", "100000", "--model-dir", str(tmp_path / "m"),
                          *extra_args])
        clock = Clock()
        B.run_driver(a, launch=_fake_launch(clock, {"default": 1.0, "kit+attention": 1.0}, []), clock=clock, gpu=True)
        runs[sub] = tmp_path / sub / "vllm_bench.json"
    doc = json.loads(runs["g"].read_text())
    assert doc["plan"]["max_cudagraph_capture_size"] == 1024
    assert {r["scenario"] for r in doc["rows"]} == {"decode, graphs to 1024"}
    assert all(r["max_cudagraph_capture_size"] == 1024 for r in doc["rows"])
    assert {c["scenario"] for c in doc["comparisons"]} == {"decode, graphs to 1024"}
    joined = json.loads(B.merge([runs["own"], runs["g"]], tmp_path / "j").read_text())
    assert sorted(r["scenario"] for r in joined["rows"]) == ["decode"] * 2 + ["decode, graphs to 1024"] * 2
    assert {(c["scenario"], tuple(c["runs"])) for c in joined["comparisons"]} == {("decode", (0, 0)),
                                                                                ("decode, graphs to 1024", (1, 1))}


def test_driver_skips_what_the_budget_cannot_start(tmp_path):
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default,invariant",
                      "--scenarios", "decode", "--budget-s", "100", "--model-dir", str(tmp_path / "m")])
    clock, calls = Clock(), []
    extra = B.run_driver(a, launch=_fake_launch(clock, {"default": 1.0, "invariant": 1.0}, calls), clock=clock, gpu=True)
    # the first worker's runs take 100 s of the fake clock: nothing is left for the second
    assert extra["jobs"][0]["status"] == "ran" and extra["jobs"][1]["status"] == "skipped"
    doc = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert any(not c["passed"] and "budget" in c.get("reason", "") for c in doc["checks"])
    assert B.main(["--out", str(tmp_path), "--merge", str(tmp_path / "vllm_bench.json")]) == 0


def test_build_failure_is_recorded(tmp_path):
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default", "--scenarios", "decode",
                      "--model-dir", str(tmp_path / "m")])
    extra = B.run_driver(a, launch=lambda *x: {"rc": 1, "seconds": 1.0, "timed_out": False, "log_tail": "boom"},
                         gpu=True)
    assert extra["build"]["log_tail"] == "boom" and extra["jobs"][0]["status"] == "skipped"
    doc = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert doc["checks"] == [{"name": "the models were built", "passed": False}]


# ----------------------------------------------------------------------------- vLLM's command lines and results

def test_throughput_cli_command_and_parse():
    s = B.SCENARIOS["tm"]
    flags = B.engine_flags("/m", mode="default", max_len=512, gpu=True)
    cmd = B.throughput_cli_command(flags, s, 7, "/o.json")
    assert cmd[1:6] == ["-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model"]
    assert cmd.count("--seed") == 1 and cmd[cmd.index("--seed") + 1] == "7"
    assert cmd[cmd.index("--num-prompts") + 1] == "1000" and cmd[cmd.index("--output-json") + 1] == "/o.json"
    out = "INFO x\nThroughput: 38.50 requests/s, 9000.25 total tokens/s, 3850.00 output tokens/s\nTotal num ...\n"
    m = B.parse_throughput_cli(out, {"elapsed_time": 26.0, "num_requests": 1000, "total_num_tokens": 234006})
    assert m["output_tokens_per_s"] == 3850.0 and m["requests_per_s"] == 38.5 and m["output_tokens"] == 100100
    with pytest.raises(ValueError, match="Throughput"):
        B.parse_throughput_cli("nothing", {})
    with pytest.raises(ValueError, match="elapsed_time"):
        B.parse_throughput_cli(out, {"num_requests": 1})


def test_cli_job_with_a_stand_in_command(tmp_path):
    """``--offline-runner cli``: one process per run; a stand-in for ``vllm bench throughput``
    writes its JSON and prints its line."""
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default", "--scenarios", "decode",
                      "--offline-runner", "cli", "--model-dir", str(tmp_path / "m")])
    runs = []

    def launch(cmd, env, timeout, log):
        seed = int(cmd[cmd.index("--seed") + 1])
        runs.append(seed)
        Path(cmd[cmd.index("--output-json") + 1]).write_text(json.dumps(
            {"elapsed_time": 2.0, "num_requests": 256, "total_num_tokens": 1000}))
        return {"rc": 0, "log_tail": f"Throughput: 128.0 requests/s, 500.0 total tokens/s, {400 + len(runs)}.0 "
                                     f"output tokens/s\n"}

    job = {"model": "tiny", "mode": "default", "label": "default", "vllm_invariant": None}
    doc = B.run_cli_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True, launch=launch)
    assert runs == [1, 0, 0, 0] and doc["status"] == "done"
    rows = B.part_rows(doc)
    assert [r["output_tokens_per_s"] for r in rows[0]["repeats"]] == [402.0, 403.0, 404.0]
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default", "--scenarios", "decode",
                      "--offline-runner", "cli", "--model-dir", str(tmp_path / "m"), "--max-cudagraph-capture-size",
                      "1024"])
    cmds = []
    B.run_cli_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True,
                  launch=lambda cmd, *x: cmds.append(cmd) or launch(cmd, *x))
    assert all(c[c.index("--max-cudagraph-capture-size") + 1] == "1024" for c in cmds) and len(cmds) == 4


def test_online_measures_and_serve_command():
    s = B.SCENARIOS["online"]
    cmd = B.serve_bench_command("http://127.0.0.1:9", "/m", s, 3, "/d", "r.json")
    for flag, val in (("--max-concurrency", "64"), ("--request-rate", "16.0"), ("--dataset-name", "random"),
                      ("--seed", "3"), ("--endpoint", "/v1/completions")):
        assert cmd[cmd.index(flag) + 1] == val
    doc = {k: 1.5 for k, _ in B.MEASURES["online"]} | {"completed": 512, "failed": 0}
    assert B.online_measures(doc)["median_ttft_ms"] == 1.5 and B.online_measures(doc)["completed"] == 512
    with pytest.raises(ValueError, match="median_tpot_ms"):
        B.online_measures({k: v for k, v in doc.items() if k != "median_tpot_ms"})


class FakeServer:
    base_url = "http://127.0.0.1:1"

    def __init__(self, cmd, env, log):
        self.cmd, self.env = cmd, env

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def wait_ready(self, timeout):
        return 1.0


def test_online_job_with_a_stand_in_server_and_client(tmp_path):
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "kit+attention", "--vllm-mode-under-kit",
                      "off", "--scenarios", "online", "--model-dir", str(tmp_path / "m")])
    servers, seeds = [], []

    def launch_server(cmd, env, log):
        servers.append(FakeServer(cmd, env, log))
        return servers[-1]

    def client(url, s, seed):
        seeds.append(seed)
        return {k: 10.0 + len(seeds) for k, _ in B.MEASURES["online"]}

    job = {"model": "tiny", "mode": "kit+attention", "label": "kit+attention alone", "vllm_invariant": False}
    doc = B.run_online_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True,
                           launch_server=launch_server, run_client=client)
    assert doc["status"] == "done" and seeds == [1, 0, 0, 0]
    cmd, env = servers[0].cmd, servers[0].env
    assert cmd[cmd.index("--attention-backend") + 1] == "CUSTOM" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["KIT_VLLM_INVARIANT"] == "0" and env["VLLM_BATCH_INVARIANT"] == "0"
    row = B.part_rows(doc)[0]
    assert row["kind"] == "online" and row["impl"] == "kit+attention alone"
    assert row["measures"]["median_ttft_ms"] == B.stats([12.0, 13.0, 14.0])
    assert "--max-cudagraph-capture-size" not in cmd
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "kit+attention", "--vllm-mode-under-kit",
                      "off", "--scenarios", "online", "--model-dir", str(tmp_path / "m"),
                      "--max-cudagraph-capture-size", "512"])
    B.run_online_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True, launch_server=launch_server,
                     run_client=client)
    cmd = servers[-1].cmd
    assert cmd[cmd.index("--max-cudagraph-capture-size") + 1] == "512"


def test_online_job_falls_back_to_the_kits_client(tmp_path, monkeypatch):
    """``vllm bench serve`` that stops on an import before any measurement: the kit's client takes
    every run, and the row says so; a client that fails is an error of the scenario."""
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default", "--scenarios", "online",
                      "--model-dir", str(tmp_path / "m")])
    monkeypatch.setattr(B, "has_bench_serve", lambda: True)

    def unavailable(*args):
        raise B.BenchServeUnavailable("ModuleNotFoundError: No module named 'aiohttp'")

    monkeypatch.setattr(B, "_bench_serve", unavailable)
    seeds = []
    monkeypatch.setattr(B, "serve_client", lambda url, s, vocab, seed, timeout_s: seeds.append(seed) or
                        {k: 5.0 for k, _ in B.MEASURES["online"]})
    job = {"model": "tiny", "mode": "default", "label": "default", "vllm_invariant": None}
    doc = B.run_online_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True, launch_server=FakeServer)
    assert doc["status"] == "done" and seeds == [1, 0, 0, 0] and "aiohttp" in doc["runner"]
    assert B.part_rows(doc)[0]["runner"].startswith("the kit's client")
    monkeypatch.setattr(B, "serve_client", lambda *x, **k: {})
    doc = B.run_online_job(a, job, B.scenarios_of(a), time.time() + 1e6, tmp_path, gpu=True, launch_server=FakeServer)
    assert doc["status"] == "failed" and "lacks" in doc["scenarios"]["online"]["error"]


def test_bench_serve_results_and_import_failures(tmp_path, monkeypatch):
    """A stand-in for the ``vllm bench serve`` process: its result file read into the measures; an
    import error in its log is :class:`BenchServeUnavailable`, any other failure a RuntimeError."""
    s = B.SCENARIOS["online"]

    def ok(cmd, env, timeout, log):
        d = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        d.write_text(json.dumps({k: 2.0 for k, _ in B.MEASURES["online"]} | {"completed": 384, "failed": 0}))
        return {"rc": 0, "timed_out": False, "log_tail": ""}

    monkeypatch.setattr(B.R, "run_process", ok)
    assert B._bench_serve("http://x", "/m", s, 0, {}, tmp_path, 10)["completed"] == 384
    monkeypatch.setattr(B.R, "run_process", lambda *x: {"rc": 1, "timed_out": False, "log_tail":
                                                        "Traceback\nModuleNotFoundError: No module named 'aiohttp'\n"})
    with pytest.raises(B.BenchServeUnavailable, match="aiohttp"):
        B._bench_serve("http://x", "/m", s, 0, {}, tmp_path, 10)
    monkeypatch.setattr(B.R, "run_process", lambda *x: {"rc": 1, "timed_out": True, "log_tail": "killed"})
    with pytest.raises(RuntimeError, match="timed_out=True"):
        B._bench_serve("http://x", "/m", s, 0, {}, tmp_path, 10)


def test_kit_client_against_the_stand_in_server():
    """The kit's client (where ``vllm bench serve`` cannot run) against ``tests/fake_openai_server.py``
    (tokens streamed 20 ms apart): every request completes with its tokens; TTFT and TPOT near the
    server's pace; arrivals are a seeded Poisson process."""
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    srv = subprocess.Popen([sys.executable, str(TESTS / "fake_openai_server.py"), "--port", str(port), "--token-s",
                            "0.02"], start_new_session=True)
    try:
        import httpx

        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        s = B.Scenario("online", "online", 12, 20, 6, 0.0, request_rate=40.0, max_concurrency=4)
        m = B.serve_client(f"http://127.0.0.1:{port}", s, 512, 0, timeout_s=60)
    finally:
        srv.kill()
        srv.wait()
    assert m["completed"] == 12 and m["failed"] == 0 and m["total_output_tokens"] == 72
    assert 15 < m["median_ttft_ms"] < 500 and 15 < m["median_tpot_ms"] < 100 and m["output_throughput"] > 0
    assert B.arrivals(5, 10.0, 1) == B.arrivals(5, 10.0, 1) != B.arrivals(5, 10.0, 2)
    assert B.arrivals(3, 10.0, 1)[0] == 0.0
    reqs = B.random_requests(B.SCENARIOS["tm"], 512, 4)
    assert len(reqs) == 1000 and all(115 <= len(p) <= 141 and 90 <= n <= 110 for p, n in reqs)
    assert min(t for p, _ in reqs for t in p) >= len(B.SPECIAL_TOKENS)


def test_client_metrics():
    res = [{"ttft": 0.1, "latency": 1.1, "itls": [0.2] * 5, "output_tokens": 6, "prompt_tokens": 10, "error": None},
           {"ttft": 0.3, "latency": 0.8, "itls": [0.1] * 5, "output_tokens": 6, "prompt_tokens": 10, "error": None},
           {"ttft": None, "latency": 0.0, "itls": [], "output_tokens": 0, "prompt_tokens": 10, "error": "x"}]
    m = B.client_metrics(res, 2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["output_throughput"] == 6.0
    assert m["median_ttft_ms"] == pytest.approx(200.0) and m["median_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)


# ----------------------------------------------------------------------------- merge, models

def test_merge_joins_and_recomputes(tmp_path):
    from batch_invariance_kit.report import results

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    results.save("vllm_bench", [_row("dense", "default", "decode", [100, 101, 99]),
                                _row("dense", "kit+attention", "decode", [50, 50, 50])], [], folder=tmp_path / "a")
    results.save("vllm_bench", [_row("dense", "kit+attention", "decode", [97, 97, 97])],
                 [{"name": "dense kit+attention offline: ran every scenario", "passed": True}], folder=tmp_path / "b")
    path = B.merge([tmp_path / "a" / "vllm_bench.json", tmp_path / "b" / "vllm_bench.json"], tmp_path / "c")
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == 2 and len(doc["sources"]) == 2
    c = [c for c in doc["comparisons"] if c["impl"] == "kit+attention"][0]
    assert c["ratio"] == pytest.approx(0.97) and c["resolved"]
    assert any(g.get("goal") and g["verdict"] == "met" for g in doc["checks"])
    # a joined file joined again contributes its runs, each with its own provenance
    results.save("vllm_bench", [_row("moe", "default", "tm", [10, 10, 10])], [], folder=tmp_path / "e")
    again = json.loads(B.merge([path, tmp_path / "e" / "vllm_bench.json"], tmp_path / "f").read_text())
    assert len(again["rows"]) == 3 and len(again["sources"]) == 3
    assert again["sources"][:2] == doc["sources"] and all("jobs" in s for s in again["sources"])
    assert sorted((r["model"], r["impl"], r["source"]) for r in again["rows"]) == [
        ("dense", "default", 0), ("dense", "kit+attention", 1), ("moe", "default", 2)]  # each row's run, kept
    c = [c for c in again["comparisons"] if c["impl"] == "kit+attention"][0]
    assert c["runs"] == [1, 0] and c["why"] is None
    with pytest.raises(ValueError, match="not a result file"):
        (tmp_path / "bad.json").write_text("{}")
        B.merge([tmp_path / "bad.json"], tmp_path / "d")


def test_model_shapes_tokenizer_and_build(tmp_path):
    d, m = B.model_config("dense"), B.model_config("moe", 12)
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
            d.intermediate_size, d.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert (m.hidden_size, m.num_hidden_layers, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.num_key_value_heads) == (2048, 12, 128, 8, 768, 4)
    with pytest.raises(ValueError, match="model"):
        B.model_config("huge")
    assert B.build_model("tiny", tmp_path / "tiny", device="cpu") == "built"
    assert B.build_model("tiny", tmp_path / "tiny", device="cpu") == "reused"
    assert B.build_model("tiny", tmp_path / "dummy", weights="dummy") == "built"
    assert not (tmp_path / "dummy" / "model.safetensors").exists()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tiny"))
    ids = [3, 500, 17, 17, 511]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.all_special_ids == [0, 1, 2] and tok.vocab_size == 512
    with pytest.raises(ValueError, match="vocab_size"):
        B.write_tokenizer(tmp_path / "t", 3)


# ----------------------------------------------------------------------------- the profile summary

def test_kernel_families():
    names = {"gemm": ["_mm_kernel", "_mm_tma_kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN",
                      "sm90_xmma_gemm_bf16bf16_bf16f32", "matmul_kernel_persistent", "void cutlass::Kernel2<x>"],
             "attention": ["_attn_split_kernel", "_attn_merge_kernel", "_write_kv_kernel",
                           "void flash::FlashAttnFwdSm90<x>", "reshape_and_cache_flash_kernel"],
             "norm": ["_rms_norm_kernel", "fused_add_rms_norm_kernel",
                      "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"],
             "moe": ["_router_kernel", "_dispatch_kernel", "_grouped_gemm_kernel", "_combine_kernel",
                     "fused_moe_kernel", "moe_align_block_size_kernel", "topkGatingSoftmax"],
             "other": ["triton_poi_fused_mul_silu_0", "rotary_embedding_kernel", "gatherTopK", "Memcpy DtoH"]}
    for fam, ns in names.items():
        assert [SP.kernel_family(n) for n in ns] == [fam] * len(ns), fam
    with pytest.raises(TypeError, match="name"):
        SP.kernel_family(3)


def test_gaps_and_summary_of_a_synthetic_trace():
    ev = [{"name": "_mm_kernel", "cat": "kernel", "ts": 0.0, "dur": 10.0},
          {"name": "_rms_norm_kernel", "cat": "kernel", "ts": 5.0, "dur": 10.0},        # overlaps: no gap
          {"name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": 20.0, "dur": 5.0},         # 5 us gap before
          {"name": "_attn_split_kernel", "cat": "kernel", "ts": 225.0, "dur": 25.0},   # 200 us gap before
          {"name": "elementwise", "cat": "kernel", "ts": 265.0, "dur": 5.0}]           # 15 us gap before
    g = SP.gaps(ev)
    assert g["span_us"] == 270.0 and g["busy_us"] == 50.0 and g["idle_us"] == 220.0 and g["gaps"] == 3
    assert g["gaps_over_10us"] == 2 and g["gaps_over_100us"] == 1 and g["median_gap_us"] == 15.0
    assert g["largest_gaps_us"] == [200.0, 15.0, 5.0] and g["idle_fraction"] == pytest.approx(220 / 270)
    assert [(n["us"], n["after"], n["before"]) for n in g["largest"]] == [
        (200.0, "Memcpy HtoD", "_attn_split_kernel"), (15.0, "_attn_split_kernel", "elementwise"),
        (5.0, "_rms_norm_kernel", "Memcpy HtoD")]
    assert g["idle_in_gaps_over_1ms_us"] == 0.0 and all(n["host"] == [] for n in g["largest"])
    # the host's work during a gap, by overlap: a long op call (a kernel loaded on first use) and its launch
    host = [{"name": "ProfilerStep#1", "cat": "user_annotation", "ts": -10.0, "dur": 400.0},
            {"name": "batch_invariance_kit::linear", "cat": "cpu_op", "ts": 30.0, "dur": 1190.0},
            {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 215.0, "dur": 12.0},
            {"name": "aten::empty", "cat": "cpu_op", "ts": 400.0, "dur": 1.0}]
    late = ev[:3] + [dict(ev[3], ts=1225.0), dict(ev[4], ts=1265.0)]  # the 200 us gap grows to 1200 us
    s = SP.summarize(late + host)
    big = s["gaps"]["largest"][0]
    assert big["us"] == 1200.0 and s["gaps"]["idle_in_gaps_over_1ms_us"] == 1200.0
    assert big["host"] == [{"name": "batch_invariance_kit::linear", "us": 1190.0},
                           {"name": "ProfilerStep#1", "us": 365.0}, {"name": "cudaLaunchKernel", "us": 12.0},
                           {"name": "aten::empty", "us": 1.0}]
    assert s["kernels"] == 4  # host events count in no family
    # an enclosing kernel that outlasts a later-starting one stays the name before the next gap
    g2 = SP.gaps([{"name": "long", "ts": 0.0, "dur": 50.0}, {"name": "short", "ts": 10.0, "dur": 5.0},
                  {"name": "next", "ts": 1100.0, "dur": 1.0}])
    assert g2["largest"][0]["after"] == "long" and g2["idle_in_gaps_over_1ms_us"] == 1050.0
    s = SP.summarize(ev)
    assert s["kernels"] == 4 and s["copies"] == 1 and s["kernel_time_us"] == 50.0 and s["copy_time_us"] == 5.0
    f = s["families"]
    assert (f["gemm"]["time_us"], f["norm"]["time_us"], f["attention"]["time_us"], f["other"]["time_us"],
            f["moe"]["kernels"]) == (10.0, 10.0, 25.0, 5.0, 0)
    assert f["attention"]["share"] == 0.5 and f["moe"]["share"] == 0.0
    assert f["gemm"]["top"] == [{"name": "_mm_kernel", "time_us": 10.0}]
    assert SP.gaps([])["idle_fraction"] is None and SP.gaps([ev[0]])["span_us"] == 10.0
    text = SP.profile_table([{"op": "vllm_profile", "model": "dense", "impl": "kit+attention", **s}])
    assert "attention 50%" in text and "device idle 81%" in text and "1 over 100 us" in text


def test_read_trace_of_a_cpu_profiler_run(tmp_path):
    """The trace of a real profiler run (CPU activity) reads into events of its ``cpu_op`` category
    with the shape the summary takes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x = torch.mm(x, x).tanh()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ev = SP.read_trace(tmp_path / "t.json", categories=("cpu_op",))
    names = [e["name"] for e in ev]
    assert names.count("aten::mm") == 3 and all(e["dur"] >= 0 for e in ev) and ev == sorted(ev, key=lambda e: e["ts"])
    assert SP.read_trace(tmp_path / "t.json") == []  # no device kernels on a CPU run
    out = SP.profile_call(lambda: torch.mm(x, x))
    assert out["device"] == "cpu" and out["kernels"] == 0 and out["wall_s"] > 0


def test_profile_command_arguments(capsys, monkeypatch):
    assert SP.main(["--out", "x", "--scenarios", "decode"]) == 2
    assert SP.main(["--out", "x", "--scenarios=profile,tm"]) == 2
    assert "tm" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(B, "main", lambda argv: seen.append(argv) or 0)
    assert SP.main(["--out", "x", "--dry-run"]) == 0
    assert seen[0][-6:] == ["--modes", "default,kit+attention", "--scenarios", "profile", "--result-name",
                            "vllm_profile"]
    assert SP.main(["--out", "x", "--scenarios", "profile,profile_tm", "--modes", "default"]) == 0
    assert seen[1] == ["--out", "x", "--modes", "default", "--scenarios", "profile,profile_tm",
                       "--result-name", "vllm_profile"]
    mixed = B.SCENARIOS["profile_tm"]
    assert mixed.kind == "profile" and mixed.bounds(mixed.output_len)[0] < mixed.bounds(mixed.output_len)[1]


# ----------------------------------------------------------------------------- live: vLLM's CPU build

@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh installs it)")
def test_live_worker_on_vllms_cpu_build(tmp_path):
    """The worker on vLLM's CPU build (``python -m batch_invariance_kit.vllm.bench --worker``, the
    engine in its process, eager): the tiny model and its tokenizer, one engine built from
    ``vllm bench throughput``'s flags by its own parser, vLLM's own ``get_requests`` and
    ``_run_vllm_requests`` for a warm-up and three repeats of a small decode scenario; the rows have
    the shape the book reads."""
    a = B.parse_args(["--out", str(tmp_path), "--models", "tiny", "--modes", "default", "--scenarios", "decode",
                      "--scale", "0.02", "--length-scale", "0.05", "--eager", "--model-dir", str(tmp_path / "m")])
    assert B.build_model("tiny", B.model_folder(a, "tiny"), device="cpu") == "built"
    job, part = tmp_path / "job.json", tmp_path / "part.json"
    job.write_text(json.dumps(B.worker_job(a, "tiny", "default", None, B.scenarios_of(a), None, gpu=False)))
    env = R.mode_env("default", {k: v for k, v in os.environ.items() if not k.startswith("KIT_")}, gpu=False)
    r = subprocess.run([sys.executable, "-m", "batch_invariance_kit.vllm.bench", "--worker", str(job), "--part",
                        str(part)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    doc = json.loads(part.read_text())
    (row,) = B.part_rows(doc)
    assert row["runner"].startswith("vllm bench throughput (in process") and row["model"] == "tiny"
    assert len(row["warmups"]) == 1 and len(row["repeats"]) == 3
    for rep in row["repeats"]:
        assert rep["requests"] == 5 and rep["prompt_tokens"] == 5 * 6 and rep["output_tokens"] == 5 * 26
    assert row["measures"]["output_tokens_per_s"]["n"] == 3 and row["engine"]["enforce_eager"] is True
    assert "tiny / decode" in B.table([row], B.comparisons([row]))


def test_a_joined_row_without_its_run_is_placed_by_plan_and_jobs():
    def src(models, scenarios, jobs):
        return {"plan": {"models": models, "scenarios": dict.fromkeys(scenarios, {})},
                "jobs": [{"label": lab, "model": m, "status": st} for lab, m, st in jobs]}

    sources = [src(["dense"], ["tm", "decode"], [("default", "dense", "ran"), ("kit+attention alone", "dense", "ran")]),
               src(["dense"], ["tm"], [("invariant", "dense", "ran")]),
               src(["dense"], ["tm"], [("default", "dense", "ran"), ("kit+attention alone", "dense", "skipped")])]
    row = {"model": "dense", "scenario": "tm"}
    assert B._row_source(dict(row, impl="default"), sources) == 2  # the last run that ran it
    assert B._row_source(dict(row, impl="kit+attention alone"), sources) == 0  # run 2 skipped it
    assert B._row_source(dict(row, impl="invariant"), sources) == 1
    assert B._row_source(dict(row, impl="invariant", source=0), sources) == 0  # a row that names its run
    with pytest.raises(ValueError, match="no run"):
        B._row_source(dict(row, impl="default", model="moe"), sources)
