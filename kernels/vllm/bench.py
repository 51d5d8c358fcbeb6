"""What invariance costs inside vLLM, measured the way vLLM measures itself.

One command drives vLLM's own benchmarks over the modes and writes one JSON file
(``DIR/vllm_bench.json``, :mod:`batch_invariance_kit.report.results`' shape: ``rows`` of
measurements, ``checks`` of speed goals, plus ``plan``, ``jobs`` and ``comparisons``).  It
needs a CUDA GPU with vLLM staged as in ``shared/device/vllm`` (its ``export`` line first)::

    python -m batch_invariance_kit.vllm.bench --out DIR --dry-run        # the plan and its time; runs nothing
    python -m batch_invariance_kit.vllm.bench --out DIR --models dense --modes default,invariant
    python -m batch_invariance_kit.vllm.bench --out DIR --modes kit+attention --vllm-mode-under-kit both
    python -m batch_invariance_kit.vllm.bench --merge A/vllm_bench.json B/vllm_bench.json --out DIR

**Models** (:func:`model_config`): random weights drawn on the box from a fixed seed
(:func:`batch_invariance_kit.bench.e2e.device_random_weights`, saved by
:meth:`batch_invariance_kit.serving.model.Qwen3Model.save_pretrained`), and a word-level tokenizer
of the model's vocabulary (:func:`write_tokenizer`: ``t<id>`` words, so that vLLM's random
dataset turns token ids into text and back exactly).  ``dense``: Qwen3-8B's shape (hidden 4096, 36
layers, 32 q / 8 kv heads of 128, intermediate 12288, vocabulary 151936); ``moe``: Qwen3-30B-A3B's
shape (hidden 2048, 32 / 4 heads, 128 experts top-8 of intermediate 768) with ``--moe-layers``
of its 48 layers (1.24 GB each in bf16); ``tiny``: a seconds-scale model for a CPU run.
``--weights dummy`` leaves the weights to vLLM's dummy loader instead (nothing written but the
config and the tokenizer: for depths whose checkpoint would not fit the disk).

**Modes** (:data:`batch_invariance_kit.vllm.records.MODES`): ``default`` (vLLM as installed), ``invariant``
(``VLLM_BATCH_INVARIANT=1``), ``kit`` (the kit's plugin, vLLM's attention in vLLM's invariant
mode), ``kit+attention`` (the plugin with the kit's attention backend).  Kit modes run with vLLM's
own mode under them (``--vllm-mode-under-kit on``), without it (``off``: ``KIT_VLLM_INVARIANT=0``,
the kit alone, labelled ``<mode> alone``; only ``kit+attention``, as
:data:`batch_invariance_kit.vllm.plugin.VLLM_MODE_PARTS` explains) or both.  Every mode runs
compiled with CUDA graphs (vLLM's default), the prefix cache off (repeats send the same prompts),
one engine per (model, mode) in its own process, in vLLM's own process layout (the engine core
beside the front end, as ``vllm bench throughput`` and ``vllm serve`` run it); the profile runs
the engine in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the profiler
sees its kernels.

**Scenarios** (:data:`SCENARIOS`; ``--scale`` multiplies the number of prompts, ``--length-scale``
the lengths): ``prefill`` (long prompts, few new tokens), ``decode`` (short prompts, 512 new
tokens), ``tm`` (Thinking Machines' setting: 1,000 requests of about 100 new tokens), ``online``
(a server under 64 concurrent clients at a fixed request rate: TTFT, TPOT), ``profile`` (a few
steps under ``torch.profiler``: :mod:`batch_invariance_kit.vllm.step_profile`) and ``profile_tm``
(the ``tm`` scenario's requests with fewer new tokens, under the profiler).  Prompts come from
vLLM's random dataset with a fixed seed; the warm-ups use the next seeds.

**How each number is taken.**  Offline, the measure of ``vllm bench throughput``: vLLM's own
``get_requests`` (the random dataset, from the command line ``vllm bench throughput`` would get,
parsed by its own parser) and its own timed call ``_run_vllm_requests`` (one ``LLM.generate`` of
every request, ``temperature=1``, ``ignore_eos``), on one engine built by
``LLM.from_engine_args`` as that command builds it; requests/s, total and output tokens/s as it
counts them.  The command itself builds a new engine for every run (a minute or more per start
on the GPU box), so ``--offline-runner inprocess`` (the default) runs warm-ups and repeats on one
engine; ``--offline-runner cli`` runs ``vllm bench throughput`` once per run.  Where the installed
vLLM lacks those functions, the same measure is taken by the kit (token-id prompts of the same
lengths, the same sampling parameters, one ``generate``), and the row says so.  Online: ``vllm
serve`` (``vllm.entrypoints.openai.api_server``) started by the driver, then ``vllm bench serve``
(random dataset, ``--max-concurrency``, ``--request-rate``, fixed seed) once per run; where it
cannot run (it needs ``aiohttp``), the kit's client (:func:`serve_client`) sends the same load
(Poisson arrivals of that rate from a seeded generator, at most that many in flight, streamed)
and takes vLLM's measures (TTFT, TPOT = (latency - TTFT) / (tokens - 1), ITL, throughputs).

**Statistics** (:func:`stats`, :func:`compare`): ``--warmups`` runs (default 1), then
``--repeats`` (default 3, at least 3) timed runs; median and spread (max - min) per measure.  A
ratio is reported only when the difference it reports is larger than the spread of either side;
otherwise the comparison says ``unresolved`` and gives both medians and spreads.  Speed goals
(kit modes against vLLM's invariant mode and against 0.9 and 0.95 of default) are goal checks:
met, not met, or unresolved.  Every offline run also records the Triton kernels its engine
compiled while it ran (``jit``: :mod:`batch_invariance_kit.vllm.jit_log`, through ``KIT_JIT_LOG``), and the
printed summary names the compiles that fell in timed runs: a timed run that compiles measures
the compiler too.

Robustness: a ``--budget-s`` (default 540 s, under a 10-minute call); a job that cannot start in
what is left is skipped; a worker runs a scenario's repeats while they fit before its deadline
(fewer than 3: no ratio); every worker rewrites its part file after every run and the driver
rewrites the JSON after every job.  ``--merge`` joins the files of several calls (rows of later
files replace those of earlier ones) and recomputes the comparisons.

This module imports without vLLM (only its workers import it); everything but the engine is tested
on a CPU (``tests/test_vllm_bench.py``, with stand-in engines and commands), and a CPU run of the
worker on vLLM's CPU build with the ``tiny`` model.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..checks import positive_float, positive_int
from . import jit_log
from . import runner as R
from .check import csv_arg
from .records import KIT_MODES, MODES, UNDER_KIT_HELP, check_under_kit, label, variants
from .records import attention_backend as _attention_backend

# ---------------------------------------------------------------------------------------------
# Models, modes, scenarios
# ---------------------------------------------------------------------------------------------

MODEL_NAMES = ("dense", "moe", "tiny")
#: Qwen3-30B-A3B has 48 layers; the default keeps a checkpoint of about 16 GB.
MOE_LAYERS = 12
OFFLINE_RUNNERS = ("inprocess", "cli")
WEIGHTS = ("kit", "dummy")
#: Timed runs at least, for a median and a spread to mean something.
MIN_REPEATS = 3
#: Seconds a job needs at least to start an engine (process start, vLLM import, weights,
#: torch.compile, CUDA-graph capture: 47-99 s were seen on the H200 for small models).
MIN_START_S = {"dense": 150.0, "moe": 150.0, "tiny": 30.0}


def build_estimate_s(name: str, moe_layers: int = MOE_LAYERS, weights: str = "kit") -> float:
    """Seconds to write a model's checkpoint on the GPU box (planning only: about 5 s per GB,
    drawing, copying and writing; a few seconds for a config and a tokenizer alone)."""
    if weights == "dummy":
        return 5.0
    return {"dense": 5.0 * 16.4, "moe": 5.0 * (1.24 * moe_layers + 1.3), "tiny": 3.0}[name]


def model_config(name: str, moe_layers: int = MOE_LAYERS):
    """The :class:`~batch_invariance_kit.serving.model.Qwen3Config` of a bench model."""
    from ..serving.model import Qwen3Config

    positive_int("moe_layers", moe_layers)
    if name == "dense":
        return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                           torch_dtype="bfloat16", seed=81)
    if name == "moe":
        return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=moe_layers,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                           max_position_embeddings=40960, torch_dtype="bfloat16", num_experts=128,
                           num_experts_per_tok=8, moe_intermediate_size=768, seed=82)
    if name == "tiny":
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                           torch_dtype="bfloat16", seed=83)
    raise ValueError(f"model must be one of {list(MODEL_NAMES)}, got {name!r}")


@dataclass(frozen=True)
class Scenario:
    """One load.  Lengths are the random dataset's means; ``range_ratio`` spreads them uniformly
    over ``[(1 - r) len, (1 + r) len]``.  ``estimate_s``: seconds of one run of the dense model in
    default mode on an H200, for planning only (the worker times its warm-up and fits the repeats
    into what is left)."""
    name: str
    kind: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    request_rate: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    estimate_s: float = 10.0
    what: str = ""

    def scaled(self, prompts: float = 1.0, lengths: float = 1.0) -> "Scenario":
        return dataclasses.replace(self, num_prompts=max(1, round(self.num_prompts * prompts)),
                                   input_len=max(4, round(self.input_len * lengths)),
                                   output_len=max(2, round(self.output_len * lengths)),
                                   estimate_s=self.estimate_s * prompts * lengths)

    def bounds(self, n: int) -> tuple:
        """The shortest and longest of a length whose mean is ``n``."""
        return (math.floor(round(n * (1 - self.range_ratio), 9)), math.ceil(round(n * (1 + self.range_ratio), 9)))

    def longest(self) -> int:
        """The longest prompt plus output the dataset draws (vLLM's random dataset may round one
        more token up)."""
        return self.bounds(self.input_len)[1] + self.bounds(self.output_len)[1] + 2


SCENARIOS = {s.name: s for s in (
    Scenario("prefill", "offline", 128, 1024, 32, 0.25, estimate_s=8.0,
             what="prefill-heavy: 128 prompts of 768-1280 tokens, 24-40 new tokens each"),
    Scenario("decode", "offline", 256, 128, 512, 0.0, estimate_s=9.0,
             what="decode-heavy: 256 prompts of 128 tokens, 512 new tokens each"),
    Scenario("tm", "offline", 1000, 128, 100, 0.1, estimate_s=10.0,
             what="Thinking Machines' setting: 1,000 requests, 90-110 new tokens each"),
    Scenario("online", "online", 384, 512, 128, 0.25, request_rate=16.0, max_concurrency=64, estimate_s=30.0,
             what="online: 64 concurrent clients at 16 requests/s, prompts of 384-640 tokens, 96-160 new tokens"),
    Scenario("profile", "profile", 64, 512, 16, 0.0, estimate_s=4.0,
             what="one batch of 64 prompts of 512 tokens, 16 new tokens each, under torch.profiler"),
    Scenario("profile_tm", "profile", 1000, 128, 16, 0.1, estimate_s=6.0,
             what="the tm scenario's requests with 14-18 new tokens each, under torch.profiler: 1,000 prompts of "
                  "115-141 tokens in prefill chunks, then decode steps of up to 1,000 requests"),
)}

#: Per kind: the measures kept, and whether more is better; the first is the headline.
MEASURES = {
    "offline": (("output_tokens_per_s", True), ("total_tokens_per_s", True), ("requests_per_s", True),
                ("elapsed_s", False)),
    "online": (("output_throughput", True), ("median_ttft_ms", False), ("median_tpot_ms", False),
               ("p99_ttft_ms", False), ("p99_tpot_ms", False), ("mean_ttft_ms", False), ("mean_tpot_ms", False),
               ("median_itl_ms", False), ("request_throughput", True), ("duration", False)),
}
#: The measures a comparison reports (``compare``), per kind.
COMPARED = {"offline": ("output_tokens_per_s",), "online": ("output_throughput", "median_ttft_ms", "median_tpot_ms")}
#: Speed goals of a kit mode: (name, reference label, fraction of the reference).
GOALS = (("kit >= vLLM's invariant mode", "invariant", 1.0), ("kit >= 0.9 x default", "default", 0.9),
         ("kit >= 0.95 x default", "default", 0.95))


def attention_backend(mode: str, *, gpu: bool) -> str | None:
    """The ``--attention-backend`` of a mode (:func:`batch_invariance_kit.vllm.records.attention_backend`:
    the kit's in ``kit+attention`` on a GPU; ``None``: vLLM's choice)."""
    return _attention_backend(mode, None, gpu=gpu)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.vllm.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder of the JSON file (and parts/, logs/)")
    p.add_argument("--models", default="dense", help=f"comma-separated subset of {','.join(MODEL_NAMES)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--vllm-mode-under-kit", default="on", help=UNDER_KIT_HELP)
    p.add_argument("--scenarios", default="prefill,decode,tm", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"timed runs per scenario (>= {MIN_REPEATS})")
    p.add_argument("--warmups", type=int, default=1, help="untimed runs before them (>= 1)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every scenario's number of prompts")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiplies every scenario's lengths")
    p.add_argument("--moe-layers", type=int, default=MOE_LAYERS,
                   help=f"layers of the moe model (of 48; default {MOE_LAYERS})")
    p.add_argument("--weights", default="kit", help="kit: the kit's seeded random weights, written once; "
                   "dummy: vLLM's dummy loader (nothing written)")
    p.add_argument("--offline-runner", default="inprocess", help="inprocess: one engine, vLLM's benchmark functions; "
                   "cli: `vllm bench throughput` once per run (an engine start each)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run (s)")
    p.add_argument("--model-dir", default=None, help="where the models are saved (default <tempdir>/kit-bench-models)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--eager", action="store_true", help="every mode with enforce_eager=True (default: compiled)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="every mode with vLLM's --max-cudagraph-capture-size N, as requested (vLLM may round "
                        "it down to its capture-size grid; each engine record holds the size it used; "
                        "default: vLLM's own limit)")
    p.add_argument("--result-name", default="vllm_bench", help=argparse.SUPPRESS)
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join result files into --out")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; run nothing")
    # internal
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check; raises ``ValueError`` naming the offending argument."""
    a = parser().parse_args(argv)
    if a.worker is not None:
        if not a.part:
            raise ValueError("--worker needs --part")
        return a
    if a.merge is not None:
        if not a.out:
            raise ValueError("--out is required with --merge (the folder of the joined file)")
        missing = [f for f in a.merge if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"--merge: no such file {missing}")
        return a
    a.models = csv_arg("models", a.models, MODEL_NAMES)
    a.modes = csv_arg("modes", a.modes, MODES)
    a.scenarios = csv_arg("scenarios", a.scenarios, tuple(SCENARIOS))
    check_under_kit(a.vllm_mode_under_kit, a.modes)
    if a.offline_runner not in OFFLINE_RUNNERS:
        raise ValueError(f"--offline-runner must be one of {list(OFFLINE_RUNNERS)}, got {a.offline_runner!r}")
    if a.weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {list(WEIGHTS)}, got {a.weights!r}")
    if isinstance(a.repeats, bool) or a.repeats < MIN_REPEATS:
        raise ValueError(f"--repeats must be at least {MIN_REPEATS} (a median and a spread), got {a.repeats}")
    if a.warmups < 1:
        raise ValueError(f"--warmups must be at least 1 (compilation and graph capture outside the timing), "
                         f"got {a.warmups}")
    for name in ("scale", "length_scale", "budget_s"):
        v = getattr(a, name)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive finite number, got {v!r}")
    if not 1 <= a.moe_layers <= 48:
        raise ValueError(f"--moe-layers must be in 1..48 (Qwen3-30B-A3B has 48), got {a.moe_layers}")
    if not 0.05 <= a.gpu_memory_utilization <= 0.95:
        raise ValueError(f"--gpu-memory-utilization must be in [0.05, 0.95], got {a.gpu_memory_utilization!r}")
    if a.max_cudagraph_capture_size is not None and a.max_cudagraph_capture_size < 1:
        raise ValueError(f"--max-cudagraph-capture-size must be a positive integer, "
                         f"got {a.max_cudagraph_capture_size!r}")
    if a.max_cudagraph_capture_size is not None and a.eager:
        raise ValueError("--max-cudagraph-capture-size needs CUDA graphs: not with --eager")
    if a.offline_runner == "cli" and "profile" in a.scenarios:
        raise ValueError("--scenarios profile runs in the in-process worker: not with --offline-runner cli")
    if a.model_dir is None:
        a.model_dir = os.path.join(tempfile.gettempdir(), "kit-bench-models")
    if not a.build and not a.dry_run and not a.out:
        raise ValueError("--out is required (the folder of the JSON file)")
    return a


