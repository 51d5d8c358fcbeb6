"""The cost of invariance, read from stored benchmark results (chapter 8).

:func:`summary` turns every stored benchmark of one device folder (``results/<where>/``) into
one row per (kernel family, cell): the invariant implementation's time (or rate), the fastest
implementation *without* an invariance guarantee timed in the same run (variants, cuBLAS,
``torch.compile``, SDPA, vLLM's default mode), and

    speed_ratio = peer_time / invariant_time        (times: median us)
    speed_ratio = invariant_rate / peer_rate        (rates: tokens/s)

so ``speed_ratio >= 1`` means the invariant implementation is at least as fast.  Nothing is
measured here: it only reads JSON, so it runs anywhere.  A benchmark file that is absent is
skipped.  :data:`GOALS` are the speed goals the issues stated; :func:`check_goals` evaluates them.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from . import results as _results

#: Families in the order the chapter shows them.
FAMILIES = ["rms_norm", "fused_add_rms_norm", "matmul", "moe", "moe vs vLLM", "attention decode",
            "attention prefill", "e2e kit serve", "vLLM"]

#: Benchmark files read by :func:`summary`, in order.
SOURCES = ["rms_norm_bench", "rms_norm_hidden_sizes", "matmul_sweep", "moe_bench", "moe_vs_vllm", "attention_bench",
           "e2e_model", "vllm_check"]

#: Rows that are reference points, not implementations (a copy kernel is a ceiling, not a peer).
NOT_PEERS = {"copy"}


def is_invariant(impl: str) -> bool:
    """Whether a kernel benchmark's ``impl`` carries the invariance guarantee
    (``triton-invariant``, ``kit-invariant:small``, ...; not ``kit-variant``, ``cublas``, ...)."""
    return "invariant" in impl


def _row(family, cell, params, unit, inv_name, inv_value, peers, source, doc, **extra) -> dict:
    """One summary row; ``peers`` maps name -> time (unit "us") or rate (unit "tok/s")."""
    if not peers:
        raise ValueError(f"{source}: no non-invariant peer for {family} {cell}")
    if unit == "us":
        peer = min(peers, key=peers.get)
        ratio = peers[peer] / inv_value
    else:
        peer = max(peers, key=peers.get)
        ratio = inv_value / peers[peer]
    row = {"family": family, "cell": cell, "params": params, "unit": unit,
           "invariant": inv_name, "invariant_value": inv_value,
           "peer": peer, "peer_value": peers[peer], "peers": dict(peers),
           "speed_ratio": ratio, "source": f"{source}.json",
           "commit": str(doc.get("provenance", {}).get("git_commit"))}
    row.update(extra)
    return row


def _timed(rows, key):
    """Group timing rows (with a median) by ``key(row)``: {cell key: {impl: row}}."""
    cells: dict = {}
    for r in rows:
        if r.get("median_us") is None:
            continue
        cells.setdefault(key(r), {})[r["impl"]] = r
    return cells


def _split(cell: dict):
    """(invariant rows, non-invariant peer rows) of one cell.  A row's own ``invariant`` flag,
    where the benchmark writes one, wins over its name (``fa3-num_splits1``, FlashAttention-3
    with one split, is invariant; it is neither the kit's nor a peer)."""
    flag = {k: r.get("invariant", is_invariant(k)) for k, r in cell.items()}
    inv = {k: r for k, r in cell.items() if flag[k] and is_invariant(k)}
    peers = {k: r for k, r in cell.items() if not flag[k] and k not in NOT_PEERS}
    return inv, peers


def _rms_norm(doc, out, source="rms_norm_bench"):
    """Cells ``T=<tokens>`` at hidden 4096 (chapter 3's benchmark), ``T=<tokens>, hidden=<h>`` at the others."""
    cells = _timed(doc["rows"], lambda r: (r["op"], r["tokens"], r.get("hidden"), r.get("dtype")))
    for (op, tokens, hidden, dtype), cell in sorted(cells.items(),
                                                    key=lambda kv: (kv[0][0] != "rms_norm", kv[0][2] or 0, kv[0][1])):
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        best = min(inv, key=lambda k: inv[k]["median_us"])  # the kit's fastest invariant kernel
        label = f"T={tokens}" if hidden in (None, 4096) else f"T={tokens}, hidden={hidden}"
        out.append(_row(op, label, {"tokens": tokens, "hidden": hidden, "dtype": dtype}, "us",
                        best, inv[best]["median_us"], {k: r["median_us"] for k, r in peers.items()},
                        source, doc, fraction_of_copy=inv[best].get("fraction_of_copy")))


def _matmul(doc, out):
    import torch

    from ..ops import matmul as MM  # the cost model the kit uses picks the invariant config per shape

    sms = doc.get("provenance", {}).get("sm_count") or MM.COST_MODEL.sms
    cells = _timed(doc["rows"], lambda r: (r["N"], r["K"], r["M"], r.get("dtype", "bfloat16")))
    for (n, k, m, dtype), cell in sorted(cells.items()):
        inv, peers = _split(cell)
        # the sweep's own record of what the kit ran, else the model's pick for the sweep's GPU
        picked = [name for name, r in inv.items() if r.get("selected")]
        pick = picked[0] if picked else \
            "kit-invariant:" + MM.select_config(m, n, k, getattr(torch, dtype), compiled=True, sms=int(sms)).name
        if pick not in inv or not peers:
            continue
        out.append(_row("matmul", f"M={m}, N={n}, K={k}", {"M": m, "N": n, "K": k, "dtype": dtype}, "us",
                        pick, inv[pick]["median_us"], {p: r["median_us"] for p, r in peers.items()},
                        "matmul_sweep", doc))


def _moe(doc, out):
    cells = _timed(doc["rows"], lambda r: r["tokens"])
    for tokens, cell in sorted(cells.items()):
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        best = min(inv, key=lambda k: inv[k]["median_us"])
        r0 = inv[best]
        out.append(_row("moe", f"T={tokens}", {"tokens": tokens, "experts": r0.get("experts"),
                                                "top_k": r0.get("top_k")}, "us",
                        best, r0["median_us"], {p: r["median_us"] for p, r in peers.items()}, "moe_bench", doc))


def _attention(doc, out):
    dec = _timed([r for r in doc["rows"] if r["op"] == "attention_decode"], lambda r: (r["context"], r["batch"]))
    for (ctx, batch), cell in sorted(dec.items()):
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        best = min(inv, key=lambda k: inv[k]["median_us"])
        out.append(_row("attention decode", f"batch {batch} x context {ctx}", {"batch": batch, "context": ctx},
                        "us", best, inv[best]["median_us"], {p: r["median_us"] for p, r in peers.items()},
                        "attention_bench", doc,
                        calls_per_timing={k: r.get("calls_per_timing") for k, r in cell.items()}))
    pre = _timed([r for r in doc["rows"] if r["op"] == "attention_prefill"],
                 lambda r: (r.get("seqs", 1), r.get("prompt", r["tokens"])))
    for (seqs, prompt), cell in sorted(pre.items()):
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        best = min(inv, key=lambda k: inv[k]["median_us"])
        label = f"T={prompt}" if seqs == 1 else f"{seqs} x {prompt}"
        out.append(_row("attention prefill", label, {"tokens": seqs * prompt, "seqs": seqs, "prompt": prompt}, "us",
                        best, inv[best]["median_us"], {p: r["median_us"] for p, r in peers.items()},
                        "attention_bench", doc,
                        calls_per_timing={k: r.get("calls_per_timing") for k, r in cell.items()}))


def _e2e(doc, out):
    by_model: dict = {}
    for r in doc["rows"]:
        if r.get("op") == "e2e_serve":
            by_model.setdefault(r["model"], {})[r["impl"]] = r
    for model, cell in by_model.items():
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        for field, what in (("tokens_per_s", "under load"), ("bs1_tokens_per_s", "alone (bs1)")):
            iv = {k: r[field] for k, r in inv.items() if r.get(field)}
            pv = {k: r[field] for k, r in peers.items() if r.get(field)}
            if not iv or not pv:
                continue
            best = max(iv, key=iv.get)
            copies = inv[best].get("copies")
            cell_name = f"{model}, {copies} copies {what}" if field == "tokens_per_s" else f"{model}, {what}"
            out.append(_row("e2e kit serve", cell_name, {"model": model, "measure": field}, "tok/s",
                            best, iv[best], pv, "e2e_model", doc))


#: vLLM engine settings that make two throughput runs not like-for-like when they differ.
_ENGINE_KEYS = ("enforce_eager", "compilation_mode", "cudagraph_mode", "max_cudagraph_capture_size")


def _vllm(doc, out):
    by_model: dict = {}
    for r in doc["rows"]:
        if r.get("op") == "vllm_throughput" and r.get("output_tokens_per_s"):
            by_model.setdefault(r["model"], {})[r["impl"]] = r
    for model, cell in by_model.items():
        peers = {k: r for k, r in cell.items() if k == "default"}  # vLLM's default mode: no guarantee
        if not peers:
            continue
        peer_engine = peers["default"].get("engine", {})
        for mode in sorted(k for k in cell if k != "default"):
            r = cell[mode]
            eng = r.get("engine", {})
            differs = {k: (eng.get(k), peer_engine.get(k)) for k in _ENGINE_KEYS if eng.get(k) != peer_engine.get(k)}
            label = "VLLM_BATCH_INVARIANT=1" if mode == "invariant" else f"{mode} kernels"
            out.append(_row("vLLM", f"{model}, {label}", {"model": model, "mode": mode}, "tok/s",
                            mode, r["output_tokens_per_s"], {"default": peers["default"]["output_tokens_per_s"]},
                            "vllm_check", doc, engine_differs=differs, like_for_like=not differs))


def _moe_vs_vllm(doc, out):
    """The kit's invariant MoE against vLLM's default fused_moe: one cell per (model, tokens)."""
    cells = _timed(doc["rows"], lambda r: (r["model"], r["tokens"]))
    for (model, tokens), cell in sorted(cells.items()):
        inv, peers = _split(cell)
        if not inv or not peers:
            continue
        best = min(inv, key=lambda k: inv[k]["median_us"])
        r0 = inv[best]
        out.append(_row("moe vs vLLM", f"{model}, T={tokens}",
                        {"model": model, "tokens": tokens, "experts": r0.get("experts"), "top_k": r0.get("top_k")},
                        "us", best, r0["median_us"], {p: r["median_us"] for p, r in peers.items()}, "moe_vs_vllm", doc))


_READERS = {"rms_norm_bench": _rms_norm, "rms_norm_hidden_sizes": lambda d, o: _rms_norm(d, o, "rms_norm_hidden_sizes"),
            "matmul_sweep": _matmul, "moe_bench": _moe, "moe_vs_vllm": _moe_vs_vllm,
            "attention_bench": _attention, "e2e_model": _e2e, "vllm_check": _vllm}


def _folder(where: str, root) -> Path:
    if not isinstance(where, str) or not where or where in (".", "..") or "/" in where or "\\" in where:
        raise ValueError(f"where must be the name of a results folder (e.g. 'h200'), got {where!r}")
    root = Path(root) if root is not None else Path(_results.RESULTS)
    if not (root / where).is_dir():
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ValueError(f"no results folder {where!r}; stored folders: {known}")
    return root


def summary(where: str = "h200", root=None) -> list[dict]:
    """One row per (family, cell) of every stored benchmark in ``<root>/<where>/`` (``root``
    defaults to ``batch_invariance_kit.report.results.RESULTS``).  Absent files are skipped; an unknown ``where``
    raises ``ValueError``.  See the module docstring for ``speed_ratio``."""
    root = _folder(where, root)
    out: list[dict] = []
    for name in SOURCES:
        doc = _results.load(name, where, root)
        if doc is not None:
            _READERS[name](doc, out)
    return out


def sources(where: str = "h200", root=None) -> dict:
    """{file name: provenance} of the benchmark files :func:`summary` read."""
    root = _folder(where, root)
    return {f"{n}.json": d["provenance"] for n in SOURCES if (d := _results.load(n, where, root)) is not None}


# --- goals ------------------------------------------------------------------------------------

#: The speed goals: family, text (and a short label), scope (a predicate on a row's ``params``),
#: metric, threshold.  Goals, not checks: a cell below one is reported, never a failure of
#: the validation command (whose exit status is the invariance and correctness checks').
#: ``metric`` names what is compared with the threshold: "speed_ratio" (fastest peer), a peer
#: name (the ratio to that peer only), or "fraction_of_copy".
GOALS = [
    {"family": "rms_norm", "text": ">= 0.9 of copy bandwidth at T >= 16384", "metric": "fraction_of_copy",
     "threshold": 0.9, "short": "0.9 of copy, T >= 16384", "scope": lambda p: p["tokens"] >= 16384},
    {"family": "fused_add_rms_norm", "text": ">= 0.9 of copy bandwidth at T >= 16384",
     "metric": "fraction_of_copy", "threshold": 0.9, "short": "0.9 of copy, T >= 16384", "scope": lambda p: p["tokens"] >= 16384},
    {"family": "rms_norm", "text": ">= 1.0x torch.compile, every T and hidden size", "metric": "torch.compile",
     "threshold": 1.0, "short": "1.0x torch.compile", "scope": lambda p: True},
    {"family": "fused_add_rms_norm", "text": ">= 1.0x torch.compile, every T and hidden size",
     "metric": "torch.compile", "threshold": 1.0, "short": "1.0x torch.compile", "scope": lambda p: True},
    {"family": "matmul", "text": ">= 0.9x cuBLAS at M >= 64", "metric": "cublas", "threshold": 0.9,
     "short": "0.9x cuBLAS, M >= 64", "scope": lambda p: p["M"] >= 64},
    {"family": "matmul", "text": ">= 0.95x cuBLAS at M <= 16", "metric": "cublas", "threshold": 0.95,
     "short": "0.95x cuBLAS, M <= 16", "scope": lambda p: p["M"] <= 16},
    {"family": "moe", "text": ">= 0.85x the variant, every T", "metric": "kit-variant", "threshold": 0.85,
     "short": "0.85x variant", "scope": lambda p: True},
    {"family": "moe vs vLLM", "text": ">= 0.9x vLLM's fused_moe, every T", "metric": "vllm-fused_moe",
     "threshold": 0.9, "short": "0.9x vLLM fused_moe", "scope": lambda p: True},
    {"family": "attention decode", "text": ">= 0.9x the fastest non-invariant, every cell",
     "metric": "speed_ratio", "threshold": 0.9, "short": "0.9x fastest peer", "scope": lambda p: True},
    {"family": "attention prefill", "text": ">= 0.8x cuDNN SDPA, every cell", "metric": "sdpa",
     "threshold": 0.8, "short": "0.8x cuDNN SDPA", "scope": lambda p: True},
]


def goal_value(row: dict, metric: str) -> float | None:
    """The number a goal compares: the speed ratio, the ratio to one named peer, or a field."""
    if metric == "speed_ratio":
        return row["speed_ratio"]
    if metric in row.get("peers", {}):
        t = row["peers"][metric]
        return t / row["invariant_value"] if row["unit"] == "us" else row["invariant_value"] / t
    return row.get(metric)


def check_goals(rows: list[dict]) -> list[dict]:
    """Each goal of :data:`GOALS` whose family has rows: cells in scope, cells meeting it,
    the worst cell and its value, and ``met`` (every cell in scope meets it)."""
    out = []
    for g in GOALS:
        cells = [(r, goal_value(r, g["metric"])) for r in rows if r["family"] == g["family"] and g["scope"](r["params"])]
        cells = [(r, v) for r, v in cells if v is not None]
        if not cells:
            continue
        worst_row, worst = min(cells, key=lambda c: c[1])
        n_met = sum(v >= g["threshold"] for _, v in cells)
        out.append({"family": g["family"], "goal": g["text"], "metric": g["metric"], "threshold": g["threshold"],
                    "cells": len(cells), "cells_met": n_met, "worst_cell": worst_row["cell"], "worst": worst,
                    "met": n_met == len(cells)})
    return out


def by_family(rows: list[dict]) -> list[dict]:
    """Per family: cells, min / median / max speed ratio, and the worst cell."""
    out = []
    for fam in FAMILIES + sorted({r["family"] for r in rows} - set(FAMILIES)):
        fr = [r for r in rows if r["family"] == fam]
        if not fr:
            continue
        ratios = [r["speed_ratio"] for r in fr]
        worst = min(fr, key=lambda r: r["speed_ratio"])
        out.append({"family": fam, "cells": len(fr), "min": min(ratios), "median": statistics.median(ratios),
                    "max": max(ratios), "worst_cell": worst["cell"], "worst_peer": worst["peer"]})
    return out
