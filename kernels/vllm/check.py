"""Is vLLM itself batch invariant?  The kit's random-weight models served by vLLM 0.26.

One command, one JSON file (``DIR/vllm_check.json``, the :mod:`batch_invariance_kit.report.results` shape:
``{"provenance", "rows", "checks"}`` plus ``"jobs"`` and ``"plan"``).  It needs a CUDA GPU with vLLM
staged as in ``shared/device/vllm`` (that README's ``export`` line first, then)::

    python -m batch_invariance_kit.vllm.check --out DIR            # everything, within --budget-s (480 s)
    python -m batch_invariance_kit.vllm.check --out DIR --models dense --modes default,invariant --quick
    python -m batch_invariance_kit.vllm.check --out DIR --models deepseek --modes default,kit
    python -m batch_invariance_kit.vllm.check --out DIR --modes kit+attention --vllm-mode-under-kit both
    python -m batch_invariance_kit.vllm.check --out DIR --dry-run  # print the plan; runs nothing

**Models** (:data:`MODEL_NAMES`): ``dense`` and ``moe``, the kit's Qwen3 models at a realistic size
(:data:`batch_invariance_kit.bench.e2e.MODELS`), and ``deepseek``, a DeepSeek-V2-Lite-shaped
``DeepseekV3ForCausalLM`` (:mod:`batch_invariance_kit.vllm.deepseek_model`: MLA attention, grouped
sigmoid routing with a correction bias, shared experts), 8 layers on a GPU and a small shape on a
CPU (:data:`DEEPSEEK_SHAPES`).  Each is built once from its seed and saved; a saved folder is reused
when its ``config.json`` holds the model's configuration, ``kit_seed`` included (:func:`want_config`).

**Modes** (:data:`batch_invariance_kit.vllm.records.MODES`), each in its own worker process
(:mod:`batch_invariance_kit.vllm.runner`: the engine runs in that process;
``VLLM_USE_FLASHINFER_SAMPLER=0`` always, flashinfer is not staged):

* ``default``: vLLM as shipped (torch.compile + CUDA graphs);
* ``invariant``: ``VLLM_BATCH_INVARIANT=1``, vLLM's own batch-invariant mode;
* ``kit``: ``KIT_BATCH_INVARIANT=1``: the kit's vLLM plugin (:mod:`batch_invariance_kit.vllm.plugin`,
  loaded by vLLM through its ``vllm.general_plugins`` entry point) with ``VLLM_BATCH_INVARIANT=1``
  under it, swapping the kit's Triton kernels in (``plugin.REPLACEMENT_TABLE``: linear layers,
  every RMSNorm, the MoE experts), all through the kit's torch custom ops; attention is vLLM's
  (``--attention-backend``) in vLLM's batch-invariant mode;
* ``kit+attention``: kit mode with the kit's attention as well
  (:mod:`batch_invariance_kit.vllm.attention_backend`, registered by the plugin as vLLM's ``CUSTOM``
  backend).  Not for ``deepseek``: its attention is MLA, which vLLM serves with its MLA backends
  (vLLM chooses one; ``--attention-backend`` applies to the other models).

``--vllm-mode-under-kit`` (:data:`batch_invariance_kit.vllm.records.VLLM_UNDER_KIT`, shared with
:mod:`batch_invariance_kit.vllm.bench`): the kit's modes with vLLM's own mode under them (``on``, the
default), without it (``off``: ``KIT_VLLM_INVARIANT=0``, the plugin sets ``VLLM_BATCH_INVARIANT=0``;
the rows and checks name it ``<mode> alone``; ``kit+attention`` only: with vLLM's FlashAttention
and its own mode off, decode splits the KV sequence by the batch), or ``both``.  Each variant is
a job of its own, and its part records the switches its engine ran with (``engine_env``).

The kit's modes are compiled like the default (torch.compile + CUDA graphs); ``--kit-eager`` runs
them with ``enforce_eager=True``.  The call counters of the swapped kernels count the calls outside
CUDA-graph replays (every call, eager).

Experiments of one (model, mode) (:func:`experiments`, run by the worker), all greedy with the raw
fp32 log-probability of every sampled token, compared bitwise (max |difference| recorded too):

1. ``bs``: the :data:`~batch_invariance_kit.vllm.records.TARGET` prompt (100 tokens), 48 tokens,
   alone and inside batches of 9, 33 and 129 (random fillers of random lengths and output lengths,
   target at a random place): tokens and log-probabilities equal to the bs1 run, bitwise?
2. ``needle``: the :data:`~batch_invariance_kit.vllm.records.NEEDLE` prompt (257 tokens) alone,
   then among 64..128 random fillers in 4 trials: the number of distinct completions (token
   sequences, log-probability sequences);
3. ``decode_vs_prefill``: the 48 tokens decoded in (1) alone, then the prompt plus the first 47
   of them sent as one prompt with ``prompt_logprobs=0`` and ``max_tokens=1``: the prompt
   log-probability of each generated position (and the one sampled token) against the decode
   log-probability, bitwise;
4. ``throughput``: 256 prompts of 128..512 tokens, 128 new tokens each: wall time of
   ``llm.generate``, output and total tokens/s (a serving number, CPU scheduling included).

**One pipeline.**  A worker's document is read into typed records
(:mod:`batch_invariance_kit.vllm.records`: a malformed part file is an error naming the field);
each experiment becomes one row record (:func:`part_rows`, built by :func:`bs_row`,
:func:`needle_row` and :func:`dvp_row`); :func:`checks` derives every check from the rows.
``--model PATH`` (a user's own model, :func:`run_user_model`) goes through the same builders and
the same :func:`checks`, and :mod:`batch_invariance_kit.vllm.online` (the same question under a
server) shares the modes, the prompts and the records.

Robustness (the command is meant to run once, unattended): the models are built and saved once
(a subprocess), every (model, mode) is a worker process with a timeout taken from what is left of
``--budget-s``; a job that does not fit is recorded as skipped; the worker runs every experiment
in ``try/except`` with its traceback recorded, skips one that no longer fits before the deadline,
and rewrites its part file after every experiment; the driver rewrites ``vllm_check.json`` after
every job.  Order: default and invariant for every model, then the kit's modes.  When a model with
experts does not start in a kit mode (the kit's MoE refuses a routing it does not implement), the
job is retried once with the MoE swap off (``KIT_MOE=0``), and says so.

This module imports without vLLM (only the worker imports it), so its pure-Python parts
(prompts, the job, the rows from a worker's document, the checks, the budget logic) are tested
on a CPU (``tests/test_vllm_check.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
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
from . import records as RC
from . import runner as R
from .records import (NEEDLE, TARGET, BsRow, BsRun, DecodeVsPrefillRow, FailedRow, NeedleRow, NeedleTrial,
                      Prefill, TargetsResult, ThroughputRow)

MODEL_NAMES = ("dense", "moe", "deepseek")
#: The models with routed experts (the kit's MoE swap applies).
MOE_MODELS = ("moe", "deepseek")
#: The models whose attention is MLA: vLLM serves them with its MLA backends, the kit's attention
#: backend (MHA/GQA over a paged K/V cache) does not.
MLA_MODELS = ("deepseek",)
#: The modes run when ``--modes`` is not given (``kit+attention`` is asked for by name).
DEFAULT_MODES = ("default", "invariant", "kit")
#: vLLM attention backends of the non-MLA models (the kit's is ``kit+attention``'s, not named here).
ATTENTION_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")

#: DeepSeek's shape per device: 8 of V2-Lite's layers on a GPU; on a CPU a small model of the same
#: structure whose MLA head (latent 256 + rope 64 = 320) is one vLLM's CPU MLA backend serves.
DEEPSEEK_SHAPES = {
    "cuda": {"num_hidden_layers": 8},
    "cpu": {"vocab_size": RC.VOCAB, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 256, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2},
}
#: Keys of DeepSeek-V3's ``config.json`` that vLLM reads to route as transformers' class always
#: does (sigmoid scores, the correction bias): without ``noaux_tc`` vLLM has no bias to load.
DEEPSEEK_VLLM_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

MAX_MODEL_LEN = 2048
NEW_TOKENS = 48
BATCH_SIZES = (1, 9, 33, 129)
#: Seconds a worker needs at least (process start, vLLM import, engine init, one experiment): a
#: job with less left is skipped rather than started.  The measured first ``LLM(...)`` with
#: torch.compile and CUDA graphs took 47-59 s (every mode, the kit's included, unless ``--kit-eager``);
#: an eager engine (``enforce_eager=True``: no compile, no capture) starts sooner.
MIN_JOB_S = {"compiled": 70.0, "eager": 45.0}
#: Rough seconds each experiment needs once the engine is up (the worker skips one when less is
#: left before its deadline).
EXPERIMENT_S = {"bs": 15.0, "needle": 15.0, "decode_vs_prefill": 5.0, "throughput": 20.0}
EXPERIMENTS = tuple(EXPERIMENT_S)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

def csv_arg(name: str, value: str, allowed: tuple) -> list:
    """A comma-separated subset of ``allowed``; ``ValueError`` naming ``--name`` otherwise."""
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
    p.add_argument("--models", default="dense,moe", help=f"comma-separated subset of {','.join(MODEL_NAMES)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(RC.MODES)}")
    p.add_argument("--vllm-mode-under-kit", default="on", help=RC.UNDER_KIT_HELP)
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run (s; default 480, with --model 1800)")
    p.add_argument("--quick", action="store_true", help="smaller experiments (fewer trials, fewer prompts)")
    p.add_argument("--model-dir", default=None,
                   help="where the models are saved (default: <tempdir>/kit-models)")
    p.add_argument("--attention-backend", default="FLASH_ATTN",
                   help=f"vLLM's attention backend of the non-MLA models, one of {list(ATTENTION_BACKENDS)} "
                        f"(the kit's attention: --modes kit+attention)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--kit-eager", action="store_true",
                   help="the kit's modes with enforce_eager=True (default: torch.compile + CUDA graphs, like "
                        "vLLM's default); with --model, every mode eager")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    # internal: the subprocess that builds the models
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check; raises ``ValueError`` naming the offending argument."""
    a = parser().parse_args(argv)
    a.models = csv_arg("models", a.models, MODEL_NAMES)
    a.modes = csv_arg("modes", a.modes, RC.MODES)
    RC.check_under_kit(a.vllm_mode_under_kit, a.modes)
    if a.budget_s is None:
        a.budget_s = 1800.0 if a.model is not None else 480.0
    if not (isinstance(a.budget_s, float) and math.isfinite(a.budget_s) and a.budget_s > 0):
        raise ValueError(f"--budget-s must be a positive number of seconds, got {a.budget_s!r}")
    a.kit_compiled = not a.kit_eager
    if a.attention_backend == RC.KIT_ATTENTION_BACKEND:
        raise ValueError(f"--attention-backend {RC.KIT_ATTENTION_BACKEND} (the kit's attention) is the mode "
                         f"kit+attention: use --modes kit+attention")
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
    if a.model is None and not a.build and not plan(a.models, a.modes, a.vllm_mode_under_kit):
        raise ValueError(f"--models {','.join(a.models)} with --modes {','.join(a.modes)} gives no job "
                         f"({'; '.join(not_applicable(m, mode) for m in a.models for mode in a.modes)})")
    return a