def scenarios_of(a) -> list:
    return [SCENARIOS[s].scaled(a.scale, a.length_scale) for s in a.scenarios]


def max_model_len(scenarios: list) -> int:
    """The engine's context: the longest prompt plus output of any scenario, rounded up to 256."""
    return max(256, -(-max(s.longest() + 8 for s in scenarios) // 256) * 256)


# ---------------------------------------------------------------------------------------------
# Statistics and comparisons
# ---------------------------------------------------------------------------------------------

def stats(values: list) -> dict:
    """``n``, ``median``, ``min``, ``max`` and ``spread`` (max - min) of a measure's repeats."""
    vals = [float(v) for v in values]
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"values must be a non-empty list of finite numbers, got {values!r}")
    return {"n": len(vals), "median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "spread": max(vals) - min(vals)}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def compare(x: list, ref: list, *, higher_is_better: bool = True, fraction: float = 1.0, names=("x", "ref")) -> dict:
    """``x`` against ``fraction`` times ``ref`` (each a list of repeats of one measure).

    ``ratio``: median(x) / median(ref).  The comparison is **resolved** when both sides have at
    least :data:`MIN_REPEATS` repeats and the difference it reports, ``median(x) - fraction *
    median(ref)``, is larger than the spread (max - min) of either side (``ref``'s scaled by
    ``fraction``); then ``better`` says whether ``x`` is on the good side of ``fraction * ref``.
    Unresolved, ``ratio`` and ``better`` are ``None``, ``why`` says why, and ``text`` gives both
    medians and spreads."""
    positive_float("fraction", fraction)
    sx, sr = stats(x), stats(ref)
    diff = sx["median"] - fraction * sr["median"]
    noise = max(sx["spread"], fraction * sr["spread"])
    enough = sx["n"] >= MIN_REPEATS and sr["n"] >= MIN_REPEATS
    resolved = enough and abs(diff) > noise
    ratio = sx["median"] / sr["median"] if sr["median"] else None
    out = {"x": sx, "ref": sr, "fraction": fraction, "difference": diff, "noise": noise, "resolved": resolved,
           "ratio": ratio if resolved else None, "nominal_ratio": ratio,
           "better": ((diff > 0) == higher_is_better) if resolved else None}
    both = (f"{names[0]} {_fmt(sx['median'])} (spread {_fmt(sx['spread'])}, n={sx['n']}) vs "
            f"{names[1]} {_fmt(sr['median'])} (spread {_fmt(sr['spread'])}, n={sr['n']})")
    out["why"] = None if resolved else (f"fewer than {MIN_REPEATS} repeats" if not enough
                                        else "the spread exceeds the difference")
    out["text"] = f"{ratio:.3f}x ({both})" if resolved else f"unresolved ({out['why']}): {both}"
    return out


def _measured(rows: list) -> list:
    """``[((model, scenario), {label: row})]`` of the measurement rows with repeats, sorted."""
    by = {}
    for r in rows:
        if r.get("op") == "vllm_bench" and r.get("repeats"):
            by.setdefault((r["model"], r["scenario"]), {})[r["impl"]] = r
    return sorted(by.items())


def comparisons(rows: list) -> list:
    """Every label against default (and kit labels against invariant) per (model, scenario) and
    compared measure, from the rows' repeats.  ``runs``: the two rows' ``source`` (the run each
    came from in a joined file; ``None`` in one run's file)."""
    out = []
    for (model, scen), labels in _measured(rows):
        for lab, row in labels.items():
            refs = [ref for ref in ("default", "invariant") if ref in labels and ref != lab
                    and (ref == "default" or lab.split()[0] in KIT_MODES)]
            for ref in refs:
                for measure in COMPARED[row["kind"]]:
                    hib = dict(MEASURES[row["kind"]])[measure]
                    xs = [rep[measure] for rep in row["repeats"] if rep.get(measure) is not None]
                    rs = [rep[measure] for rep in labels[ref]["repeats"] if rep.get(measure) is not None]
                    if not xs or not rs:
                        continue
                    c = compare(xs, rs, higher_is_better=hib, names=(lab, ref))
                    out.append({"model": model, "scenario": scen, "impl": lab, "against": ref, "measure": measure,
                                "higher_is_better": hib, "runs": [row.get("source"), labels[ref].get("source")],
                                **{k: c[k] for k in ("ratio", "nominal_ratio", "resolved", "better", "difference",
                                                     "noise", "why", "text")}})
    return out


def goal_checks(rows: list) -> list:
    """The speed goals (:data:`GOALS`) of every kit label on the headline measure, as goal checks
    (:func:`batch_invariance_kit.report.results.goal`): ``verdict`` met / not met / unresolved."""
    from ..report import results

    out = []
    for (model, scen), labels in _measured(rows):
        for lab, row in labels.items():
            if lab.split()[0] not in KIT_MODES:
                continue
            measure, hib = MEASURES[row["kind"]][0]
            for name, ref, frac in GOALS:
                if ref not in labels:
                    continue
                c = compare([rep[measure] for rep in row["repeats"]], [rep[measure] for rep in labels[ref]["repeats"]],
                            higher_is_better=hib, fraction=frac, names=(lab, ref))
                verdict = "unresolved" if not c["resolved"] else ("met" if c["better"] else "not met")
                out.append(results.goal(f"{model} {scen}: {name.replace('kit', lab, 1)} ({measure})",
                                        verdict == "met", verdict=verdict, nominal_ratio=c["nominal_ratio"],
                                        text=c["text"]))
    return out


# ---------------------------------------------------------------------------------------------
# Models on disk
# ---------------------------------------------------------------------------------------------

#: Special tokens of :func:`write_tokenizer` (the ids of the kit's configs: bos 0, eos 1).
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")


def write_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` ids in ``folder``: ids 0, 1, 2 are ``<s>``,
    ``</s>`` (the configs' bos/eos) and ``<unk>``, every other id ``i`` is the word ``t<i>``;
    words are split on white space and decoded joined by spaces, so any id sequence of
    non-special ids turns into text and back unchanged (vLLM's random dataset decodes its random
    ids and encodes them again)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    positive_int("vocab_size", vocab_size)
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)} (the special tokens), got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    cpath = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(cpath.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers release loads
    cfg.pop("backend", None)
    cpath.write_text(json.dumps(cfg, indent=1))


def build_model(name: str, folder, *, moe_layers: int = MOE_LAYERS, weights: str = "kit", device=None) -> str:
    """Write model ``name`` to ``folder`` (config, tokenizer and, with ``weights="kit"``, the
    seeded random weights drawn on ``device``); reuse a folder that holds the same.  Returns
    ``"built"`` or ``"reused"``."""
    import torch

    from ..bench.e2e import device_random_weights
    from ..serving.model import Qwen3Model

    cfg = model_config(name, moe_layers)
    folder = Path(folder)
    want = cfg.hf_config()
    cpath, wpath = folder / "config.json", folder / "model.safetensors"
    same = cpath.exists() and json.loads(cpath.read_text()) == want and R.has_tokenizer(folder)
    if same and (weights == "dummy" or wpath.exists()):
        return "reused"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    if weights == "kit":
        m = Qwen3Model(cfg, weights=device_random_weights(cfg, device), device=device)
        m.save_pretrained(str(folder))
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    else:
        cpath.write_text(json.dumps(want, indent=2, sort_keys=True))
    write_tokenizer(folder, cfg.vocab_size)
    return "built"


def run_build(a) -> int:
    for name in a.models:
        t0 = time.time()
        how = build_model(name, model_folder(a, name), moe_layers=a.moe_layers, weights=a.weights)
        print(f"{name}: {how} in {time.time() - t0:.1f} s", flush=True)
    return 0


def model_folder(a, name: str) -> Path:
    """``<model-dir>/<name>`` (``moe-<layers>`` for the MoE model, ``-dummy`` with vLLM's dummy
    weights)."""
    return Path(a.model_dir) / ((f"{name}-{a.moe_layers}" if name == "moe" else name)
                                + ("-dummy" if a.weights == "dummy" else ""))


# ---------------------------------------------------------------------------------------------
# vLLM's command lines
# ---------------------------------------------------------------------------------------------

def engine_flags(folder, *, mode: str, max_len: int, gpu: bool, gpu_memory_utilization: float = 0.85,
                 weights: str = "kit", eager: bool = False, max_capture: int | None = None) -> list:
    """The engine's flags, as ``vllm bench throughput`` and ``vllm serve`` take them: bf16, seed 0,
    the prefix cache off, vLLM's default scheduler and CUDA graphs (up to ``max_capture`` tokens
    when given, the same for every mode); the kit's attention backend in ``kit+attention``; on a
    CPU a 512 MiB KV cache."""
    f = ["--model", str(folder), "--tokenizer", str(folder), "--dtype", "bfloat16", "--max-model-len", str(max_len),
         "--seed", "0", "--no-enable-prefix-caching"]
    f += ["--gpu-memory-utilization", str(gpu_memory_utilization)] if gpu else ["--kv-cache-memory-bytes", str(2 ** 29)]
    if weights == "dummy":
        f += ["--load-format", "dummy"]
    if attention_backend(mode, gpu=gpu):
        f += ["--attention-backend", attention_backend(mode, gpu=gpu)]
    if eager:
        f.append("--enforce-eager")
    if max_capture is not None:
        f += ["--max-cudagraph-capture-size", str(max_capture)]
    return f


def job_flags(a, model: str, mode: str, scenarios: list, gpu: bool) -> list:
    """:func:`engine_flags` of one job of the run ``a``: its model's folder, its scenarios' longest
    request, the run's engine settings."""
    return engine_flags(model_folder(a, model), mode=mode, max_len=max_model_len(scenarios), gpu=gpu,
                        gpu_memory_utilization=a.gpu_memory_utilization, weights=a.weights, eager=a.eager,
                        max_capture=a.max_cudagraph_capture_size)


def dataset_flags(s: Scenario, seed: int) -> list:
    """The random dataset of scenario ``s`` with seed ``seed`` (``--seed``: vLLM's benchmarks
    seed the dataset with it)."""
    return ["--dataset-name", "random", "--random-input-len", str(s.input_len), "--random-output-len",
            str(s.output_len), "--random-range-ratio", str(s.range_ratio), "--num-prompts", str(s.num_prompts),
            "--seed", str(seed)]


def _without_seed(flags: list) -> list:
    """The engine's flags without ``--seed N`` (a run's seed comes with its dataset's flags)."""
    return [x for i, x in enumerate(flags) if not (x == "--seed" or (i and flags[i - 1] == "--seed"))]


def throughput_cli_command(flags: list, s: Scenario, seed: int, out_json) -> list:
    """``vllm bench throughput`` (through ``vllm.entrypoints.cli.main``: the staged vLLM has no
    ``vllm`` executable on the PATH)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", *_without_seed(flags),
            "--disable-detokenize",
            *dataset_flags(s, seed), "--output-json", str(out_json)]


_THROUGHPUT_LINE = re.compile(r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output "
                              r"tokens/s")


def parse_throughput_cli(stdout: str, doc: dict) -> dict:
    """The measures of one ``vllm bench throughput`` run: its ``--output-json`` document and the
    ``Throughput:`` line it prints (the document has no output tokens/s)."""
    m = _THROUGHPUT_LINE.findall(stdout)
    if not m:
        raise ValueError("the output of vllm bench throughput has no 'Throughput: ... output tokens/s' line")
    req_s, tot_s, out_s = (float(v) for v in m[-1])
    for k in ("elapsed_time", "num_requests", "total_num_tokens"):
        if k not in doc:
            raise ValueError(f"the --output-json document of vllm bench throughput lacks {k!r}")
    return {"elapsed_s": float(doc["elapsed_time"]), "requests": int(doc["num_requests"]),
            "total_tokens": int(doc["total_num_tokens"]), "output_tokens": round(out_s * float(doc["elapsed_time"])),
            "requests_per_s": req_s, "total_tokens_per_s": tot_s, "output_tokens_per_s": out_s}


def serve_command(folder, port: int, flags: list) -> list:
    """``vllm serve`` (``vllm.entrypoints.openai.api_server``) on ``127.0.0.1:port``."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", "model", "--host",
            "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *flags]


def serve_bench_command(base_url: str, folder, s: Scenario, seed: int, result_dir, result_file) -> list:
    """``vllm bench serve`` of scenario ``s`` against ``base_url``."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm", "--base-url",
            base_url, "--endpoint", "/v1/completions", "--model", str(folder), "--served-model-name", "model",
            "--tokenizer", str(folder), *dataset_flags(s, seed), "--request-rate", str(s.request_rate),
            "--max-concurrency", str(s.max_concurrency), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(result_dir), "--result-filename",
            str(result_file), "--disable-tqdm", "--ready-check-timeout-sec", "60"]


def online_measures(doc: dict) -> dict:
    """The measures of one online run from a ``vllm bench serve`` result document (or the kit's
    client's, which has the same keys)."""
    out = {}
    for k, _ in MEASURES["online"]:
        if k not in doc:
            raise ValueError(f"the online result lacks {k!r}")
        out[k] = float(doc[k])
    for k in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        if k in doc and doc[k] is not None:
            out[k] = int(doc[k])
    return out


def has_bench_serve() -> bool:
    """Whether ``vllm bench serve`` can run here (it imports ``aiohttp``)."""
    return importlib.util.find_spec("aiohttp") is not None


# ---------------------------------------------------------------------------------------------
# The kit's client (where vllm bench serve cannot run)
# ---------------------------------------------------------------------------------------------

def arrivals(n: int, rate: float, seed: int) -> list:
    """Send times (s after the start) of ``n`` requests at ``rate`` per second: a Poisson process
    (exponential gaps) from a seeded generator, as ``vllm bench serve`` with burstiness 1."""
    positive_int("n", n)
    positive_float("rate", rate)
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def random_requests(s: Scenario, vocab: int, seed: int) -> list:
    """``[(prompt token ids, new tokens)]`` of scenario ``s``: lengths uniform in
    ``[(1 - r) len, (1 + r) len]``, ids uniform over the non-special ids, from ``seed``."""
    rng = random.Random(seed)
    lo = len(SPECIAL_TOKENS)

    def length(n):
        return max(1, rng.randint(*s.bounds(n)))

    return [([rng.randrange(lo, vocab) for _ in range(length(s.input_len))], length(s.output_len))
            for _ in range(s.num_prompts)]


def _pct(vals: list, p: float) -> float:
    if not vals:
        return float("nan")
    v = sorted(vals)
    k = (len(v) - 1) * p / 100
    f = math.floor(k)
    return v[f] if f == len(v) - 1 else v[f] + (v[f + 1] - v[f]) * (k - f)


def client_metrics(results: list, duration: float) -> dict:
    """vLLM's serving measures from per-request results ``{"ttft", "latency", "itls", "output_tokens",
    "prompt_tokens", "error"}`` (seconds): TTFT, TPOT = (latency - TTFT) / (output tokens - 1),
    ITL, E2E latency (ms: mean, median, p99), throughputs over ``duration``."""
    ok = [r for r in results if not r.get("error")]
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3 for r in ok if r["output_tokens"] > 1]
    itl = [x * 1e3 for r in ok for x in r["itls"]]
    e2el = [r["latency"] * 1e3 for r in ok]
    out_toks = sum(r["output_tokens"] for r in ok)
    doc = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": sum(r["prompt_tokens"] for r in ok), "total_output_tokens": out_toks,
           "request_throughput": len(ok) / duration, "output_throughput": out_toks / duration,
           "total_token_throughput": (out_toks + sum(r["prompt_tokens"] for r in ok)) / duration}
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        doc[f"mean_{name}_ms"] = statistics.fmean(vals) if vals else float("nan")
        doc[f"median_{name}_ms"] = statistics.median(vals) if vals else float("nan")
        doc[f"p99_{name}_ms"] = _pct(vals, 99)
    return doc


async def _client(base_url: str, reqs: list, times: list, max_concurrency: int, timeout_s: float) -> tuple:
    import httpx

    sem = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(prompt, new, at):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with sem:
                body = {"model": "model", "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
                        "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
                r = {"prompt_tokens": len(prompt), "output_tokens": 0, "itls": [], "ttft": None, "error": None}
                start = last = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            choices = json.loads(line[6:]).get("choices") or []
                            n = len(((choices[0].get("logprobs") or {}).get("tokens") or [])) if choices else 0
                            if not n:
                                continue
                            now = time.perf_counter()
                            if r["ttft"] is None:
                                r["ttft"] = now - start
                            else:
                                r["itls"].append(now - last)
                            last = now
                            r["output_tokens"] += n
                    r["latency"] = time.perf_counter() - start
                    if r["ttft"] is None:
                        r["error"] = "no token streamed"
                except Exception as e:  # recorded: a failed request counts as failed
                    r["error"] = f"{type(e).__name__}: {e}"
                return r

        results = await asyncio.gather(*(one(p, n, at) for (p, n), at in zip(reqs, times)))
        return list(results), time.perf_counter() - t0


def serve_client(base_url: str, s: Scenario, vocab: int, seed: int, *, timeout_s: float = 600.0) -> dict:
    """The kit's stand-in for ``vllm bench serve``: scenario ``s``'s requests
    (:func:`random_requests`) at :func:`arrivals` times, at most ``s.max_concurrency`` in flight,
    streamed completions; returns :func:`client_metrics`."""
    reqs = random_requests(s, vocab, seed)
    results, duration = asyncio.run(_client(base_url, reqs, arrivals(len(reqs), s.request_rate, seed),
                                            s.max_concurrency, timeout_s))
    return client_metrics(results, duration)


# ---------------------------------------------------------------------------------------------
# The worker: one engine, the offline scenarios (and the profile)
# ---------------------------------------------------------------------------------------------

def offline_measures(elapsed: float, prompt_tokens: int, output_tokens: int, requests: int) -> dict:
    """``vllm bench throughput``'s measures of one run."""
    positive_float("elapsed", elapsed)
    return {"elapsed_s": elapsed, "requests": requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens, "requests_per_s": requests / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed}


class VllmBench:
    """One vLLM engine and vLLM's benchmark functions (the inside of ``vllm bench throughput``).

    Built from the flags ``vllm bench throughput`` would get, parsed by its own parser; the
    engine by ``LLM.from_engine_args`` as that command builds it.  :meth:`run` times one pass over
    a scenario's requests with ``_run_vllm_requests``.  Without those functions (another vLLM),
    the same measure is taken with the kit's prompts and ``LLM.generate`` (``runner`` says which)."""

    def __init__(self, flags: list, scenarios: list):
        from vllm import LLM

        self.flags, self._requests = list(flags), {}
        try:
            from vllm.benchmarks import throughput as T
            from vllm.engine.arg_utils import EngineArgs
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            for fn in ("add_cli_args", "get_requests", "_run_vllm_requests", "get_tokenizer"):
                getattr(T, fn)
        except (ImportError, AttributeError) as e:
            self.T, self.missing = None, f"{type(e).__name__}: {e}"
        else:
            self.T, self._parser = T, FlexibleArgumentParser()
            T.add_cli_args(self._parser)
        if self.T is None:
            self.llm = LLM(**_llm_kwargs(flags))
            self.runner = (f"the kit's equivalent of vllm bench throughput (vLLM's benchmark functions: "
                           f"{self.missing})")
            return
        args = self.args(scenarios[0], 0)
        self.llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
        self.tokenizer = T.get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                                         trust_remote_code=args.trust_remote_code)
        self.runner = "vllm bench throughput (in process: its get_requests and _run_vllm_requests)"

    def args(self, s: Scenario, seed: int):
        a = self._parser.parse_args(_without_seed(self.flags) + ["--disable-detokenize"] + dataset_flags(s, seed))
        if hasattr(self.T, "validate_args"):
            self.T.validate_args(a)
        return a

    def requests(self, s: Scenario, seed: int):
        key = (s, seed)
        if key not in self._requests:
            if self.T is not None:
                self._requests[key] = self.T.get_requests(self.args(s, seed), self.tokenizer)
            else:
                vocab = self.llm.llm_engine.model_config.get_vocab_size()
                self._requests[key] = random_requests(s, vocab, seed)
        return self._requests[key]

    def run(self, s: Scenario, seed: int) -> dict:
        reqs = self.requests(s, seed)
        if self.T is not None:
            elapsed, outs = self.T._run_vllm_requests(self.llm, reqs, 1, True, do_profile=False,
                                                      prequeue_requests=False, enable_lora=False)
        else:
            from vllm import SamplingParams

            prompts = [{"prompt_token_ids": p} for p, _ in reqs]
            params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n, detokenize=False)
                      for _, n in reqs]
            t0 = time.perf_counter()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
        prompt_toks = sum(len(o.prompt_token_ids or []) for o in outs)
        out_toks = sum(len(c.token_ids or []) for o in outs for c in o.outputs if c is not None)
        return offline_measures(elapsed, prompt_toks, out_toks, len(reqs))

    def profile(self, s: Scenario, seed: int) -> dict:
        """One run of ``s`` under ``torch.profiler``: :func:`batch_invariance_kit.vllm.step_profile.profile_call`."""
        from .step_profile import profile_call

        res = {}

        def call():
            res.update(self.run(s, seed))

        summary = profile_call(call)
        return {**summary, "run": res}

    def info(self) -> dict:
        return R.Engine(self.llm, False).info()


def _llm_kwargs(flags: list) -> dict:
    """``LLM(...)`` keyword arguments from :func:`engine_flags` (the kit's path when vLLM's
    benchmark functions are absent)."""
    kw, i = {}, 0
    while i < len(flags):
        key = flags[i][2:].replace("-", "_")
        if key == "enforce_eager":
            kw[key], i = True, i + 1
            continue
        if key == "no_enable_prefix_caching":
            kw["enable_prefix_caching"], i = False, i + 1
            continue
        val = flags[i + 1]
        kw[key] = int(val) if key in ("max_model_len", "seed", "kv_cache_memory_bytes") else (
            float(val) if key == "gpu_memory_utilization" else val)
        if key == "attention_backend":
            kw.pop(key)
            kw["attention_config"] = {"backend": val}
        if key == "max_cudagraph_capture_size":
            kw.pop(key)
            kw["compilation_config"] = {"max_cudagraph_capture_size": int(val)}
        i += 2
    return kw


def _timed(run: dict, t0: float, t1: float) -> None:
    """Record a run's wall time ``run_s`` and, when the engine logs its Triton compiles
    (``KIT_JIT_LOG``, :mod:`batch_invariance_kit.vllm.jit_log`), the compiles that ended inside
    it (``jit``)."""
    run["run_s"] = t1 - t0
    path = os.environ.get(jit_log.ENV)
    if path:
        run["jit"] = jit_log.window(path, t0, t1)


def run_worker(job: dict, part, *, build=None, clock=time.time) -> int:
    """Run ``job`` (:func:`worker_job`) in this process: build the engine, then per scenario the
    warm-ups and the timed repeats that fit before the job's deadline (the warm-up's time is the
    estimate of a run), or the profile; rewrite ``part`` after every run.  ``build(job)`` makes
    the engine (default :class:`VllmBench`).  Returns 0 (done), 3 (no engine), 4 (a scenario raised)."""
    t0 = clock()
    doc = {k: job.get(k) for k in ("model", "mode", "label", "vllm_invariant", "attention_backend")}
    doc.update(status="starting", scenarios={}, errors=[], mode_env={k: os.environ.get(k) for k in R.RECORDED_ENV})

    def save(status=None):
        if status:
            doc["status"] = status
        doc["worker_s"] = clock() - t0
        R.write_json(part, doc)

    save()
    scenarios = [Scenario(**s) for s in job["scenarios"]]
    try:
        engine = (build or (lambda j: VllmBench(j["flags"], scenarios)))(job)
    except Exception:
        doc["errors"].append({"stage": "init", "traceback": traceback.format_exc()})
        doc["init_s"] = clock() - t0
        save("init_failed")
        return 3
    doc["init_s"] = clock() - t0
    doc["runner"] = engine.runner
    doc["engine_env"] = {k: os.environ.get(k) for k in R.RECORDED_ENV}
    try:
        doc["engine"] = engine.info()
    except Exception:
        doc["engine"] = {"error": traceback.format_exc()}
    save("initialized")
    deadline, failed = job.get("deadline"), False
    for s in scenarios:
        res = doc["scenarios"][s.name] = {"scenario": dataclasses.asdict(s), "warmups": [], "repeats": []}
        try:
            for w in range(job["warmups"]):
                if deadline is not None and deadline - clock() < s.estimate_s * (1 + w):
                    res["skipped"] = f"budget: {deadline - clock():.0f} s left before the deadline"
                    break
                t1 = clock()
                res["warmups"].append(engine.run(s, s.seed + 1 + w))
                _timed(res["warmups"][-1], t1, clock())
                save()
            if "skipped" in res:
                continue
            per_run = max(r["run_s"] for r in res["warmups"])
            if s.kind == "profile":
                res["profile"] = engine.profile(s, s.seed)
                save()
                continue
            for _ in range(job["repeats"]):
                if deadline is not None and deadline - clock() < 1.2 * per_run:
                    res["stopped"] = (f"budget: {deadline - clock():.0f} s left, a run takes {per_run:.0f} s: "
                                      f"{len(res['repeats'])} of {job['repeats']} repeats")
                    break
                t1 = clock()
                res["repeats"].append(engine.run(s, s.seed))
                _timed(res["repeats"][-1], t1, clock())
                per_run = max(r["run_s"] for r in res["repeats"])  # a warm-up also compiles: slower
                save()
        except Exception:
            res["error"] = traceback.format_exc()
            failed = True
            save()
    save("failed" if failed else "done")
    return 4 if failed else 0


def worker_job(a, model: str, mode: str, vllm_invariant, scenarios: list, deadline: float | None, *,
               gpu: bool = True) -> dict:
    return {"model": model, "mode": mode, "label": label(mode, vllm_invariant), "vllm_invariant": vllm_invariant,
            "attention_backend": attention_backend(mode, gpu=gpu) or "vLLM's choice",
            "flags": job_flags(a, model, mode, scenarios, gpu),
            "scenarios": [dataclasses.asdict(s) for s in scenarios], "warmups": a.warmups, "repeats": a.repeats,
            "deadline": deadline}


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

def rows_of(model: str, mode: str, vllm_invariant, res: dict, *, kind: str, runner: str, engine=None,
            attention=None) -> list:
    """The JSON rows of one scenario's result ``res`` (``warmups``, ``repeats`` or ``profile``,
    or why it did not run)."""
    common = {"model": model, "impl": label(mode, vllm_invariant), "mode": mode, "vllm_invariant": vllm_invariant,
              "attention_backend": attention, "scenario": res["scenario"]["name"],
              "kind": kind, "runner": runner, "scenario_spec": res["scenario"]}
    if engine is not None:
        common["engine"] = engine
    if "profile" in res:
        return [{"op": "vllm_profile", **common, **res["profile"]}]
    row = {"op": "vllm_bench", **common, "warmups": res.get("warmups", []), "repeats": res.get("repeats", [])}
    for k in ("skipped", "stopped", "error"):
        if res.get(k):
            row[k] = res[k]
    if row["repeats"]:
        row["measures"] = {m: stats([r[m] for r in row["repeats"]]) for m, _ in MEASURES[kind]
                           if all(r.get(m) is not None and math.isfinite(r[m]) for r in row["repeats"])}
    return [row]


def with_setting(rows: list, max_capture) -> list:
    """``rows`` of a run with ``--max-cudagraph-capture-size`` (``max_capture``, None: vLLM's own
    limit) name the limit in their scenario (``"tm, graphs to 1024"``) and in
    ``max_cudagraph_capture_size``: rows of another engine setting are never compared with them,
    nor replaced by them in a join."""
    if max_capture is None:
        return rows
    return [dict(r, scenario=f"{r['scenario']}, graphs to {max_capture}", max_cudagraph_capture_size=max_capture)
            for r in rows]


def part_rows(doc: dict) -> list:
    """The rows of a worker's document."""
    rows = []
    for res in (doc.get("scenarios") or {}).values():
        rows += rows_of(doc["model"], doc["mode"], doc["vllm_invariant"], res, kind=res["scenario"]["kind"],
                        runner=doc.get("runner"), engine=doc.get("engine"), attention=doc.get("attention_backend"))
    return rows


def table(rows: list, comps: list) -> str:
    """The printed summary: per (model, scenario), each label's headline median, spread and
    repeats, and its comparison with default (a ratio, or ``unresolved`` with both numbers)."""
    lines = []
    by = {}
    for r in rows:
        if r.get("op") == "vllm_bench":
            by.setdefault((r["model"], r["scenario"]), []).append(r)
    for (model, scen), rs in sorted(by.items()):
        measure = MEASURES[rs[0]["kind"]][0][0]
        lines.append(f"{model} / {scen} ({measure}, median of repeats; spread = max - min):")
        for r in rs:
            st = (r.get("measures") or {}).get(measure)
            head = (f"{_fmt(st['median'])} (spread {_fmt(st['spread'])}, n={st['n']})" if st else
                    (r.get("skipped") or r.get("stopped") or ("error" if r.get("error") else "no repeats")))
            c = next((c for c in comps if c["model"] == model and c["scenario"] == scen and c["impl"] == r["impl"]
                      and c["against"] == "default" and c["measure"] == measure), None)
            lines.append(f"  {r['impl']:<22} {head}" + (f"   vs default: {c['text']}" if c else "")
                         + _compiles_note(r))
    return "\n".join(lines)


def _compiles_note(row: dict) -> str:
    """``"; Triton compiles in timed runs: N (S s)"`` where the row's timed runs logged any."""
    jits = [r["jit"] for r in row.get("repeats") or [] if r.get("jit")]
    n = sum(j["compiles"] for j in jits)
    return f"; Triton compiles in timed runs: {n} ({sum(j['seconds'] for j in jits):.1f} s)" if n else ""


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def plan(a) -> list:
    """The jobs in order: per model, the offline worker of each mode variant, then the online
    job of each, then the profile worker of each; with an estimate of their seconds."""
    sc = scenarios_of(a)
    groups = (("offline" if a.offline_runner == "inprocess" else "offline-cli", [s for s in sc if s.kind == "offline"]),
              ("online", [s for s in sc if s.kind == "online"]), ("profile", [s for s in sc if s.kind == "profile"]))
    jobs = []
    for m in a.models:
        size = {"dense": 1.0, "moe": 1.0, "tiny": 0.05}[m]
        for kind, scs in groups:
            if not scs:
                continue
            runs = a.warmups + (1 if kind == "profile" else a.repeats)
            for mode, on in variants(a.modes, a.vllm_mode_under_kit):
                starts = runs * len(scs) if kind == "offline-cli" else 1
                est = starts * MIN_START_S[m] + sum(runs * s.estimate_s * size for s in scs)
                jobs.append({"model": m, "mode": mode, "vllm_invariant": on, "label": label(mode, on), "kind": kind,
                             "scenarios": [s.name for s in scs], "estimate_s": round(est)})
    return jobs


def job_name(model: str, lab: str, kind: str) -> str:
    """A job's name in file names: ``<model>__<label>__<kind>`` (``+`` and spaces as ``_``)."""
    return f"{model}__{lab.replace(' ', '_').replace('+', '_')}__{kind}"


def _plugin_report(folder) -> dict | None:
    """The kit plugin's merged report (:func:`batch_invariance_kit.vllm.plugin.read_report`):
    its replacements and call counters (calls outside CUDA-graph replays), or ``None``."""
    from .plugin import read_report

    return read_report(folder) if Path(folder).is_dir() else None


def _deps_note() -> dict:
    return {"vllm_bench_serve": has_bench_serve()}


def run_online_job(a, job: dict, scenarios: list, deadline: float, out: Path, *, gpu: bool, launch_server=None,
                   run_client=None, clock=time.time) -> dict:
    """Start ``vllm serve`` in the job's mode, then per online scenario the warm-ups and repeats
    of ``vllm bench serve`` (or the kit's client); stop the server.  Returns the part document."""
    from .online import Server, free_port

    folder = model_folder(a, job["model"])
    doc = {k: job[k] for k in ("model", "mode", "label", "vllm_invariant")}
    doc.update(scenarios={}, status="starting",
               attention_backend=attention_backend(job["mode"], gpu=gpu) or "vLLM's choice")
    flags = job_flags(a, job["model"], job["mode"], scenarios, gpu)
    env = R.mode_env(job["mode"], gpu=gpu, vllm_invariant=job["vllm_invariant"])
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's own process layout, as `vllm serve` runs
    if job["mode"] in KIT_MODES:
        env["KIT_PLUGIN_REPORT"] = str(out / "logs" / f"plugin-{job_name(job['model'], job['label'], 'online')}")
    client_env = R.mode_env("default", gpu=gpu)  # the client loads vLLM's plugins too: the kit's stays off
    port = free_port()
    cmd = serve_command(folder, port, flags)
    log_dir = out / "logs"
    use_cli = has_bench_serve() if run_client is None else False
    doc["runner"] = "vllm bench serve" if use_cli else (
        "the kit's client (vllm bench serve needs aiohttp, absent here)" if run_client is None else "stand-in client")
    srv = (launch_server or (lambda c, e, log: Server(c, e, log)))(cmd, env, log_dir / f"server-{job['model']}-"
                                                                              f"{job['label'].replace(' ', '_')}.log")
    vocab = model_config(job["model"], a.moe_layers).vocab_size
    t0 = clock()
    try:
        with srv:
            doc["server_ready_s"] = srv.wait_ready(max(deadline - clock(), 1.0))
            for s in scenarios:
                res = doc["scenarios"][s.name] = {"scenario": dataclasses.asdict(s), "warmups": [], "repeats": []}
                per_run = s.estimate_s
                for i in range(a.warmups + a.repeats):
                    if deadline - clock() < 1.2 * per_run:
                        res["stopped"] = f"budget: {deadline - clock():.0f} s left, a run takes {per_run:.0f} s"
                        break
                    seed = s.seed + 1 + i if i < a.warmups else s.seed
                    t1 = clock()
                    try:
                        if run_client is not None:
                            m = online_measures(run_client(srv.base_url, s, seed))
                        elif use_cli:
                            try:
                                m = _bench_serve(srv.base_url, folder, s, seed, client_env, log_dir, deadline - clock())
                            except BenchServeUnavailable as e:
                                if any(r["warmups"] or r["repeats"] for r in doc["scenarios"].values()):
                                    raise  # no runner changes after a measurement
                                use_cli = False
                                doc["runner"] = f"the kit's client (vllm bench serve could not start: {e})"
                        if run_client is None and not use_cli:
                            m = online_measures(serve_client(srv.base_url, s, vocab, seed,
                                                             timeout_s=max(deadline - clock(), 1.0)))
                    except Exception:
                        res["error"] = traceback.format_exc()
                        break
                    m["run_s"] = clock() - t1
                    per_run = max(per_run if i else 0.0, m["run_s"])
                    res["warmups" if i < a.warmups else "repeats"].append(m)
        doc["status"] = "failed" if any(r.get("error") for r in doc["scenarios"].values()) else "done"
    except Exception:
        doc["status"] = "failed"
        doc["error"] = traceback.format_exc()
    doc["seconds"] = clock() - t0
    doc["server_command"] = " ".join(["python", "-m", cmd[2]] + [x if not x.startswith("/") else "<dir>"
                                                                 for x in cmd[3:]])
    return doc


class BenchServeUnavailable(RuntimeError):
    """``vllm bench serve`` stopped on an import (a module its client needs is not installed)."""


def _bench_serve(base_url, folder, s, seed, env, log_dir, timeout) -> dict:
    with tempfile.TemporaryDirectory(prefix="kit-bench-serve-") as d:
        cmd = serve_bench_command(base_url, folder, s, seed, d, "result.json")
        r = R.run_process(cmd, env, max(timeout, 1.0),
                          Path(log_dir) / f"bench-serve-{seed}.log")
        path = Path(d) / "result.json"
        if r["rc"] != 0 and not path.exists():
            m = re.findall(r"(ModuleNotFoundError|ImportError): (.*)", r["log_tail"])
            if m:
                raise BenchServeUnavailable(": ".join(m[-1]))
        if r["rc"] != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve failed (rc={r['rc']}, timed_out={r['timed_out']}):\n{r['log_tail']}")
        return online_measures(json.loads(path.read_text()))


def run_cli_job(a, job: dict, scenarios: list, deadline: float, out: Path, *, gpu: bool, launch=None,
                clock=time.time) -> dict:
    """``vllm bench throughput`` once per warm-up and repeat of each offline scenario (an engine
    start each)."""
    launch = launch or (lambda cmd, env, timeout, log: R.run_process(cmd, env, timeout, log))
    flags = job_flags(a, job["model"], job["mode"], scenarios, gpu)
    env = R.mode_env(job["mode"], gpu=gpu, vllm_invariant=job["vllm_invariant"])
    doc = {k: job[k] for k in ("model", "mode", "label", "vllm_invariant")}
    doc.update(scenarios={}, status="done", runner="vllm bench throughput (one process per run)",
               attention_backend=attention_backend(job["mode"], gpu=gpu) or "vLLM's choice")
    for s in scenarios:
        res = doc["scenarios"][s.name] = {"scenario": dataclasses.asdict(s), "warmups": [], "repeats": []}
        per_run = MIN_START_S[job["model"]] + s.estimate_s
        for i in range(a.warmups + a.repeats):
            if deadline - clock() < per_run:
                res["stopped"] = f"budget: {deadline - clock():.0f} s left, a run takes {per_run:.0f} s"
                break
            seed = s.seed + 1 + i if i < a.warmups else s.seed
            with tempfile.TemporaryDirectory(prefix="kit-bench-") as d:
                t1 = clock()
                r = launch(throughput_cli_command(flags, s, seed, Path(d) / "out.json"), env, deadline - clock(),
                           out / "logs" / f"throughput-{job_name(job['model'], job['label'], s.name)}-{i}.log")
                try:
                    m = parse_throughput_cli(r.get("log_tail", ""), json.loads((Path(d) / "out.json").read_text()))
                except Exception as e:
                    res["error"] = f"run {i}: rc={r.get('rc')}: {e}\n{r.get('log_tail', '')[-2000:]}"
                    doc["status"] = "failed"
                    break
            m["run_s"] = clock() - t1
            per_run = max(per_run, m["run_s"])
            res["warmups" if i < a.warmups else "repeats"].append(m)
    return doc


def run_driver(a, *, launch=None, clock=time.time, save=None, gpu=None, online_job=None, cli_job=None) -> dict:
    """Build the models, run the jobs of :func:`plan` within ``a.budget_s``, write the JSON after
    every job.  ``launch(kind, cmd, env, timeout, log) -> dict`` runs a process (default
    :func:`batch_invariance_kit.vllm.runner.run_process`); ``online_job``/``cli_job`` replace
    :func:`run_online_job`/:func:`run_cli_job` (tests)."""
    import torch

    if gpu is None:
        gpu = torch.cuda.is_available()
    launch = launch or (lambda kind, cmd, env, timeout, log: R.run_process(cmd, env, timeout, log))
    out = Path(a.out)
    if save is None:
        from ..report import results

        def save(rows, checks, extra):
            return results.save(a.result_name, rows, checks, folder=out, extra=extra)

    t_start = clock()
    deadline = t_start + a.budget_s
    jobs = plan(a)
    sc = {s.name: s for s in scenarios_of(a)}
    extra = {"plan": {"models": a.models, "modes": a.modes, "vllm_mode_under_kit": a.vllm_mode_under_kit,
                      "scenarios": {n: dataclasses.asdict(s) for n, s in sc.items()}, "repeats": a.repeats,
                      "warmups": a.warmups, "weights": a.weights, "moe_layers": a.moe_layers,
                      "offline_runner": a.offline_runner, "budget_s": a.budget_s, "eager": a.eager,
                      "max_cudagraph_capture_size": a.max_cudagraph_capture_size,
                      "gpu_memory_utilization": a.gpu_memory_utilization, **_deps_note()},
             "jobs": jobs}
    rows, job_checks = [], []

    def write():
        extra["comparisons"] = comparisons(rows)
        extra["elapsed_s"] = clock() - t_start
        save(rows, job_checks + goal_checks(rows), extra)

    me = [sys.executable, "-m", "batch_invariance_kit.vllm.bench"]
    build = launch("build", me + ["--build", "--models", ",".join(a.models), "--model-dir", a.model_dir,
                                  "--moe-layers", str(a.moe_layers), "--weights", a.weights],
                   os.environ.copy(), max(deadline - clock(), 1.0), out / "logs" / "build.log")
    extra["build"] = {k: build.get(k) for k in ("rc", "seconds", "timed_out")}
    if build.get("rc") != 0:
        extra["build"]["log_tail"] = build.get("log_tail")
        for j in jobs:
            j.update(status="skipped", skipped="the model build failed (see build.log_tail)")
        job_checks.append({"name": "the models were built", "passed": False})
        write()
        return extra
    write()
    with tempfile.TemporaryDirectory(prefix="kit-bench-jobs-") as jobs_dir:
        for j in jobs:
            left = deadline - clock()
            if left < MIN_START_S[j["model"]]:
                j.update(status="skipped",
                         skipped=f"budget: {left:.0f} s left < {MIN_START_S[j['model']]:.0f} s to start")
                job_checks.append({"name": f"{j['model']} {j['label']} {j['kind']}: ran", "passed": False,
                                   "reason": j["skipped"]})
                write()
                continue
            scs = [sc[n] for n in j["scenarios"]]
            name = job_name(j["model"], j["label"], j["kind"])
            if j["kind"] in ("offline", "profile"):
                part, job_path = out / "parts" / f"{name}.json", Path(jobs_dir) / f"{name}.json"
                if part.exists():
                    part.unlink()
                R.write_json(job_path, worker_job(a, j["model"], j["mode"], j["vllm_invariant"], scs, deadline - 5.0,
                                                  gpu=gpu))
                env = R.mode_env(j["mode"], gpu=gpu, vllm_invariant=j["vllm_invariant"])
                if j["kind"] == "offline":  # vLLM's own process layout, as `vllm bench throughput` runs
                    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
                    # the worker reads the model's classes through LLM.apply_model, whose function
                    # reaches the engine's process only by pickle
                    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
                if j["mode"] in KIT_MODES:  # every process of the engine reports the kit's replacements
                    env["KIT_PLUGIN_REPORT"] = str(out / "logs" / f"plugin-{name}")
                # every process of the engine logs its Triton compiles; each run records its own
                env[jit_log.ENV] = str(out / "logs" / f"jit-{name}.jsonl")
                r = launch("worker", me + ["--worker", str(job_path), "--part", str(part)], env, left,
                           out / "logs" / f"{name}.log")
                j.update(status="ran", **{k: r.get(k) for k in ("rc", "seconds", "timed_out")})
                try:
                    doc = json.loads(part.read_text())
                except Exception:
                    doc = {"status": "no part file", "scenarios": {}}
                if r.get("rc") != 0:
                    j["log_tail"] = r.get("log_tail")
            elif j["kind"] == "offline-cli":
                doc = (cli_job or run_cli_job)(a, j, scs, deadline, out, gpu=gpu)
                j.update(status="ran")
            else:
                doc = (online_job or run_online_job)(a, j, scs, deadline, out, gpu=gpu)
                j.update(status="ran")
            j["worker_status"] = doc.get("status")
            j["plugin"] = _plugin_report(out / "logs" / f"plugin-{name}") if j["mode"] in KIT_MODES else None
            for k in ("runner", "init_s", "server_ready_s", "mode_env", "engine_env", "errors", "error"):
                if doc.get(k):
                    j[k] = doc[k]
            rows.extend(with_setting(part_rows(doc), a.max_cudagraph_capture_size) if doc.get("scenarios") else [])
            ok = doc.get("status") == "done"
            job_checks.append({"name": f"{j['model']} {j['label']} {j['kind']}: ran every scenario", "passed": ok,
                               **({} if ok else {"reason": doc.get("status")})})
            write()
    return extra


# ---------------------------------------------------------------------------------------------
# Merge, dry run, main
# ---------------------------------------------------------------------------------------------

def _row_source(row: dict, sources: list) -> int:
    """The index of a joined file's row's run: its ``source``, or for a row joined without one, the
    last run whose plan holds the row's model and scenario and whose jobs ran its label (later
    runs replace earlier ones when joined)."""
    if row.get("source") is not None:
        return row["source"]
    for k in reversed(range(len(sources))):
        plan, jobs = sources[k].get("plan") or {}, sources[k].get("jobs") or []
        if (row.get("model") in plan.get("models", ()) and row.get("scenario") in plan.get("scenarios", {})
                and any(j.get("label") == row.get("impl") and j.get("model") == row.get("model")
                        and j.get("status") == "ran" for j in jobs)):
            return k
    raise ValueError(f"--merge: no run of the joined file holds the row {row.get('model')} {row.get('impl')} "
                     f"{row.get('scenario')}")


def merge(paths: list, out, *, name: str = "vllm_bench") -> Path:
    """Join result files (rows of later files replace the rows of earlier ones with the same
    model, label, scenario and op) and recompute the comparisons and goals.  A file that is
    itself a join contributes its sources (each run's provenance), not the join's.  Each row
    keeps ``source``, the index of its run in the joined file's ``sources``."""
    from ..report import results

    rows, sources, checks = {}, [], []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if not {"provenance", "rows"} <= set(doc):
            raise ValueError(f"--merge: {p} is not a result file (no provenance/rows)")
        first = len(sources)
        if doc.get("sources"):  # a joined file: its own sources, each with the provenance of its run
            sources += doc["sources"]
        else:
            sources.append({"file": results.portable(str(Path(p).resolve())), "provenance": doc["provenance"],
                            "plan": doc.get("plan"), "jobs": doc.get("jobs")})
        for r in doc["rows"]:  # each row names its run: an index into the joined file's sources
            src = first + _row_source(r, doc["sources"]) if doc.get("sources") else first
            rows[(r.get("op"), r.get("model"), r.get("impl"), r.get("scenario"))] = dict(r, source=src)
        checks += [c for c in doc.get("checks", []) if not c.get("goal")]
    rows = list(rows.values())
    return results.save(name, rows, checks + goal_checks(rows), folder=Path(out),
                        extra={"sources": sources, "comparisons": comparisons(rows)})


def main(argv=None) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.worker is not None:
        return run_worker(json.loads(Path(a.worker).read_text()), a.part)
    if a.merge is not None:
        path = merge(a.merge, a.out, name=a.result_name)
        doc = json.loads(path.read_text())
        print(table(doc["rows"], doc["comparisons"]))
        print(f"wrote {path}")
        return 0
    if a.build:
        return run_build(a)
    if a.dry_run:
        jobs = plan(a)
        build = {m: round(build_estimate_s(m, a.moe_layers, a.weights)) for m in a.models}
        print(json.dumps({"jobs": jobs, "build_estimate_s": build,
                          "estimate_s": sum(j["estimate_s"] for j in jobs) + sum(build.values()),
                          "budget_s": a.budget_s, "max_model_len": max_model_len(scenarios_of(a)),
                          "scenarios": {s.name: dataclasses.asdict(s) for s in scenarios_of(a)},
                          "env": {label(m, on): {k: v for k, v in R.mode_env(m, {}, gpu=True, vllm_invariant=on).items()
                                                 if k.startswith(("KIT_", "VLLM_"))}
                                  for m, on in variants(a.modes, a.vllm_mode_under_kit)}}, indent=1))
        return 0
    extra = run_driver(a)
    for j in extra["jobs"]:
        print(f"{j['model']:>5} {j['label']:<22} {j['kind']:<11} {j.get('status')}: {j.get('worker_status') or ''} "
              f"{j.get('skipped') or ''}", flush=True)
    doc = json.loads((Path(a.out) / f"{a.result_name}.json").read_text())
    print(table(doc["rows"], doc.get("comparisons", [])))
    if any(r.get("op") == "vllm_profile" for r in doc["rows"]):
        from .step_profile import profile_table

        print(profile_table(doc["rows"]))
    print(f"wrote {Path(a.out) / (a.result_name + '.json')}", flush=True)
    return 0 if all(c["passed"] for c in doc["checks"] if not c.get("goal") and not c.get("informational")) else 1


if __name__ == "__main__":
    sys.exit(main())
