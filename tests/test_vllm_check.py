"""CPU tests of :mod:`batch_invariance_kit.vllm.check`: everything except vLLM itself.

Arguments, prompt generation, the worker's job and the results read from its documents (the
worker's loop with a stand-in engine, ``tests/fake_engine.py``), the merge into rows/checks, the
budget and skip logic of the driver (with a fake clock and a fake launcher that runs that worker
in-process), and the kit replacements of vLLM's RMSNorm and MoE forwards (on the Triton
interpreter, against the kit's own ops).  The worker itself and the bitwise comparisons are
tested in ``tests/test_vllm_runner.py``."""
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.device import DEVICE
from batch_invariance_kit.ops import custom_ops as OPS
from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.ops import moe as MOE
from batch_invariance_kit.ops import rms_norm as RN
from batch_invariance_kit.vllm import check as V
from batch_invariance_kit.vllm import plugin as P
from batch_invariance_kit.vllm import records as RC
from batch_invariance_kit.vllm import runner as R
from fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- arguments

def test_args_defaults_and_plan_order():
    a = V.parse_args(["--out", "x"])
    assert a.models == ["dense", "moe"] and a.modes == ["default", "invariant", "kit"]
    assert a.budget_s == 480.0 and a.attention_backend == "FLASH_ATTN"
    assert V.plan(a.models, a.modes) == [("dense", "default"), ("dense", "invariant"), ("moe", "default"),
                                         ("moe", "invariant"), ("dense", "kit"), ("moe", "kit")]
    assert V.plan(["moe"], ["kit", "invariant"]) == [("moe", "invariant"), ("moe", "kit")]


