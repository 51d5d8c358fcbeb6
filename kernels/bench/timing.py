"""Timing on a CUDA GPU: per-call medians over rotated inputs, plain or from CUDA-graph replays.

Speed is measured here and stored (``batch_invariance_kit.report.results``), never asserted in a test.

Plain launches are timed by ``triton.testing.do_bench`` (CUDA events, quantiles; it also clears
the L2 cache before each call).  The CUDA-graph path captures a *fixed* number of consecutive
calls in one graph and times its replays: ``triton.testing.do_bench_cudagraph`` sizes its graph
from its own time estimate, so two implementations compared in one cell could be timed with
different numbers of calls per graph; the kit fixes that number per cell.  Both paths cycle
through ``rotate``: enough argument sets that together they exceed the L2 cache, so that
weights are read from HBM as in a model.
"""
from __future__ import annotations

import itertools
import statistics

import torch


def _calls(fn, rotate) -> list:
    """One zero-argument callable per argument set of ``rotate`` (one without it)."""
    return [(lambda a=a: fn(*a)) for a in (rotate if rotate else [()])]


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


def _elapsed_us(run, n: int) -> float:
    """Mean microseconds per ``run()`` over ``n`` back-to-back runs (CUDA events)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        run()
    e1.record()
    torch.cuda.synchronize()
    return max(e0.elapsed_time(e1) * 1000.0 / n, 1.0)


def median_us(fn, *, warmup: int = 10, reps: int = 100, rotate: list | None = None, graph: bool = False,
              graph_calls: int = 20, budget_s: float = 1.5, calls_per_graph: int | None = None) -> dict:
    """Median (and quartiles) of timed calls of ``fn`` in microseconds.

    ``rotate``: a list of argument tuples; call ``fn(*rotate[i % len(rotate)])`` so that
    inputs larger than L2 in total are not served from cache.  Plain launches
    (``graph=False``): ``triton.testing.do_bench`` for about ``reps`` calls (at most
    ``budget_s``).  ``graph=True`` captures consecutive calls (cycling through ``rotate``) in one
    CUDA graph, times ``reps`` replays and divides by the calls per graph: launch overhead
    leaves the numbers, the same way for every implementation compared.  Calls per graph:
    ``calls_per_graph`` when given; else all argument sets for a call estimated over 100 µs,
    and at least ``graph_calls`` for a shorter one.  Long calls get fewer replays so that one
    measurement takes about ``budget_s`` (at least 10)."""
    if calls_per_graph is not None and (isinstance(calls_per_graph, bool) or not isinstance(calls_per_graph, int)
                                        or calls_per_graph < 1):
        raise ValueError(f"calls_per_graph must be a positive int or None, got {calls_per_graph!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("median_us needs a CUDA GPU")
    calls = _calls(fn, rotate)
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    cycle = itertools.cycle(calls)
    est_us = _elapsed_us(lambda: next(cycle)(), len(calls))
    if not graph:
        import triton.testing

        reps = int(max(10, min(reps, budget_s * 1e6 / est_us)))
        med, p25, p75 = triton.testing.do_bench(lambda: next(cycle)(), warmup=max(1e-3 * est_us, 1.0),
                                                rep=reps * est_us * 1e-3, quantiles=[0.5, 0.25, 0.75])
        return {"median_us": med * 1000.0, "p25_us": p25 * 1000.0, "p75_us": p75 * 1000.0, "reps": reps,
                "calls_per_timing": 1}
    # the estimate from a one-call graph: eager timing of a host-heavy launch would count the
    # host's launch time and push a short kernel over the 100 µs line
    g1 = _capture([calls[0]])
    est_us = _elapsed_us(g1.replay, 3)
    del g1
    per = calls_per_graph if calls_per_graph is not None else \
        len(calls) if est_us > 100.0 else max(graph_calls, len(calls))
    reps = int(max(10, min(reps, budget_s * 1e6 / (est_us * per))))
    g = _capture([calls[i % len(calls)] for i in range(per)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
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
