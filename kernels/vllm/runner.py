"""One vLLM engine in one mode, in a fresh process: the worker behind every vLLM run of the kit.

Two callers: chapter 7 and ``check --model PATH`` (:func:`run_mode`: a :func:`make_spec` experiment
of target prompts), and the H200 check (:mod:`batch_invariance_kit.vllm.check`: its jobs of
experiments, one process per (model, mode)).  Everything that starts, configures and drives the
engine, and every comparison of its outputs, is here.

**Modes** (:data:`batch_invariance_kit.vllm.records.MODES`, :func:`mode_env`), each in its own
process because each switch is read when the engine is built:

* ``default``: vLLM as installed (``KIT_BATCH_INVARIANT=0``, ``VLLM_BATCH_INVARIANT`` unset);
* ``invariant``: ``VLLM_BATCH_INVARIANT=1``, vLLM's own batch-invariant mode;
* ``kit``: ``KIT_BATCH_INVARIANT=1``: the kit's plugin (:mod:`batch_invariance_kit.vllm.plugin`)
  replaces the batch-variant ops.  On a GPU vLLM's own mode runs under it
  (``VLLM_BATCH_INVARIANT=1``: the sampler's ``log_softmax``); vLLM's CPU build cannot run that
  mode, and the plugin replaces what it would cover.  A kit mode *alone* (``vllm_invariant=False``)
  runs without vLLM's mode (``KIT_VLLM_INVARIANT=0``).  With ``KIT_PLUGIN_REPORT`` the plugin
  reports which replacements ran and how often;
* ``kit+attention``: kit mode with the kit's attention backend: on a GPU the engine asks for
  vLLM's ``CUSTOM`` backend (:func:`batch_invariance_kit.vllm.records.attention_backend`), on
  the CPU ``KIT_ATTENTION=1`` (the Triton interpreter: ``TRITON_INTERPRET=1``).

In every mode the engine runs in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
every request is submitted before the first step, so what is compared is batching, not arrival
timing) with ``VLLM_USE_FLASHINFER_SAMPLER=0``, the prefix cache off (a hit would change the
prefill shapes between runs), greedy (``temperature=0``, ``ignore_eos=True``), and the raw fp32
log-probability of each sampled token (``logprobs=0``, ``logprobs_mode="raw_logprobs"``, returned
as Python floats and compared bitwise).  Prompts are token ids; a model folder with a tokenizer
also gets the texts.

**A job** (:func:`make_job`) is the engine's options (:data:`ENGINE`) and a list of named
experiments; ``python -m batch_invariance_kit.vllm.runner --model DIR --spec JOB --out OUT``
(:func:`run_worker`) builds the engine, runs the experiments in order and rewrites ``OUT``
(atomically) once the engine is built and after every experiment.  Each experiment runs in
``try/except`` with its traceback recorded; with a ``deadline``, one whose ``estimate_s`` no
longer fits is skipped.  The kinds of experiment:

* ``targets`` (a :func:`make_spec` spec): every target prompt **alone** (a batch of one); every
  target **in batches** with fillers (shuffled by a seed, or in a given order); **decode vs
  prefill** for the first ``decode_vs_prefill`` targets: the prompt plus its decoded tokens but the
  last as one prompt (``prompt_logprobs=0``), the prefill's log-probability of each generated
  token against the decode's;
* ``decode_vs_prefill``: the same for one target of an earlier ``targets`` experiment (``of``);
* ``throughput``: the wall time of one ``generate`` of many prompts, after a short warm-up.

**The checks** of the results: :func:`~batch_invariance_kit.vllm.records.compare` (a completion
against a reference, bitwise) and :func:`~batch_invariance_kit.vllm.records.distinct` (distinct
completions among runs), both from :mod:`batch_invariance_kit.vllm.records`;
:func:`decode_vs_prefill`, and :func:`summarize` (a :func:`run_mode` document per target).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..checks import positive_float, positive_int
from .records import (KIT_MODES, MODES, TargetsResult, attention_backend, check_mode,  # noqa: F401 (MODES: run_mode's)
                      label)

#: Environment of every mode.
BASE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
#: Extra environment per mode (the kit's modes on a GPU add ``VLLM_BATCH_INVARIANT=1``, and
#: ``kit+attention`` on the CPU ``KIT_ATTENTION=1``: :func:`mode_env`).
MODE_ENV = {"default": {"KIT_BATCH_INVARIANT": "0"},
            "invariant": {"KIT_BATCH_INVARIANT": "0", "VLLM_BATCH_INVARIANT": "1"},
            "kit": {"KIT_BATCH_INVARIANT": "1"},
            "kit+attention": {"KIT_BATCH_INVARIANT": "1"}}
#: The variables a worker records at its start (``mode_env``) and once its engine is built
#: (``engine_env``: the kit's plugin sets ``VLLM_CPU_ATTN_SPLIT_KV`` itself, and
#: ``VLLM_BATCH_INVARIANT`` on CUDA as ``KIT_VLLM_INVARIANT`` says).
RECORDED_ENV = ("KIT_BATCH_INVARIANT", "KIT_VLLM_INVARIANT", "VLLM_BATCH_INVARIANT",
                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_CPU_ATTN_SPLIT_KV", "KIT_MOE",
                "KIT_ATTENTION", "KIT_DIRECT_LAUNCH")
#: The engine's options and their defaults (``None``: vLLM's own default).  ``eager``:
#: ``enforce_eager=True`` (otherwise compiled, as vLLM ships: torch.compile, CUDA graphs on a
#: GPU); ``kv_cache_gib``: the KV cache's size (``kv_cache_memory_bytes``);
#: ``attention_backend``: ``attention_config={"backend": ...}``.
ENGINE = {"dtype": "bfloat16", "max_model_len": 1024, "max_num_batched_tokens": None, "eager": False,
          "kv_cache_gib": None, "gpu_memory_utilization": None, "attention_backend": None}
#: The keys of a :func:`make_spec` spec that are engine options.
SPEC_ENGINE_KEYS = ("dtype", "max_model_len", "max_num_batched_tokens", "eager", "kv_cache_gib")
KINDS = ("targets", "decode_vs_prefill", "throughput")
#: Characters of a worker's log kept when it fails.
LOG_TAIL = 6000


# ---------------------------------------------------------------------------------------------
# Modes and processes
# ---------------------------------------------------------------------------------------------

def mode_env(mode: str, base: dict | None = None, *, gpu: bool | None = None,
             vllm_invariant: bool | None = None) -> dict:
    """The environment of a mode's process: ``base`` (default ``os.environ``) without a
    ``VLLM_BATCH_INVARIANT``, ``KIT_VLLM_INVARIANT``, ``KIT_PLUGIN_REPORT`` or ``KIT_JIT_LOG`` of the caller's, plus
    :data:`BASE_ENV` and the mode's :data:`MODE_ENV`; ``gpu`` (default: CUDA is present) puts
    vLLM's own mode under the kit's modes, and ``kit+attention`` on the CPU switches the kit's
    attention on.  ``vllm_invariant=False`` (a kit mode alone, :func:`~batch_invariance_kit.vllm.records.variants`)
    sets ``KIT_VLLM_INVARIANT=0`` (the plugin's switch) and ``VLLM_BATCH_INVARIANT=0`` instead."""
    name = check_mode(mode)
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    env = dict(os.environ if base is None else base)
    for k in ("VLLM_BATCH_INVARIANT", "KIT_VLLM_INVARIANT", "KIT_PLUGIN_REPORT", "KIT_JIT_LOG"):
        env.pop(k, None)
    env.update(BASE_ENV)
    env.update(MODE_ENV[name])
    if name in KIT_MODES and vllm_invariant is False:
        env.update(KIT_VLLM_INVARIANT="0", VLLM_BATCH_INVARIANT="0")
    elif name in KIT_MODES and gpu:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if name == "kit+attention" and not gpu:
        env.update({"KIT_ATTENTION": "1", "TRITON_INTERPRET": "1"})
    return env


def run_process(cmd: list, env: dict, timeout: float, log_path) -> dict:
    """Run ``cmd`` in its own process group, its output to ``log_path``; on timeout kill that
    group (the engine may have started compile workers).  Returns ``rc``, ``seconds``,
    ``timed_out`` and the log's tail."""
    t0 = time.time()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    text = Path(log_path).read_text(errors="replace")
    return {"rc": rc, "seconds": time.time() - t0, "timed_out": timed_out, "log_tail": text[-LOG_TAIL:]}


def write_json(path, doc) -> None:
    """Write ``doc`` to ``path`` through a temporary file: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def worker_command(model, job_path, out) -> list:
    """The command line of a worker process."""
    return [sys.executable, "-m", "batch_invariance_kit.vllm.runner", "--model", str(model),
            "--spec", str(job_path), "--out", str(out)]


# ---------------------------------------------------------------------------------------------
# Experiments and jobs
# ---------------------------------------------------------------------------------------------

def _prompts(name: str, group) -> None:
    if not isinstance(group, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in group):
        raise TypeError(f"{name} must be a list of non-empty lists of token ids")


def _order(b: dict, n_targets: int) -> list:
    """The request order of batch ``b``: its ``order``, or its first ``fillers`` fillers and the
    targets shuffled by its ``seed``."""
    if "order" not in b:
        return batch_order(n_targets, b["fillers"], b["seed"])
    return [(k, int(i)) for k, i in b["order"]]


def make_spec(targets: list, fillers: list, *, max_tokens: int, filler_max_tokens=None, orders=(0,), batches=None,
              decode_vs_prefill: int = 1, dtype: str = "bfloat16", max_model_len: int = 1024,
              max_num_batched_tokens: int = 4096, eager: bool = False, kv_cache_gib: float = 1.0) -> dict:
    """Check and bundle a ``targets`` experiment and the engine options of :func:`run_mode`.

    ``targets``/``fillers``: lists of token-id lists.  ``batches``: each
    ``{"fillers": k, "seed": s}`` (every target and the first ``k`` fillers, shuffled by ``s``)
    or ``{"order": [("t", i) | ("f", j), ...], "seed": s}`` (the requests in that order, every
    target once); default one batch of all fillers per seed of ``orders``.  ``eager=False``: the
    engine compiled, as vLLM ships; ``eager=True``: ``enforce_eager=True``."""
    _prompts("targets", targets)
    _prompts("fillers", fillers)
    if not targets:
        raise ValueError("targets must hold at least one prompt")
    positive_int("max_tokens", max_tokens)
    if filler_max_tokens is None:
        filler_max_tokens = [max_tokens] * len(fillers)
    if len(filler_max_tokens) != len(fillers) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in filler_max_tokens):
        raise ValueError("filler_max_tokens must give one positive length per filler")
    if not (isinstance(decode_vs_prefill, int) and 0 <= decode_vs_prefill <= len(targets)):
        raise ValueError(f"decode_vs_prefill must be in [0, {len(targets)}], got {decode_vs_prefill!r}")
    if batches is None:
        batches = [{"fillers": len(fillers), "seed": int(o)} for o in orders]
    for b in batches:
        if not (isinstance(b, dict) and isinstance(b.get("seed"), int)):
            raise ValueError(f"batches: each must be a dict with an int 'seed', got {b!r}")
        if "order" in b:
            order = b["order"]
            if not (isinstance(order, (list, tuple)) and all(
                    isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ("t", "f") and isinstance(r[1], int)
                    and 0 <= r[1] < (len(targets) if r[0] == "t" else len(fillers)) for r in order)):
                raise ValueError(f"batches: 'order' must list ('t', target) / ('f', filler) pairs in range, got {b!r}")
            if sorted(i for k, i in order if k == "t") != list(range(len(targets))):
                raise ValueError(f"batches: 'order' must hold every target once, got {b!r}")
        elif not 0 <= b.get("fillers", -1) <= len(fillers):
            raise ValueError(f"batches: each must be {{'fillers': 0..{len(fillers)}, 'seed': int}} or hold an "
                             f"'order', got {b!r}")
    positive_int("max_model_len", max_model_len)
    if max_num_batched_tokens is not None:
        positive_int("max_num_batched_tokens", max_num_batched_tokens)
    positive_float("kv_cache_gib", kv_cache_gib)
    longest = max(len(p) for p in list(targets) + list(fillers)) + max([max_tokens] + list(filler_max_tokens))
    if longest > max_model_len:
        raise ValueError(f"max_model_len ({max_model_len}) is shorter than the longest prompt + output ({longest})")
    return {"targets": [list(p) for p in targets], "fillers": [list(p) for p in fillers],
            "max_tokens": max_tokens, "filler_max_tokens": list(filler_max_tokens),
            "batches": [{**b, "order": [list(r) for r in b["order"]]} if "order" in b else dict(b) for b in batches],
            "decode_vs_prefill": decode_vs_prefill, "dtype": dtype, "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens, "eager": bool(eager), "kv_cache_gib": kv_cache_gib}


def batch_order(n_targets: int, n_fillers: int, seed: int) -> list:
    """The request order of a batched run: ``("t", i)`` / ``("f", j)`` shuffled by ``seed``."""
    items = [("t", i) for i in range(n_targets)] + [("f", j) for j in range(n_fillers)]
    random.Random(seed).shuffle(items)
    return items


def targets_experiment(name: str, spec: dict, **fields) -> dict:
    """A job's ``targets`` experiment from a :func:`make_spec` spec (its engine options left out)."""
    return {"name": name, "kind": "targets", **{k: v for k, v in spec.items() if k not in SPEC_ENGINE_KEYS}, **fields}


def make_job(engine: dict, experiments: list, *, deadline: float | None = None, tags: dict | None = None) -> dict:
    """Check and bundle a worker's job.

    ``engine``: options of :data:`ENGINE` (the others keep its defaults).  ``experiments``:
    dicts with a unique ``name``, a ``kind`` of :data:`KINDS`, an optional ``estimate_s`` (seconds
    it needs; skipped when less is left before ``deadline``) and the kind's fields: ``targets``: a
    :func:`make_spec` spec; ``decode_vs_prefill``: ``of`` (an earlier ``targets`` experiment)
    and ``target`` (an index); ``throughput``: ``prompts`` (token-id lists), ``new_tokens`` and
    ``warmup`` (prompts of the untimed warm-up).  ``deadline``: a ``time.time()`` value or
    ``None``; ``tags``: copied into the worker's document (e.g. the model's name)."""
    if not isinstance(engine, dict):
        raise TypeError(f"engine must be a dict of options, got {type(engine).__name__}")
    unknown = sorted(set(engine) - set(ENGINE))
    if unknown:
        raise ValueError(f"engine: unknown options {unknown}; known: {list(ENGINE)}")
    options = {**ENGINE, **engine}
    positive_int("engine max_model_len", options["max_model_len"])
    if not isinstance(experiments, (list, tuple)) or not experiments:
        raise ValueError("experiments must be a non-empty list")
    seen: dict = {}
    for ex in experiments:
        if not (isinstance(ex, dict) and isinstance(ex.get("name"), str) and ex["name"]):
            raise ValueError(f"experiments: each must be a dict with a 'name', got {ex!r}")
        name, kind = ex["name"], ex.get("kind")
        if name in seen:
            raise ValueError(f"experiments: the name {name!r} is used twice")
        if kind not in KINDS:
            raise ValueError(f"experiments: {name!r} has kind {kind!r}, not one of {list(KINDS)}")
        if "estimate_s" in ex:
            positive_float(f"experiments: {name!r} estimate_s", ex["estimate_s"])
        if kind == "targets":
            try:
                make_spec(ex.get("targets"), ex.get("fillers"), max_tokens=ex.get("max_tokens"),
                          filler_max_tokens=ex.get("filler_max_tokens"), batches=ex.get("batches"),
                          decode_vs_prefill=ex.get("decode_vs_prefill"), max_model_len=options["max_model_len"])
            except (TypeError, ValueError) as e:
                raise type(e)(f"experiments: {name!r} (a make_spec() spec): {e}") from e
        elif kind == "decode_vs_prefill":
            of = seen.get(ex.get("of"))
            if of is None or of.get("kind") != "targets":
                raise ValueError(f"experiments: {name!r}: 'of' must name an earlier 'targets' experiment, "
                                 f"got {ex.get('of')!r}")
            if not (isinstance(ex.get("target"), int) and 0 <= ex["target"] < len(of["targets"])):
                raise ValueError(f"experiments: {name!r}: 'target' must index a target of {ex['of']!r}, "
                                 f"got {ex.get('target')!r}")
        else:
            _prompts(f"experiments: {name!r} prompts", ex.get("prompts"))
            positive_int(f"experiments: {name!r} new_tokens", ex.get("new_tokens"))
            if not (isinstance(ex.get("warmup", 0), int) and ex.get("warmup", 0) >= 0):
                raise ValueError(f"experiments: {name!r}: warmup must be an int >= 0, got {ex.get('warmup')!r}")
        seen[name] = ex
    if deadline is not None:
        positive_float("deadline", deadline)
    return {"engine": options, "experiments": [dict(ex) for ex in experiments], "deadline": deadline,
            "tags": dict(tags or {})}


# ---------------------------------------------------------------------------------------------
# The engine (inside the worker's process)
# ---------------------------------------------------------------------------------------------

def has_tokenizer(folder) -> bool:
    return any((Path(folder) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _model_summary(model) -> dict:
    """What the built model contains (run inside the engine by ``llm.apply_model``)."""
    classes, backends = {}, {}
    for m in model.modules():
        name = type(m).__name__
        if name in ("KitRMSNorm", "RMSNorm", "RoutedExperts") or "Norm" in name:
            classes[name] = classes.get(name, 0) + 1
        qm = getattr(m, "quant_method", None)
        if qm is not None and "MoE" in type(qm).__name__:
            key = "moe_method:" + type(qm).__name__
            classes[key] = classes.get(key, 0) + 1
        ab = getattr(m, "attn_backend", None)
        if ab is not None:
            try:
                bname = ab.get_name()
            except Exception:
                bname = getattr(ab, "__name__", str(ab))
            backends[bname] = backends.get(bname, 0) + 1
    return {"module_classes": classes, "attention_backends": backends}


class Engine:
    """A built ``vllm.LLM`` and the calls the experiments make of it."""

    def __init__(self, llm, text: bool):
        from vllm import SamplingParams

        self.llm, self.text, self._sampling = llm, text, SamplingParams

    @classmethod
    def build(cls, model, options: dict, doc: dict) -> "Engine":
        """Build the engine of ``options`` (:data:`ENGINE`) on the model folder ``model``;
        record the versions and the ``LLM`` arguments in ``doc``."""
        import torch
        import vllm

        doc["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        try:
            import triton

            doc["versions"]["triton"] = triton.__version__
        except Exception:
            pass
        text = has_tokenizer(model)
        kw = dict(model=str(model), skip_tokenizer_init=not text, dtype=options["dtype"],
                  max_model_len=options["max_model_len"], seed=0, enable_prefix_caching=False,
                  logprobs_mode="raw_logprobs", max_num_seqs=256, enforce_eager=bool(options["eager"]))
        if options["max_num_batched_tokens"] is not None:
            kw["max_num_batched_tokens"] = options["max_num_batched_tokens"]
        if options["kv_cache_gib"] is not None:
            kw["kv_cache_memory_bytes"] = int(options["kv_cache_gib"] * 2 ** 30)
        if options["gpu_memory_utilization"] is not None:
            kw["gpu_memory_utilization"] = options["gpu_memory_utilization"]
        if options["attention_backend"] is not None:
            kw["attention_config"] = {"backend": options["attention_backend"]}
        doc["llm_kwargs"] = {k: (v if k != "model" else "<model folder>") for k, v in kw.items()}
        return cls(vllm.LLM(**kw), text)

    def info(self) -> dict:
        """What runs: vLLM's batch-invariant switch, the model's classes and attention backends,
        the engine's configuration.  Each part records its own error."""
        engine = {}
        try:
            import vllm.envs as envs

            engine["VLLM_BATCH_INVARIANT"] = bool(envs.VLLM_BATCH_INVARIANT)
            from vllm.model_executor.layers import batch_invariant as BI

            engine["batch_invariant_mode_enabled"] = bool(getattr(BI, "_batch_invariant_MODE", False))
        except Exception:
            engine["batch_invariant_error"] = traceback.format_exc()
        try:
            engine["model"] = self.llm.apply_model(_model_summary)[0]
        except Exception:
            engine["model_error"] = traceback.format_exc()
        try:
            vc = self.llm.llm_engine.vllm_config
            cc, sc = vc.compilation_config, vc.scheduler_config
            engine.update({"compilation_mode": str(cc.mode),  # "0": none, "3": vLLM's compile
                           "cudagraph_mode": str(cc.cudagraph_mode), "custom_ops": list(cc.custom_ops),
                           "enforce_eager": bool(vc.model_config.enforce_eager),
                           "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                           "max_cudagraph_capture_size": getattr(cc, "max_cudagraph_capture_size", None),
                           "chunked_prefill": bool(sc.enable_chunked_prefill),
                           "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
                           "logprobs_mode": vc.model_config.logprobs_mode})
            engine["attention_backend_requested"] = str(vc.attention_config.backend)
        except Exception:
            engine["config_error"] = traceback.format_exc()
        return engine

    def _params(self, max_tokens: int, **extra):
        return self._sampling(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                              detokenize=self.text, **extra)

    def _completion(self, out) -> dict:
        """Tokens, the sampled token's log-probability per step, and the text (or ``None``)."""
        c = out.outputs[0]
        toks = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs)] if c.logprobs is not None else []
        return {"tokens": toks, "logprobs": lps, "text": c.text if self.text else None}

    def generate(self, prompts: list, max_tokens: list) -> list:
        """One batch: every prompt (token ids) with its own output length; their completions."""
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], [self._params(n) for n in max_tokens],
                                 use_tqdm=False)
        return [self._completion(o) for o in outs]

    def prefill(self, prompt: list, completion: dict) -> dict:
        """Decode vs prefill of a completion of ``prompt``: the prompt plus the completion's
        tokens but the last as one prompt, ``prompt_logprobs=0``, one new token.  ``prefill``:
        the prefill's log-probability of each generated token (the last one sampled again),
        ``decode``: the completion's own."""
        toks = completion["tokens"]
        full = list(prompt) + toks[:-1]
        o = self.llm.generate([{"prompt_token_ids": full}], [self._params(1, prompt_logprobs=0)], use_tqdm=False)[0]
        plp = [None if d is None else float(d[t].logprob) for t, d in zip(full, o.prompt_logprobs)]
        last = self._completion(o)
        return {"prompt_len": len(prompt), "decode": completion["logprobs"],
                "prefill": plp[len(prompt):] + last["logprobs"], "last_token_equal": last["tokens"][0] == toks[-1]}


