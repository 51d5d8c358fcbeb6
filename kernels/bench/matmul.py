"""Chapters 1 and 4's GPU measurements: where cuBLAS depends on the batch, and the kit's matmul
against it.  Each function returns ``(rows, checks)`` in the shape of
:mod:`batch_invariance_kit.report.results`; :mod:`.parts` names them.

* :func:`first_divergence`: the first M at which a ``torch.mm`` row depends on the batch;
* :func:`invariance_map`: ``torch.mm`` / ``bmm`` / ``F.linear`` under three cuBLAS set-ups;
* :func:`sweep`: eight (N, K) shapes, the configs' bits, the cost model's pick and its
  runners-up timed beside cuBLAS (:func:`config_sweep`);
* :func:`refit_sweep`: every config, shipped and trial, at the stored and the new shapes
  (:data:`REFIT_GROUPS`, one part each), M = 1 ... 8192; :func:`refit` fits the model to them and
  checks it leave-one-shape-out (``python -m batch_invariance_kit.bench.matmul FILE ...``);
* :func:`fit_cost_model`: the coefficients of :func:`batch_invariance_kit.ops.matmul.predict_us`
  from such a sweep; :func:`leave_one_shape_out`: how well the model picks on a shape it was
  not fit on;
* :func:`cpu_invariance`: the invariant matmul and its split-K twin under the Triton interpreter.
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..checks import DTYPES, dtype_name
from ..device import sm_count
from ..ops import matmul as MM
from ..report.results import RESULTS
from ..verify import divergence
from ..verify.harness import bitwise_equal, check_invariance, row_maker, seeded_normal
from .timing import median_us_graph_or_plain, rotating_sets


def first_divergence(quick: bool) -> tuple:
    shapes = [(4096, 4096)] if quick else [(4096, 4096), (12288, 4096), (4096, 12288)]
    sizes = divergence.default_batch_sizes(1024 if quick else 4096)
    rows = []
    for dt in ("bfloat16", "float16", "float32"):
        for n, k in shapes:
            # every row of every batch up to 64, then first / middle / last rows
            r = divergence.mm_first_divergence(DTYPES[dt], n, k, sizes,
                                               positions=lambda bs: range(bs) if bs <= 64 else (0, bs // 2, bs - 1))
            rows.append(r)
            print(f"  torch.mm {dt:<9} N={n:<6} K={k:<6} first diverging M = {r['first_divergence_M']}")
    checks = [{"name": "cuBLAS torch.mm depends on the batch for some dtype and shape",
               "passed": any(r["first_divergence_M"] is not None for r in rows)}]
    return rows, checks


#: (label, environment, cuBLASLt preferred): the cuBLAS set-ups of :func:`invariance_map`
CUBLAS_SETUPS = [
    ("default", {}, False),
    ("no-split-K env", {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}, False),
    ("no-split-K env + cuBLASLt", {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}, True),
]


def invariance_map(quick: bool, save=None) -> tuple:
    """torch.mm/bmm/linear first divergence under the cuBLAS set-ups of :data:`CUBLAS_SETUPS`,
    each in a fresh process (cuBLAS reads its workspace variables when it starts).  ``save(rows,
    checks)`` is called after each set-up, so that a later one running out of time keeps the rest."""
    rows = []
    for label, env, cublaslt in CUBLAS_SETUPS:
        found = divergence.invariance_map_in_process(env, cublaslt=cublaslt, limit=1024 if quick else 2048,
                                                     quick=quick)
        for r in found:
            r["setup"] = label
            rows.append(r)
            print(f"  {label:<26} {r['op']:<16} {r['dtype']:<9} N={r['N']:<6} K={r['K']:<6} "
                  f"first M = {r['first_divergence_M']}", flush=True)
        if save is not None:
            save(rows, [{"name": f"set-ups done: {len({r['setup'] for r in rows})} of {len(CUBLAS_SETUPS)}",
                         "passed": True, "informational": True}])
    bf16_env = [r for r in rows if r["setup"] != "default" and r["dtype"] == "bfloat16"]
    checks = [{"name": "the no-split-K cuBLAS environment makes bf16 mm/bmm/linear batch-invariant "
                       "(observed, not required)", "passed": all(r["first_divergence_M"] is None for r in bf16_env),
               "informational": True}]
    return rows, checks


#: (N, K, where from) of :func:`sweep`: four Llama-style hidden-4096 shapes (a square projection,
#: a wide N, a long K, a vocabulary), the configs' first sweep, and four from other models
SHAPES = [
    (4096, 4096, "hidden 4096, o_proj"),
    (12288, 4096, "hidden 4096, fused gate/up of width 12288"),
    (4096, 12288, "hidden 4096, down_proj of a 12288-wide MLP (long K)"),
    (151936, 4096, "vocabulary projection (Qwen2 vocabulary)"),
    (28672, 4096, "Llama-3-8B fused gate/up (2 x 14336)"),
    (5120, 5120, "Qwen2.5-14B o_proj (hidden 5120)"),
    (5120, 32768, "Mistral-Small-24B down_proj (intermediate 32768, long K)"),
    (7168, 18432, "DeepSeek-V3 dense-layer down_proj (hidden 7168, intermediate 18432, long K)"),
]
#: the Ms of :func:`sweep`: decode batches to long prefills
SWEEP_MS = [1, 8, 16, 64, 256, 1024, 4096]


def sweep(quick: bool, save=None) -> tuple:
    """:func:`config_sweep` over :data:`SHAPES` and :data:`SWEEP_MS` (bf16): per cell the cost
    model's pick and its runners-up (the model's top 4; ``quick``: the four new shapes at three
    Ms, top 2), the split-K variant and cuBLAS.  About 5 minutes on an H200 (``quick``: 1-2)."""
    if quick:
        return config_sweep([(n, k) for n, k, _ in SHAPES[4:]], [1, 256, 4096], torch.bfloat16, reps=30, top=2,
                            save=save)
    return config_sweep([(n, k) for n, k, _ in SHAPES], SWEEP_MS, torch.bfloat16, reps=50, top=4,
                        deadline_s=330.0, save=save)


# --------------------------------------------------------------------------------------------
# The refit sweep: every config (shipped and trial) at the stored shapes and at new ones
# --------------------------------------------------------------------------------------------

#: (N, K, where from) the shipped fit never saw (5120 x 5120 is also one of :data:`SHAPES`)
NEW_SHAPES = [
    (5120, 5120, "Qwen2.5-14B o_proj (hidden 5120)"),
    (5120, 13824, "Qwen2.5-14B down_proj (intermediate 13824, long K)"),
    (7168, 2048, "hidden 2048 -> 7168 (a 7168-wide up projection)"),
    (2048, 7168, "hidden 7168 -> 2048 (its down projection)"),
    (3584, 18944, "Qwen2-7B down_proj (hidden 3584, intermediate 18944, long K)"),
]
#: The Ms of the refit: decode batches to long prefills
REFIT_MS = [1, 8, 16, 64, 256, 1024, 2048, 4096, 8192]
QUICK_REFIT_MS = [1, 16, 256, 4096]
#: The refit's shapes in groups, one validation part each (each under 10 minutes on an H200)
REFIT_GROUPS = {
    "new_a": [(5120, 5120), (5120, 13824), (3584, 18944)],
    "new_b": [(7168, 2048), (2048, 7168)],
    "stored_a": [(4096, 4096), (12288, 4096), (4096, 12288)],
    "stored_b": [(151936, 4096), (28672, 4096), (5120, 32768), (7168, 18432)],
}


def refit_sweep(group: str, quick: bool, save=None) -> tuple:
    """:func:`config_sweep` of one group of :data:`REFIT_GROUPS` for a refit of the cost model:
    every shipped config (:data:`batch_invariance_kit.ops.matmul.CONFIGS`) and every trial
    config (:data:`batch_invariance_kit.ops.matmul.TRIAL_CONFIGS`) timed and checked bitwise
    against the pick in every cell, beside the split-K variant and cuBLAS, bf16, M = 1 ... 8192
    (``quick``: four Ms, the first shape of the group).  :func:`refit` fits the model to the
    stored groups and checks it leave-one-shape-out."""
    if group not in REFIT_GROUPS:
        raise ValueError(f"group must be one of {sorted(REFIT_GROUPS)}, got {group!r}")
    shapes = REFIT_GROUPS[group][:1] if quick else REFIT_GROUPS[group]
    return config_sweep(shapes, QUICK_REFIT_MS if quick else REFIT_MS, torch.bfloat16, reps=20,
                        top=len(MM.CONFIGS), deadline_s=None if quick else 500.0, save=save,
                        extra=MM.TRIAL_CONFIGS)


#: One validation part per group (``matmul_refit_<group>``): functions of ``(quick, save=None)``
refit_new_a, refit_new_b, refit_stored_a, refit_stored_b = (functools.partial(refit_sweep, g) for g in REFIT_GROUPS)


def refit(docs, *, new_shapes=None, goal: float = 0.95, bar: float = 0.9) -> dict:
    """Fit the cost model to stored refit sweeps (``docs``: documents of
    :func:`refit_sweep`'s parts) over every config timed in all of them (shipped and trial)
    and check it leave-one-shape-out: each shape's picks come from a model fit on the others.
    Returns ``{"model", "configs", "loso", "goals"}``: the fitted
    :class:`batch_invariance_kit.ops.matmul.CostModel`, the configs fitted, the rows of
    :func:`leave_one_shape_out` and, per M range (M <= 16, M >= 64), the worst cuBLAS / pick
    ratio over the cells of ``new_shapes`` (default :data:`NEW_SHAPES`) against the goal
    (0.95) and the bar (0.9).  Goals: reported, never a failure."""
    docs = list(docs)
    if not docs:
        raise ValueError("docs must hold at least one stored refit sweep")
    doc = {"provenance": docs[-1]["provenance"], "rows": [r for d in docs for r in d["rows"]]}
    cells = _kit_times(doc["rows"])
    timed = {name for cell in cells.values() for name in cell}
    configs = [c for c in MM.CONFIGS + MM.TRIAL_CONFIGS if c.name in timed]
    model = fit_cost_model(doc, configs=configs)
    loso = leave_one_shape_out(doc, configs=configs)
    unseen = {(n, k) for n, k, *_ in (NEW_SHAPES if new_shapes is None else new_shapes)}
    goals = []
    for label, scope in (("M <= 16", lambda m: m <= 16), ("M >= 64", lambda m: m >= 64)):
        vals = [(r["cublas_over_pick"], r) for r in loso
                if (r["N"], r["K"]) in unseen and scope(r["M"]) and r["cublas_over_pick"] is not None]
        if not vals:
            continue
        worst, row = min(vals, key=lambda v: v[0])
        goals.append({"name": f"matmul {label}, shapes the fit never saw: every cell >= {goal} of cuBLAS "
                              f"(bar {bar})", "passed": worst >= goal, "goal": True, "bar_met": worst >= bar,
                      "worst": worst, "worst_cell": {"N": row["N"], "K": row["K"], "M": row["M"]},
                      "cells": len(vals), "cells_met": sum(v >= goal for v, _ in vals)})
    return {"model": model, "configs": [c.name for c in configs], "loso": loso, "goals": goals}


def _refit_main(argv=None) -> int:
    """``python -m batch_invariance_kit.bench.matmul FILE ...``: :func:`refit` of stored refit
    sweeps; prints the fitted model (a literal to paste as ``COST_MODEL``), the trial configs
    it would ship (fastest in some cell), the leave-one-shape-out table and the goals."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m batch_invariance_kit.bench.matmul", description=_refit_main.__doc__)
    ap.add_argument("files", nargs="+", help="stored refit sweeps (matmul_refit_*.json)")
    a = ap.parse_args(argv)
    out = refit([json.loads(Path(f).read_text()) for f in a.files])
    m = out["model"]
    print(f"COST_MODEL = CostModel(launch_us={m.launch_us}, sms={m.sms}, coef={{")
    for name in out["configs"]:
        print(f"    {name!r}: {m.coef[name]},")
    print("})")
    wins = sorted({r["best"] for r in out["loso"]} & {c.name for c in MM.TRIAL_CONFIGS})
    print(f"trial configs fastest in some cell: {wins or 'none'}")
    print(f"{'N':>7} {'K':>6} {'M':>5}  {'pick':<13} {'best':<13} pick/best  cuBLAS/pick")
    for r in out["loso"]:
        cb = f"{r['cublas_over_pick']:.2f}" if r["cublas_over_pick"] is not None else "-"
        print(f"{r['N']:>7} {r['K']:>6} {r['M']:>5}  {r['pick']:<13} {r['best']:<13} {r['pick_over_best']:9.2f}  {cb:>11}")
    for g in out["goals"]:
        print(f"goal {'met' if g['passed'] else 'NOT met'} (bar {'met' if g['bar_met'] else 'NOT met'}): {g['name']}; "
              f"{g['cells_met']} of {g['cells']} cells, worst {g['worst']:.2f} at {g['worst_cell']}")
    return 0


