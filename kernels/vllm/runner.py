"""One vLLM engine, one mode, one experiment: targets alone, in batches, and decode vs prefill.

:func:`run_mode` starts a fresh Python process (``python -m batch_invariance_kit.vllm.runner``)
with the environment of one mode, and reads back the JSON it writes:

* ``default``: vLLM as installed (``KIT_BATCH_INVARIANT=0``, ``VLLM_BATCH_INVARIANT`` unset);
* ``vllm-invariant``: ``VLLM_BATCH_INVARIANT=1``, vLLM's own batch-invariant mode;
* ``kit``: ``KIT_BATCH_INVARIANT=1``: the kit's plugin (:mod:`batch_invariance_kit.vllm.plugin`)
  replaces the batch-variant ops; its report folder (``KIT_PLUGIN_REPORT``) says which
  replacements ran and how often.

A fresh process per mode, because each switch is read when the engine is built.  In that
process the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: every request is
submitted before the first step, so what is compared is batching, not arrival timing) with the
prefix cache off (a cache hit would change the prefill shapes between runs), greedy, the raw fp32
log-probability of each sampled token returned (``logprobs_mode="raw_logprobs"``).

The experiment (``spec``):

1. every target prompt **alone** (a batch of one);
2. every target **in a batch** with the fillers, once per ``orders`` seed (the requests shuffled by
   that seed: each target at another place, beside other neighbours); or, with ``batches``, in
   batches of the first ``fillers`` fillers, each shuffled by its ``seed``;
3. **decode vs prefill** for the first ``decode_vs_prefill`` targets: the prompt plus its decoded
   tokens but the last as one prompt, ``prompt_logprobs=0``: the prefill's log-probability of each
   generated token against the decode's.

Prompts are token ids (``skip_tokenizer_init`` when the folder has no tokenizer); texts are
decoded when it has one.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MODES = ("default", "vllm-invariant", "kit")
BASE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
MODE_ENV = {"default": {"KIT_BATCH_INVARIANT": "0"},
            "vllm-invariant": {"KIT_BATCH_INVARIANT": "0", "VLLM_BATCH_INVARIANT": "1"},
            "kit": {"KIT_BATCH_INVARIANT": "1"}}


def mode_env(mode: str, base: dict | None = None) -> dict:
    """The environment of a mode's process (``base``: default ``os.environ``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_BATCH_INVARIANT", None)
    env.pop("KIT_PLUGIN_REPORT", None)
    env.update(BASE_ENV)
    env.update(MODE_ENV[mode])
    return env