def run_targets(engine, ex: dict, done: dict) -> dict:
    """The ``targets`` experiment: ``alone`` (a completion per target), ``batches`` (per batch:
    its seed, the targets' ``positions``, ``requests``, ``prompt_tokens``, ``seconds`` and the
    targets' completions) and ``decode_vs_prefill`` (per target of the first
    ``decode_vs_prefill``: :meth:`Engine.prefill` and its index)."""
    targets, fillers = ex["targets"], ex["fillers"]
    t0 = time.time()
    res = {"alone": [engine.generate([p], [ex["max_tokens"]])[0] for p in targets]}
    res["alone_s"] = time.time() - t0
    res["batches"] = []
    for b in ex["batches"]:
        order = _order(b, len(targets))
        prompts = [(targets if k == "t" else fillers)[i] for k, i in order]
        news = [ex["max_tokens"] if k == "t" else ex["filler_max_tokens"][i] for k, i in order]
        t1 = time.time()
        outs = engine.generate(prompts, news)
        got = {i: c for (k, i), c in zip(order, outs) if k == "t"}
        res["batches"].append({"seed": b["seed"], "positions": [order.index(("t", i)) for i in range(len(targets))],
                               "requests": len(order), "prompt_tokens": sum(len(p) for p in prompts),
                               "seconds": time.time() - t1, "targets": [got[i] for i in range(len(targets))]})
    res["decode_vs_prefill"] = [{"target": i, **engine.prefill(targets[i], res["alone"][i])}
                                for i in range(ex["decode_vs_prefill"])]
    return res


