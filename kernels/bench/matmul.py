"""Chapters 1 and 4's GPU measurements: where cuBLAS depends on the batch, and the kit's matmul
against it.  Each function returns ``(rows, checks)`` in the shape of
:mod:`batch_invariance_kit.report.results`; :mod:`.parts` names them.

* :func:`first_divergence`: the first M at which a ``torch.mm`` row depends on the batch;
* :func:`invariance_map`: ``torch.mm`` / ``bmm`` / ``F.linear`` under three cuBLAS set-ups;
* :func:`sweep`: every config's bits and time beside cuBLAS (:func:`config_sweep`);
* :func:`cpu_invariance`: the invariant matmul and its split-K twin under the Triton interpreter.
"""
from __future__ import annotations

import torch

from ..checks import DTYPES, dtype_name
from ..ops import matmul as MM
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


def sweep(quick: bool) -> tuple:
    """:func:`config_sweep` at the chapter's shapes (bf16), the vocabulary projection included."""
    if quick:  # two shapes, six Ms, plus the vocabulary projection at decode sizes
        rows, checks = config_sweep([(4096, 4096), (4096, 12288)], [1, 16, 64, 256, 1024, 4096], torch.bfloat16,
                                    reps=50)
        more = config_sweep([(151936, 4096)], [1, 16], torch.bfloat16, reps=30)
        return rows + more[0], checks + more[1]
    shapes = [(4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
    return config_sweep(shapes, [1, 4, 16, 64, 256, 1024, 4096, 8192], torch.bfloat16, reps=50)


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


def _worth_timing(c: MM.MMConfig, M: int) -> bool:
    """The sweep times thin tiles for thin M and big tiles for big M only (its time budget)."""
    area = c.block_m * c.block_n
    if area <= 64 * 64:
        return M <= 256
    if area >= 128 * 128:
        return M >= 256
    return 16 <= M <= 4096


def config_sweep(shapes, Ms, dtype=torch.bfloat16, *, reps: int = 50, graph: bool = True,
                 rotate: bool = True) -> tuple:
    """On a CUDA GPU: for each ``(N, K)`` in ``shapes`` and each ``M`` in ``Ms``

    (a) checks that every config of :func:`batch_invariance_kit.ops.matmul.invariant_candidates` gives the bits of the default
        config (the table's pick for that M), and that the default config's rows for M equal
        its rows for the largest M (so all Ms and all configs agree row by row); records
        whether the split-K variant and cuBLAS rows differ (negative control / peer);
    (b) times the configs worth timing at that M (:func:`_worth_timing`, and always the
        table's pick), the variant and ``torch.mm`` (cuBLAS) with
        :func:`batch_invariance_kit.bench.timing.median_us` (``graph``: CUDA-graph replays, the same for all;
        ``rotate``: enough copies of the operands to exceed L2, so weights are read from HBM).

    Returns ``(rows, checks)`` in the shape of :mod:`batch_invariance_kit.report.results`."""
    if not torch.cuda.is_available():
        raise RuntimeError("config_sweep needs a CUDA GPU")
    Ms = sorted(set(int(m) for m in Ms))
    dname = dtype_name(dtype)
    cands = MM.invariant_candidates()
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
            for c in cands:
                if c.name in failed:
                    continue
                try:
                    if not bitwise_equal(MM.mm(a, b, config=c), default):
                        bad_configs.append([M, c.name])
                    if not bitwise_equal(MM.linear(a, w, config=c), default):
                        bad_configs.append([M, c.name, "linear"])
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

            def timed(impl, fn):
                t, used = median_us_graph_or_plain(fn, reps=reps, rotate=sets, graph=graph)
                us = t["median_us"]
                rows.append({"op": "mm", "impl": impl, "dtype": dname, "M": M, "N": N, "K": K,
                             "median_us": us, "p25_us": t["p25_us"], "p75_us": t["p75_us"],
                             "tflops": flop / (us * 1e-6) / 1e12, "gbs": nbytes / (us * 1e-6) / 1e9,
                             "cuda_graph": used, "rotating_sets": len(sets)})

            for c in cands:
                if c.name not in failed and (c is MM.select_config(M, N, K, dtype) or _worth_timing(c, M)):
                    timed(f"kit-invariant:{c.name}", lambda x, y, z, c=c: MM.mm(x, y, config=c, out=z))
            timed("kit-variant-splitk", lambda x, y, z: MM.mm(x, y, impl="variant", out=z))
            timed("cublas", lambda x, y, z: torch.mm(x, y, out=z))
            del sets
        shape = {"dtype": dname, "N": N, "K": K, "Ms": Ms}
        results.append({"name": f"mm: every invariant config gives the default config's bits, as mm (K, N) and "
                                f"as linear (N, K) ({dname}, N={N}, K={K})",
                        "passed": not bad_configs and not failed, "differing_M_config": bad_configs[:50],
                        "configs_failed_to_run": dict(failed), **shape})
        results.append({"name": f"mm: invariant rows equal across M ({dname}, N={N}, K={K})",
                        "passed": not rows_bad, "differing_M": rows_bad, **shape})
        results.append({"name": f"mm: split-K variant differs at some M (negative control; {dname}, N={N}, K={K})",
                        "passed": bool(variant_differs), "differing_M": variant_differs, **shape})
        results.append({"name": f"mm: cuBLAS rows depend on M (observed, not required; {dname}, N={N}, K={K})",
                        "passed": True, "informational": True, "differing_M": cublas_differs, **shape})
    return rows, results
