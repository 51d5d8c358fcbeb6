"""Where a step's time goes: a few engine steps of each mode under ``torch.profiler``, summed by
kernel family, and the time the GPU sat idle between kernels waiting for the host.

    python -m batch_invariance_kit.vllm.step_profile --out DIR                       # dense: default, kit+attention
    python -m batch_invariance_kit.vllm.step_profile --out DIR --models moe --modes default,invariant,kit+attention
    python -m batch_invariance_kit.vllm.step_profile --out DIR --scenarios profile,profile_tm

It is :mod:`batch_invariance_kit.vllm.bench` with its ``profile`` scenario (one engine per mode, a
warm-up batch, then one batch of 64 prompts of 512 tokens and 16 new tokens, a prefill and 15
decode steps, under the profiler) or its ``profile_tm`` scenario (the ``tm`` scenario's 1,000
prompts with 14-18 new tokens: prefill chunks, then decode steps of up to 1,000 requests),
written to ``DIR/vllm_profile.json``: one row per (model, mode, scenario) with

* ``families``: per family of :data:`FAMILIES` (:func:`kernel_family`: by the kernel's name, the
  kit's Triton kernels and vLLM's, cuBLAS's and Inductor's), the kernels, their summed time and
  its share of the kernel time, and the heaviest kernels of the family;
* ``gaps``: the device timeline's busy time (the union of kernels and copies), the idle time
  between them (the host's share of the step: launches, Python, synchronisations), the number of
  gaps above 10 and 100 microseconds and the idle time in gaps above 1 ms, the median gap and the
  largest ones; each of the largest named by the device work before and after it and by the
  host's work during it (the profiler's host events that overlap the gap, by overlap: operators,
  CUDA runtime and driver calls such as a kernel's module load);
* the window's wall time and the run's tokens.

The summary (:func:`summarize`) reads the profiler's Chrome trace (:func:`read_trace`), so it is
tested on a CPU with a synthetic trace and with the trace of a CPU run of the profiler.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("gemm", "attention", "norm", "moe", "other")
#: ``(family, pattern)`` tried in order on the kernel's lower-cased name; no match: ``other``.
#: MoE first (its grouped GEMM is MoE time), then attention (the KV-cache writes included), norms
#: (Inductor's fused ``rsqrt`` reductions included), then GEMMs.
PATTERNS = (
    ("moe", r"moe|expert|_router_kernel|_dispatch_kernel|_combine_kernel|grouped_gemm|splitk_silu|silu_mul_kernel"
            r"|topk_?gating"
            r"|topkgating|align_block|count_and_sort"),
    ("attention", r"attn|attention|flash|fmha|reshape_and_cache|write_kv|paged|unified"),
    ("norm", r"rms|norm|rsqrt"),
    ("gemm", r"gemm|matmul|_mm_|mm_kernel|mm_tma|cutlass|xmma|nvjet|cublas|wgmma|splitkreduce|triton_tem_fused_mm"),
)
_COMPILED = tuple((fam, re.compile(p)) for fam, p in PATTERNS)
#: Trace categories of device work: kernels (their family by name) and copies (busy time only).
KERNEL_CATEGORIES = ("kernel",)
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
#: Trace categories of host work that may fill a device gap (:func:`gaps`' attribution).
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
#: Gap sizes counted (microseconds).
GAP_THRESHOLDS_US = (10.0, 100.0)
#: Gaps longer than this (microseconds) have their idle time summed apart (``idle_in_gaps_over_1ms_us``).
LONG_GAP_US = 1000.0
#: The largest gaps listed with their neighbours and the host's work during them.
NAMED_GAPS = 8


def kernel_family(name: str) -> str:
    """The family of a kernel by its name (:data:`PATTERNS`)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    low = name.lower()
    for fam, pat in _COMPILED:
        if pat.search(low):
            return fam
    return "other"


def read_trace(path, categories=KERNEL_CATEGORIES + COPY_CATEGORIES) -> list:
    """The complete events (``"ph": "X"``) of the given categories of a Chrome trace written by
    ``torch.profiler``: ``[{"name", "cat", "ts", "dur"}]`` (microseconds), by start time."""
    doc = json.loads(Path(path).read_text())
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    out = [{"name": e.get("name", ""), "cat": e.get("cat"), "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
           for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in categories]
    return sorted(out, key=lambda e: e["ts"])


def gaps(events: list, host: list = ()) -> dict:
    """The device timeline of ``events`` (``ts``, ``dur`` in microseconds): ``span_us`` (first start
    to last end), ``busy_us`` (the union of the events), ``idle_us`` and ``idle_fraction`` (the gaps
    between them), their count, the gaps above each of :data:`GAP_THRESHOLDS_US`, the idle time in
    gaps above :data:`LONG_GAP_US`, the median gap and the five largest (``largest_gaps_us``).
    ``largest``: the :data:`NAMED_GAPS` largest gaps, each with ``us``, ``after`` and ``before`` (the
    names of the device events that end last before it and start it) and ``host``: the names of the
    ``host`` events (:data:`HOST_CATEGORIES`) that overlap it, with their overlap, most first (five)."""
    ev = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")) for e in events),
                key=lambda t: t[0])
    if not ev:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "idle_fraction": None, "gaps": 0,
                **{f"gaps_over_{int(t)}us": 0 for t in GAP_THRESHOLDS_US}, "idle_in_gaps_over_1ms_us": 0.0,
                "median_gap_us": None, "largest_gaps_us": [], "largest": []}
    busy, found = 0.0, []  # (gap, its start, its end, name of the event ending last before, name after)
    start, end, last = ev[0][0], ev[0][1], ev[0][2]
    for s, e, name in ev[1:]:
        if s > end:
            busy += end - start
            found.append((s - end, end, s, last, name))
            start, end, last = s, e, name
        elif e >= end:
            end, last = e, name
    busy += end - start
    span = max(e for _, e, _ in ev) - ev[0][0]
    gap_list = [g[0] for g in found]
    idle = sum(gap_list)
    named = [{"us": g, "after": a[:160], "before": b[:160], "host": _overlapping(host, lo, hi)}
             for g, lo, hi, a, b in sorted(found, key=lambda g: -g[0])[:NAMED_GAPS]]
    return {"span_us": span, "busy_us": busy, "idle_us": idle, "idle_fraction": idle / span if span else None,
            "gaps": len(gap_list), **{f"gaps_over_{int(t)}us": sum(g > t for g in gap_list) for t in GAP_THRESHOLDS_US},
            "idle_in_gaps_over_1ms_us": sum(g for g in gap_list if g > LONG_GAP_US),
            "median_gap_us": statistics.median(gap_list) if gap_list else None,
            "largest_gaps_us": sorted(gap_list, reverse=True)[:5], "largest": named}