def make_spec(targets: list, fillers: list, *, max_tokens: int, filler_max_tokens=None, orders=(0,), batches=None,
              decode_vs_prefill: int = 1, dtype: str = "bfloat16", max_model_len: int = 1024,
              max_num_batched_tokens: int = 4096, eager: bool = False, kv_cache_gib: float = 1.0) -> dict:
    """Check and bundle an experiment.  ``targets``/``fillers``: lists of token-id lists.
    ``eager=False``: every mode compiled, as vLLM ships (torch.compile; CUDA graphs on a GPU);
    ``eager=True``: ``enforce_eager=True`` for every mode."""
    for name, group in (("targets", targets), ("fillers", fillers)):
        if not isinstance(group, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p) for p in group):
            raise TypeError(f"{name} must be a list of non-empty lists of token ids")
    if not targets:
        raise ValueError("targets must hold at least one prompt")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if filler_max_tokens is None:
        filler_max_tokens = [max_tokens] * len(fillers)
    if len(filler_max_tokens) != len(fillers):
        raise ValueError("filler_max_tokens must give one length per filler")
    if not (0 <= decode_vs_prefill <= len(targets)):
        raise ValueError(f"decode_vs_prefill must be in [0, {len(targets)}], got {decode_vs_prefill}")
    if batches is None:
        batches = [{"fillers": len(fillers), "seed": int(o)} for o in orders]
    for b in batches:
        if not (isinstance(b, dict) and 0 <= b.get("fillers", -1) <= len(fillers) and isinstance(b.get("seed"), int)):
            raise ValueError(f"batches: each must be {{'fillers': 0..{len(fillers)}, 'seed': int}}, got {b!r}")
    longest = max(len(p) for p in list(targets) + list(fillers)) + max([max_tokens] + list(filler_max_tokens))
    if longest > max_model_len:
        raise ValueError(f"max_model_len ({max_model_len}) is shorter than the longest prompt + output ({longest})")
    return {"targets": [list(p) for p in targets], "fillers": [list(p) for p in fillers],
            "max_tokens": max_tokens, "filler_max_tokens": list(filler_max_tokens),
            "batches": [dict(b) for b in batches],
            "decode_vs_prefill": decode_vs_prefill, "dtype": dtype, "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens, "eager": bool(eager), "kv_cache_gib": kv_cache_gib}


def batch_order(n_targets: int, n_fillers: int, seed: int) -> list:
    """The request order of a batched run: ``("t", i)`` / ``("f", j)`` shuffled by ``seed``."""
    items = [("t", i) for i in range(n_targets)] + [("f", j) for j in range(n_fillers)]
    random.Random(seed).shuffle(items)
    return items


# ---------------------------------------------------------------------------------------------
# The worker (the mode's own process)
# ---------------------------------------------------------------------------------------------

def _has_tokenizer(folder) -> bool:
    return any((Path(folder) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def run_worker(model: str, spec: dict, out: str) -> int:
    doc = {"status": "starting", "mode_env": {k: os.environ.get(k) for k in
                                               ("KIT_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT",
                                                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_ATTN_SPLIT_KV")}}

    def save(status=None):
        if status:
            doc["status"] = status
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, out)

    t0 = time.time()
    try:
        import vllm
        from vllm import LLM, SamplingParams

        doc["vllm"] = vllm.__version__
        tok = _has_tokenizer(model)
        llm = LLM(model=model, skip_tokenizer_init=not tok, dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0, enable_prefix_caching=False,
                  logprobs_mode="raw_logprobs", max_num_seqs=256, enforce_eager=spec["eager"],
                  kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2 ** 30))
        doc["init_s"] = time.time() - t0
        # what the engine saw once built (the kit's plugin sets VLLM_CPU_ATTN_SPLIT_KV itself)
        doc["engine_env"] = {k: os.environ.get(k) for k in ("VLLM_CPU_ATTN_SPLIT_KV", "VLLM_BATCH_INVARIANT")}
        vc = llm.llm_engine.vllm_config
        doc["engine"] = {"enforce_eager": bool(vc.model_config.enforce_eager),
                         "compilation_mode": int(vc.compilation_config.mode),  # 0: none, 3: vLLM's compile
                         "cudagraph_mode": str(vc.compilation_config.cudagraph_mode)}
    except Exception:
        doc["error"] = traceback.format_exc()
        doc["init_s"] = time.time() - t0
        save("init_failed")
        return 3
    save("initialized")

    def params(n, **extra):
        return SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True, detokenize=tok, **extra)

    def completion(o):
        c = o.outputs[0]
        toks = list(c.token_ids)
        return {"tokens": toks, "logprobs": [float(step[t].logprob) for t, step in zip(toks, c.logprobs)],
                "text": c.text if tok else None}

    targets, fillers = spec["targets"], spec["fillers"]
    try:
        t1 = time.time()
        doc["alone"] = [completion(llm.generate([{"prompt_token_ids": p}], [params(spec["max_tokens"])],
                                                use_tqdm=False)[0]) for p in targets]
        doc["alone_s"] = time.time() - t1
        save()
        doc["batches"] = []
        for b in spec["batches"]:
            seed = b["seed"]
            order = batch_order(len(targets), b["fillers"], seed)
            prompts = [{"prompt_token_ids": (targets if k == "t" else fillers)[i]} for k, i in order]
            sps = [params(spec["max_tokens"] if k == "t" else spec["filler_max_tokens"][i]) for k, i in order]
            t1 = time.time()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            res = [None] * len(targets)
            for (k, i), o in zip(order, outs):
                if k == "t":
                    res[i] = completion(o)
            doc["batches"].append({"seed": seed, "positions": [order.index(("t", i)) for i in range(len(targets))],
                                   "requests": len(order), "seconds": time.time() - t1, "targets": res})
            save()
        doc["decode_vs_prefill"] = []
        for i in range(spec["decode_vs_prefill"]):
            a = doc["alone"][i]
            prompt = targets[i] + a["tokens"][:-1]
            o = llm.generate([{"prompt_token_ids": prompt}], [params(1, prompt_logprobs=0)], use_tqdm=False)[0]
            plp = [None if d is None else float(d[t].logprob) for t, d in zip(prompt, o.prompt_logprobs)]
            last = completion(o)
            pre = plp[len(targets[i]):] + last["logprobs"]
            doc["decode_vs_prefill"].append({"target": i, "decode": a["logprobs"], "prefill": pre,
                                             "last_token_equal": last["tokens"][0] == a["tokens"][-1]})
        save("done")
    except Exception:
        doc["error"] = traceback.format_exc()
        save("failed")
        return 4
    return 0


# ---------------------------------------------------------------------------------------------
# The driver side
# ---------------------------------------------------------------------------------------------

def run_mode(model, mode: str, spec: dict, *, timeout: float = 600.0, report_dir=None) -> dict:
    """Run ``spec`` on ``model`` (a local HF folder) in a fresh process in ``mode``.

    Returns the worker's JSON plus ``mode``, ``seconds`` (the whole process), ``rc`` and, on
    failure, ``log_tail``; in kit mode ``plugin`` is the merged plugin report."""
    from .plugin import read_report

    if not Path(model, "config.json").is_file():
        raise FileNotFoundError(f"model must be a local HF folder with a config.json, got {model!r}")
    env = mode_env(mode)
    with tempfile.TemporaryDirectory(prefix="kit-vllm-") as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        rep = Path(report_dir) if report_dir else Path(tmp) / "plugin"
        if mode == "kit":
            env["KIT_PLUGIN_REPORT"] = str(rep)
        t0 = time.time()
        cmd = [sys.executable, "-m", "batch_invariance_kit.vllm.runner", "--model", str(model),
               "--spec", str(spec_path), "--out", str(out)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = None, f"timed out after {timeout} s\n" + str(e.stdout or "")[-2000:]
        doc = json.loads(out.read_text()) if out.exists() else {"status": "no_output"}
        doc.update(mode=mode, seconds=time.time() - t0, rc=rc)
        if rc != 0:
            doc["log_tail"] = log[-6000:]
        if mode == "kit":
            doc["plugin"] = read_report(rep) if rep.exists() else None
    return doc


def _equal(a: dict, b: dict) -> tuple:
    """(tokens equal, log-probabilities bitwise equal) of two completions."""
    return a["tokens"] == b["tokens"], len(a["logprobs"]) == len(b["logprobs"]) and all(
        x == y for x, y in zip(a["logprobs"], b["logprobs"]))


def summarize(doc: dict) -> dict:
    """Per target and over all batches: did the tokens / log-probabilities change against alone?
    And decode vs prefill: how many positions are bitwise equal."""
    if doc.get("status") != "done":
        return {"mode": doc.get("mode"), "status": doc.get("status"), "ran": False}
    n = len(doc["alone"])
    tok_changed, lp_changed, first_diff = [], [], []
    for i in range(n):
        a = doc["alone"][i]
        te = le = True
        fd = None
        for b in doc["batches"]:
            t, lp = _equal(a, b["targets"][i])
            te, le = te and t, le and lp
            if not t:
                at = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["targets"][i]["tokens"])) if x != y), None)
                fd = at if fd is None or (at is not None and at < fd) else fd
        tok_changed.append(not te)
        lp_changed.append(not le)
        first_diff.append(fd)
    dvp = [{"target": d["target"], "positions": len(d["decode"]),
            "equal": sum(x == y for x, y in zip(d["decode"], d["prefill"])),
            "max_abs_diff": max(abs(x - y) for x, y in zip(d["decode"], d["prefill"]))}
           for d in doc.get("decode_vs_prefill", [])]
    return {"mode": doc["mode"], "status": "done", "ran": True, "targets": n, "batches": len(doc["batches"]),
            "tokens_changed": sum(tok_changed), "logprobs_changed": sum(lp_changed),
            "changed_targets": [i for i in range(n) if tok_changed[i]], "first_token_diff": first_diff,
            "all_bitwise_equal": not any(tok_changed) and not any(lp_changed),
            "decode_vs_prefill_equal": all(d["equal"] == d["positions"] for d in dvp) if dvp else None,
            "decode_vs_prefill": dvp, "init_s": doc.get("init_s"), "seconds": doc.get("seconds")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.vllm.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    return run_worker(a.model, json.loads(Path(a.spec).read_text()), a.out)


if __name__ == "__main__":
    sys.exit(main())