def run_decode_vs_prefill(engine, ex: dict, done: dict) -> dict:
    """The ``decode_vs_prefill`` experiment of target ``target`` of the earlier ``targets``
    experiment ``of`` (its run alone)."""
    spec, res = done.get(ex["of"], (None, {}))
    if not res.get("alone"):
        raise RuntimeError(f"needs the runs alone of experiment {ex['of']!r}, which did not complete")
    i = ex["target"]
    return {"target": i, **engine.prefill(spec["targets"][i], res["alone"][i])}


def run_throughput(engine, ex: dict, done: dict) -> dict:
    """The ``throughput`` experiment: ``warmup`` prompts of 8 tokens first (lazy compilation
    outside the timing), then one timed ``generate`` of all prompts, ``new_tokens`` each."""
    prompts, new = ex["prompts"], ex["new_tokens"]
    w = min(ex.get("warmup", 0), len(prompts))
    if w:
        engine.generate(prompts[:w], [8] * w)
    t1 = time.perf_counter()
    outs = engine.generate(prompts, [new] * len(prompts))
    wall = time.perf_counter() - t1
    out_toks = sum(len(c["tokens"]) for c in outs)
    in_toks = sum(len(p) for p in prompts)
    return {"prompts": len(prompts), "new_tokens_each": new, "prompt_tokens": in_toks, "output_tokens": out_toks,
            "wall_s": wall, "output_tokens_per_s": out_toks / wall, "total_tokens_per_s": (in_toks + out_toks) / wall}


