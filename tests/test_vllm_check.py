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
    (["--out", "x", "--attention-backend", "CUSTOM"], "--modes kit"),
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
    assert V.random_prompt(50, 3) == V.random_prompt(50, 3) != V.random_prompt(50, 4)
    p = V.random_prompt(1000, 9)
    assert len(p) == 1000 and min(p) >= 2 and max(p) < V.VOCAB
    assert len(V.target_prompt()) == V.TARGET_LEN and len(V.needle_prompt()) == V.NEEDLE_LEN
    with pytest.raises(ValueError, match="length"):
        V.random_prompt(0, 1)


def test_batch_with():
    tgt = V.target_prompt()
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
    assert bs["targets"] == [V.target_prompt()] and [len(b["order"]) for b in bs["batches"]] == list(V.BATCH_SIZES[1:])
    assert needle["targets"] == [V.needle_prompt()] and len(needle["batches"]) == 4
    assert all(64 <= len(b["order"]) <= 128 for b in needle["batches"])
    # each batch is the driver's batch_with: the target at its place among the same fillers
    prompts, news, pos = V.batch_with(V.target_prompt(), 33, seed=133)
    b = bs["batches"][1]
    assert b["seed"] == 133 and b["order"][pos] == ["t", 0]
    assert [bs["fillers"][i] for k, i in b["order"] if k == "f"] == [p for j, p in enumerate(prompts) if j != pos]
    assert by["decode_vs_prefill"]["of"] == "bs" and len(by["throughput"]["prompts"]) == 256
    quick = {e["name"]: e for e in V.experiments(quick=True)}
    assert len(quick["needle"]["batches"]) == 2 and len(quick["throughput"]["prompts"]) == 64


def _run_worker(job, out, *, calls=None, **kw):
    """The worker on ``job`` with a stand-in engine; ``calls``: the kit counters each experiment records."""
    R.run_worker("model", {**job, "deadline": None}, out, build=FakeEngine.builder(**kw))
    if calls is not None:
        doc = json.loads(Path(out).read_text())
        for r in doc["experiments"].values():
            r["kit_calls"] = dict(calls)
        R.write_json(out, doc)


@pytest.mark.parametrize("variant", [False, True])
def test_results_from_the_worker(tmp_path, variant):
    a = V.parse_args(["--out", str(tmp_path), "--quick"])
    _run_worker(V.worker_job(a, "dense", "invariant", 1.0, V.experiments(quick=True)), tmp_path / "p.json",
                variant=variant)
    part = json.loads((tmp_path / "p.json").read_text())
    ex = V.experiment_results(part)
    bs, nd, dp, tp = (ex[n] for n in V.EXPERIMENTS)
    assert bs["batch_sizes"] == list(V.BATCH_SIZES) and len(bs["bs1_tokens"]) == V.NEW_TOKENS
    assert [r["batch_size"] for r in bs["runs"]] == list(V.BATCH_SIZES[1:]) and bs["all_equal"] is (not variant)
    assert all(r["prompt_tokens_in_batch"] > V.TARGET_LEN for r in bs["runs"])
    assert nd["n"] == 3 and nd["unique_logprob_sequences"] == (3 if variant else 1) and len(nd["trials"]) == 2
    assert dp["positions"] == V.NEW_TOKENS and (dp["equal_positions"] == V.NEW_TOKENS) is (not variant)
    assert dp["prompt_len"] == V.TARGET_LEN and dp["last_token_equal"]
    assert tp["prompts"] == 64 and tp["output_tokens"] == 64 * 64
    rows, checks = V.rows_and_checks([{**part, "experiments": ex}], [{"model": "dense", "mode": "invariant"}])
    assert [r["op"] for r in rows] == [f"vllm_{n}" for n in V.EXPERIMENTS]
    assert len(checks) == 3 and all(c["passed"] is (not variant) for c in checks)


# ----------------------------------------------------------------------------- merge