# --------------------------------------------------------------------------------------------
# The cost model's fit and its leave-one-shape-out check (CPU: reads a stored sweep)
# --------------------------------------------------------------------------------------------

#: grids of the fit: launch cost (us), GB/s, us per K step (4 decimals)
FIT_LAUNCH_US = np.arange(0.0, 4.01, 0.5)
FIT_GBS = np.arange(1500.0, 5001.0, 100.0)
FIT_US_PER_STEP = np.round(np.geomspace(0.02, 3.0, 300), 4)


def _kit_times(rows, dtype="bfloat16") -> dict:
    """{(N, K, M): {config name: median us}} of the invariant configs' rows, and cuBLAS's under
    the name ``"cublas"``."""
    cells: dict = {}
    for r in rows:
        if r.get("op") != "mm" or r.get("dtype", dtype) != dtype or r.get("median_us") is None:
            continue
        impl = r["impl"]
        if impl.startswith("kit-invariant:"):
            name = impl.split(":", 1)[1]
        elif impl == "cublas":
            name = "cublas"
        else:
            continue
        cells.setdefault((r["N"], r["K"], r["M"]), {})[name] = r["median_us"]
    return cells


def _sweep_sms(doc: dict) -> int:
    """The SM count of the GPU a stored sweep ran on (its provenance; the fit's GPU if absent)."""
    return int(doc.get("provenance", {}).get("sm_count") or MM.COST_MODEL.sms)


