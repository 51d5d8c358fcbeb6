"""Chapter 3's measurements: emulator vs CUDA bits, the 255-vs-300-token test of vLLM's RMSNorm
fix for every op, rows flipped against the batch size, the benchmark against ``torch.compile``,
and the CPU check of both backends.  Each function returns ``(rows, checks)``;
:mod:`.parts` names them."""
from __future__ import annotations

import torch

from ..ops import rms_norm_family as fam
from .timing import copy_bandwidth_gbs, median_us, rotating_sets
from ..checks import DTYPES
from ..report.cost import is_invariant
from ..report.results import goal



def crosscheck(quick: bool) -> tuple:
    from ..ops.rms_norm_cuda import gpu_crosscheck

    rows = gpu_crosscheck(rows=1000 if not quick else 200)
    for r in rows:
        r.setdefault("impl", "cuda-vs-emulator")
    total = sum(r["rows"] for r in rows)
    bad = sum(r["rows_differing"] for r in rows)
    checks = [{"name": "emulator predicts the CUDA kernels' output bits exactly", "passed": bad == 0,
               "cases": len(rows), "rows_compared": total, "rows_differing": bad}]
    return rows, checks


def invariance(quick: bool) -> tuple:
    rows, checks = [], []
    seeds = range(4) if quick else range(16)
    for backend in fam.BACKENDS:
        for op in fam.OPS:
            for dt in ("bfloat16", "float16", "float32"):
                impls = ("invariant", "variant") + (("invariant256",) if backend == "cuda" else ())
                for impl in impls:
                    r = fam.seed_method(backend, op, impl, DTYPES[dt], hidden=4096, seeds=seeds)
                    rows.append(r)
                    print(f"  {backend:<6} {op:<36} {dt:<8} {impl:<9} rows differing {r['rows_differing']}")
    for backend in fam.BACKENDS:
        for op in fam.OPS:
            inv = [r for r in rows if r["backend"] == backend and r["op"] == op and r["impl"].startswith("invariant")]
            var = [r for r in rows if r["backend"] == backend and r["op"] == op and r["impl"] == "variant"]
            checks.append({"name": f"{backend} {op} invariant: first 255 rows bit-identical in 255 vs 300 tokens",
                           "passed": all(r["rows_differing"] == 0 for r in inv),
                           "rows_compared": sum(r["rows_compared"] for r in inv)})
            checks.append({"name": f"{backend} {op} variant: the same check finds a difference (some dtype)",
                           "passed": any(r["rows_differing"] > 0 for r in var),
                           "rows_differing_by_dtype": {r["dtype"]: r["rows_differing"] for r in var}})
    return rows, checks


def flips(quick: bool) -> tuple:
    sizes = [1, 8, 32, 64, 128, 192, 240, 255, 256, 257, 300, 384, 512, 1024, 2048]
    rows = []
    for backend in fam.BACKENDS:
        for dt in ("bfloat16", "float32"):
            for impl in ("variant", "invariant"):
                for r in fam.flips_vs_batch(backend, "rms_norm", impl, DTYPES[dt], 4096, sizes,
                                            rows_alone=256 if quick else 1024):
                    rows.append({"backend": backend, "op": "rms_norm", "impl": impl, "dtype": dt, "hidden": 4096, **r})
    checks = [{"name": "invariant rms_norm: no row differs from the row alone at any batch size",
               "passed": all(r["rows_differing"] == 0 for r in rows if r["impl"] == "invariant")}]
    return rows, checks


def _torch_rms_norm(x, w, eps: float = 1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _torch_fused_add(x, r, w, eps: float = 1e-6):
    z = x + r
    return _torch_rms_norm(z, w, eps), z


#: The hidden sizes of :func:`bench_hidden_sizes` (Llama / Qwen / DeepSeek-style models; hidden
#: 4096 is :func:`bench`'s)
HIDDEN_SIZES = (2048, 5120, 7168, 8192)
#: Token counts of the benchmarks: one decode token to a long prefill
BENCH_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 32768, 65536)
QUICK_TOKENS = (1, 16, 256, 4096, 65536)


