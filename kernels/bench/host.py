"""The host path on the CPU: what a step costs before any kernel runs.

:func:`plan_times` times the attention planner (:func:`batch_invariance_kit.ops.attention.make_plan`)
on the steps a serving engine issues, from host ``int32`` tensors as vLLM's metadata builder
hands them over, at the production head layout (32 q heads over 8 kv heads of dim 128) and
the shipped schedule (:data:`~batch_invariance_kit.ops.attention.DEFAULT_CONFIG`), with the
plan's tensors on the CPU:

* decode of 256 sequences with contexts of 1 to 32k keys, exact and padded to a fixed size
  (``decode_capacity``, ``max_seq_len``: the plan a CUDA graph replays), and with the split-KV
  variant;
* one 16k-token prefill;
* a mixed step of 64 sequences with 8192 new tokens: 48 decodes and 16 prefill chunks starting
  at random positions.

Each figure is the median of many timed calls (``time.perf_counter`` around each call) beside
its target from the design ("The host path").  Speed is measured here, never asserted in a test.

    python -m batch_invariance_kit.bench.host
"""
from __future__ import annotations

import statistics
import time

import torch

from ..ops import attention as A

HQ, HKV, D = 32, 8, 128
MAX_CONTEXT = 32768


def _step(q_lens: list, contexts: list) -> tuple:
    """``(seq_lens, query_start_loc)`` int32 CPU tensors of a step whose sequence ``s`` gets
    ``q_lens[s]`` new tokens after ``contexts[s]`` cached ones."""
    ql = torch.tensor(q_lens, dtype=torch.int32)
    lens = ql + torch.tensor(contexts, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ql.cumsum(0).to(torch.int32)])
    return lens, qsl


def plan_steps(seed: int = 0) -> list:
    """The timed steps: ``(name, seq_lens, query_start_loc, make_plan keywords, target_us)``."""
    g = torch.Generator().manual_seed(seed)
    ctx = lambda n: torch.randint(0, MAX_CONTEXT, (n,), generator=g).tolist()  # noqa: E731
    dec = _step([1] * 256, ctx(256))
    chunks = 16
    per_chunk = (8192 - 48) // chunks
    mixed = _step([1] * 48 + [per_chunk] * chunks, ctx(48) + torch.randint(0, MAX_CONTEXT - per_chunk, (chunks,),
                                                                          generator=g).tolist())
    padded = dict(decode_capacity=256, max_seq_len=MAX_CONTEXT + 1)
    return [
        ("decode, 256 sequences", *dec, {}, 50.0),
        ("decode, 256 sequences, padded", *dec, padded, 50.0),
        ("decode, 256 sequences, variant", *dec, {"impl": "variant"}, 50.0),
        ("prefill, 16384 tokens", *_step([16384], [0]), {}, 200.0),
        ("mixed, 64 sequences, 8192 tokens", *mixed, {}, 200.0),
    ]


def _median_us(fn, reps: int, budget_s: float) -> tuple:
    """Median microseconds of timed calls of ``fn`` (one warm-up call; at most ``reps`` calls,
    fewer when they pass ``budget_s``, at least 3) and the number of calls timed."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(times)


def plan_times(reps: int = 2000, budget_s: float = 0.5, seed: int = 0) -> list:
    """One row per step of :func:`plan_steps`: ``{"part", "case", "median_us", "target_us",
    "calls"}`` for :func:`~batch_invariance_kit.ops.attention.make_plan` on the CPU."""
    cfg = A.AttnConfig()
    rows = []
    for name, lens, qsl, kw, target in plan_steps(seed):
        fn = lambda: A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, config=cfg,  # noqa: E731
                                 device="cpu", **kw)
        us, n = _median_us(fn, reps, budget_s)
        rows.append({"part": "attention plan", "case": name, "median_us": us, "target_us": target, "calls": n})
    return rows


def table(rows: list) -> str:
    """Rows of :func:`plan_times` (or any rows with those keys) as a text table."""
    head = ("part", "case", "median µs", "target µs", "calls")
    body = [(r["part"], r["case"], f"{r['median_us']:.1f}",
             "" if r.get("target_us") is None else f"{r['target_us']:.0f}", str(r["calls"])) for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda x: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in body])


def main() -> None:
    print(f"host path on the CPU (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(table(plan_times()))


if __name__ == "__main__":
    main()