def fit_cost_model(doc: dict, *, shapes=None, configs=None) -> "MM.CostModel":
    """Fit :class:`batch_invariance_kit.ops.matmul.CostModel` to a stored matmul sweep (``doc``:
    ``{"provenance", "rows"}``; bf16 rows; ``shapes``: the (N, K) to fit on, None for all).

    :func:`batch_invariance_kit.ops.matmul.predict_us` per config ``c`` is
    ``launches * L + max(bytes / G_c, steps * S_c)``: one launch cost ``L`` for all configs, a
    bandwidth ``G_c`` and a time per K step ``S_c`` per config.  The fit minimises the squared
    log error over every timed (config, cell), by exhaustive search over fixed grids
    (:data:`FIT_LAUNCH_US`, :data:`FIT_GBS`, :data:`FIT_US_PER_STEP`): deterministic, no
    starting point.  ``steps`` use the sweep's SM count (its provenance).  ``configs``: the
    configs to fit (default :data:`batch_invariance_kit.ops.matmul.CONFIGS`; each needs timed cells)."""
    if not isinstance(doc, dict) or "rows" not in doc:
        raise ValueError("doc must be a stored sweep: a dict with 'rows' (and 'provenance')")
    sms = _sweep_sms(doc)
    cells = _kit_times(doc["rows"])
    if shapes is not None:
        shapes = {tuple(s) for s in shapes}
        cells = {k: v for k, v in cells.items() if k[:2] in shapes}
    if not cells:
        raise ValueError("doc has no bf16 mm rows of the invariant configs" + (" at shapes" if shapes else ""))
    terms = {}  # config -> arrays over its timed cells
    for c in (MM.CONFIGS if configs is None else configs):
        t = [(MM.cost_terms(c, m, n, k, torch.bfloat16, sms=sms, compiled=True), cell[c.name])
             for (n, k, m), cell in sorted(cells.items()) if c.name in cell]
        if not t:
            raise ValueError(f"config {c.name!r} has no timed cell in doc: the model cannot be fit for it")
        terms[c.name] = (np.array([x["bytes"] for x, _ in t], float), np.array([x["steps"] for x, _ in t], float),
                         np.array([x["launches"] for x, _ in t], float), np.array([y for _, y in t], float))
    best = None
    for launch in FIT_LAUNCH_US:
        total, coef = 0.0, {}
        for name, (nbytes, steps, launches, obs) in terms.items():
            mem = nbytes[:, None] / (FIT_GBS[None, :] * 1e3)  # cells x GB/s
            comp = steps[:, None] * FIT_US_PER_STEP[None, :]  # cells x us per step
            pred = launches[:, None, None] * launch + np.maximum(mem[:, :, None], comp[:, None, :])
            err = (np.log(pred / obs[:, None, None]) ** 2).sum(axis=0)
            i, j = np.unravel_index(int(err.argmin()), err.shape)
            total += float(err[i, j])
            coef[name] = (float(FIT_US_PER_STEP[j]), float(FIT_GBS[i]))
        if best is None or total < best[0]:
            best = (total, MM.CostModel(launch_us=float(launch), coef=coef, sms=sms))
    return best[1]