# ---------------------------------------------------------------------------------------------
# Prompts (deterministic: the same seed gives the same prompts on every machine)
# ---------------------------------------------------------------------------------------------

def batch_with(prompt: list, n: int, seed: int, *, min_len: int = 16, max_len: int = 400,
               min_new: int = 4, max_new: int = 96) -> tuple:
    """``prompt`` at a random place among ``n - 1`` random fillers of random lengths.

    Returns ``(prompts, max_new_tokens, position)``: the target's ``max_new_tokens`` entry is
    ``None`` (the caller's), each filler gets a random output length so that the batch
    changes composition while the target decodes."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    fillers = [RC.random_prompt(rng.randint(min_len, max_len), seed=rng.randrange(2 ** 31)) for _ in range(n - 1)]
    news = [rng.randint(min_new, max_new) for _ in range(n - 1)]
    pos = rng.randrange(n)
    return fillers[:pos] + [prompt] + fillers[pos:], news[:pos] + [None] + news[pos:], pos


# ---------------------------------------------------------------------------------------------
# The worker's job
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
    tgt, ndl = TARGET.tokens(), NEEDLE.tokens()
    bs = _in_batches(tgt, [batch_with(tgt, n, seed=100 + n) for n in BATCH_SIZES[1:]],
                     [100 + n for n in BATCH_SIZES[1:]])
    trials = range(2 if quick else 4)
    needle = _in_batches(ndl, [batch_with(ndl, random.Random(700 + t).randint(64, 128), seed=800 + t) for t in trials],
                         [800 + t for t in trials])
    n, new = (64, 64) if quick else (256, 128)
    rng = random.Random(900)
    prompts = [RC.random_prompt(rng.randint(128, 512), seed=rng.randrange(2 ** 31)) for _ in range(n)]
    return [R.targets_experiment("bs", bs, estimate_s=EXPERIMENT_S["bs"]),
            R.targets_experiment("needle", needle, estimate_s=EXPERIMENT_S["needle"]),
            {"name": "decode_vs_prefill", "kind": "decode_vs_prefill", "of": "bs", "target": 0,
             "estimate_s": EXPERIMENT_S["decode_vs_prefill"]},
            {"name": "throughput", "kind": "throughput", "prompts": prompts, "new_tokens": new, "warmup": 8,
             "estimate_s": EXPERIMENT_S["throughput"]}]


def attention_of(a: argparse.Namespace, model: str, mode: str) -> str | None:
    """The attention backend the engine of (``model``, ``mode``) asks for: the kit's in
    ``kit+attention``, vLLM's choice for an MLA model, ``--attention-backend`` otherwise."""
    return RC.attention_backend(mode, None if model in MLA_MODELS else a.attention_backend, gpu=True)