_RUN = {"targets": run_targets, "decode_vs_prefill": run_decode_vs_prefill, "throughput": run_throughput}


def _kit_calls() -> dict:
    from . import plugin

    return plugin.snapshot()["calls"]


def run_worker(model, job: dict, out, *, build=None) -> int:
    """Run ``job`` (:func:`make_job`) on the model folder ``model`` in this process; the document
    at ``out`` is rewritten once the engine is built and after every experiment.

    The document: the job's ``tags``; ``status`` (``starting``, ``initialized``, ``init_failed``,
    then ``done``, or ``failed`` when an experiment raised); ``mode_env``/``engine_env`` (the
    switches at start and once the engine is built); ``versions``, ``llm_kwargs``, ``init_s``,
    ``engine`` (:meth:`Engine.info`); ``errors`` (the engine's start); ``experiments`` (per name:
    the result with its ``seconds`` and the kit's ``kit_calls`` made while it ran, or its
    ``error`` traceback, or why it was ``skipped``); ``kit_calls``, ``kit_calls_after_init`` and
    ``swapped`` (the plugin's counters and replacements); ``worker_s``.  ``build(model, options,
    doc)`` makes the engine (default :meth:`Engine.build`).  Returns 0 (done), 3 (the engine did
    not start) or 4 (an experiment raised)."""
    from . import plugin

    t_start = time.time()
    doc = {**job.get("tags", {}), "status": "starting", "mode_env": {k: os.environ.get(k) for k in RECORDED_ENV},
           "experiments": {}, "errors": []}

    def save(status=None):
        if status:
            doc["status"] = status
        doc["kit_calls"] = _kit_calls()
        doc["worker_s"] = time.time() - t_start
        write_json(out, doc)

    save()
    t0 = time.time()
    try:
        engine = (build or Engine.build)(model, job["engine"], doc)
        doc["init_s"] = time.time() - t0
    except Exception:
        doc["init_s"] = time.time() - t0
        doc["errors"].append({"stage": "init", "traceback": traceback.format_exc()})
        save("init_failed")
        return 3
    doc["engine_env"] = {k: os.environ.get(k) for k in RECORDED_ENV}
    doc["kit_calls_after_init"] = _kit_calls()
    if plugin.enabled():
        doc["swapped"] = dict(plugin.REPLACEMENTS)
    doc["engine"] = engine.info()
    save("initialized")
    deadline, done, failed = job.get("deadline"), {}, False
    for ex in job["experiments"]:
        name = ex["name"]
        if deadline is not None and deadline - time.time() < ex.get("estimate_s", 0.0):
            doc["experiments"][name] = {"skipped": f"budget: {deadline - time.time():.0f} s left before the deadline"}
            save()
            continue
        calls0 = _kit_calls()
        t1 = time.time()
        try:
            res = _RUN[ex["kind"]](engine, ex, done)
            res["seconds"] = time.time() - t1
            now = _kit_calls()
            res["kit_calls"] = {k: now[k] - calls0.get(k, 0) for k in now}
            done[name] = (ex, res)
        except Exception:
            res = {"error": traceback.format_exc(), "seconds": time.time() - t1}
            failed = True
        doc["experiments"][name] = res
        save()
    save("failed" if failed else "done")
    return 4 if failed else 0