def _overlapping(host: list, lo: float, hi: float, top: int = 5) -> list:
    """The names of the ``host`` events overlapping ``[lo, hi]``, with their overlap (summed per
    name over every thread, nested events each counted: an enclosing step annotation overlaps the
    whole gap), most first: ``[{"name", "us"}]``."""
    by = {}
    for e in host:
        a, b = max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e["dur"]))
        if b > a:
            by[e["name"]] = by.get(e["name"], 0.0) + b - a
    return [{"name": n[:160], "us": t} for n, t in sorted(by.items(), key=lambda kv: -kv[1])[:top]]


def summarize(events: list, *, top: int = 3) -> dict:
    """Kernel time per family (:func:`kernel_family`) and the timeline's gaps (:func:`gaps`) of a
    trace's events (:func:`read_trace`): copies count as busy time, not as a family; host events
    (:data:`HOST_CATEGORIES`) only name what the host did during the largest gaps."""
    device = [e for e in events if e.get("cat") in KERNEL_CATEGORIES + COPY_CATEGORIES]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    kernels = [e for e in device if e.get("cat") in KERNEL_CATEGORIES]
    total = sum(e["dur"] for e in kernels)
    fams = {f: {"kernels": 0, "time_us": 0.0, "share": None, "top": {}} for f in FAMILIES}
    for e in kernels:
        f = fams[kernel_family(e["name"])]
        f["kernels"] += 1
        f["time_us"] += e["dur"]
        f["top"][e["name"]] = f["top"].get(e["name"], 0.0) + e["dur"]
    for f in fams.values():
        f["share"] = f["time_us"] / total if total else None
        f["top"] = [{"name": n[:160], "time_us": t} for n, t in sorted(f["top"].items(), key=lambda kv: -kv[1])[:top]]
    copies = [e for e in events if e.get("cat") in COPY_CATEGORIES]
    return {"kernels": len(kernels), "kernel_time_us": total, "copies": len(copies),
            "copy_time_us": sum(e["dur"] for e in copies), "families": fams, "gaps": gaps(device, host)}


def profile_table(rows: list) -> str:
    """The printed summary of ``vllm_profile`` rows: per (model, mode), each family's share of the
    kernel time and the idle share of the device timeline."""
    lines = []
    for r in rows:
        if r.get("op") != "vllm_profile":
            continue
        fam = "  ".join(f"{f} {r['families'][f]['share']:.0%}" for f in FAMILIES
                        if r["families"][f]["share"] is not None)
        g = r["gaps"]
        idle = f"{g['idle_fraction']:.0%}" if g["idle_fraction"] is not None else "n/a"
        lines.append(f"{r['model']} {r.get('scenario', 'profile'):<13} {r['impl']:<22} {r['kernels']} kernels, "
                     f"{r['kernel_time_us'] / 1e3:.1f} ms: {fam}; "
                     f"device idle {idle} of {g['span_us'] / 1e3:.1f} ms ({g['gaps']} gaps, "
                     f"{g['gaps_over_100us']} over 100 us)")
    return "\n".join(lines)


def profile_call(fn) -> dict:
    """Run ``fn()`` under ``torch.profiler`` (CPU and, when present, CUDA activity) and return
    :func:`summarize` of its device events with ``wall_s`` (the call, synchronised)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tempfile.TemporaryDirectory(prefix="kit-profile-") as d:
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = summarize(read_trace(path, KERNEL_CATEGORIES + COPY_CATEGORIES + HOST_CATEGORIES))
    return {"wall_s": wall, "device": "cuda" if cuda else "cpu", **summary}


def main(argv=None) -> int:
    """``python -m batch_invariance_kit.vllm.bench --scenarios profile`` into ``vllm_profile.json``;
    ``--scenarios`` picks among the profile scenarios (``profile``, the default, and
    ``profile_tm``); the other arguments are the bench's (default ``--models dense --modes
    default,kit+attention``)."""
    from . import bench

    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--scenarios", default="profile")
    known, rest = own.parse_known_args(argv)
    names = known.scenarios
    profiles = [n for n, s in bench.SCENARIOS.items() if s.kind == "profile"]
    wrong = [n for n in names.split(",") if n not in profiles]
    if wrong or not names:
        print(f"error: --scenarios: {','.join(wrong) or repr(names)}: the profile command runs profile scenarios "
              f"only ({','.join(profiles)})", file=sys.stderr)
        return 2
    if not any(a == "--modes" or a.startswith("--modes=") for a in rest):
        rest += ["--modes", "default,kit+attention"]
    return bench.main(rest + ["--scenarios", names, "--result-name", "vllm_profile"])


if __name__ == "__main__":
    sys.exit(main())