def worker_job(a: argparse.Namespace, model: str, mode: str, deadline: float, exps: list) -> dict:
    """The job of the worker of (``model``, ``mode``; a :func:`~batch_invariance_kit.vllm.records.label`
    such as ``kit+attention alone`` too): the engine as the arguments ``a`` say, the experiments
    ``exps`` (:func:`experiments`), to finish before ``deadline``."""
    base = RC.variant_of(mode)[0]
    engine = {"dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN,
              "eager": base in RC.KIT_MODES and not a.kit_compiled, "gpu_memory_utilization": a.gpu_memory_utilization,
              "attention_backend": attention_of(a, model, base)}
    return R.make_job(engine, exps, deadline=deadline, tags={"model": model, "mode": mode, "quick": a.quick})


# ---------------------------------------------------------------------------------------------
# Rows: one record per experiment, from a worker's results
# ---------------------------------------------------------------------------------------------

def bs_row(res: TargetsResult, target: int, batches=None, *, target_len: int, **row) -> BsRow:
    """bs1 vs bsN of target ``target`` of ``res`` in its ``batches`` (indices; default all)."""
    runs = [BsRun(batch_size=b.requests, position=b.positions[target], prompt_tokens_in_batch=b.prompt_tokens,
                  **dataclasses.asdict(c)) for b, c in res.against_alone(target, batches)]
    a = res.alone[target]
    return BsRow(op="vllm_bs", batch_sizes=[1] + [r.batch_size for r in runs], target_len=target_len,
                 new_tokens=len(a.tokens), runs=runs, bs1_tokens=a.tokens, bs1_logprobs=a.logprobs,
                 all_equal=all(r.tokens_equal and r.logprobs_equal for r in runs), **row)