#: The stored H200 sweeps the shipped cost model is fit on (under ``results/h200``): every config
#: timed at four (N, K), and the top configs of the model at eight (N, K).  The chapter's
#: ``matmul_sweep.json`` is a later run of the part with the fitted model: it measures the picks.
FIT_SOURCES = ("explorations/matmul_configs/every_config_four_shapes.json",
               "explorations/matmul_configs/top_configs_eight_shapes.json")


def fit_doc(root=None) -> dict:
    """The rows of :data:`FIT_SOURCES` as one sweep document (a cell timed in both: the later
    file's time), for :func:`fit_cost_model` and :func:`leave_one_shape_out`."""
    folder = Path(root) if root is not None else RESULTS / "h200"
    docs = [json.loads((folder / name).read_text()) for name in FIT_SOURCES]
    return {"provenance": docs[-1]["provenance"], "rows": [r for d in docs for r in d["rows"]]}


def leave_one_shape_out(doc: dict, *, model_for=None, configs=None) -> list:
    """For each (N, K) of the sweep ``doc``: fit the cost model on the other shapes
    (:func:`fit_cost_model`), pick a config at each of its Ms and compare with the measured
    times.  One row per (N, K, M): ``pick`` (the model's fastest among the configs the sweep
    timed there), ``pick_untimed`` (its fastest of all, when the sweep did not time it),
    ``best`` (the fastest timed config), ``pick_over_best`` (time ratio, >= 1) and
    ``cublas_over_pick`` (cuBLAS's time / the pick's: >= 1 means the kit is as fast).
    ``model_for(shapes) -> CostModel`` replaces the fit (e.g. the shipped model); ``configs``:
    the configs fit and weighed (default :data:`batch_invariance_kit.ops.matmul.CONFIGS`)."""
    cells = _kit_times(doc["rows"])
    sms = _sweep_sms(doc)
    shapes = sorted({k[:2] for k in cells})
    out = []
    for shape in shapes:
        train = [s for s in shapes if s != shape]
        model = fit_cost_model(doc, shapes=train, configs=configs) if model_for is None else model_for(train)
        for (n, k, m), cell in sorted(cells.items()):
            if (n, k) != shape:
                continue
            ranked = MM.rank_configs(m, n, k, torch.bfloat16, sms=sms, compiled=True, model=model,
                                     configs=None if configs is None else [c for c in configs if c.name in model.coef])
            timed = [c for _, c in ranked if c.name in cell]
            if not timed:
                continue
            pick = timed[0].name
            best = min((c.name for c in timed), key=lambda name: cell[name])
            out.append({"N": n, "K": k, "M": m, "pick": pick,
                        "pick_untimed": None if ranked[0][1].name in cell else ranked[0][1].name,
                        "pick_us": cell[pick], "best": best, "best_us": cell[best],
                        "pick_over_best": cell[pick] / cell[best],
                        "cublas_over_pick": cell["cublas"] / cell[pick] if "cublas" in cell else None})
    return out


