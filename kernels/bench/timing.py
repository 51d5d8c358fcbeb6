"""Benchmark utilities: median of many timed runs with CUDA events, and the copy ceiling.

Speed is measured here and stored (``batch_invariance_kit.report.results``), never asserted in a test.
"""
from __future__ import annotations

import statistics

import torch


def _capture(seq):
    """A CUDA graph of the calls ``seq`` in order (after one warm pass on a side stream), replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in seq:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in seq:
            c()
    g.replay()
    return g


def median_us(fn, *, warmup: int = 10, reps: int = 100, rotate: list | None = None, graph: bool = False,
              graph_calls: int = 20, budget_s: float = 1.5, calls_per_graph: int | None = None) -> dict:
    """Median (and quartiles) of timed calls of ``fn`` in microseconds, CUDA events.

    ``rotate``: a list of argument tuples; call ``fn(*rotate[i % len(rotate)])`` so that
    inputs larger than L2 in total are not served from cache.  ``graph=True`` captures
    ``graph_calls`` consecutive calls (cycling through ``rotate``) in one CUDA graph, times
    ``reps`` replays and divides by ``graph_calls``: launch overhead leaves the numbers, the
    same way for every implementation compared.  Long kernels get fewer calls per graph and
    fewer repetitions so that one measurement takes about ``budget_s`` (at least 10 reps).
    ``calls_per_graph``: capture exactly that many calls per graph instead (so that two
    implementations compared in one cell are timed the same way even when only one of them
    crosses the 100 µs estimate)."""
    if calls_per_graph is not None and (isinstance(calls_per_graph, bool) or not isinstance(calls_per_graph, int)
                                        or calls_per_graph < 1):
        raise ValueError(f"calls_per_graph must be a positive int or None, got {calls_per_graph!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("median_us needs a CUDA GPU")
    args = rotate if rotate else [()]
    calls = [(lambda a=a: fn(*a)) for a in args]
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for c in calls:
        c()
    e1.record()
    torch.cuda.synchronize()
    est_us = max(e0.elapsed_time(e1) * 1000.0 / len(calls), 1.0)
    if graph:  # the estimate from a one-call graph: eager timing of a host-heavy launch would
        # count the host's launch time and push a short kernel over the 100 µs line
        g1 = _capture([calls[0]])
        e0.record()
        for _ in range(3):
            g1.replay()
        e1.record()
        torch.cuda.synchronize()
        est_us = max(e0.elapsed_time(e1) * 1000.0 / 3, 1.0)
        del g1
    per = 1
    if graph:
        per = len(calls) if est_us > 100.0 else max(graph_calls, len(calls))
        if calls_per_graph is not None:
            per = calls_per_graph
    reps = int(max(10, min(reps, budget_s * 1e6 / (est_us * per))))
    if graph:
        g = _capture([calls[i % len(calls)] for i in range(per)])
        calls = [g.replay]
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1000.0 / per for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=4)
    return {"median_us": statistics.median(times), "p25_us": q[0], "p75_us": q[2], "reps": reps,
            "calls_per_timing": per}


def median_us_graph_or_plain(fn, *, graph: bool = True, **kw) -> tuple:
    """``(timing, used_graph)``: :func:`median_us` with CUDA graphs when ``graph``, and plain
    launches when the capture fails (``calls_per_graph`` then does not apply)."""
    if graph:
        try:
            return median_us(fn, graph=True, **kw), True
        except Exception:  # a capture that fails: time plain launches instead
            pass
    kw.pop("calls_per_graph", None)
    return median_us(fn, **kw), False


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    n = nbytes // 2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = median_us(lambda: b.copy_(a), warmup=5, reps=30)["median_us"]
    return 2 * n / (t * 1e-6) / 1e9


def rotating_sets(make, total_bytes_each: int, min_sets: int = 2, l2_bytes: int = 60 << 20) -> list:
    """Enough argument sets from ``make()`` that together they exceed 3x the L2 cache."""
    k = max(min_sets, -(-3 * l2_bytes // max(1, total_bytes_each)))
    return [make() for _ in range(min(k, 64))]
