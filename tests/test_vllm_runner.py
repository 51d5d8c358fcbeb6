"""CPU tests of :mod:`batch_invariance_kit.vllm.runner`, the one vLLM engine worker, without vLLM.

The modes' environments, the process-group kill on timeout (a real subprocess), decode vs
prefill (the bitwise comparison and the distinct completions are :mod:`batch_invariance_kit.vllm.records`',
``tests/test_vllm_records.py``), the spec and job validation, the
worker's experiment loop (a stand-in engine: ``tests/fake_engine.py``: results, a failing
experiment, a failing engine, the deadline, a save after every experiment) and :func:`run_mode`'s
document from a worker process.  A real vLLM engine runs the same worker in
``tests/test_vllm_engine.py``."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from batch_invariance_kit.vllm import records as RC
from batch_invariance_kit.vllm import runner as R
from fake_engine import FakeEngine

TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- modes, processes

def test_mode_env():
    env = R.mode_env("default", {"VLLM_BATCH_INVARIANT": "1", "KIT_PLUGIN_REPORT": "/x", "PATH": "/bin"}, gpu=False)
    assert "VLLM_BATCH_INVARIANT" not in env and "KIT_PLUGIN_REPORT" not in env and env["PATH"] == "/bin"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert R.MODES == RC.MODES                                  # one name per mode
    with pytest.raises(ValueError, match="mode"):
        R.mode_env("vllm-invariant", {})
    # kit+attention: the kit's environment; on the CPU the kit's attention under the interpreter
    assert R.mode_env("kit+attention", {}, gpu=True) == R.mode_env("kit", {}, gpu=True)
    cpu = R.mode_env("kit+attention", {}, gpu=False)
    assert cpu["KIT_ATTENTION"] == "1" and cpu["TRITON_INTERPRET"] == "1" and "KIT_ATTENTION" not in R.mode_env("kit", {})
    assert R.mode_env("invariant", {})["VLLM_BATCH_INVARIANT"] == "1"
    # kit: vLLM's own mode under the plugin on a GPU only (vLLM's CPU build cannot run it)
    assert R.mode_env("kit", {}, gpu=True)["VLLM_BATCH_INVARIANT"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in R.mode_env("kit", {}, gpu=False)
    assert [R.mode_env(m, {}, gpu=True)["KIT_BATCH_INVARIANT"] for m in R.MODES] == ["0", "0", "1", "1"]
    assert all("VLLM_ALLOW_INSECURE_SERIALIZATION" not in R.mode_env(m, {}, gpu=True) for m in R.MODES)
    with pytest.raises(ValueError, match="mode"):
        R.mode_env("fast", {})
    # a kit mode alone: the plugin's switch and vLLM's mode off, whatever the caller had
    env = R.mode_env("kit+attention", {"KIT_VLLM_INVARIANT": "1", "VLLM_BATCH_INVARIANT": "1"}, gpu=True,
                     vllm_invariant=False)
    assert (env["KIT_BATCH_INVARIANT"], env["KIT_VLLM_INVARIANT"], env["VLLM_BATCH_INVARIANT"]) == ("1", "0", "0")
    env = R.mode_env("kit", {"KIT_VLLM_INVARIANT": "0"}, gpu=True, vllm_invariant=True)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and "KIT_VLLM_INVARIANT" not in env
    assert R.mode_env("kit", {}, gpu=True, vllm_invariant=True) == R.mode_env("kit", {}, gpu=True)
    assert "KIT_VLLM_INVARIANT" not in R.mode_env("default", {"KIT_VLLM_INVARIANT": "0"}, gpu=True,
                                                  vllm_invariant=False)
    assert "KIT_VLLM_INVARIANT" in R.RECORDED_ENV and "VLLM_BATCH_INVARIANT" in R.RECORDED_ENV


def test_run_process_kills_the_group_on_timeout(tmp_path):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print('started', flush=True); time.sleep(60)")
    r = R.run_process([sys.executable, "-c", code], dict(os.environ), 2.0, tmp_path / "log.txt")
    assert r["timed_out"] and r["rc"] != 0 and r["seconds"] < 30 and "started" in r["log_tail"]
    r = R.run_process([sys.executable, "-c", "print('ok')"], dict(os.environ), 30.0, tmp_path / "ok.txt")
    assert r == {**r, "rc": 0, "timed_out": False} and "ok" in r["log_tail"]


# ----------------------------------------------------------------------------- checks

def test_decode_vs_prefill():
    r = R.decode_vs_prefill([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0])
    assert r["positions"] == 3 and r["equal_positions"] == 3 and r["first_unequal"] is None and r["max_abs_diff"] == 0.0
    r = R.decode_vs_prefill([-1.0, -2.0, -3.0], [-1.0, -2.5, -3.0 + 2 ** -10])
    assert r["equal_positions"] == 1 and r["first_unequal"] == 1 and r["max_abs_diff"] == 0.5
    assert r["prefill_logprobs"] == [-1.0, -2.5, -3.0 + 2 ** -10] and r["decode_logprobs"] == [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="prefill"):
        R.decode_vs_prefill([-1.0, -2.0], [-1.0])


# ----------------------------------------------------------------------------- spec and job

TARGETS = [[5, 6, 7], [8, 9, 10, 11]]
FILLERS = [[12, 13], [14], [15, 16, 17]]


def test_make_spec_batches():
    s = R.make_spec(TARGETS, FILLERS, max_tokens=4, orders=(0, 1), max_model_len=64)
    assert s["batches"] == [{"fillers": 3, "seed": 0}, {"fillers": 3, "seed": 1}]
    assert s["filler_max_tokens"] == [4, 4, 4] and s["decode_vs_prefill"] == 1
    order = [("f", 2), ("t", 1), ("f", 0), ("t", 0)]
    s = R.make_spec(TARGETS, FILLERS, max_tokens=4, batches=[{"order": order, "seed": 7}], max_model_len=64)
    assert s["batches"] == [{"order": [list(r) for r in order], "seed": 7}]
    assert R.batch_order(2, 3, 5) == R.batch_order(2, 3, 5) and sorted(R.batch_order(2, 3, 5)) == sorted(
        [("t", 0), ("t", 1), ("f", 0), ("f", 1), ("f", 2)])


@pytest.mark.parametrize("kw, err, needle", [
    (dict(targets=[[1, "a"]]), TypeError, "targets"),
    (dict(fillers=[[]]), TypeError, "fillers"),
    (dict(targets=[]), ValueError, "targets"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(filler_max_tokens=[4]), ValueError, "filler_max_tokens"),
    (dict(decode_vs_prefill=3), ValueError, "decode_vs_prefill"),
    (dict(batches=[{"fillers": 4, "seed": 0}]), ValueError, "batches"),
    (dict(batches=[{"order": [("t", 0)], "seed": 0}]), ValueError, "every target once"),
    (dict(batches=[{"order": [("t", 0), ("t", 1), ("f", 3)], "seed": 0}]), ValueError, "in range"),
    (dict(batches=[{"fillers": 1}]), ValueError, "seed"),
    (dict(max_model_len=7), ValueError, "max_model_len"),
    (dict(kv_cache_gib=0), ValueError, "kv_cache_gib"),
])
def test_make_spec_errors_name_the_argument(kw, err, needle):
    args = {**dict(targets=TARGETS, fillers=FILLERS, max_tokens=4, max_model_len=64), **kw}
    with pytest.raises(err, match=needle):
        R.make_spec(args.pop("targets"), args.pop("fillers"), **args)


def _job(**kw):
    spec = R.make_spec(TARGETS, FILLERS, max_tokens=4, orders=(0, 1), decode_vs_prefill=2, max_model_len=64)
    exps = [R.targets_experiment("t", spec, estimate_s=1.0),
            {"name": "dvp", "kind": "decode_vs_prefill", "of": "t", "target": 1},
            {"name": "tp", "kind": "throughput", "prompts": FILLERS, "new_tokens": 3, "warmup": 2}]
    return R.make_job({"eager": True, "kv_cache_gib": 0.5}, kw.pop("experiments", exps), **kw)


def test_make_job():
    job = _job(tags={"model": "m"})
    assert job["engine"] == {**R.ENGINE, "eager": True, "kv_cache_gib": 0.5}
    assert [e["name"] for e in job["experiments"]] == ["t", "dvp", "tp"] and job["tags"] == {"model": "m"}
    assert "dtype" not in job["experiments"][0] and job["deadline"] is None
    assert json.loads(json.dumps(job)) == job


@pytest.mark.parametrize("engine, exps, err, needle", [
    ({"attention": "X"}, None, ValueError, "unknown options"),
    ({"max_model_len": 6}, None, ValueError, "'t'.*max_model_len"),       # a prompt + output does not fit
    ({}, [], ValueError, "non-empty"),
    ({}, [{"kind": "throughput"}], ValueError, "name"),
    ({}, [{"name": "a", "kind": "serve"}], ValueError, "kind"),
    ({}, [{"name": "a", "kind": "targets"}], TypeError, "'a'.*make_spec"),
    ({}, [{"name": "a", "kind": "decode_vs_prefill", "of": "b", "target": 0}], ValueError, "earlier 'targets'"),
    ({}, [{"name": "a", "kind": "throughput", "prompts": [[1]], "new_tokens": 0}], ValueError, "new_tokens"),
    ({}, [{"name": "a", "kind": "throughput", "prompts": [[1]], "new_tokens": 2, "estimate_s": -1}], ValueError,
     "estimate_s"),
])
def test_make_job_errors_name_the_argument(engine, exps, err, needle):
    with pytest.raises(err, match=needle):
        R.make_job(engine, exps if exps is not None else _job()["experiments"])
    with pytest.raises(TypeError, match="engine"):
        R.make_job(None, _job()["experiments"])


# ----------------------------------------------------------------------------- the worker's loop

def test_worker_runs_the_experiments_and_saves_after_each(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    saved = []
    write = R.write_json
    monkeypatch.setattr(R, "write_json", lambda p, d: (saved.append((d["status"], sorted(d["experiments"]))),
                                                       write(p, d)))
    eng = FakeEngine()
    rc = R.run_worker("m", _job(tags={"model": "tiny"}), out, build=lambda m, o, d: eng)
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["status"] == "done" and doc["model"] == "tiny" and doc["errors"] == []
    assert saved == [("starting", []), ("initialized", []), ("initialized", ["t"]), ("initialized", ["dvp", "t"]),
                     ("initialized", ["dvp", "t", "tp"]), ("done", ["dvp", "t", "tp"])]
    t = doc["experiments"]["t"]
    assert len(t["alone"]) == 2 and len(t["batches"]) == 2 and [d["target"] for d in t["decode_vs_prefill"]] == [0, 1]
    b = t["batches"][0]
    assert b["requests"] == 5 and b["prompt_tokens"] == 7 + 6 and b["targets"][1] == t["alone"][1]
    assert t["batches"][0]["positions"] != t["batches"][1]["positions"]   # each seed another order
    assert doc["experiments"]["dvp"]["target"] == 1 and doc["experiments"]["dvp"]["prompt_len"] == 4
    tp = doc["experiments"]["tp"]
    assert tp["prompts"] == 3 and tp["output_tokens"] == 9 and tp["prompt_tokens"] == 6
    assert eng.batches == [1, 1, 5, 5, 2, 3]   # alone x2, two batches, warm-up, timed
    assert all("seconds" in r and "kit_calls" in r for r in doc["experiments"].values())
    assert doc["engine"]["enforce_eager"] is True and "init_s" in doc and "mode_env" in doc and "engine_env" in doc


def test_worker_records_a_failing_experiment_and_goes_on(tmp_path):
    out = tmp_path / "out.json"
    rc = R.run_worker("m", _job(), out, build=FakeEngine.builder(fail_at=0))   # the first generate raises
    doc = json.loads(out.read_text())
    assert rc == 4 and doc["status"] == "failed"
    assert "fake engine's forward failed" in doc["experiments"]["t"]["error"]
    assert "did not complete" in doc["experiments"]["dvp"]["error"]          # it needs t's runs alone
    assert doc["experiments"]["tp"]["output_tokens"] == 9                    # the next one still ran


def test_worker_init_failure_and_deadline(tmp_path):
    def build(model, options, doc):
        raise RuntimeError("no engine here")

    out = tmp_path / "out.json"
    assert R.run_worker("m", _job(), out, build=build) == 3
    doc = json.loads(out.read_text())
    assert doc["status"] == "init_failed" and "no engine here" in doc["errors"][0]["traceback"]
    # an experiment whose estimate does not fit before the deadline is skipped, the others run
    R.run_worker("m", _job(deadline=time.time() + 0.5), out, build=FakeEngine.builder())
    doc = json.loads(out.read_text())
    assert "budget" in doc["experiments"]["t"]["skipped"] and doc["status"] == "failed"
    assert "did not complete" in doc["experiments"]["dvp"]["error"] and "wall_s" in doc["experiments"]["tp"]


# ----------------------------------------------------------------------------- run_mode and summarize

def _fake_worker(model, job_path, out, **kw):
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from fake_engine import FakeEngine; "
            "from batch_invariance_kit.vllm import runner as R; "
            f"sys.exit(R.run_worker(sys.argv[2], json.load(open(sys.argv[3])), sys.argv[4], "
            f"build=FakeEngine.builder(**{kw!r})))")
    return [sys.executable, "-c", code, str(TESTS), str(model), str(job_path), str(out)]


@pytest.mark.parametrize("variant", [False, True])
def test_run_mode_and_summarize(tmp_path, monkeypatch, variant):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(R, "worker_command", lambda m, j, o: _fake_worker(m, j, o, variant=variant))
    spec = R.make_spec(TARGETS, FILLERS, max_tokens=4, orders=(0, 1), decode_vs_prefill=2, max_model_len=64)
    doc = R.run_mode(tmp_path, "invariant", spec, timeout=120)
    assert doc["status"] == "done" and doc["rc"] == 0 and doc["mode"] == "invariant", doc.get("log_tail")
    assert set(R.TARGET_RESULTS) <= set(doc) and "experiments" not in doc and "error" not in doc
    assert doc["mode_env"]["VLLM_BATCH_INVARIANT"] == "1" and doc["llm_kwargs"]["kv_cache_gib"] == 1.0
    s = R.summarize(doc)
    assert s["ran"] and s["targets"] == 2 and s["batches"] == 2
    assert s["all_bitwise_equal"] is (not variant) and s["decode_vs_prefill_equal"] is (not variant)
    assert s["tokens_changed"] == 0 and s["logprobs_changed"] == (2 if variant else 0)
    assert [d["positions"] for d in s["decode_vs_prefill"]] == [4, 4]


def test_run_mode_reports_the_failure(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(R, "worker_command", lambda m, j, o: _fake_worker(m, j, o, fail_at=0))
    spec = R.make_spec(TARGETS, FILLERS, max_tokens=4, max_model_len=64)
    doc = R.run_mode(tmp_path, "kit", spec, timeout=120)
    assert doc["status"] == "failed" and doc["rc"] == 4 and "fake engine's forward failed" in doc["error"]
    assert "log_tail" in doc and doc["plugin"] is None      # kit mode: no plugin report without vLLM
    assert R.summarize(doc) == {"mode": "kit", "status": "failed", "ran": False}
    with pytest.raises(FileNotFoundError, match="model"):
        R.run_mode(tmp_path / "nowhere", "kit", spec)