def _part(model, mode, *, bs_equal=True, unique=1, dvp_equal=True, calls=None, status="done"):
    runs = [{"batch_size": n, "tokens_equal": True, "logprobs_equal": bs_equal,
             "max_abs_diff": 0.0 if bs_equal else 0.03} for n in V.BATCH_SIZES[1:]]
    swapped = {"RMSNorm": "KitRMSNorm", "moe": "KitMoEMethod"} if mode == "kit" else None
    return {"model": model, "mode": mode, "status": status, "init_s": 30.0, "swapped": swapped,
            "engine": {"enforce_eager": mode == "kit"}, "kit_calls": calls or {},
            "experiments": {
                "bs": {"runs": runs, "all_equal": bs_equal},
                "needle": {"n": 5, "unique_token_sequences": 1, "unique_logprob_sequences": unique},
                "decode_vs_prefill": {"positions": 48, "equal_positions": 48 if dvp_equal else 40,
                                      "max_abs_diff": 0.0 if dvp_equal else 0.01},
                "throughput": {"error": "Traceback ...: boom"}}}


def _checks_by_suffix(checks, label):
    return {c["name"]: c for c in checks if c["name"].startswith(label)}


def test_rows_and_checks():
    parts = [_part("dense", "default", bs_equal=False, unique=3, dvp_equal=False),
             _part("dense", "invariant"),
             _part("moe", "invariant", bs_equal=False),
             _part("moe", "kit", calls={"rms_norm": 10, "fused_add_rms_norm": 20, "moe": 5})]
    for r in parts[-1]["experiments"].values():  # per-experiment counters: the MoE one stayed 0
        r["kit_calls"] = {"rms_norm": 3, "fused_add_rms_norm": 6, "moe": 0}
    jobs = [{"model": p["model"], "mode": p["mode"], "status": "ran"} for p in parts]
    jobs.append({"model": "dense", "mode": "kit", "status": "skipped", "skipped": "budget: 12 s left"})
    rows, checks = V.rows_and_checks(parts, jobs)
    assert len(rows) == 4 * len(V.EXPERIMENTS)
    assert {r["op"] for r in rows} == {f"vllm_{e}" for e in V.EXPERIMENTS}
    assert all(r["impl"] in V.MODES and r["model"] in V.MODEL_NAMES for r in rows)
    assert any("error" in r for r in rows if r["op"] == "vllm_throughput")
    d = list(_checks_by_suffix(checks, "dense default").values())
    assert all(c["informational"] for c in d) and d[0]["differs"] is True and d[0]["max_abs_diff"] == 0.03
    di = _checks_by_suffix(checks, "dense invariant")
    assert len(di) == 3 and all(c["passed"] for c in di.values())
    mi = _checks_by_suffix(checks, "moe invariant")
    assert [c["passed"] for c in mi.values()] == [False, True, True]
    mk = [c for c in checks if c["name"].startswith("moe kit") and "kit's kernels" in c["name"]]
    assert len(mk) == 1 and mk[0]["passed"] is False  # the MoE counter stayed 0
    dk = _checks_by_suffix(checks, "dense kit")
    assert list(dk.values()) == [{"name": "dense kit: the worker produced results", "passed": False,
                                  "reason": "budget: 12 s left"}]


def test_rows_and_checks_failed_init_and_partial_worker():
    init_failed = {"model": "dense", "mode": "invariant", "status": "init_failed", "experiments": {}}
    partial = {"model": "moe", "mode": "invariant", "status": "initialized",
               "experiments": {"bs": {"runs": [], "all_equal": True}}}
    jobs = [{"model": "dense", "mode": "invariant", "status": "ran"}, {"model": "moe", "mode": "invariant",
                                                                       "status": "ran"}]
    rows, checks = V.rows_and_checks([init_failed, partial], jobs)
    assert checks[0]["passed"] is False and checks[0]["reason"] == "init_failed"
    names = [c["name"] for c in checks[1:]]
    by = {c["name"]: c for c in checks[1:]}
    assert by[names[0]]["passed"] is True                      # bs ran and was equal
    assert by[names[1]]["passed"] is False                     # needle missing: not a pass
    assert by[names[2]]["passed"] is False                     # decode/prefill missing: not a pass
    assert any(r.get("missing") for r in rows)


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
    kit = [c for c in saved[-1] if "kit's kernels" in c["name"]]
    assert len(kit) == 1 and kit[0]["passed"] and "moe" not in kit[0]["name"].split("> 0:")[1]