def _kit_impls(tri, cu, with_256: bool = True) -> dict:
    """{(op, impl): fn(x, w, r, o)} of the kit's kernels (invariant and variant, both backends)."""
    impls = {
        ("rms_norm", "triton-invariant"): lambda x, w, r, o: tri.rms_norm(x, w, 1e-6, impl="invariant", out=o),
        ("rms_norm", "triton-variant"): lambda x, w, r, o: tri.rms_norm(x, w, 1e-6, impl="variant", out=o),
        ("rms_norm", "cuda-invariant"): lambda x, w, r, o: cu.rms_norm(o, x, w, 1e-6, impl="invariant"),
        ("rms_norm", "cuda-variant"): lambda x, w, r, o: cu.rms_norm(o, x, w, 1e-6, impl="variant"),
        ("rms_norm", "cuda-invariant256"): lambda x, w, r, o: cu.rms_norm(o, x, w, 1e-6, impl="invariant256"),
        ("fused_add_rms_norm", "triton-invariant"):
            lambda x, w, r, o: tri.fused_add_rms_norm(x, r, w, 1e-6, impl="invariant", out=o, residual_out=r),
        ("fused_add_rms_norm", "triton-variant"):
            lambda x, w, r, o: tri.fused_add_rms_norm(x, r, w, 1e-6, impl="variant", out=o, residual_out=r),
        ("fused_add_rms_norm", "cuda-invariant"): lambda x, w, r, o: cu.fused_add_rms_norm(x, r, w, 1e-6, impl="invariant"),
        ("fused_add_rms_norm", "cuda-variant"): lambda x, w, r, o: cu.fused_add_rms_norm(x, r, w, 1e-6, impl="variant"),
        ("fused_add_rms_norm", "cuda-invariant256"):
            lambda x, w, r, o: cu.fused_add_rms_norm(x, r, w, 1e-6, impl="invariant256"),
    }
    return {k: f for k, f in impls.items() if with_256 or not k[1].endswith("256")}


def _compiled_peers(n_shapes: int) -> dict:
    """``torch.compile`` of the same formulas, one static specialization per shape (its best case)."""
    import torch._dynamo as dynamo

    for knob in ("recompile_limit", "cache_size_limit"):  # one specialization per (tokens, hidden)
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(64, getattr(dynamo.config, knob), n_shapes + 8))
    compiled_norm = torch.compile(_torch_rms_norm, dynamic=False)
    compiled_add = torch.compile(_torch_fused_add, dynamic=False)
    return {("rms_norm", "torch.compile"): lambda x, w, r, o: compiled_norm(x, w),
            ("fused_add_rms_norm", "torch.compile"): lambda x, w, r, o: compiled_add(x, r, w)}


def _timed_cells(hiddens, tokens, quick: bool, *, with_256: bool = True, deadline_s: float | None = None,
                 save=None, goal_checks=None) -> tuple:
    """Every (hidden, tokens) cell: the kit's kernels and ``torch.compile``, bf16, timed from
    CUDA-graph replays over rotating inputs; ``goal_checks(rows, hiddens, tokens)`` turns the
    rows into checks.  Past ``deadline_s`` seconds the remaining cells are skipped (a check
    names them).  ``save(rows, checks)`` after each hidden size."""
    import time

    from ..ops import rms_norm as tri
    from ..ops import rms_norm_cuda as cu

    dtype, es = torch.bfloat16, 2
    ceiling = copy_bandwidth_gbs()
    print(f"  copy ceiling {ceiling:.0f} GB/s")
    impls = {**_kit_impls(tri, cu, with_256), **_compiled_peers(len(hiddens) * len(tokens))}
    order = [k for k in impls if k[1] != "torch.compile"]
    order = [k for k in order if k[0] == "rms_norm"] + [("rms_norm", "torch.compile")] + \
        [k for k in order if k[0] != "rms_norm"] + [("fused_add_rms_norm", "torch.compile")]
    rows, skipped, t0 = [], [], time.perf_counter()
    for hidden in hiddens:
        for t in tokens:
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                skipped.append([hidden, t])
                continue

            def make():
                w = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype)
                x = torch.randn(t, hidden, device="cuda", dtype=dtype)
                r = torch.randn(t, hidden, device="cuda", dtype=dtype)
                return x, w, r, torch.empty_like(x)
            sets = rotating_sets(make, 4 * t * hidden * es)
            for op, impl in order:
                fn = impls[(op, impl)]
                nbytes = (2 if op == "rms_norm" else 4) * t * hidden * es + hidden * es
                try:
                    m = median_us(fn, rotate=sets, warmup=5, reps=30 if quick else 100, graph=True)
                except Exception as e:  # record, don't hide: a failed timing is a row with an error
                    rows.append({"op": op, "impl": impl, "tokens": t, "hidden": hidden, "dtype": "bfloat16",
                                 "median_us": None, "error": repr(e)[:300]})
                    print(f"  {op} {impl} hidden={hidden} T={t}: ERROR {e!r}"[:200])
                    continue
                gbs = nbytes / (m["median_us"] * 1e-6) / 1e9
                rows.append({"op": op, "impl": impl, "tokens": t, "hidden": hidden, "dtype": "bfloat16",
                             **m, "bytes": nbytes, "gbs": gbs, "fraction_of_copy": gbs / ceiling,
                             "copy_ceiling_gbs": ceiling,
                             "timing": "CUDA graph of consecutive calls over rotating inputs, per-call median"})
            del sets
            print(f"  hidden={hidden:<5} T={t:<6}" + " ".join(
                f"{r['impl']}={r['median_us']:.1f}us" for r in rows
                if r["tokens"] == t and r["hidden"] == hidden and r["op"] == "rms_norm" and r.get("median_us")),
                flush=True)
        if save is not None:
            save(rows, goal_checks(rows, hiddens, tokens) + _skipped_check(skipped, deadline_s))
    return rows, goal_checks(rows, hiddens, tokens) + _skipped_check(skipped, deadline_s)