def needle_row(res: TargetsResult, target: int, batches=None, *, needle_len: int, **row) -> NeedleRow:
    """The needle (target ``target`` of ``res``) alone and in its ``batches``: distinct completions."""
    trials = [NeedleTrial(trial=t, batch_size=b.requests, position=b.positions[target], **dataclasses.asdict(c))
              for t, (b, c) in enumerate(res.against_alone(target, batches))]
    return NeedleRow(op="vllm_needle", needle_len=needle_len, trials=trials, **res.distinct(target, batches), **row)


def dvp_row(p: Prefill, **row) -> DecodeVsPrefillRow:
    """Decode vs prefill of one target, bitwise per position."""
    return DecodeVsPrefillRow(op="vllm_decode_vs_prefill", prompt_len=p.prompt_len,
                              **R.decode_vs_prefill(p.decode, p.prefill), last_token_equal=p.last_token_equal,
                              **row)


def part_rows(part: dict, where: str = "part") -> list:
    """The rows of a worker's document (:func:`batch_invariance_kit.vllm.runner.run_worker`), one per
    experiment of :data:`EXPERIMENTS`: its record, or a :class:`~batch_invariance_kit.vllm.records.FailedRow`
    (the worker's error or skip, or ``missing``).  A malformed document raises ``ValueError``
    naming the field."""
    if not isinstance(part, dict):
        raise ValueError(f"{where}: expected an object, got {type(part).__name__}")
    for key in ("model", "mode"):
        if not isinstance(part.get(key), str):
            raise ValueError(f"{where}.{key}: expected str, got {part.get(key)!r}")
    common = {"impl": part["mode"], "model": part["model"], "init_s": part.get("init_s"),
              "engine": part.get("engine") or {}}
    ex = part.get("experiments") or {}
    rows = []
    for name in EXPERIMENTS:
        op, r, at = f"vllm_{name}", ex.get(name), f"{where}.experiments.{name}"
        if r is None:
            rows.append(FailedRow(op=op, missing="the worker stopped before this experiment", **common))
        elif isinstance(r, dict) and ("error" in r or "skipped" in r):
            rows.append(RC.parse(FailedRow, {"op": op, **common, **r}, at))
        elif name in ("bs", "needle"):
            res = RC.parse(TargetsResult, r, at)
            kept = {"seconds": res.seconds, "kit_calls": res.kit_calls, **common}
            rows.append(bs_row(res, 0, target_len=TARGET.length, **kept) if name == "bs"
                        else needle_row(res, 0, needle_len=NEEDLE.length, **kept))
        elif name == "decode_vs_prefill":
            p = RC.parse(Prefill, r, at)
            rows.append(dvp_row(p, seconds=p.seconds, kit_calls=p.kit_calls, **common))
        else:
            rows.append(RC.parse(ThroughputRow, {"op": op, **common, **r}, at))
    return rows


# ---------------------------------------------------------------------------------------------
# The checks (one function for the kit's models and for --model PATH)
# ---------------------------------------------------------------------------------------------

def checks(keys: list, rows: list, *, platform: str, failed: dict | None = None, kit: dict | None = None) -> list:
    """Every check of the (model, mode) pairs ``keys`` (a mode or its ``<mode> alone``
    :func:`~batch_invariance_kit.vllm.records.label`) from their ``rows`` (records).

    Per pair: bs1 == bsN, one needle completion, decode == prefill (bitwise), informational in
    vLLM's default mode (and its invariant mode on the CPU: :func:`~batch_invariance_kit.vllm.records.informational`);
    in the kit's modes, ``kit[key]`` (``calls``, ``need`` and details) says whether the kit's
    replacements ran.  A pair of ``failed`` (``{key: reason}``) gave no result: one failed check."""
    failed, kit = failed or {}, kit or {}
    out = []
    for model, mode in keys:
        label, info = f"{model} {mode}", RC.informational(mode, platform)
        if (model, mode) in failed:
            out.append({"name": f"{label}: the engine ran the experiments", "passed": False, "informational": info,
                        "reason": failed[(model, mode)]})
            continue
        mine = {type(r): r for r in rows if (r.model, r.impl) == (model, mode) and not isinstance(r, FailedRow)}
        why = {r.op: r.error or r.skipped or r.missing for r in rows
               if (r.model, r.impl) == (model, mode) and isinstance(r, FailedRow)}
        bs, nd, dp = mine.get(BsRow), mine.get(NeedleRow), mine.get(DecodeVsPrefillRow)
        out.append({"name": f"{label}: bs1 == bsN bitwise (tokens and logprobs) for N in "
                            f"{bs.batch_sizes[1:] if bs else list(BATCH_SIZES[1:])}",
                    "passed": bool(bs and bs.all_equal), "informational": info,
                    "max_abs_diff": max((x.max_abs_diff for x in bs.runs), default=0.0) if bs else None,
                    **({} if bs else {"reason": RC.failure(why.get("vllm_bs"))["error"]})})
        out.append({"name": f"{label}: needle among random requests: 1 distinct completion "
                            f"(tokens and logprobs, alone included)",
                    "passed": bool(nd and nd.unique_token_sequences == 1 and nd.unique_logprob_sequences == 1),
                    "informational": info,
                    **({"n": nd.n, "unique_token_sequences": nd.unique_token_sequences,
                        "unique_logprob_sequences": nd.unique_logprob_sequences} if nd
                       else {"reason": RC.failure(why.get("vllm_needle"))["error"]})})
        out.append({"name": f"{label}: decode logprobs == prefill prompt logprobs, bitwise",
                    "passed": bool(dp and dp.equal_positions == dp.positions), "informational": info,
                    **({"equal_positions": dp.equal_positions, "positions": dp.positions,
                        "max_abs_diff": dp.max_abs_diff} if dp
                       else {"reason": RC.failure(why.get("vllm_decode_vs_prefill"))["error"]})})
        if RC.variant_of(mode)[0] in RC.KIT_MODES:
            k = dict(kit.get((model, mode)) or {})
            engine_env = k.pop("engine_env", None) or {}
            out.append(RC.kit_calls_check(label, k.pop("calls", None), k.pop("need", ("rms_norm",)), **k))
            if RC.variant_of(mode)[1] is False:
                switches = {v: engine_env.get(v) for v in (plugin.ENV_VLLM_INVARIANT, "VLLM_BATCH_INVARIANT")}
                out.append({"name": f"{label}: vLLM's own mode off in the engine (KIT_VLLM_INVARIANT=0, "
                                    f"VLLM_BATCH_INVARIANT=0)",
                            "passed": set(switches.values()) == {"0"}, "engine_env": switches})
    return out