def cpu_invariance(quick: bool) -> tuple:
    """The invariant matmul (every row equals the row alone) and its split-K twin (caught), fp32,
    K = 512, N = 96, on whatever device is present (the Triton interpreter on a CPU)."""
    k, n = 512, 96
    w = seeded_normal((k, n), 5) * k ** -0.5
    make = row_maker(k, dtype=torch.float32)
    sizes = [1, 3, 17, 65] if quick else [1, 2, 3, 17, 64, 65, 127, 128, 129, 300]
    inv = check_invariance(lambda x: MM.mm(x, w), make, sizes, positions=(0, -1))
    var = check_invariance(lambda x: MM.mm(x, w, impl="variant"), make, sizes, positions=(0, -1))
    rows = [{"op": "mm", "impl": "kit-invariant", "K": k, "N": n, "row_checks": inv.checks,
             "rows_differing": inv.rows_differing},
            {"op": "mm", "impl": "kit-variant-splitk", "K": k, "N": n, "row_checks": var.checks,
             "rows_differing": var.rows_differing}]
    checks = [{"name": "mm invariant: every row equals the row alone", "passed": inv.passed},
              {"name": "mm split-K variant is caught (negative control)", "passed": not var.passed}]
    return rows, checks


def config_sweep(shapes, Ms, dtype=torch.bfloat16, *, reps: int = 50, graph: bool = True, rotate: bool = True,
                 top: int = 4, deadline_s: float | None = None, save=None, extra=()) -> tuple:
    """On a CUDA GPU: for each ``(N, K)`` in ``shapes`` and each ``M`` in ``Ms``

    (a) checks that the configs it times give the bits of the default call (the cost model's
        pick, :func:`batch_invariance_kit.ops.matmul.select_config`), that ``linear`` with the
        (N, K) weight gives them too, and that the default's rows for M equal its rows for the
        largest M (so all Ms agree row by row); at the largest M every config of
        :func:`batch_invariance_kit.ops.matmul.invariant_candidates` is checked as well.  Records
        whether the split-K variant and cuBLAS rows differ (negative control / peer);
    (b) times the model's ``top`` configs (:func:`batch_invariance_kit.ops.matmul.rank_configs`,
        the pick first), the variant and ``torch.mm`` (cuBLAS) with
        :func:`batch_invariance_kit.bench.timing.median_us` (``graph``: CUDA-graph replays, the
        same for all; ``rotate``: enough copies of the operands to exceed L2, so weights are
        read from HBM).  Past ``deadline_s`` seconds only the pick is timed beside the peers.
        ``extra``: configs outside the model (:data:`batch_invariance_kit.ops.matmul.TRIAL_CONFIGS`)
        timed and checked bitwise in every cell (before the deadline), ranked after the model's.

    Each kit row carries ``pick`` (the model's pick in that cell), ``rank`` and ``predicted_us``;
    the pick's row also ``selected``, ``cublas_over_pick`` (cuBLAS's time / the pick's) and
    ``pick_over_best`` (the pick's time / the fastest timed config's).  ``save(rows, checks)`` is
    called after each shape.  Returns ``(rows, checks)`` in the shape of
    :mod:`batch_invariance_kit.report.results`."""
    if not torch.cuda.is_available():
        raise RuntimeError("config_sweep needs a CUDA GPU")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}")
    Ms = sorted(set(int(m) for m in Ms))
    if not Ms or Ms[0] < 1:
        raise ValueError(f"Ms must be positive row counts, got {Ms!r}")
    dname = dtype_name(dtype)
    sms = sm_count()
    t_start = time.perf_counter()
    late = []  # cells timed after the deadline: the pick only
    rows, results = [], []
    for N, K in shapes:
        gen = torch.Generator(device="cuda").manual_seed(N * 100003 + K)
        a_all = torch.randn((Ms[-1], K), generator=gen, device="cuda").to(dtype)
        b = (torch.randn((K, N), generator=gen, device="cuda") * K ** -0.5).to(dtype)
        failed = {}  # this shape: config name -> the error that stopped it (never timed; the check fails)
        w = b.t().contiguous()  # the same B as a linear layer's (N, K) weight
        full = MM.mm(a_all, b)
        full_cublas = torch.mm(a_all, b)
        bad_configs, rows_bad, variant_differs, cublas_differs = [], [], [], []
        for M in Ms:
            a = a_all[:M]
            default = MM.mm(a, b)
            if not bitwise_equal(default, full[:M]):
                rows_bad.append(M)
            if not bitwise_equal(MM.linear(a, w), default):
                bad_configs.append([M, "default", "linear"])
            ranked = MM.rank_configs(M, N, K, dtype, sms=sms, compiled=True)
            pick = MM.select_config(M, N, K, dtype, sms=sms)
            assert pick is ranked[0][1]
            over = deadline_s is not None and time.perf_counter() - t_start > deadline_s
            if over:
                late.append([N, K, M])
            timed_cfgs = [(rank, us, c) for rank, (us, c) in enumerate(ranked[:1 if over else top])]
            if not over:
                timed_cfgs += [(len(ranked) + i, None, c) for i, c in enumerate(extra)]
            checked = [c for _, _, c in timed_cfgs] + ([c for c in MM.invariant_candidates()
                                                        if c not in [x for _, _, x in timed_cfgs]]
                                                       if M == Ms[-1] else [])
            for c in checked:
                if c.name in failed:
                    continue
                try:
                    if not bitwise_equal(MM.mm(a, b, config=c), default):
                        bad_configs.append([M, c.name])
                except Exception as e:  # a config that does not compile here: recorded, never timed
                    failed[c.name] = repr(e)[:400]
            if not bitwise_equal(MM.mm(a, b, impl="variant"), full[:M]):
                variant_differs.append(M)
            if not bitwise_equal(torch.mm(a, b), full_cublas[:M]):
                cublas_differs.append(M)

            o = torch.empty((M, N), dtype=dtype, device="cuda")
            flop = 2.0 * M * N * K
            nbytes = (M * K + K * N + M * N) * a.element_size()
            sets = rotating_sets(lambda: (a.clone(), b.clone(), torch.empty_like(o)), nbytes) if rotate \
                else [(a, b, o)]

            def timed(impl, fn, **extra):
                t, used = median_us_graph_or_plain(fn, reps=reps, rotate=sets, graph=graph)
                us = t["median_us"]
                row = {"op": "mm", "impl": impl, "dtype": dname, "M": M, "N": N, "K": K,
                       "median_us": us, "p25_us": t["p25_us"], "p75_us": t["p75_us"],
                       "tflops": flop / (us * 1e-6) / 1e12, "gbs": nbytes / (us * 1e-6) / 1e9,
                       "cuda_graph": used, "rotating_sets": len(sets), "pick": pick.name, "sms": sms, **extra}
                rows.append(row)
                return row

            kit = {}
            for rank, pred, c in timed_cfgs:
                if c.name not in failed:
                    kit[c.name] = timed(f"kit-invariant:{c.name}", lambda x, y, z, c=c: MM.mm(x, y, config=c, out=z),
                                        rank=rank, predicted_us=pred, selected=c is pick)
            timed("kit-variant-splitk", lambda x, y, z: MM.mm(x, y, impl="variant", out=z))
            cub = timed("cublas", lambda x, y, z: torch.mm(x, y, out=z))
            if pick.name in kit:
                best = min(r["median_us"] for r in kit.values())
                kit[pick.name]["cublas_over_pick"] = cub["median_us"] / kit[pick.name]["median_us"]
                kit[pick.name]["pick_over_best"] = kit[pick.name]["median_us"] / best
                print(f"  N={N:<6} K={K:<6} M={M:<5} pick {pick.name:<12} {kit[pick.name]['median_us']:9.1f} us  "
                      f"cuBLAS {cub['median_us']:9.1f} us  ratio {kit[pick.name]['cublas_over_pick']:.2f}  "
                      f"pick/best {kit[pick.name]['pick_over_best']:.2f}", flush=True)
            del sets
        shape = {"dtype": dname, "N": N, "K": K, "Ms": Ms}
        results.append({"name": f"mm: every timed config, and every config at M={Ms[-1]}, gives the pick's bits; "
                                f"linear (N, K) gives them too ({dname}, N={N}, K={K})",
                        "passed": not bad_configs and not failed, "differing_M_config": bad_configs[:50],
                        "configs_failed_to_run": dict(failed), **shape})
        results.append({"name": f"mm: invariant rows equal across M ({dname}, N={N}, K={K})",
                        "passed": not rows_bad, "differing_M": rows_bad, **shape})
        results.append({"name": f"mm: split-K variant differs at some M (negative control; {dname}, N={N}, K={K})",
                        "passed": bool(variant_differs), "differing_M": variant_differs, **shape})
        results.append({"name": f"mm: cuBLAS rows depend on M (observed, not required; {dname}, N={N}, K={K})",
                        "passed": True, "informational": True, "differing_M": cublas_differs, **shape})
        del a_all, b, w, full, full_cublas
        if save is not None:
            save(rows, results + _late_check(late, deadline_s))
    return rows, results + _late_check(late, deadline_s)


def _late_check(late, deadline_s) -> list:
    if deadline_s is None:
        return []
    return [{"name": f"every cell timed the model's runners-up (cells past the {deadline_s:.0f} s budget "
                     "timed the pick only)", "passed": not late, "informational": True, "late_cells": late}]


if __name__ == "__main__":
    import sys

    sys.exit(_refit_main())
