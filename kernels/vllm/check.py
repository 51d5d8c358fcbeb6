"""Is vLLM itself batch invariant?  The kit's random-weight Qwen3 models served by vLLM 0.26.

One command, one JSON file (``DIR/vllm_check.json``, the :mod:`batch_invariance_kit.report.results` shape:
``{"provenance", "rows", "checks"}`` plus ``"jobs"`` and ``"plan"``).  It needs a CUDA GPU with vLLM
staged as in ``shared/device/vllm`` (that README's ``export`` line first, then)::

    python -m batch_invariance_kit.vllm.check --out DIR            # everything, within --budget-s (480 s)
    python -m batch_invariance_kit.vllm.check --out DIR --models dense --modes default,invariant --quick
    python -m batch_invariance_kit.vllm.check --out DIR --dry-run  # print the plan; runs nothing

Three modes, each in its own worker process (:mod:`batch_invariance_kit.vllm.runner`: the engine
runs in that process; ``VLLM_USE_FLASHINFER_SAMPLER=0`` always, flashinfer is not staged):

* ``default``: vLLM as shipped (torch.compile + CUDA graphs);
* ``invariant``: ``VLLM_BATCH_INVARIANT=1``, vLLM's own batch-invariant mode;
* ``kit``: ``KIT_BATCH_INVARIANT=1``: the kit's vLLM plugin (:mod:`batch_invariance_kit.vllm.plugin`,
  loaded by vLLM through its ``vllm.general_plugins`` entry point) with ``VLLM_BATCH_INVARIANT=1``
  under it, swapping the kit's Triton kernels in through ``CustomOp.register_oot``: every ``RMSNorm``
  (plain and fused residual-add: input/post-attention norms, per-head q/k norms, the final norm)
  runs :mod:`batch_invariance_kit.ops.rms_norm`, and the MoE experts (routing from vLLM's router
  logits, dispatch, grouped GEMMs, combine) run :mod:`batch_invariance_kit.ops.moe`, all through
  the kit's torch custom ops.  Attention is vLLM's batch-invariant backend, or the kit's
  (:mod:`batch_invariance_kit.vllm.attention_backend`, registered by the plugin as vLLM's
  ``CUSTOM`` backend) with ``--attention-backend CUSTOM``.  Kit mode is compiled like the default
  (torch.compile + CUDA graphs); ``--kit-eager`` runs it with ``enforce_eager=True``.  The call
  counters of the swapped kernels count the calls outside CUDA-graph replays (every call, eager).

Experiments of one (model, mode) (:func:`experiments`, run by the worker; the comparisons are the
runner's), all greedy with the raw fp32 log-probability of every sampled token, compared bitwise
(max |difference| recorded too):

1. ``bs``: a 100-token target prompt, 48 tokens, alone and inside batches of 9, 33 and 129
   (random fillers of random lengths and output lengths, target at a random place): tokens and
   log-probabilities equal to the bs1 run, bitwise?
2. ``needle``: a 257-token prompt alone, then among 64..128 random fillers in 4 trials: the
   number of distinct completions (token sequences, log-probability sequences);
3. ``decode_vs_prefill``: the 48 tokens decoded in (1) alone, then the prompt plus the first 47
   of them sent as one prompt with ``prompt_logprobs=0`` and ``max_tokens=1``: the prompt
   log-probability of each generated position (and the one sampled token) against the decode
   log-probability, bitwise;
4. ``throughput``: 256 prompts of 128..512 tokens, 128 new tokens each: wall time of
   ``llm.generate``, output and total tokens/s (a serving number, CPU scheduling included).

Robustness (the command is meant to run once, unattended): the models are built and saved once
(a subprocess), every (model, mode) is a worker process with a timeout taken from what is left of
``--budget-s``; a job that does not fit is recorded as skipped; the worker runs every experiment
in ``try/except`` with its traceback recorded, skips one that no longer fits before the deadline,
and rewrites its part file after every experiment; the driver rewrites ``vllm_check.json`` after
every job.  Order: dense default+invariant, moe default+invariant, then the kit modes.

This module imports without vLLM (only the worker imports it), so its pure-Python parts
(prompts, the job, the results from a worker's document, the merge, the budget logic) are tested
on a CPU (``tests/test_vllm_check.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from . import plugin
from . import runner as R

MODEL_NAMES = ("dense", "moe")
MODES = ("default", "invariant", "kit")
#: ``CUSTOM``: the kit's attention backend, which the plugin registers under that name (kit mode).
ATTENTION_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CUSTOM")
KIT_ATTENTION = ("with --attention-backend CUSTOM, kit mode runs the kit's attention "
                 "(batch_invariance_kit.vllm.attention_backend.KitAttentionBackend, registered by the plugin as "
                 "vLLM's CUSTOM backend; plan built once per step on the host, any chunk start); otherwise "
                 "the requested vLLM backend in vLLM's batch-invariant mode")

VOCAB = 32768
TARGET_LEN = 100
NEEDLE_LEN = 257
NEW_TOKENS = 48
BATCH_SIZES = (1, 9, 33, 129)
MAX_MODEL_LEN = 2048
#: Seconds a worker needs at least (process start, vLLM import, engine init, one experiment): a
#: job with less left is skipped rather than started.  The measured first ``LLM(...)`` with
#: torch.compile and CUDA graphs took 47-59 s (every mode, kit mode included, unless ``--kit-eager``);
#: an eager engine (``enforce_eager=True``: no compile, no capture) starts sooner.
MIN_JOB_S = {"compiled": 70.0, "eager": 45.0}
#: Rough seconds each experiment needs once the engine is up (the worker skips one when less is
#: left before its deadline).
EXPERIMENT_S = {"bs": 15.0, "needle": 15.0, "decode_vs_prefill": 5.0, "throughput": 20.0}
EXPERIMENTS = tuple(EXPERIMENT_S)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

def _csv(name: str, value: str, allowed: tuple) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--{name} must list at least one of {list(allowed)}, got {value!r}")
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"--{name} must be a comma-separated subset of {list(allowed)}, got unknown {bad}")
    if len(set(items)) != len(items):
        raise ValueError(f"--{name} lists an item twice: {value!r}")
    return items


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.vllm.check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder of vllm_check.json (and parts/, logs/)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local Hugging Face model folder: check vLLM on it on the present device (CPU or GPU) "
                        "instead of the kit's random-weight models")
    p.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated subset of dense,moe")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of default,invariant,kit")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run (s; default 480, with --model 1800)")
    p.add_argument("--quick", action="store_true", help="smaller experiments (fewer trials, fewer prompts)")
    p.add_argument("--model-dir", default=None,
                   help="where the models are saved (default: <tempdir>/kit-models)")
    p.add_argument("--attention-backend", default="FLASH_ATTN", help=f"one of {list(ATTENTION_BACKENDS)}")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--kit-eager", action="store_true",
                   help="kit mode with enforce_eager=True (default: torch.compile + CUDA graphs, like vLLM's default); "
                        "with --model, every mode eager")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    # internal: the subprocess that builds the models
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check; raises ``ValueError`` naming the offending argument."""
    a = parser().parse_args(argv)
    a.models = _csv("models", a.models, MODEL_NAMES)
    a.modes = _csv("modes", a.modes, MODES)
    if a.budget_s is None:
        a.budget_s = 1800.0 if a.model is not None else 480.0
    if not (isinstance(a.budget_s, float) and math.isfinite(a.budget_s) and a.budget_s > 0):
        raise ValueError(f"--budget-s must be a positive number of seconds, got {a.budget_s!r}")
    a.kit_compiled = not a.kit_eager
    if a.attention_backend == "CUSTOM" and a.model is None and a.modes != ["kit"]:
        raise ValueError("--attention-backend CUSTOM (the kit's attention, registered by the plugin) needs --modes kit")
    if a.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {list(ATTENTION_BACKENDS)}, got {a.attention_backend!r}")
    if not (0.05 <= a.gpu_memory_utilization <= 0.95):
        raise ValueError(f"--gpu-memory-utilization must be in [0.05, 0.95], got {a.gpu_memory_utilization!r}")
    if a.model_dir is None:
        a.model_dir = os.path.join(tempfile.gettempdir(), "kit-models")
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        raise ValueError(f"--model must be a local Hugging Face folder with a config.json, got {a.model!r}")
    if a.model is not None and not a.out:
        a.out = os.path.join("results", "local", "vllm")
    if not a.build and not a.dry_run and not a.out:
        raise ValueError("--out is required (the folder of vllm_check.json)")
    return a