def kit_report(part: dict, rows: list) -> dict:
    """What the kit's call-counter check of a worker's (model, mode) reads: the calls made while the
    experiments ran (the engine's profile and warm-up runs excluded), the replacements it needs, and
    the switches its engine ran with (``engine_env``: the kit alone's check reads them)."""
    calls = {}
    for r in rows:
        for k, v in (r.kit_calls or {}).items():
            calls[k] = calls.get(k, 0) + v
    swapped = part.get("swapped") or {}
    need = ["rms_norm", "fused_add_rms_norm"] + (["moe"] if part.get("model") in MOE_MODELS and "moe" in swapped
                                                 else [])
    eager = (part.get("engine") or {}).get("enforce_eager")
    counted = "every call (eager)" if eager else "calls outside CUDA-graph replays only (compiled)"
    return {"calls": calls, "need": need, "kit_calls_total": part.get("kit_calls", {}), "swapped": swapped,
            "eager": eager, "counted": counted, "engine_env": part.get("engine_env")}


def rows_and_checks(parts: list, jobs: list) -> tuple:
    """The JSON's rows (records) and checks from the workers' part files (``parts``: their
    documents, possibly partial) and the job records (``jobs``: skipped or failed ones too)."""
    rows, failed, kit = [], {}, {}
    by_key = {(p["model"], p["mode"]): p for p in parts}
    keys = [(j["model"], j["mode"]) for j in jobs]
    for job, key in zip(jobs, keys):
        p = by_key.get(key)
        if p is None or p.get("status") in (None, "starting", "init_failed"):
            failed[key] = job.get("skipped") or job.get("error") or (p or {}).get("status") or "no result"
            continue
        mine = part_rows(p, f"parts/{key[0]}__{key[1]}.json")
        rows += mine
        if RC.variant_of(key[1])[0] in RC.KIT_MODES:
            kit[key] = kit_report(p, mine)
    return rows, checks(keys, rows, platform="cuda", failed=failed, kit=kit)


# ---------------------------------------------------------------------------------------------
# Building the models (a subprocess of the driver: the driver itself never touches the GPU)
# ---------------------------------------------------------------------------------------------

def deepseek_shape(gpu: bool):
    from . import deepseek_model as D

    return D.spec(**DEEPSEEK_SHAPES["cuda" if gpu else "cpu"])


def want_config(name: str, gpu: bool) -> dict:
    """The ``config.json`` keys that name model ``name``'s build, ``kit_seed`` among them: a saved
    folder whose config holds every one of them is that model.  (transformers writes DeepSeek's
    config itself and renames its dtype and RoPE keys; those are left out of the comparison.)"""
    if name == "deepseek":
        want = {k: v for k, v in deepseek_shape(gpu).hf_config().items()
                if k not in ("torch_dtype", "rope_theta", "rope_scaling")}
        return {**want, **DEEPSEEK_VLLM_KEYS}
    from ..bench.e2e import MODELS

    if name not in MODELS:
        raise ValueError(f"model name must be one of {list(MODEL_NAMES)}, got {name!r}")
    return MODELS[name].hf_config()


def saved_model(folder, want: dict) -> bool:
    """Whether ``folder`` holds a saved model whose ``config.json`` has every key of ``want``."""
    cpath = os.path.join(folder, "config.json")
    if not (os.path.exists(os.path.join(folder, "model.safetensors")) and os.path.exists(cpath)):
        return False
    with open(cpath) as f:
        saved = json.load(f)
    return all(saved.get(k) == v for k, v in want.items())


def build_model(name: str, gpu: bool):
    """Model ``name`` with its random weights (from its seed), ready to ``save_pretrained``."""
    device = "cuda" if gpu else "cpu"
    if name == "deepseek":
        from . import deepseek_model as D

        shape = deepseek_shape(gpu)
        m = D.build(shape, device=device)
        for k, v in {"kit_seed": shape.seed, **DEEPSEEK_VLLM_KEYS}.items():
            setattr(m.config, k, v)
        return m
    from ..bench.e2e import build

    return build(name, device=device)