# ---------------------------------------------------------------------------------------------
# The checks (bitwise)
# ---------------------------------------------------------------------------------------------

def decode_vs_prefill(decode: list, prefill: list) -> dict:
    """The decode log-probability of each generated token against the prefill's
    (:meth:`Engine.prefill`), bitwise: positions, how many are equal, the first that is not, the
    largest difference."""
    if len(decode) != len(prefill):
        raise ValueError(f"prefill must hold one log-probability per decoded token ({len(decode)}), "
                         f"got {len(prefill)}")
    equal = [x == y for x, y in zip(decode, prefill)]
    return {"positions": len(decode), "equal_positions": sum(equal),
            "first_unequal": equal.index(False) if False in equal else None,
            "max_abs_diff": max((abs(x - y) for x, y in zip(decode, prefill)), default=0.0),
            "decode_logprobs": list(decode), "prefill_logprobs": list(prefill)}


def targets_result(doc: dict, where: str = "doc") -> TargetsResult:
    """The ``targets`` results of a :func:`run_mode` document (:data:`TARGET_RESULTS`, at its top)
    as a typed :class:`~batch_invariance_kit.vllm.records.TargetsResult`; ``ValueError`` naming
    the first malformed field."""
    from .records import parse

    return parse(TargetsResult, {k: doc[k] for k in TARGET_RESULTS if k in doc}, where)