# ---------------------------------------------------------------------------------------------
# Prompts (deterministic: the same seed gives the same prompts on every machine)
# ---------------------------------------------------------------------------------------------

def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list:
    """``length`` token ids in ``2..vocab-1`` (0 and 1 are the config's bos/eos) from ``seed``."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


def target_prompt() -> list:
    return random_prompt(TARGET_LEN, seed=1234)


def needle_prompt() -> list:
    return random_prompt(NEEDLE_LEN, seed=4321)


def batch_with(prompt: list, n: int, seed: int, *, min_len: int = 16, max_len: int = 400,
               min_new: int = 4, max_new: int = 96) -> tuple:
    """``prompt`` at a random place among ``n - 1`` random fillers of random lengths.

    Returns ``(prompts, max_new_tokens, position)``: the target's ``max_new_tokens`` entry is
    ``None`` (the caller's), each filler gets a random output length so that the batch
    changes composition while the target decodes."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    fillers = [random_prompt(rng.randint(min_len, max_len), seed=rng.randrange(2 ** 31)) for _ in range(n - 1)]
    news = [rng.randint(min_new, max_new) for _ in range(n - 1)]
    pos = rng.randrange(n)
    return fillers[:pos] + [prompt] + fillers[pos:], news[:pos] + [None] + news[pos:], pos


# ---------------------------------------------------------------------------------------------
# The worker's job, and the experiments' results from its document
# ---------------------------------------------------------------------------------------------

def _in_batches(target: list, batches: list, seeds: list) -> dict:
    """A :func:`batch_invariance_kit.vllm.runner.make_spec` spec of ``target`` alone and in each
    of ``batches`` (:func:`batch_with` results, in their own order), ``NEW_TOKENS`` tokens."""
    fillers, news, spec_batches = [], [], []
    for (prompts, new, pos), seed in zip(batches, seeds):
        order = []
        for i, (p, n) in enumerate(zip(prompts, new)):
            if i == pos:
                order.append(("t", 0))
            else:
                order.append(("f", len(fillers)))
                fillers.append(p)
                news.append(n)
        spec_batches.append({"order": order, "seed": seed})
    return R.make_spec([target], fillers, max_tokens=NEW_TOKENS, filler_max_tokens=news, batches=spec_batches,
                       decode_vs_prefill=0, max_model_len=MAX_MODEL_LEN)


def experiments(quick: bool = False) -> list:
    """The experiments of one (model, mode), as a worker job's list
    (:func:`batch_invariance_kit.vllm.runner.make_job`), each with its ``estimate_s``."""
    tgt, ndl = target_prompt(), needle_prompt()
    bs = _in_batches(tgt, [batch_with(tgt, n, seed=100 + n) for n in BATCH_SIZES[1:]],
                     [100 + n for n in BATCH_SIZES[1:]])
    trials = range(2 if quick else 4)
    needle = _in_batches(ndl, [batch_with(ndl, random.Random(700 + t).randint(64, 128), seed=800 + t) for t in trials],
                         [800 + t for t in trials])
    n, new = (64, 64) if quick else (256, 128)
    rng = random.Random(900)
    prompts = [random_prompt(rng.randint(128, 512), seed=rng.randrange(2 ** 31)) for _ in range(n)]
    return [R.targets_experiment("bs", bs, estimate_s=EXPERIMENT_S["bs"]),
            R.targets_experiment("needle", needle, estimate_s=EXPERIMENT_S["needle"]),
            {"name": "decode_vs_prefill", "kind": "decode_vs_prefill", "of": "bs", "target": 0,
             "estimate_s": EXPERIMENT_S["decode_vs_prefill"]},
            {"name": "throughput", "kind": "throughput", "prompts": prompts, "new_tokens": new, "warmup": 8,
             "estimate_s": EXPERIMENT_S["throughput"]}]


def worker_job(a: argparse.Namespace, model: str, mode: str, deadline: float, exps: list) -> dict:
    """The job of the worker of (``model``, ``mode``): the engine as the arguments ``a`` say,
    the experiments ``exps`` (:func:`experiments`), to finish before ``deadline``."""
    engine = {"dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN, "eager": mode == "kit" and not a.kit_compiled,
              "gpu_memory_utilization": a.gpu_memory_utilization, "attention_backend": a.attention_backend}
    return R.make_job(engine, exps, deadline=deadline, tags={"model": model, "mode": mode, "quick": a.quick})


def _against_alone(res: dict) -> list:
    """``[(batch, comparison)]``: each batch of a one-target ``targets`` result against the run alone."""
    a = res["alone"][0]
    return [(b, R.compare(a["tokens"], a["logprobs"], b["targets"][0]["tokens"], b["targets"][0]["logprobs"]))
            for b in res["batches"]]


def experiment_results(doc: dict) -> dict:
    """The experiments' results of a worker's document (:func:`batch_invariance_kit.vllm.runner.run_worker`),
    as the rows of ``vllm_check.json`` hold them; an error, a skip or a missing experiment as the worker
    recorded it."""
    out = {}
    for name, r in (doc.get("experiments") or {}).items():
        if "error" in r or "skipped" in r:
            out[name] = r
            continue
        kept = {"seconds": r.get("seconds"), "kit_calls": r.get("kit_calls")}
        if name == "bs":
            a = r["alone"][0]
            runs = [{"batch_size": b["requests"], "position": b["positions"][0],
                     "prompt_tokens_in_batch": b["prompt_tokens"], **c} for b, c in _against_alone(r)]
            out[name] = {"batch_sizes": list(BATCH_SIZES), "target_len": TARGET_LEN, "new_tokens": NEW_TOKENS,
                         "runs": runs, "bs1_tokens": a["tokens"], "bs1_logprobs": a["logprobs"],
                         "all_equal": all(x["tokens_equal"] and x["logprobs_equal"] for x in runs), **kept}
        elif name == "needle":
            trials = [{"trial": t, "batch_size": b["requests"], "position": b["positions"][0], **c}
                      for t, (b, c) in enumerate(_against_alone(r))]
            comps = [(c["tokens"], c["logprobs"]) for c in [r["alone"][0]] + [b["targets"][0] for b in r["batches"]]]
            out[name] = {"needle_len": NEEDLE_LEN, "trials": trials, **R.distinct(comps), **kept}
        elif name == "decode_vs_prefill":
            out[name] = {"prompt_len": r["prompt_len"], **R.decode_vs_prefill(r["decode"], r["prefill"]),
                         "last_token_equal": r["last_token_equal"], **kept}
        else:
            out[name] = r
    return out


# ---------------------------------------------------------------------------------------------
# Building the models (a subprocess of the driver: the driver itself never touches the GPU)
# ---------------------------------------------------------------------------------------------

def run_build(a: argparse.Namespace) -> int:
    from ..bench.e2e import MODELS, build

    for name in a.models:
        folder = os.path.join(a.model_dir, name)
        cpath = os.path.join(folder, "config.json")
        want = MODELS[name].hf_config()
        if os.path.exists(os.path.join(folder, "model.safetensors")) and os.path.exists(cpath):
            with open(cpath) as f:
                if json.load(f) == want:
                    print(f"{name}: reusing <model-dir>/{Path(folder).name}", flush=True)
                    continue
        t0 = time.time()
        m = build(name, device="cuda" if torch.cuda.is_available() else "cpu")
        m.save_pretrained(folder)
        print(f"{name}: built and saved in {time.time() - t0:.1f} s", flush=True)
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------------------------
# The driver: plan, budget, subprocesses, merge
# ---------------------------------------------------------------------------------------------

def plan(models: list, modes: list) -> list:
    """Jobs ``[(model, mode)]`` in priority order: dense default+invariant, moe default+invariant,
    then kit (dense, moe); restricted to the requested models and modes."""
    order = [(m, mode) for mode_group in (("default", "invariant"), ("kit",))
             for m in MODEL_NAMES for mode in mode_group]
    return [(m, mode) for m, mode in order if m in models and mode in modes]


def rows_and_checks(parts: list, jobs: list) -> tuple:
    """The JSON's rows and checks from the workers' part files (``parts``: their documents, possibly
    partial, with their :func:`experiment_results`) and the job records (``jobs``: skipped/failed ones)."""
    rows, checks = [], []
    by_key = {(p["model"], p["mode"]): p for p in parts}
    for job in jobs:
        key = (job["model"], job["mode"])
        label = f"{job['model']} {job['mode']}"
        p = by_key.get(key)
        if p is None or p.get("status") in (None, "starting", "init_failed"):
            why = job.get("skipped") or job.get("error") or (p or {}).get("status") or "no result"
            checks.append({"name": f"{label}: the worker produced results", "passed": False, "reason": why})
            continue
        ex = p.get("experiments", {})
        common = {"impl": job["mode"], "model": job["model"], "init_s": p.get("init_s"),
                  "engine": p.get("engine", {})}
        for name in EXPERIMENTS:
            r = ex.get(name)
            if r is None:
                r = {"missing": "the worker stopped before this experiment"}
            rows.append({"op": f"vllm_{name}", **common, **r})
        invariant = job["mode"] in ("invariant", "kit")
        bs, nd, dp = ex.get("bs", {}), ex.get("needle", {}), ex.get("decode_vs_prefill", {})
        bs_ok = "all_equal" in bs
        if job["mode"] == "default":
            differs = None
            if bs_ok or "unique_logprob_sequences" in nd:
                differs = (bs_ok and not bs["all_equal"]) or nd.get("unique_logprob_sequences", 1) > 1
            checks.append({"name": f"{label}: bs1 vs bsN / needle differ somewhere (expected for default "
                                   f"kernels; informational, not a failure when equal)",
                           "passed": differs is not None, "informational": True, "differs": differs,
                           "max_abs_diff": max([x["max_abs_diff"] for x in bs.get("runs", [])], default=None)})
        if invariant:
            checks.append({"name": f"{label}: bs1 == bsN bitwise (tokens and logprobs) for N in "
                                   f"{list(BATCH_SIZES[1:])}",
                           "passed": bool(bs_ok and bs["all_equal"]),
                           "runs": [{k: x.get(k) for k in ("batch_size", "tokens_equal", "logprobs_equal",
                                                            "max_abs_diff")} for x in bs.get("runs", [])],
                           **({"error": bs.get("error") or bs.get("skipped")} if not bs_ok else {})})
            checks.append({"name": f"{label}: needle among random fillers: 1 distinct completion "
                                   f"(tokens and logprobs, bs1 included)",
                           "passed": nd.get("unique_token_sequences") == 1 and nd.get("unique_logprob_sequences") == 1,
                           "unique_token_sequences": nd.get("unique_token_sequences"),
                           "unique_logprob_sequences": nd.get("unique_logprob_sequences"), "n": nd.get("n")})
        if "positions" in dp or invariant:
            checks.append({"name": f"{label}: decode logprobs == prefill prompt logprobs, bitwise"
                                   + ("" if invariant else " (informational)"),
                           "passed": (dp.get("equal_positions") == dp.get("positions") and "positions" in dp)
                           if invariant else "positions" in dp,
                           "informational": not invariant,
                           "equal_positions": dp.get("equal_positions"), "positions": dp.get("positions"),
                           "max_abs_diff": dp.get("max_abs_diff")})
        if job["mode"] == "kit":
            # calls made while the experiments ran (the engine's profile/warm-up runs excluded)
            calls = {}
            for r in ex.values():
                for k, v in (r.get("kit_calls") or {}).items():
                    calls[k] = calls.get(k, 0) + v
            moe_swapped = "moe" in (p.get("swapped") or {})
            need = ["rms_norm", "fused_add_rms_norm"] + (["moe"] if job["model"] == "moe" and moe_swapped else [])
            checks.append({"name": f"{label}: the kit's kernels ran inside vLLM during the experiments "
                                   f"(call counters > 0: {', '.join(need)})",
                           "passed": all(calls.get(k, 0) > 0 for k in need), "kit_calls_in_experiments": calls,
                           "kit_calls_total": p.get("kit_calls", {}), "swapped": p.get("swapped"),
                           "eager": (p.get("engine", {}) or {}).get("enforce_eager"),
                           "counted": "every call (eager)" if (p.get("engine", {}) or {}).get("enforce_eager")
                           else "calls outside CUDA-graph replays only (compiled)"})
    return rows, checks


def run_driver(a: argparse.Namespace, *, launch=None, clock=time.time, save=None) -> dict:
    """Plan the jobs, build the models, run the workers within ``a.budget_s``, merge.

    ``launch(kind, cmd, env, timeout, log_path) -> dict`` (default
    :func:`batch_invariance_kit.vllm.runner.run_process`) and ``clock`` are parameters so that the
    budget logic can be tested without a GPU; ``save(rows, checks, extra)`` writes the JSON
    (default :func:`batch_invariance_kit.report.results.save`) and is called after the build and
    after every job."""
    launch = launch or (lambda kind, cmd, env, timeout, log: R.run_process(cmd, env, timeout, log))
    out = Path(a.out)
    if save is None:
        from ..report import results

        def save(rows, checks, extra):
            return results.save("vllm_check", rows, checks, folder=out, extra=extra)  # portable command

    t_start = clock()
    deadline = t_start + a.budget_s
    jobs = [{"model": m, "mode": mode} for m, mode in plan(a.models, a.modes)]
    extra = {"plan": {"models": a.models, "modes": a.modes, "budget_s": a.budget_s, "quick": a.quick,
                      "attention_backend": a.attention_backend, "kit_compiled": a.kit_compiled,
                      "experiments": list(EXPERIMENTS), "batch_sizes": list(BATCH_SIZES),
                      "new_tokens": NEW_TOKENS, "kit_attention": KIT_ATTENTION},
             "jobs": jobs}
    me = [sys.executable, "-m", "batch_invariance_kit.vllm.check"]
    exps = experiments(a.quick)
    parts = []

    def write():
        rows, checks = rows_and_checks(parts, [j for j in jobs if j.get("status") != "pending"])
        extra["elapsed_s"] = clock() - t_start
        save(rows, checks, extra)

    for j in jobs:
        j["status"] = "pending"
    # 1. the models
    build = launch("build", me + ["--build", "--models", ",".join(a.models), "--model-dir", a.model_dir],
                   os.environ.copy(), max(deadline - clock(), 1.0), out / "logs" / "build.log")
    extra["build"] = build
    write()
    if build.get("rc") != 0:
        for j in jobs:
            j.update(status="skipped", skipped="the model build failed (see build.log_tail)")
        write()
        return extra
    # 2. the workers, most important first (their jobs in a temporary folder: inputs, not results)
    with tempfile.TemporaryDirectory(prefix="kit-vllm-jobs-") as jobs_dir:
        for j in jobs:
            left = deadline - clock()
            need = MIN_JOB_S["eager" if j["mode"] == "kit" and not a.kit_compiled else "compiled"]
            if left < need:
                j.update(status="skipped", skipped=f"budget: {left:.0f} s left < {need:.0f} s needed to start")
                write()
                continue
            part_path = out / "parts" / f"{j['model']}__{j['mode']}.json"
            job_path = Path(jobs_dir) / f"{j['model']}__{j['mode']}.json"
            if part_path.exists():
                part_path.unlink()
            job_path.write_text(json.dumps(worker_job(a, j["model"], j["mode"], deadline - 5.0, exps)))
            cmd = R.worker_command(os.path.join(a.model_dir, j["model"]), job_path, part_path)
            env = R.mode_env(j["mode"], gpu=True)
            if j["mode"] == "kit" and j["model"] == "dense":
                env[plugin.ENV_MOE] = "0"  # no experts to swap
            try:
                r = launch("worker", cmd, env, left, out / "logs" / f"{j['model']}__{j['mode']}.log")
            except Exception:
                r = {"rc": None, "error": traceback.format_exc()}
            j.update(status="ran", **{k: r.get(k) for k in ("rc", "seconds", "timed_out", "error")})
            if r.get("rc") != 0:
                j["log_tail"] = r.get("log_tail")
            try:
                part = json.loads(part_path.read_text())
            except Exception:
                part = None
                j["error"] = (j.get("error")
                              or f"no readable part file (rc={r.get('rc')}, timed_out={r.get('timed_out')})")
            left = deadline - clock()
            if (j["mode"] == "kit" and j["model"] == "moe" and part is not None and part.get("status") == "init_failed"
                    and left >= need):
                # The engine did not come up with the kit's MoE swapped in: try once more (a fresh
                # process) with the RMSNorm swap only, so that kit mode still says something.
                j["first_attempt"] = {"rc": r.get("rc"), "seconds": r.get("seconds"), "errors": part.get("errors")}
                part_path.unlink()
                r = launch("worker", cmd, {**env, plugin.ENV_MOE: "0"}, left,
                           out / "logs" / f"{j['model']}__{j['mode']}__no_moe.log")
                j.update(retried_without_moe_swap=True, **{k: r.get(k) for k in ("rc", "seconds", "timed_out")})
                j["log_tail"] = r.get("log_tail") if r.get("rc") != 0 else None
                try:
                    part = json.loads(part_path.read_text())
                except Exception:
                    part = None
                    j["error"] = f"no readable part file after the retry (rc={r.get('rc')})"
            if part is not None:
                parts.append({**part, "experiments": experiment_results(part)})
            write()
    return extra


# ---------------------------------------------------------------------------------------------
# --model PATH: a user's own model on the present device (CPU or GPU)
# ---------------------------------------------------------------------------------------------

#: Batches of ``--model`` with a seed from here on are the needle trials (all fillers, other orders).
NEEDLE_SEED = 800


def user_spec(folder, *, gpu: bool, quick: bool = False) -> dict:
    """The experiment of ``--model``: two targets (``bs``: a short one, and the ``needle``: a
    longer one), answered alone, then among ``N - 1`` fillers for each N of the bs sweep, then
    among all fillers in more orders (the needle trials); decode vs prefill for the first.

    A folder with a tokenizer gets chat prompts (:mod:`.chat`); one without gets random token
    ids below its ``vocab_size``."""
    from . import chat

    sizes = (9, 33) if not gpu or quick else (9, 33, 49)
    trials = 1 if quick else 2
    new = 16 if not gpu else NEW_TOKENS
    n_fill = max(sizes) - 2
    with open(os.path.join(folder, "config.json")) as f:
        vocab = int(json.load(f).get("vocab_size", VOCAB))
    rng = random.Random(5)
    if R.has_tokenizer(folder):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        targets = [chat.encode(tok, chat.TARGETS[0]),
                   chat.encode(tok, " ".join(chat.TARGETS[1:]) + " Answer the first question only.")]
        pool = list(chat.FILLERS)
        fillers = [chat.encode(tok, pool[i % len(pool)] + ("" if i < len(pool) else " Be brief."))
                   for i in range(n_fill)]
    else:
        targets = [random_prompt(64, 11, vocab), random_prompt(200, 12, vocab)]
        fillers = [random_prompt(rng.randint(8, 160), 100 + i, vocab) for i in range(n_fill)]
    batches = [{"fillers": n - 2, "seed": 100 + n} for n in sizes]
    batches += [{"fillers": n_fill, "seed": NEEDLE_SEED + t} for t in range(trials)]
    return R.make_spec(targets, fillers, max_tokens=new, filler_max_tokens=[rng.randint(2, 2 * new) for _ in fillers],
                       batches=batches, decode_vs_prefill=1, dtype="bfloat16",
                       max_model_len=max(len(p) for p in targets + fillers) + 2 * new + 8)


def user_checks(docs: dict, platform: str) -> tuple:
    """Rows and checks of ``--model`` from the runner's documents per mode (``{mode: doc}``)."""
    rows, checks = [], []
    for mode, d in docs.items():
        label = f"{mode}"
        if d.get("status") != "done":
            informational = mode == "default" or (mode == "invariant" and platform == "cpu")
            last = [ln for ln in (d.get("error") or d.get("log_tail") or "").strip().splitlines() if ln][-1:]
            rows.append({"op": "vllm_model", "impl": mode, "status": d.get("status"), "seconds": d.get("seconds"),
                         "error": last[0] if last else None})
            checks.append({"name": f"{label}: the engine ran the experiment", "passed": False,
                           "informational": informational, "reason": last[0] if last else d.get("status")})
            continue
        s = R.summarize(d)
        alone = d["alone"]
        bs = []
        for b in d["batches"]:
            if b["seed"] >= NEEDLE_SEED:
                continue
            t = b["targets"][0]
            bs.append({"batch_size": b["requests"], "seed": b["seed"],
                       **R.compare(alone[0]["tokens"], alone[0]["logprobs"], t["tokens"], t["logprobs"])})
        needle = R.distinct([(alone[1]["tokens"], alone[1]["logprobs"])]
                            + [(b["targets"][1]["tokens"], b["targets"][1]["logprobs"]) for b in d["batches"]])
        dv = R.decode_vs_prefill(d["decode_vs_prefill"][0]["decode"], d["decode_vs_prefill"][0]["prefill"])
        dvp = {k: dv[k] for k in ("positions", "equal_positions", "max_abs_diff")}
        row = {"op": "vllm_model", "impl": mode, "status": "done", "seconds": d.get("seconds"), "init_s": d.get("init_s"),
               "bs": bs, "needle": needle, "decode_vs_prefill": dvp, "alone_text": alone[0].get("text"),
               "plugin": d.get("plugin"), "summary": {k: s[k] for k in ("tokens_changed", "logprobs_changed")}}
        rows.append(row)
        bs_equal = all(x["tokens_equal"] and x["logprobs_equal"] for x in bs)
        needle_one = needle["unique_token_sequences"] == 1 and needle["unique_logprob_sequences"] == 1
        dvp_equal = dvp["equal_positions"] == dvp["positions"]
        informational = mode == "default"
        sizes = sorted({x["batch_size"] for x in bs})
        checks.append({"name": f"{label}: bs1 == bsN bitwise (tokens and logprobs) for N in {sizes}",
                       "passed": bs_equal, "informational": informational,
                       "max_abs_diff": max(x["max_abs_diff"] for x in bs)})
        checks.append({"name": f"{label}: needle: 1 distinct completion among {needle['n']} runs",
                       "passed": needle_one, "informational": informational, **needle})
        checks.append({"name": f"{label}: decode logprobs == prefill prompt logprobs, bitwise",
                       "passed": dvp_equal, "informational": informational, **dvp})
        if mode == "kit":
            calls = (d.get("plugin") or {}).get("calls", {})
            need = ["linear", "rms_norm"] if platform == "cpu" else ["rms_norm"]
            checks.append({"name": f"kit: the plugin's replacements ran inside vLLM ({', '.join(need)} > 0)",
                           "passed": all(calls.get(k, 0) > 0 for k in need), "calls": calls})
    return rows, checks


def verdict_page(model: str, platform: str, version: str, rows: list, checks: list) -> str:
    """The one-page answer to "is my deployment batch-invariant?"."""
    out = [f"vLLM {version} on {platform}: {model}", ""]
    for r in rows:
        if r["status"] != "done":
            out.append(f"{r['impl']:<10} did not run the experiment ({r['status']}): {r.get('error')}")
            continue
        bs = ", ".join(f"bs{x['batch_size']}: {'same' if x['tokens_equal'] and x['logprobs_equal'] else ('tokens differ' if not x['tokens_equal'] else 'logprobs differ')}"
                       for x in r["bs"])
        n = r["needle"]
        dv = r["decode_vs_prefill"]
        out.append(f"{r['impl']:<10} {r['seconds']:.0f} s")
        out.append(f"  bs1 vs bsN : {bs}")
        out.append(f"  needle     : {n['unique_token_sequences']} token / {n['unique_logprob_sequences']} "
                   f"log-prob sequence(s) among {n['n']} runs")
        out.append(f"  decode vs prefill: {dv['equal_positions']} of {dv['positions']} positions bitwise equal")
    out.append("")
    for c in checks:
        tag = "INFO" if c.get("informational") else ("PASS" if c["passed"] else "FAIL")
        out.append(f"  {tag}  {c['name']}")
    def verdict(r):
        if r["status"] != "done":
            return "did not run"
        ok = all(c["passed"] for c in checks if c["name"].startswith(r["impl"] + ":"))
        return "batch-invariant" if ok else "NOT batch-invariant"

    out.append("")
    out.append("verdict: " + "; ".join(f"{r['impl']}: {verdict(r)}" for r in rows))
    return "\n".join(out)


def run_user_model(a: argparse.Namespace) -> int:
    from ..report import results

    gpu = torch.cuda.is_available()
    platform = "cuda" if gpu else "cpu"
    spec = user_spec(a.model, gpu=gpu, quick=a.quick)
    spec["eager"] = bool(a.kit_eager)  # every mode alike: the modes differ only in the switch
    t0 = time.time()
    docs = {}
    for mode in a.modes:
        left = a.budget_s - (time.time() - t0)
        if left < 30:
            docs[mode] = {"status": "skipped", "error": f"budget: {left:.0f} s left"}
            continue
        docs[mode] = R.run_mode(a.model, mode, spec, timeout=left)
        print(f"{mode:<10} {docs[mode].get('status')} in {docs[mode].get('seconds', 0):.0f} s", flush=True)
    version = next((d["versions"]["vllm"] for d in docs.values() if (d.get("versions") or {}).get("vllm")), "?")
    rows, checks = user_checks(docs, platform)
    extra = {"plan": {"model": os.path.abspath(a.model), "modes": a.modes, "platform": platform,
                      "batches": spec["batches"], "max_tokens": spec["max_tokens"], "eager": spec["eager"],
                      "targets": [len(t) for t in spec["targets"]], "fillers": len(spec["fillers"])}}
    results.save("vllm_check_model", rows, checks, folder=Path(a.out), extra=extra)  # portable command
    print(verdict_page(a.model, platform, version, rows, checks))
    print(f"wrote {Path(a.out) / 'vllm_check_model.json'}")
    hard = [c for c in checks if not c.get("informational")]
    return 0 if all(c["passed"] for c in hard) else 1


def main(argv=None) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.build:
        return run_build(a)
    if a.model is not None:
        return run_user_model(a)
    if a.dry_run:
        jobs = plan(a.models, a.modes)
        print(json.dumps({"jobs": [{"model": m, "mode": mode, "env": R.mode_env(mode, {}, gpu=True),
                                    "enforce_eager": mode == "kit" and not a.kit_compiled} for m, mode in jobs],
                          "budget_s": a.budget_s, "min_job_s": MIN_JOB_S, "model_dir": a.model_dir,
                          "experiments": EXPERIMENT_S}, indent=1))
        return 0
    extra = run_driver(a)
    for j in extra["jobs"]:
        print(f"{j['model']:>5} {j['mode']:<9} {j.get('status')}: rc={j.get('rc')} "
              f"{j.get('seconds') or 0:.0f} s {j.get('skipped') or ''}", flush=True)
    print(f"wrote {Path(a.out) / 'vllm_check.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