def run_build(a: argparse.Namespace) -> int:
    gpu = torch.cuda.is_available()
    for name in a.models:
        folder = os.path.join(a.model_dir, name)
        if saved_model(folder, want_config(name, gpu)):
            print(f"{name}: reusing <model-dir>/{Path(folder).name}", flush=True)
            continue
        t0 = time.time()
        m = build_model(name, gpu)
        m.save_pretrained(folder)
        print(f"{name}: built and saved in {time.time() - t0:.1f} s", flush=True)
        del m
        if gpu:
            torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------------------------
# The driver: plan, budget, subprocesses, merge
# ---------------------------------------------------------------------------------------------

def not_applicable(model: str, mode: str) -> str | None:
    """Why (``model``, ``mode``) is not a job, or ``None``."""
    if model in MLA_MODELS and mode == "kit+attention":
        return (f"{model} kit+attention: the kit's attention backend serves MHA/GQA layers, {model}'s "
                f"attention is MLA")
    return None


def plan(models: list, modes: list, under_kit: str = "on") -> list:
    """Jobs ``[(model, mode)]`` in priority order: default and invariant for every model, then the
    kit's modes (each as ``under_kit`` says: with vLLM's own mode under it, then ``<mode> alone``,
    :func:`~batch_invariance_kit.vllm.records.variants`); restricted to the requested models and
    modes, without the pairs :func:`not_applicable` names."""
    labels = [RC.label(mode, on) for mode, on in RC.variants([m for m in RC.MODES if m in modes], under_kit)]
    order = [(m, lab) for group in (("default", "invariant"), RC.KIT_MODES) for m in MODEL_NAMES for lab in labels
             if RC.variant_of(lab)[0] in group]
    return [(m, lab) for m, lab in order if m in models and not not_applicable(m, RC.variant_of(lab)[0])]


def job_env(model: str, mode: str, base: dict | None = None) -> dict:
    """The environment of the worker of (``model``, ``mode``; ``<mode> alone`` too) on the GPU:
    :func:`batch_invariance_kit.vllm.runner.mode_env` of the mode and vLLM's mode under it, and the
    MoE swap off in a kit mode of a model without experts."""
    name, on = RC.variant_of(mode)
    env = R.mode_env(name, base, gpu=True, vllm_invariant=on)
    if name in RC.KIT_MODES and model not in MOE_MODELS:
        env[plugin.ENV_MOE] = "0"  # no experts to swap
    return env