# ----------------------------------------------------------------------------- --model PATH

def test_model_path_argument(tmp_path):
    with pytest.raises(ValueError, match="--model"):
        V.parse_args(["--model", str(tmp_path)])          # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    a = V.parse_args(["--model", str(tmp_path)])
    assert a.out == os.path.join("results", "local", "vllm") and a.modes == ["default", "invariant", "kit"]
    spec = V.user_spec(str(tmp_path), gpu=False)          # no tokenizer: random ids below vocab_size
    assert len(spec["targets"]) == 2 and all(2 <= t < 300 for p in spec["targets"] + spec["fillers"] for t in p)
    assert [b["fillers"] + 2 for b in spec["batches"]] == [9, 33, 33, 33]
    assert spec == V.user_spec(str(tmp_path), gpu=False)


def _doc(mode, *, shift=0.0, tokens_flip=False, status="done"):
    alone = [{"tokens": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5], "text": "a"},
             {"tokens": [8, 9, 9], "logprobs": [-0.25, -1.5, -3.0], "text": "b"}]
    def moved(c):
        return {"tokens": [c["tokens"][0], 99 if tokens_flip else c["tokens"][1], c["tokens"][2]],
                "logprobs": [x + shift for x in c["logprobs"]], "text": "c"}
    batches = [{"seed": s, "requests": n, "positions": [0, 1], "targets": [moved(alone[0]), moved(alone[1])]}
               for s, n in ((109, 9), (133, 33), (V.NEEDLE_SEED, 33))]
    doc = {"status": status, "mode": mode, "seconds": 50.0, "init_s": 20.0, "alone": alone, "batches": batches,
           "decode_vs_prefill": [{"target": 0, "decode": [-1.0, -2.0, -0.5], "prefill": [-1.0, -2.0 + shift, -0.5],
                                  "last_token_equal": True}]}
    if mode == "kit":
        doc["plugin"] = {"calls": {"linear": 10, "rms_norm": 3}}
    return doc


def test_user_checks_and_verdict():
    docs = {"default": _doc("default", shift=2 ** -10, tokens_flip=True),
            "invariant": {"status": "init_failed", "seconds": 9.0, "error": "Traceback\nTypeError: boom"},
            "kit": _doc("kit")}
    rows, checks = V.user_checks(docs, "cpu")
    kit = [c for c in checks if c["name"].startswith("kit")]
    assert len(kit) == 4 and all(c["passed"] and not c.get("informational") for c in kit)
    default = [c for c in checks if c["name"].startswith("default")]
    assert all(c["informational"] and not c["passed"] for c in default)
    inv = [c for c in checks if c["name"].startswith("invariant")]
    assert inv[0]["informational"] and "TypeError: boom" in inv[0]["reason"]     # CPU: vLLM's mode cannot run
    assert V.user_checks(docs, "cuda")[1][3]["informational"] is False            # on a GPU it must
    page = V.verdict_page("m", "cpu", "0.32.0", rows, checks)
    assert "kit: batch-invariant" in page and "default: NOT batch-invariant" in page
    assert "invariant: did not run" in page and page.count("bs33") == 2   # one per mode that ran: the needle trial is no bs run
    assert "bs9: tokens differ" in page and "3 of 3 positions" in page
    # the kit's counters must show that its replacements ran
    docs["kit"]["plugin"] = {"calls": {"rms_norm": 3}}
    assert not [c for c in V.user_checks(docs, "cpu")[1] if "replacements ran" in c["name"]][0]["passed"]