def _skipped_check(skipped, deadline_s) -> list:
    if deadline_s is None:
        return []
    return [{"name": f"every cell timed (cells past the {deadline_s:.0f} s budget were skipped)",
             "passed": not skipped, "informational": True, "skipped_hidden_tokens": skipped}]


def _cell(rows, op, t, hidden):
    return {r["impl"]: r for r in rows
            if r["op"] == op and r["tokens"] == t and r["hidden"] == hidden and r.get("median_us")}


def _bench_goals(rows, hiddens, tokens) -> list:
    """:func:`bench`'s speed goals (hidden 4096): the fastest invariant kernel against the
    fastest of the variants and torch.compile, and the copy-bandwidth fraction at T >= 16384.
    Goals, reported and never a failure (:func:`batch_invariance_kit.report.results.goal`)."""
    checks = []
    for op in ("rms_norm", "fused_add_rms_norm"):
        for hidden in hiddens:
            for t in tokens:
                cell = _cell(rows, op, t, hidden)
                best_inv = min((cell[k]["median_us"] for k in cell if is_invariant(k)), default=None)
                peers = [cell[k]["median_us"] for k in ("triton-variant", "cuda-variant", "torch.compile") if k in cell]
                if best_inv is None or not peers:
                    continue
                checks.append(goal(f"{op} T={t}: fastest invariant <= fastest of variant and torch.compile",
                                   best_inv <= min(peers), ratio_invariant_over_fastest_peer=best_inv / min(peers)))
                if t >= 16384:
                    frac = max(cell[k]["fraction_of_copy"] for k in cell if is_invariant(k))
                    checks.append(goal(f"{op} T={t}: invariant reaches >= 90% of the copy ceiling", frac >= 0.9,
                                       fraction_of_copy=frac))
    return checks


def bench(quick: bool) -> tuple:
    """Chapter 3's benchmark at hidden 4096, bf16: every kit kernel of the family (both
    backends, invariant and variant) and ``torch.compile`` of the same formula, T = 1 ... 65536.
    The speed comparisons are goals (reported, never a failure)."""
    return _timed_cells((4096,), QUICK_TOKENS if quick else BENCH_TOKENS, quick, goal_checks=_bench_goals)


def _torch_compile_goals(rows, hiddens, tokens) -> list:
    """Per (op, hidden, T): the fastest invariant kernel at least as fast as torch.compile (the
    goal), with the ratio ``torch.compile time / invariant time``."""
    checks = []
    for op in ("rms_norm", "fused_add_rms_norm"):
        for hidden in hiddens:
            for t in tokens:
                cell = _cell(rows, op, t, hidden)
                inv = {k: r["median_us"] for k, r in cell.items() if is_invariant(k)}
                if not inv or "torch.compile" not in cell:
                    continue
                best = min(inv, key=inv.get)
                ratio = cell["torch.compile"]["median_us"] / inv[best]
                checks.append(goal(f"{op} hidden={hidden} T={t}: invariant >= 1.0x torch.compile", ratio >= 1.0,
                                   hidden=hidden, tokens=t, invariant=best, speed_ratio_vs_torch_compile=ratio))
    return checks