def _read_part(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_driver(a: argparse.Namespace, *, launch=None, clock=time.time, save=None) -> dict:
    """Plan the jobs, build the models, run the workers within ``a.budget_s``, merge.

    ``launch(kind, cmd, env, timeout, log_path) -> dict`` (default
    :func:`batch_invariance_kit.vllm.runner.run_process`) and ``clock`` are parameters so that the
    budget logic can be tested without a GPU; ``save(rows, checks, extra)`` writes the JSON
    (default :func:`batch_invariance_kit.report.results.save`, the rows as plain dicts) and is
    called after the build and after every job."""
    launch = launch or (lambda kind, cmd, env, timeout, log: R.run_process(cmd, env, timeout, log))
    out = Path(a.out)
    if save is None:
        from ..report import results

        def save(rows, checks, extra):
            return results.save("vllm_check", rows, checks, folder=out, extra=extra)  # portable command

    t_start = clock()
    deadline = t_start + a.budget_s
    jobs = [{"model": m, "mode": mode} for m, mode in plan(a.models, a.modes, a.vllm_mode_under_kit)]
    extra = {"plan": {"models": a.models, "modes": a.modes, "vllm_mode_under_kit": a.vllm_mode_under_kit,
                      "budget_s": a.budget_s, "quick": a.quick,
                      "attention_backend": a.attention_backend, "kit_compiled": a.kit_compiled,
                      "experiments": list(EXPERIMENTS), "batch_sizes": list(BATCH_SIZES),
                      "new_tokens": NEW_TOKENS,
                      "mode_descriptions": {RC.label(m, on): RC.describe(RC.label(m, on))
                                            for m, on in RC.variants(a.modes, a.vllm_mode_under_kit)},
                      "not_applicable": [r for r in (not_applicable(m, mode) for m in a.models for mode in a.modes)
                                         if r]},
             "jobs": jobs}
    me = [sys.executable, "-m", "batch_invariance_kit.vllm.check"]
    exps = experiments(a.quick)
    parts = []

    def write():
        rows, checks = rows_and_checks(parts, [j for j in jobs if j.get("status") != "pending"])
        extra["elapsed_s"] = clock() - t_start
        save([RC.to_dict(r) for r in rows], checks, extra)

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
            kit_mode = RC.variant_of(j["mode"])[0] in RC.KIT_MODES
            need = MIN_JOB_S["eager" if kit_mode and not a.kit_compiled else "compiled"]
            if left < need:
                j.update(status="skipped", skipped=f"budget: {left:.0f} s left < {need:.0f} s needed to start")
                write()
                continue
            stem = f"{j['model']}__{j['mode']}".replace(" ", "_")
            part_path, job_path = out / "parts" / f"{stem}.json", Path(jobs_dir) / f"{stem}.json"
            if part_path.exists():
                part_path.unlink()
            job_path.write_text(json.dumps(worker_job(a, j["model"], j["mode"], deadline - 5.0, exps)))
            cmd = R.worker_command(os.path.join(a.model_dir, j["model"]), job_path, part_path)
            env = job_env(j["model"], j["mode"])
            try:
                r = launch("worker", cmd, env, left, out / "logs" / f"{stem}.log")
            except Exception:
                r = {"rc": None, "error": traceback.format_exc()}
            j.update(status="ran", **{k: r.get(k) for k in ("rc", "seconds", "timed_out", "error")})
            if r.get("rc") != 0:
                j["log_tail"] = r.get("log_tail")
            part = _read_part(part_path)
            if part is None:
                j["error"] = (j.get("error")
                              or f"no readable part file (rc={r.get('rc')}, timed_out={r.get('timed_out')})")
            left = deadline - clock()
            if (kit_mode and j["model"] in MOE_MODELS and part is not None
                    and part.get("status") == "init_failed" and left >= need):
                # The engine did not come up with the kit's MoE swapped in: try once more (a fresh
                # process) with the RMSNorm swap only, so that kit mode still says something.
                j["first_attempt"] = {"rc": r.get("rc"), "seconds": r.get("seconds"), "errors": part.get("errors")}
                part_path.unlink()
                r = launch("worker", cmd, {**env, plugin.ENV_MOE: "0"}, left, out / "logs" / f"{stem}__no_moe.log")
                j.update(retried_without_moe_swap=True, **{k: r.get(k) for k in ("rc", "seconds", "timed_out")})
                j["log_tail"] = r.get("log_tail") if r.get("rc") != 0 else None
                part = _read_part(part_path)
                if part is None:
                    j["error"] = f"no readable part file after the retry (rc={r.get('rc')})"
            if part is not None:
                parts.append(part)
            write()
    return extra


# ---------------------------------------------------------------------------------------------
# --model PATH: a user's own model on the present device (CPU or GPU)
# ---------------------------------------------------------------------------------------------

def user_spec(folder, *, gpu: bool, quick: bool = False) -> dict:
    """The experiment of ``--model``: two targets, the short ``target`` (0) and the long
    ``needle`` (1), answered alone, then among ``N - 1`` fillers for each N of the bs sweep
    (batches of ``role`` ``bs``), then among all fillers in more orders (``role`` ``needle``:
    the needle trials); decode vs prefill for the first.

    A folder with a tokenizer gets chat prompts (:mod:`.chat`); one without gets the checks'
    :data:`~batch_invariance_kit.vllm.records.TARGET` and :data:`~batch_invariance_kit.vllm.records.NEEDLE`
    prompts (by their seeds) below its ``vocab_size``."""
    from . import chat

    sizes = (9, 33) if not gpu or quick else (9, 33, 49)
    trials = 1 if quick else 2
    new = 16 if not gpu else NEW_TOKENS
    n_fill = max(sizes) - 2
    with open(os.path.join(folder, "config.json")) as f:
        vocab = int(json.load(f).get("vocab_size", RC.VOCAB))
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
        targets = [TARGET.tokens(vocab), NEEDLE.tokens(vocab)]
        fillers = [RC.random_prompt(rng.randint(8, 160), 100 + i, vocab) for i in range(n_fill)]
    batches = [{"fillers": n - 2, "seed": 100 + n, "role": "bs"} for n in sizes]
    batches += [{"fillers": n_fill, "seed": 800 + t, "role": "needle"} for t in range(trials)]
    return R.make_spec(targets, fillers, max_tokens=new, filler_max_tokens=[rng.randint(2, 2 * new) for _ in fillers],
                       batches=batches, decode_vs_prefill=1, dtype="bfloat16",
                       max_model_len=max(len(p) for p in targets + fillers) + 2 * new + 8)


def user_rows(model: str, docs: dict, spec: dict, platform: str) -> tuple:
    """Rows (records) and checks of ``--model`` from the runner's documents per mode (``{mode: doc}``, a
    mode or its ``<mode> alone`` :func:`~batch_invariance_kit.vllm.records.label`;
    :func:`batch_invariance_kit.vllm.runner.run_mode`) of the :func:`user_spec` experiment ``spec``:
    the short target in the ``bs`` batches, the needle in every batch, decode vs prefill of the short
    target."""
    rows, failed, kit = [], {}, {}
    bs_batches = [i for i, b in enumerate(spec["batches"]) if b.get("role") == "bs"]
    keys = [(model, mode) for mode in docs]
    for mode, d in docs.items():
        if d.get("status") != "done":
            f = RC.failure(d.get("error") or d.get("log_tail"))
            failed[(model, mode)] = f["error"] or d.get("status")
            continue
        res = R.targets_result(d, f"{mode} document")
        common = {"impl": mode, "model": model, "init_s": d.get("init_s"), "engine": d.get("engine") or {}}
        rows += [bs_row(res, 0, bs_batches, target_len=len(spec["targets"][0]), **common),
                 needle_row(res, 1, needle_len=len(spec["targets"][1]), **common),
                 dvp_row(res.decode_vs_prefill[0], **common)]
        if RC.variant_of(mode)[0] in RC.KIT_MODES:
            kit[(model, mode)] = {"calls": (d.get("plugin") or {}).get("calls"), "need": RC.KIT_CALLS_NEEDED[platform],
                                  "engine_env": d.get("engine_env")}
    return rows, checks(keys, rows, platform=platform, failed=failed, kit=kit)


def verdict_page(title: str, model: str, rows: list, checks: list, runs: dict) -> str:
    """The one-page answer to "is my deployment batch-invariant?": per mode of ``model`` what ran
    (``runs``: ``{mode: {"status", "seconds"}}``), its rows in a line each, every check, the verdict."""
    out = [title, ""]
    for mode, run in runs.items():
        mine = {type(r): r for r in rows if r.impl == mode}
        if BsRow not in mine:
            out.append(f"{mode:<14} did not run the experiment ({run.get('status')})")
            continue
        bs, n, dv = mine[BsRow], mine[NeedleRow], mine[DecodeVsPrefillRow]
        runs_text = ", ".join(f"bs{x.batch_size}: " + ("same" if x.tokens_equal and x.logprobs_equal else
                                                        "tokens differ" if not x.tokens_equal else "logprobs differ")
                              for x in bs.runs)
        out.append(f"{mode:<14} {run.get('seconds') or 0:.0f} s")
        out.append(f"  bs1 vs bsN : {runs_text}")
        out.append(f"  needle     : {n.unique_token_sequences} token / {n.unique_logprob_sequences} "
                   f"log-prob sequence(s) among {n.n} runs")
        out.append(f"  decode vs prefill: {dv.equal_positions} of {dv.positions} positions bitwise equal")
    out.append("")
    for c in checks:
        tag = "INFO" if c.get("informational") else ("PASS" if c["passed"] else "FAIL")
        out.append(f"  {tag}  {c['name']}" + (f" ({c['reason']})" if c.get("reason") else ""))

    def verdict(mode):
        mine = [c for c in checks if c["name"].startswith(f"{model} {mode}:")]
        if any(c["name"].endswith("the engine ran the experiments") for c in mine):
            return "did not run"
        return "batch-invariant" if all(c["passed"] for c in mine) else "NOT batch-invariant"

    out.append("")
    out.append("verdict: " + "; ".join(f"{mode}: {verdict(mode)}" for mode in runs))
    return "\n".join(out)


def run_user_model(a: argparse.Namespace) -> int:
    from ..report import results

    gpu = torch.cuda.is_available()
    platform = "cuda" if gpu else "cpu"
    spec = user_spec(a.model, gpu=gpu, quick=a.quick)
    spec["eager"] = bool(a.kit_eager)  # every mode alike: the modes differ only in the switch
    t0 = time.time()
    docs = {}
    for mode, on in RC.variants(a.modes, a.vllm_mode_under_kit):
        name, left = RC.label(mode, on), a.budget_s - (time.time() - t0)
        if left < 30:
            docs[name] = {"status": "skipped", "error": f"budget: {left:.0f} s left"}
            continue
        docs[name] = R.run_mode(a.model, mode, spec, timeout=left, vllm_invariant=on)
        print(f"{name:<19} {docs[name].get('status')} in {docs[name].get('seconds', 0):.0f} s", flush=True)
    version = next((d["versions"]["vllm"] for d in docs.values() if (d.get("versions") or {}).get("vllm")), "?")
    name = Path(a.model).resolve().name
    rows, checks_ = user_rows(name, docs, spec, platform)
    runs = {mode: {"status": d.get("status"), "seconds": d.get("seconds"), "init_s": d.get("init_s")}
            for mode, d in docs.items()}
    extra = {"plan": {"model": name, "modes": a.modes, "platform": platform, "batches": spec["batches"],
                      "max_tokens": spec["max_tokens"], "eager": spec["eager"],
                      "targets": [len(t) for t in spec["targets"]], "fillers": len(spec["fillers"])},
             "runs": runs}
    results.save("vllm_check_model", [RC.to_dict(r) for r in rows], checks_, folder=Path(a.out), extra=extra)
    print(verdict_page(f"vLLM {version} on {platform}: {name}", name, rows, checks_, runs))
    print(f"wrote {Path(a.out) / 'vllm_check_model.json'}")
    hard = [c for c in checks_ if not c.get("informational")]
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
        jobs = plan(a.models, a.modes, a.vllm_mode_under_kit)
        print(json.dumps({"jobs": [{"model": m, "mode": mode, "env": job_env(m, mode, {}),
                                    "attention_backend": attention_of(a, m, RC.variant_of(mode)[0]),
                                    "enforce_eager": RC.variant_of(mode)[0] in RC.KIT_MODES and not a.kit_compiled}
                                   for m, mode in jobs],
                          "not_applicable": [r for r in (not_applicable(m, mode) for m in a.models for mode in a.modes)
                                             if r],
                          "budget_s": a.budget_s, "min_job_s": MIN_JOB_S, "model_dir": a.model_dir,
                          "experiments": EXPERIMENT_S}, indent=1))
        return 0
    extra = run_driver(a)
    for j in extra["jobs"]:
        print(f"{j['model']:>8} {j['mode']:<19} {j.get('status')}: rc={j.get('rc')} "
              f"{j.get('seconds') or 0:.0f} s {j.get('skipped') or ''}", flush=True)
    print(f"wrote {Path(a.out) / 'vllm_check.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