@pytest.mark.parametrize("argv, needle", [
    (["--out", "x", "--models", "dense,foo"], "--models"),
    (["--out", "x", "--models", ","], "--models"),
    (["--out", "x", "--modes", "kit,kit"], "--modes"),
    (["--out", "x", "--budget-s", "-5"], "--budget-s"),
    (["--out", "x", "--budget-s", "nan"], "--budget-s"),
    (["--out", "x", "--attention-backend", "FLASHINFER"], "--attention-backend"),
    (["--out", "x", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    ([], "--out"),
    (["--out", "x", "--attention-backend", "CUSTOM"], "--modes kit\\+attention"),
    (["--out", "x", "--models", "deepseek", "--modes", "kit+attention"], "MLA"),
    (["--out", "x", "--vllm-mode-under-kit", "maybe"], "--vllm-mode-under-kit"),
    (["--out", "x", "--vllm-mode-under-kit", "off"], "--modes kit\\+attention"),   # default modes: kit
    (["--out", "x", "--models", "deepseek", "--modes", "kit+attention", "--vllm-mode-under-kit", "both"], "MLA"),
])
def test_args_errors_name_the_argument(argv, needle):
    with pytest.raises(ValueError, match=needle):
        V.parse_args(argv)


def test_main_returns_2_on_bad_args(capsys):
    assert V.main(["--out", "x", "--modes", "turbo"]) == 2
    assert "--modes" in capsys.readouterr().err


def test_imports_without_vllm_and_help():
    code = "import sys, batch_invariance_kit.vllm.check; assert 'vllm' not in sys.modules, 'vllm imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "batch_invariance_kit.vllm.check", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--budget-s" in r.stdout and "--modes" in r.stdout


# ----------------------------------------------------------------------------- prompts

def test_prompts_are_deterministic():
    assert RC.random_prompt(50, 3) == RC.random_prompt(50, 3) != RC.random_prompt(50, 4)
    p = RC.random_prompt(1000, 9)
    assert len(p) == 1000 and min(p) >= 2 and max(p) < RC.VOCAB
    assert len(RC.TARGET.tokens()) == 100 and len(RC.NEEDLE.tokens()) == 257


def test_batch_with():
    tgt = RC.TARGET.tokens()
    a = V.batch_with(tgt, 33, seed=7)
    assert a == V.batch_with(tgt, 33, seed=7)
    prompts, news, pos = a
    assert len(prompts) == len(news) == 33 and prompts[pos] is tgt and news[pos] is None
    others = [p for i, p in enumerate(prompts) if i != pos]
    assert all(16 <= len(p) <= 400 for p in others) and len({tuple(p) for p in others}) == 32
    assert all(4 <= n <= 96 for i, n in enumerate(news) if i != pos)
    assert V.batch_with(tgt, 1, seed=1) == ([tgt], [None], 0)
    assert V.batch_with(tgt, 33, seed=8)[0] != prompts
    with pytest.raises(ValueError, match="n must"):
        V.batch_with(tgt, 0, seed=1)


# ----------------------------------------------------------------------------- the job and its results

def test_worker_job():
    a = V.parse_args(["--out", "x", "--kit-eager", "--attention-backend", "TRITON_ATTN"])
    exps = V.experiments()
    assert exps == V.experiments()                                        # deterministic
    job = V.worker_job(a, "moe", "kit", 1234.5, exps)
    assert json.loads(json.dumps(job)) == job and job["deadline"] == 1234.5
    assert job["tags"] == {"model": "moe", "mode": "kit", "quick": False}
    assert job["engine"] == {**R.ENGINE, "max_model_len": V.MAX_MODEL_LEN, "eager": True,
                             "gpu_memory_utilization": 0.5, "attention_backend": "TRITON_ATTN"}
    assert V.worker_job(a, "moe", "default", 1.0, exps)["engine"]["eager"] is False   # --kit-eager: kit only
    by = {e["name"]: e for e in job["experiments"]}
    assert list(by) == list(V.EXPERIMENTS) and all(by[n]["estimate_s"] == V.EXPERIMENT_S[n] for n in by)
    bs, needle = by["bs"], by["needle"]
    assert bs["targets"] == [RC.TARGET.tokens()] and [len(b["order"]) for b in bs["batches"]] == list(V.BATCH_SIZES[1:])
    assert needle["targets"] == [RC.NEEDLE.tokens()] and len(needle["batches"]) == 4
    assert all(64 <= len(b["order"]) <= 128 for b in needle["batches"])
    # each batch is the driver's batch_with: the target at its place among the same fillers
    prompts, news, pos = V.batch_with(RC.TARGET.tokens(), 33, seed=133)
    b = bs["batches"][1]
    assert b["seed"] == 133 and b["order"][pos] == ["t", 0]
    assert [bs["fillers"][i] for k, i in b["order"] if k == "f"] == [p for j, p in enumerate(prompts) if j != pos]
    assert by["decode_vs_prefill"]["of"] == "bs" and len(by["throughput"]["prompts"]) == 256
    quick = {e["name"]: e for e in V.experiments(quick=True)}
    assert len(quick["needle"]["batches"]) == 2 and len(quick["throughput"]["prompts"]) == 64
    # the mode names the attention: the kit's in kit+attention, vLLM's choice for an MLA model
    assert V.worker_job(a, "dense", "kit+attention", 1.0, exps)["engine"]["attention_backend"] == "CUSTOM"
    assert V.worker_job(a, "deepseek", "kit", 1.0, exps)["engine"]["attention_backend"] is None
    assert V.worker_job(a, "deepseek", "default", 1.0, exps)["engine"]["eager"] is False


def _run_worker(job, out, *, calls=None, **kw):
    """The worker on ``job`` with a stand-in engine; ``calls``: the kit counters each experiment records."""
    R.run_worker("model", {**job, "deadline": None}, out, build=FakeEngine.builder(**kw))
    if calls is not None:
        doc = json.loads(Path(out).read_text())
        for r in doc["experiments"].values():
            r["kit_calls"] = dict(calls)
        R.write_json(out, doc)


@pytest.mark.parametrize("variant", [False, True])
def test_rows_from_the_worker(tmp_path, variant):
    a = V.parse_args(["--out", str(tmp_path), "--quick"])
    _run_worker(V.worker_job(a, "dense", "invariant", 1.0, V.experiments(quick=True)), tmp_path / "p.json",
                variant=variant)
    part = json.loads((tmp_path / "p.json").read_text())
    bs, nd, dp, tp = V.part_rows(part)
    assert (type(bs), type(nd), type(dp), type(tp)) == (RC.BsRow, RC.NeedleRow, RC.DecodeVsPrefillRow, RC.ThroughputRow)
    assert bs.batch_sizes == list(V.BATCH_SIZES) and len(bs.bs1_tokens) == V.NEW_TOKENS and bs.target_len == 100
    assert [r.batch_size for r in bs.runs] == list(V.BATCH_SIZES[1:]) and bs.all_equal is (not variant)
    assert all(r.prompt_tokens_in_batch > 100 for r in bs.runs)
    assert nd.n == 3 and nd.unique_logprob_sequences == (3 if variant else 1) and len(nd.trials) == 2
    assert dp.positions == V.NEW_TOKENS and (dp.equal_positions == V.NEW_TOKENS) is (not variant)
    assert dp.prompt_len == 100 and dp.last_token_equal
    assert tp.prompts == 64 and tp.output_tokens == 64 * 64
    rows, checks = V.rows_and_checks([part], [{"model": "dense", "mode": "invariant"}])
    assert [r.op for r in rows] == [f"vllm_{n}" for n in V.EXPERIMENTS]
    assert len(checks) == 3 and all(c["passed"] is (not variant) for c in checks)
    # the rows go to JSON and read back as the same records
    back = RC.read({"provenance": {}, "rows": [RC.to_dict(r) for r in rows], "checks": checks})
    assert back.rows == rows


def test_a_malformed_part_names_the_field(tmp_path):
    a = V.parse_args(["--out", str(tmp_path), "--quick"])
    _run_worker(V.worker_job(a, "dense", "kit", 1.0, V.experiments(quick=True)), tmp_path / "p.json")
    part = json.loads((tmp_path / "p.json").read_text())
    part["experiments"]["bs"]["batches"][1]["requests"] = "33"
    with pytest.raises(ValueError, match=r"^x\.experiments\.bs\.batches\[1\]\.requests: expected int"):
        V.part_rows(part, "x")
    del part["experiments"]["bs"]["alone"]
    with pytest.raises(ValueError, match=r"x\.experiments\.bs: missing field 'alone'"):
        V.part_rows(part, "x")
    with pytest.raises(ValueError, match=r"x\.mode: expected str"):
        V.part_rows({"model": "dense"}, "x")


# ----------------------------------------------------------------------------- merge

def _part(tmp_path, model, mode, *, variant=False, calls=None):
    """A worker's document of (model, mode): the stand-in engine, batch-variant or not."""
    a = V.parse_args(["--out", str(tmp_path), "--quick"])
    out = tmp_path / f"{model}__{mode}.json"
    _run_worker(V.worker_job(a, model, mode, 1.0, V.experiments(quick=True)), out, variant=variant, calls=calls)
    doc = json.loads(out.read_text())
    if mode in RC.KIT_MODES:
        doc["swapped"] = {"RMSNorm": "KitRMSNorm", "moe": "KitMoEMethod"}
    doc["experiments"]["throughput"] = {"error": "Traceback ...: boom", "seconds": 1.0}
    return doc


def _checks_by_suffix(checks, label):
    return {c["name"]: c for c in checks if c["name"].startswith(label + ":")}


def test_rows_and_checks(tmp_path):
    parts = [_part(tmp_path, "dense", "default", variant=True), _part(tmp_path, "dense", "invariant"),
             _part(tmp_path, "moe", "invariant", variant=True),
             _part(tmp_path, "moe", "kit", calls={"rms_norm": 3, "fused_add_rms_norm": 6, "moe": 0})]
    jobs = [{"model": p["model"], "mode": p["mode"], "status": "ran"} for p in parts]
    jobs.append({"model": "dense", "mode": "kit", "status": "skipped", "skipped": "budget: 12 s left"})
    rows, checks = V.rows_and_checks(parts, jobs)
    assert len(rows) == 4 * len(V.EXPERIMENTS)
    assert {r.op for r in rows} == {f"vllm_{e}" for e in V.EXPERIMENTS}
    assert all(r.impl in RC.MODES and r.model in V.MODEL_NAMES for r in rows)
    failed = [r for r in rows if isinstance(r, RC.FailedRow)]
    assert len(failed) == 4 and all(r.op == "vllm_throughput" and "boom" in r.error for r in failed)
    d = list(_checks_by_suffix(checks, "dense default").values())
    assert len(d) == 3 and all(c["informational"] and not c["passed"] for c in d) and d[0]["max_abs_diff"] > 0
    di = _checks_by_suffix(checks, "dense invariant")
    assert len(di) == 3 and all(c["passed"] and not c["informational"] for c in di.values())
    mi = _checks_by_suffix(checks, "moe invariant")
    assert [c["passed"] for c in mi.values()] == [False, False, False]
    mk = [c for c in checks if c["name"].startswith("moe kit:") and "replacements ran" in c["name"]]
    assert len(mk) == 1 and mk[0]["passed"] is False and "moe" in mk[0]["name"]  # the MoE counter stayed 0
    dk = _checks_by_suffix(checks, "dense kit")
    assert list(dk.values()) == [{"name": "dense kit: the engine ran the experiments", "passed": False,
                                  "informational": False, "reason": "budget: 12 s left"}]


def test_rows_and_checks_failed_init_and_partial_worker(tmp_path):
    init_failed = {"model": "dense", "mode": "invariant", "status": "init_failed", "experiments": {}}
    partial = _part(tmp_path, "moe", "invariant")
    partial["status"] = "initialized"
    for name in ("needle", "decode_vs_prefill", "throughput"):
        del partial["experiments"][name]
    jobs = [{"model": "dense", "mode": "invariant", "status": "ran"}, {"model": "moe", "mode": "invariant",
                                                                       "status": "ran"}]
    rows, checks = V.rows_and_checks([init_failed, partial], jobs)
    assert checks[0]["passed"] is False and checks[0]["reason"] == "init_failed"
    assert [c["passed"] for c in checks[1:]] == [True, False, False]  # bs ran and was equal; the others missing
    assert checks[2]["reason"] == "the worker stopped before this experiment"
    assert sum(isinstance(r, RC.FailedRow) and r.missing is not None for r in rows) == 3


# ----------------------------------------------------------------------------- driver / budget

class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _args(tmp_path, *extra):
    return V.parse_args(["--out", str(tmp_path / "out"), "--model-dir", str(tmp_path / "models"), *extra])


def _job_of(cmd):
    return json.loads(Path(cmd[cmd.index("--spec") + 1]).read_text())


def test_driver_budget_skips_and_incremental_saves(tmp_path):
    clock = FakeClock()
    calls, saves = [], []

    def launch(kind, cmd, env, timeout, log):
        calls.append((kind, timeout, env.get("VLLM_BATCH_INVARIANT")))
        if kind == "build":
            clock.t += 10
            return {"rc": 0, "seconds": 10}
        job = _job_of(cmd)
        assert job["deadline"] == 1000.0 + 300 - 5.0
        assert cmd[cmd.index("--model") + 1] == str(tmp_path / "models" / job["tags"]["model"])
        clock.t += 100
        _run_worker(job, cmd[cmd.index("--out") + 1], calls={"rms_norm": 1, "fused_add_rms_norm": 1, "moe": 1})
        return {"rc": 0, "seconds": 100, "timed_out": False}

    def save(rows, checks, extra):
        saves.append((len(rows), len(checks), json.loads(json.dumps(extra["jobs"]))))

    extra = V.run_driver(_args(tmp_path, "--budget-s", "300", "--quick"), launch=launch, clock=clock, save=save)
    st = [(j["model"], j["mode"], j["status"]) for j in extra["jobs"]]
    assert st == [("dense", "default", "ran"), ("dense", "invariant", "ran"), ("moe", "default", "ran"),
                  ("moe", "invariant", "skipped"), ("dense", "kit", "skipped"), ("moe", "kit", "skipped")]
    assert [c[1] for c in calls] == [300, 290, 190, 90]          # each timeout = what is left
    assert [c[2] for c in calls[1:]] == [None, "1", None]        # mode environments
    assert len(saves) == 1 + 6                                   # after the build and every job
    assert saves[1][0] == len(V.EXPERIMENTS) and saves[-1][0] == 3 * len(V.EXPERIMENTS)
    assert all("budget" in j["skipped"] for j in extra["jobs"][3:])


def test_driver_worker_failures_are_recorded(tmp_path):
    clock = FakeClock()

    def launch(kind, cmd, env, timeout, log):
        clock.t += 5
        if kind == "build":
            return {"rc": 0}
        if _job_of(cmd)["tags"]["model"] == "dense":
            raise OSError("cannot start")
        return {"rc": 1, "seconds": 5, "timed_out": False, "log_tail": "Traceback: CUDA error"}

    extra = V.run_driver(_args(tmp_path, "--modes", "invariant"), launch=launch, clock=clock)
    doc = json.loads((tmp_path / "out" / "vllm_check.json").read_text())
    assert set(doc) >= {"provenance", "rows", "checks", "jobs", "plan", "build"}
    assert doc["rows"] == [] and len(doc["checks"]) == 2 and not any(c["passed"] for c in doc["checks"])
    dense, moe = extra["jobs"]
    assert "cannot start" in dense["error"] and moe["rc"] == 1 and "CUDA error" in moe["log_tail"]
    assert "no readable part file" in moe["error"]


def test_driver_build_failure_skips_everything(tmp_path):
    def launch(kind, cmd, env, timeout, log):
        assert kind == "build"
        return {"rc": 1, "log_tail": "OOM"}

    saved = []
    extra = V.run_driver(_args(tmp_path), launch=launch, clock=FakeClock(),
                         save=lambda r, c, e: saved.append(c))
    assert all(j["status"] == "skipped" and "build failed" in j["skipped"] for j in extra["jobs"])
    assert len(saved[-1]) == 6 and not any(c["passed"] for c in saved[-1])


def test_the_kit_alone_planned_launched_and_checked(tmp_path, capsys):
    """``--vllm-mode-under-kit both``: each kit mode runs with vLLM's own mode under it and alone
    (``KIT_VLLM_INVARIANT=0``, the plugin's switch, and ``VLLM_BATCH_INVARIANT=0``), as jobs,
    parts, rows and checks of their own; the kit alone's check reads the switches its engine ran
    with, and fails when vLLM's mode was on after all."""
    argv = ["--models", "dense", "--modes", "default,kit+attention", "--vllm-mode-under-kit", "both", "--quick"]
    a = _args(tmp_path, *argv)
    assert V.plan(a.models, a.modes, a.vllm_mode_under_kit) == [("dense", "default"), ("dense", "kit+attention"),
                                                                ("dense", "kit+attention alone")]
    assert V.plan(["moe"], ["kit+attention"], "off") == [("moe", "kit+attention alone")]
    assert V.main(["--out", "x", "--dry-run", *argv]) == 0
    dry = {j["mode"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert {k: dry["kit+attention alone"]["env"].get(k) for k in ("KIT_BATCH_INVARIANT", "KIT_VLLM_INVARIANT",
                                                                    "VLLM_BATCH_INVARIANT")} == {
        "KIT_BATCH_INVARIANT": "1", "KIT_VLLM_INVARIANT": "0", "VLLM_BATCH_INVARIANT": "0"}
    assert dry["kit+attention"]["env"]["VLLM_BATCH_INVARIANT"] == "1" and "KIT_VLLM_INVARIANT" not in dry["kit+attention"]["env"]
    assert dry["kit+attention alone"]["attention_backend"] == "CUSTOM"
    switches = []

    def launch(kind, cmd, env, timeout, log, *, plugin_sets=True):
        if kind == "build":
            return {"rc": 0}
        switches.append((Path(cmd[cmd.index("--out") + 1]).name, env.get("KIT_VLLM_INVARIANT"),
                         env.get("VLLM_BATCH_INVARIANT")))
        engine = dict(env)
        if not plugin_sets:          # an engine that ran with vLLM's own mode on after all
            engine["VLLM_BATCH_INVARIANT"] = "1"
        with mock.patch.dict(os.environ, {k: engine[k] for k in R.RECORDED_ENV if k in engine}):
            # the worker records the switches of its process
            _run_worker(_job_of(cmd), cmd[cmd.index("--out") + 1], calls={"rms_norm": 1, "fused_add_rms_norm": 1})
        return {"rc": 0, "seconds": 1.0}

    extra = V.run_driver(a, launch=launch, clock=FakeClock())
    assert switches == [("dense__default.json", None, None), ("dense__kit+attention.json", None, "1"),
                        ("dense__kit+attention_alone.json", "0", "0")]
    assert extra["plan"]["vllm_mode_under_kit"] == "both" and "KIT_VLLM_INVARIANT=0" in \
        extra["plan"]["mode_descriptions"]["kit+attention alone"]
    doc = json.loads((tmp_path / "out" / "vllm_check.json").read_text())
    res = RC.read(doc)
    assert res.keys() == [("dense", "default"), ("dense", "kit+attention"), ("dense", "kit+attention alone")]
    alone = {c["name"]: c for c in doc["checks"] if c["name"].startswith("dense kit+attention alone:")}
    assert len(alone) == 5 and all(c["passed"] and not c.get("informational") for c in alone.values()), alone
    off = alone["dense kit+attention alone: vLLM's own mode off in the engine (KIT_VLLM_INVARIANT=0, "
                "VLLM_BATCH_INVARIANT=0)"]
    assert off["engine_env"] == {"KIT_VLLM_INVARIANT": "0", "VLLM_BATCH_INVARIANT": "0"}
    assert not any("own mode off" in c["name"] for c in doc["checks"] if not c["name"].startswith("dense kit+attention alone"))
    # the same check fails when the engine ran with vLLM's mode on
    V.run_driver(_args(tmp_path, *argv[:-2], "off", "--quick"), clock=FakeClock(),
                 launch=lambda *x: launch(*x, plugin_sets=False))
    doc = json.loads((tmp_path / "out" / "vllm_check.json").read_text())
    assert [c["passed"] for c in doc["checks"] if "own mode off" in c["name"]] == [False]


# ----------------------------------------------------------------------------- the plugin's CUDA replacements
# (the kit's Triton kernels; here under the interpreter)

def test_kit_rms_norm_forward_matches_the_kit_ops():
    g = torch.Generator().manual_seed(0)
    T, hq, d = 5, 3, 32
    qkv = torch.randn(T, (hq + 2) * d, generator=g).to(DEVICE)
    q = qkv[:, :hq * d].view(T, hq, d)                 # strided, like Qwen3's q_by_head
    w = 1 + 0.1 * torch.randn(d, generator=g).to(DEVICE)
    out = P.kit_rms_norm_forward(q, w, 1e-6)
    assert out.shape == q.shape
    ref = RN.rms_norm(q.reshape(-1, d).contiguous(), w, 1e-6, impl="invariant").view(T, hq, d)
    assert torch.equal(out, ref)
    x, r = (torch.randn(T, 64, generator=g).to(DEVICE) for _ in range(2))
    wh = 1 + 0.1 * torch.randn(64, generator=g).to(DEVICE)
    before = OPS.CALLS["fused_add_rms_norm"]
    o, z = P.kit_rms_norm_forward(x, wh, 1e-5, residual=r)
    o2, z2 = RN.fused_add_rms_norm(x, r, wh, 1e-5, impl="invariant")
    assert torch.equal(o, o2) and torch.equal(z, z2)
    assert OPS.CALLS["fused_add_rms_norm"] == before + 1   # counted by the custom op
    o3 = P.kit_rms_norm_forward(x, wh.double(), 1e-5)   # the weight follows x's dtype
    assert torch.equal(o3, RN.rms_norm(x, wh, 1e-5))


def test_kit_moe_from_logits_matches_fused_moe():
    g = torch.Generator().manual_seed(1)
    T, H, E, inter, k = 6, 32, 4, 16, 2
    x = torch.randn(T, H, generator=g).to(DEVICE)
    router = torch.randn(E, H, generator=g).to(DEVICE) * H ** -0.5
    w13 = torch.randn(E, 2 * inter, H, generator=g).to(DEVICE) * H ** -0.5   # vLLM's w13_weight: gate rows, then up
    w2 = torch.randn(E, H, inter, generator=g).to(DEVICE) * inter ** -0.5    # vLLM's w2_weight
    logits = MM.linear(x, router, impl="invariant")
    n0 = OPS.CALLS["moe"]
    out = P.kit_moe_from_logits(x, logits, w13, w2, k, True)
    assert OPS.CALLS["moe"] == n0 + 1
    assert torch.equal(out, MOE.fused_moe(x, router, w13, w2, k, renormalize=True, impl="invariant"))


def _moe_layer(g, E, H, inter, **routing):
    """A stand-in for vLLM's routed-experts layer: the attributes the kit's MoE method reads."""
    from types import SimpleNamespace

    base = dict(use_grouped_topk=False, scoring_func="softmax", e_score_correction_bias=None,
                routed_scaling_factor=1.0, custom_routing_function=None, expert_map=None,
                apply_router_weight_on_input=False, top_k=2, renormalize=True)
    return SimpleNamespace(**{**base, **routing},
                           w13_weight=(torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).to(DEVICE),
                           w2_weight=(torch.randn(E, H, inter, generator=g) * inter ** -0.5).to(DEVICE))


def test_kit_moe_for_layer_routes_deepseek_layers_and_refuses_other_routing():
    """vLLM's DeepSeek-V3 MoE layer (grouped sigmoid routing, correction bias, scaling factor) runs
    the kit's grouped routing and experts: the bits of the kit's DeepSeek MoE layer with zero
    shared experts, and the same bits for a token alone as in its batch; a softmax layer runs the
    plain MoE; routing the kit has no kernel for is refused, naming what the layer asked for."""
    from batch_invariance_kit.ops import routing as RT

    g = torch.Generator().manual_seed(2)
    T, H, E, inter = 9, 32, 8, 16
    x = torch.randn(T, H, generator=g).to(DEVICE)
    router = (torch.randn(E, H, generator=g) * H ** -0.5).to(DEVICE)
    bias = (0.1 * torch.randn(E, generator=g)).to(DEVICE)
    layer = _moe_layer(g, E, H, inter, use_grouped_topk=True, scoring_func="sigmoid", e_score_correction_bias=bias,
                       num_expert_group=4, topk_group=2, top_k=3, routed_scaling_factor=2.5)
    logits = MM.linear(x, router, impl="invariant")
    n0 = OPS.CALLS["moe"]
    out = P.kit_moe_for_layer(layer, x, logits)
    assert OPS.CALLS["moe"] == n0 + 1
    cfg = RT.RoutingConfig(E, 4, 2, 3, routed_scaling_factor=2.5)
    zeros_up, zeros_down = torch.zeros(2 * inter, H, device=DEVICE), torch.zeros(H, inter, device=DEVICE)
    want = RT.deepseek_moe(x, router, bias, layer.w13_weight, layer.w2_weight, zeros_up, zeros_down, cfg)
    assert torch.equal(out, want)
    assert torch.equal(P.kit_moe_for_layer(layer, x[4:5], logits[4:5]), out[4:5])

    plain = _moe_layer(g, E, H, inter)
    assert torch.equal(P.kit_moe_for_layer(plain, x, logits),
                       MOE.fused_moe(x, router, plain.w13_weight, plain.w2_weight, 2, renormalize=True,
                                     impl="invariant"))
    for routing, named in ((dict(use_grouped_topk=True, num_expert_group=4, topk_group=2), "scoring_func!=sigmoid"),
                           (dict(use_grouped_topk=True, scoring_func="sigmoid", num_expert_group=4, topk_group=2),
                            "without e_score_correction_bias"),
                           (dict(e_score_correction_bias=bias), "e_score_correction_bias"),
                           (dict(routed_scaling_factor=2.0), "routed_scaling_factor!=1"),
                           (dict(custom_routing_function=len), "custom_routing_function")):
        with pytest.raises(NotImplementedError, match=named):
            P.kit_moe_for_layer(_moe_layer(g, E, H, inter, **routing), x, logits)


def test_driver_retries_moe_kit_without_the_moe_swap(tmp_path):
    clock = FakeClock()
    envs = []

    def launch(kind, cmd, env, timeout, log):
        clock.t += 20
        if kind == "build":
            return {"rc": 0}
        envs.append(env)
        out = cmd[cmd.index("--out") + 1]
        if env.get("KIT_MOE") != "0":
            R.write_json(out, {"model": "moe", "mode": "kit", "status": "init_failed", "experiments": {},
                               "errors": [{"stage": "init", "traceback": "NotImplementedError: kit MoE"}]})
            return {"rc": 3, "seconds": 20, "log_tail": "..."}
        _run_worker(_job_of(cmd), out, calls={"rms_norm": 2, "fused_add_rms_norm": 2, "moe": 0})
        doc = json.loads(Path(out).read_text())
        R.write_json(out, {**doc, "swapped": {"RMSNorm": "KitRMSNorm"}})
        return {"rc": 0, "seconds": 20}

    saved = []
    extra = V.run_driver(_args(tmp_path, "--models", "moe", "--modes", "kit", "--quick"), launch=launch, clock=clock,
                         save=lambda r, c, e: saved.append(c))
    job = extra["jobs"][0]
    assert len(envs) == 2 and envs[1]["KIT_MOE"] == "0" and job["retried_without_moe_swap"]
    assert all(e["KIT_BATCH_INVARIANT"] == "1" and e["VLLM_BATCH_INVARIANT"] == "1" for e in envs)
    assert "kit MoE" in job["first_attempt"]["errors"][0]["traceback"] and job["rc"] == 0
    kit = [c for c in saved[-1] if "replacements ran" in c["name"]]
    assert len(kit) == 1 and kit[0]["passed"] and "moe" not in kit[0]["name"].split("> 0:")[1]


# ----------------------------------------------------------------------------- --model PATH

def test_model_path_argument(tmp_path):
    with pytest.raises(ValueError, match="--model"):
        V.parse_args(["--model", str(tmp_path)])          # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    a = V.parse_args(["--model", str(tmp_path)])
    assert a.out == os.path.join("results", "local", "vllm") and a.modes == ["default", "invariant", "kit"]
    spec = V.user_spec(str(tmp_path), gpu=False)          # no tokenizer: the checks' prompts below vocab_size
    assert spec["targets"] == [RC.TARGET.tokens(300), RC.NEEDLE.tokens(300)]
    assert all(2 <= t < 300 for p in spec["targets"] + spec["fillers"] for t in p)
    assert [(b["fillers"] + 2, b["role"]) for b in spec["batches"]] == [(9, "bs"), (33, "bs")] + [(33, "needle")] * 2
    assert spec == V.user_spec(str(tmp_path), gpu=False)


SPEC = {"targets": [[1] * 64, [2] * 200],
        "batches": [{"fillers": 7, "seed": 109, "role": "bs"}, {"fillers": 31, "seed": 133, "role": "bs"},
                    {"fillers": 31, "seed": 800, "role": "needle"}]}


def _doc(mode, *, shift=0.0, tokens_flip=False):
    """A run_mode document of the user_spec shape: 2 targets in 2 bs batches and a needle trial."""
    alone = [{"tokens": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5], "text": "a"},
             {"tokens": [8, 9, 9], "logprobs": [-0.25, -1.5, -3.0], "text": "b"}]

    def moved(c):
        return {"tokens": [c["tokens"][0], 99 if tokens_flip else c["tokens"][1], c["tokens"][2]],
                "logprobs": [x + shift for x in c["logprobs"]], "text": "c"}
    batches = [{"seed": b["seed"], "requests": b["fillers"] + 2, "positions": [0, 1], "prompt_tokens": 400,
                "seconds": 0.5, "targets": [moved(alone[0]), moved(alone[1])]} for b in SPEC["batches"]]
    doc = {"status": "done", "mode": mode, "seconds": 50.0, "init_s": 20.0, "alone": alone, "alone_s": 1.0,
           "batches": batches,
           "decode_vs_prefill": [{"target": 0, "prompt_len": 64, "decode": [-1.0, -2.0, -0.5],
                                  "prefill": [-1.0, -2.0 + shift, -0.5], "last_token_equal": True}]}
    if mode in RC.KIT_MODES:
        doc["plugin"] = {"calls": {"linear": 10, "rms_norm": 3}}
    return doc


def test_user_rows_checks_and_verdict():
    docs = {"default": _doc("default", shift=2 ** -10, tokens_flip=True),
            "invariant": {"status": "init_failed", "seconds": 9.0, "error": "Traceback\nTypeError: boom"},
            "kit": _doc("kit"), "kit+attention": _doc("kit+attention")}
    rows, checks = V.user_rows("m", docs, SPEC, "cpu")
    bs = [r for r in rows if isinstance(r, RC.BsRow)]
    assert [r.impl for r in bs] == ["default", "kit", "kit+attention"]
    assert bs[0].batch_sizes == [1, 9, 33] and bs[0].target_len == 64       # the bs batches only
    nd = [r for r in rows if isinstance(r, RC.NeedleRow)][0]
    assert nd.n == 4 and nd.needle_len == 200 and nd.unique_logprob_sequences == 2  # alone + every batch
    for mode in RC.KIT_MODES:
        kit = [c for c in checks if c["name"].startswith(f"m {mode}:")]
        assert len(kit) == 4 and all(c["passed"] and not c.get("informational") for c in kit)
    default = [c for c in checks if c["name"].startswith("m default:")]
    assert len(default) == 3 and all(c["informational"] and not c["passed"] for c in default)
    inv = [c for c in checks if c["name"].startswith("m invariant:")]
    assert len(inv) == 1 and inv[0]["informational"] and inv[0]["reason"] == "TypeError: boom"  # CPU: cannot run
    assert not V.user_rows("m", docs, SPEC, "cuda")[1][3]["informational"]           # on a GPU it must
    runs = {mode: {"status": d["status"], "seconds": d["seconds"]} for mode, d in docs.items()}
    page = V.verdict_page("vLLM 0.32.0 on cpu: m", "m", rows, checks, runs)
    assert "kit: batch-invariant" in page and "kit+attention: batch-invariant" in page
    assert "default: NOT batch-invariant" in page and "invariant: did not run" in page
    assert page.count("bs33") == 3 and "bs9: tokens differ" in page and "3 of 3 positions" in page
    # the kit's counters must show that its replacements ran
    docs["kit"]["plugin"] = {"calls": {"rms_norm": 3}}
    assert not [c for c in V.user_rows("m", docs, SPEC, "cpu")[1] if c["name"].startswith("m kit: the kit's")][0]["passed"]
    # a malformed document names the field
    docs["kit"]["batches"][0]["targets"][1]["logprobs"] = [-0.25]
    with pytest.raises(ValueError, match=r"kit document\.batches\[0\]\.targets\[1\]: 3 tokens but 1 logprobs"):
        V.user_rows("m", docs, SPEC, "cpu")


# ----------------------------------------------------------------------------- DeepSeek through the check

def test_deepseek_builds_and_goes_through_the_check(tmp_path, capsys):
    """The DeepSeek model (the CPU shape) is built, saved with its kit_seed and the routing keys vLLM
    reads, reused by its config, and planned, launched and merged like the other models (the
    worker with the stand-in engine: vLLM's CPU build runs the model in default mode, about 45 s,
    but its kit mode stops in the kit's CPU MoE, which has no shared experts)."""
    a = _args(tmp_path, "--models", "deepseek", "--modes", "default,kit,kit+attention", "--quick")
    assert V.plan(a.models, a.modes) == [("deepseek", "default"), ("deepseek", "kit")]
    assert V.run_build(a) == 0 and "built and saved" in capsys.readouterr().out
    saved = json.loads((tmp_path / "models" / "deepseek" / "config.json").read_text())
    assert saved["architectures"] == ["DeepseekV3ForCausalLM"] and saved["kv_lora_rank"] + saved["qk_rope_head_dim"] == 320
    assert saved["kit_seed"] == V.deepseek_shape(False).seed and saved["topk_method"] == "noaux_tc"
    assert V.run_build(a) == 0 and "reusing" in capsys.readouterr().out            # same config, same seed
    assert not V.saved_model(tmp_path / "models" / "deepseek", {**V.want_config("deepseek", False), "kit_seed": 99})
    envs = []

    def launch(kind, cmd, env, timeout, log):
        if kind == "build":
            return {"rc": 0}
        job = _job_of(cmd)
        assert job["engine"]["attention_backend"] is None                          # MLA: vLLM's choice
        envs.append(env)
        _run_worker(job, cmd[cmd.index("--out") + 1], calls={"rms_norm": 1, "fused_add_rms_norm": 1, "moe": 1})
        return {"rc": 0, "seconds": 1.0}

    extra = V.run_driver(a, launch=launch, clock=FakeClock())
    assert "MLA" in extra["plan"]["not_applicable"][0] and [j["status"] for j in extra["jobs"]] == ["ran", "ran"]
    assert P.ENV_MOE not in envs[1]                                                # experts: the MoE swap stays on
    doc = json.loads((tmp_path / "out" / "vllm_check.json").read_text())
    res = RC.read(doc)
    assert res.keys() == [("deepseek", "default"), ("deepseek", "kit")] and len(res.rows) == 2 * len(V.EXPERIMENTS)
    kit = [c for c in doc["checks"] if c["name"].startswith("deepseek kit:")]
    assert len(kit) == 4 and all(c["passed"] for c in kit)