def summarize(doc: dict) -> dict:
    """Per target of a :func:`run_mode` document, over all batches: did the tokens / the
    log-probabilities change against the run alone (and the first token that did)?  And decode
    vs prefill: how many positions are bitwise equal."""
    if doc.get("status") != "done":
        return {"mode": doc.get("mode"), "status": doc.get("status"), "ran": False}
    res = targets_result(doc)
    n = len(res.alone)
    cmps = [[c for _, c in res.against_alone(i)] for i in range(n)]
    tok_changed = [not all(c.tokens_equal for c in cs) for cs in cmps]
    lp_changed = [not all(c.logprobs_equal for c in cs) for cs in cmps]
    first_diff = [min((c.first_token_diff for c in cs if c.first_token_diff is not None), default=None) for cs in cmps]
    dvp = []
    for d in res.decode_vs_prefill:
        c = decode_vs_prefill(d.decode, d.prefill)
        dvp.append({"target": d.target, "positions": c["positions"], "equal": c["equal_positions"],
                    "max_abs_diff": c["max_abs_diff"]})
    return {"mode": doc["mode"], "status": "done", "ran": True, "targets": n, "batches": len(res.batches),
            "tokens_changed": sum(tok_changed), "logprobs_changed": sum(lp_changed),
            "changed_targets": [i for i in range(n) if tok_changed[i]], "first_token_diff": first_diff,
            "all_bitwise_equal": not any(tok_changed) and not any(lp_changed),
            "decode_vs_prefill_equal": all(d["equal"] == d["positions"] for d in dvp) if dvp else None,
            "decode_vs_prefill": dvp, "init_s": doc.get("init_s"), "seconds": doc.get("seconds")}