def bench_hidden_sizes(quick: bool, save=None) -> tuple:
    """The family at the other hidden sizes of current models (:data:`HIDDEN_SIZES`; 4096 is
    :func:`bench`'s), plain and fused-add, bf16, T = 1 ... 65536, the kit's invariant and
    variant kernels of both backends beside ``torch.compile``.  Goals: the fastest invariant
    kernel >= torch.compile in every cell (reported, never a failure).  About 6 minutes on an
    H200 (a 480 s budget; ``quick``: 5 token counts, 2-3 minutes)."""
    return _timed_cells(HIDDEN_SIZES, QUICK_TOKENS if quick else BENCH_TOKENS, quick, with_256=False,
                        deadline_s=480.0, save=save, goal_checks=_torch_compile_goals)


def tune_warps(quick: bool) -> tuple:
    """Sweep the invariant Triton kernel's warp count at hidden 4096 (a per-hidden-size
    constant: it shapes the reduction tree but never depends on the batch)."""
    from ..ops import rms_norm as tri

    hidden, dtype = 4096, torch.bfloat16
    rows, checks = [], []
    ceiling = copy_bandwidth_gbs()
    try:
        for nw in (2, 4, 8, 16):
            tri.NUM_WARPS_OVERRIDE[hidden] = nw
            inv = fam.seed_method("triton", "rms_norm", "invariant", dtype, hidden=hidden, seeds=range(4))
            checks.append({"name": f"num_warps={nw}: invariant 255 vs 300", "passed": inv["rows_differing"] == 0})
            for t in (4096, 16384, 65536):
                x = [torch.randn(t, hidden, device="cuda", dtype=dtype) for _ in range(3)]
                r = [torch.randn(t, hidden, device="cuda", dtype=dtype) for _ in range(3)]
                w = torch.randn(hidden, device="cuda", dtype=dtype)
                o = [torch.empty_like(a) for a in x]
                for op in ("rms_norm", "fused_add_rms_norm"):
                    if op == "rms_norm":
                        fn = lambda a, b, c: tri.rms_norm(a, w, 1e-6, impl="invariant", out=c)  # noqa: E731
                        nbytes = 2 * t * hidden * 2
                    else:
                        fn = lambda a, b, c: tri.fused_add_rms_norm(a, b, w, 1e-6, impl="invariant", out=c,  # noqa: E731
                                                                    residual_out=b)
                        nbytes = 4 * t * hidden * 2
                    m = median_us(fn, rotate=list(zip(x, r, o)), warmup=3, reps=30, graph=True)
                    gbs = nbytes / (m["median_us"] * 1e-6) / 1e9
                    rows.append({"op": op, "impl": f"triton-invariant-w{nw}", "num_warps": nw, "tokens": t,
                                 "hidden": hidden, "dtype": "bfloat16", **m, "gbs": gbs,
                                 "fraction_of_copy": gbs / ceiling})
                    print(f"  w{nw} {op} T={t}: {m['median_us']:.1f} us ({gbs / ceiling:.0%} of copy)", flush=True)
    finally:
        tri.NUM_WARPS_OVERRIDE.pop(hidden, None)
    return rows, checks


def cpu_invariance(quick: bool) -> tuple:
    """Every op of both backends in fp32 (Triton interpreted, CUDA through the emulator on a
    CPU): the 255-vs-300-token test of vLLM's RMSNorm fix, the invariant must find no row
    differing; the variant's count is recorded (observed, not required at these sizes)."""
    rows, checks = [], []
    seeds = range(2) if quick else range(16)
    for backend in fam.BACKENDS:
        for op in fam.OPS:
            inv = fam.seed_method(backend, op, "invariant", torch.float32, hidden=4096 if not quick else 1024,
                                  seeds=seeds)
            var = fam.seed_method(backend, op, "variant", torch.float32, hidden=4096, seeds=seeds)
            rows += [inv, var]
            checks.append({"name": f"{backend} {op} invariant: 255 vs 300 tokens bit-identical",
                           "passed": inv["rows_differing"] == 0})
            checks.append({"name": f"{backend} {op} variant differs (observed)", "informational": True,
                           "passed": True, "rows_differing": var["rows_differing"]})
    return rows, checks