# ---------------------------------------------------------------------------------------------
# The caller's side: one mode, one targets experiment
# ---------------------------------------------------------------------------------------------

#: The results of :func:`run_targets` that :func:`run_mode` puts at the top of its document.
TARGET_RESULTS = ("alone", "alone_s", "batches", "decode_vs_prefill")


def run_mode(model, mode: str, spec: dict, *, timeout: float = 600.0, report_dir=None,
             vllm_invariant: bool | None = None) -> dict:
    """Run the :func:`make_spec` experiment ``spec`` on ``model`` (a local HF folder) in a fresh
    process in ``mode`` (:data:`MODES`; a kit mode with ``vllm_invariant=False``: alone, without
    vLLM's own mode, :func:`mode_env`), within ``timeout`` seconds.

    Returns the worker's document (:func:`run_worker`) with the experiment's results
    (:data:`TARGET_RESULTS`) at its top, ``error`` (the first traceback, when there is one),
    ``mode``, ``seconds`` (the whole process), ``rc``, ``timed_out`` and, on failure,
    ``log_tail``; in the kit's modes ``plugin`` is the merged plugin report (in ``report_dir``,
    default a temporary folder)."""
    import torch

    from .plugin import read_report

    if not Path(model, "config.json").is_file():
        raise FileNotFoundError(f"model must be a local HF folder with a config.json, got {model!r}")
    kit = check_mode(mode) in KIT_MODES
    gpu = torch.cuda.is_available()
    env = mode_env(mode, gpu=gpu, vllm_invariant=vllm_invariant)
    engine = {**{k: spec[k] for k in SPEC_ENGINE_KEYS}, "attention_backend": attention_backend(mode, None, gpu=gpu)}
    job = make_job(engine, [targets_experiment("targets", spec)])
    with tempfile.TemporaryDirectory(prefix="kit-vllm-") as tmp:
        job_path, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        write_json(job_path, job)
        rep = Path(report_dir) if report_dir else Path(tmp) / "plugin"
        if kit:
            env["KIT_PLUGIN_REPORT"] = str(rep)
        r = run_process(worker_command(model, job_path, out), env, timeout, Path(tmp) / "worker.log")
        doc = json.loads(out.read_text()) if out.exists() else {"status": "no_output"}
        res = doc.pop("experiments", {}).get("targets", {})
        doc.update({k: res[k] for k in TARGET_RESULTS if k in res})
        errors = ([e["traceback"] for e in doc.get("errors", [])] + ([res["error"]] if "error" in res else []))
        if errors:
            doc["error"] = errors[0]
        doc.update(mode=label(mode, vllm_invariant), seconds=r["seconds"], rc=r["rc"], timed_out=r["timed_out"])
        if r["rc"] != 0:
            doc["log_tail"] = r["log_tail"]
        if kit:
            doc["plugin"] = read_report(rep) if rep.exists() else None
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.vllm.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model folder")
    p.add_argument("--spec", required=True, help="the job (JSON, as made by make_job)")
    p.add_argument("--out", required=True, help="the worker's document (JSON)")
    a = p.parse_args(argv)
    job = json.loads(Path(a.spec).read_text())
    job = make_job(job["engine"], job["experiments"], deadline=job.get("deadline"), tags=job.get("tags"))
    return run_worker(a.model, job, a.out)


if __name__ == "__main__":
    sys.exit(main())
