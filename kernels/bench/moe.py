"""The MoE chapter's GPU measurements at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048,
expert intermediate 768, bf16).  Each function returns ``(rows, checks)`` in the shape of
:mod:`batch_invariance_kit.report.results`; :mod:`.parts` names them (the ``moe_*`` parts).

* :func:`invariance`: a token alone vs the same token inside batches of 1..8192 tokens, uniform
  and skewed routing; the invariant MoE must never differ, the variant must differ somewhere;
* :func:`loads`: tokens per expert against the batch size (the chapter's histogram figure);
* :func:`bench`: median time of the invariant MoE and of the variant with its tuned table;
* :func:`tiles`: every grouped-GEMM tile of :data:`TILE_GRID` forced (bits and time, vLLM beside
  them), the data for choosing :data:`batch_invariance_kit.ops.moe.INVARIANT_TABLE`'s rows.

The comparison with vLLM's own ``fused_moe`` is :mod:`.moe_vllm`.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ops import moe
from .timing import median_us_graph_or_plain
from ..report.results import goal
from ..verify.harness import bitwise_equal, ulp_distance

E, TOPK, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
ROUTINGS = ("uniform", "skewed")
HOT = 8  # skewed routing: most tokens prefer these experts


def token_counts(quick: bool) -> list:
    """The token counts of the MoE measurements: 1 ... 8192 (``quick``: 1, 16, 256, 4096)."""
    return [1, 16, 256, 4096] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def _weights(seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rw = torch.randn((E, HIDDEN), generator=g, device="cuda") * HIDDEN ** -0.5
    u = torch.randn((HIDDEN,), generator=g, device="cuda")
    u = u / u.norm()
    w13 = (torch.randn((E, 2 * INTER, HIDDEN), generator=g, device="cuda") * HIDDEN ** -0.5).to(DTYPE)
    w2 = (torch.randn((E, HIDDEN, INTER), generator=g, device="cuda") * INTER ** -0.5).to(DTYPE)
    skewed_rw = rw.clone()
    skewed_rw[:HOT] += 3.0 * u  # the hot experts share a direction ...
    return {"uniform": rw.to(DTYPE), "skewed": skewed_rw.to(DTYPE)}, w13, w2, u


def _tokens(n: int, routing: str, u: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((n, HIDDEN), generator=g, device="cuda")
    if routing == "skewed":
        x = x + 2.0 * u  # ... that every token carries
    return x.to(DTYPE)


def invariance(quick: bool) -> tuple:
    sizes = token_counts(quick)
    rws, w13, w2, u = _weights()
    probes = [0, 1, 7, 100, 1000, 5000]
    rows, checks = [], []
    for routing in ROUTINGS:
        rw = rws[routing]
        x_all = _tokens(max(sizes), routing, u)
        for impl in ("invariant", "variant"):
            f = lambda x: moe.fused_moe(x, rw, w13, w2, TOPK, impl=impl)  # noqa: E731
            alone = {p: f(x_all[p:p + 1].clone())[0] for p in probes if p < max(sizes)}
            for n in sizes:
                out = f(x_all[:n])
                ps = [p for p in probes if p < n] + ([n - 1] if n - 1 not in probes else [])
                if n - 1 not in alone:
                    alone[n - 1] = f(x_all[n - 1:n].clone())[0]
                differ = [p for p in ps if not bitwise_equal(out[p], alone[p])]
                max_ulp = max((int(ulp_distance(out[p], alone[p]).max()) for p in differ), default=0)
                rows.append({"op": "moe", "impl": impl, "routing": routing, "tokens": n, "experts": E, "top_k": TOPK,
                             "hidden": HIDDEN, "inter": INTER, "dtype": "bfloat16", "rows_compared": len(ps),
                             "rows_differing": len(differ), "positions_differing": differ, "max_ulp": max_ulp,
                             "config": moe.select_config(n, TOPK, E, DTYPE, impl).name})
                print(f"  {routing:<8} {impl:<9} T={n:<5} rows differing {len(differ)} of {len(ps)}", flush=True)
        inv = [r for r in rows if r["routing"] == routing and r["impl"] == "invariant"]
        var = [r for r in rows if r["routing"] == routing and r["impl"] == "variant"]
        checks.append({"name": f"moe invariant ({routing} routing): a token alone == the token in every batch",
                       "passed": all(r["rows_differing"] == 0 for r in inv),
                       "rows_compared": sum(r["rows_compared"] for r in inv)})
        checks.append({"name": f"moe variant ({routing} routing): the same check finds a difference (negative control)",
                       "passed": any(r["rows_differing"] > 0 for r in var),
                       "differing_tokens": [r["tokens"] for r in var if r["rows_differing"]]})
    return rows, checks


def loads(quick: bool) -> tuple:
    sizes = token_counts(quick)
    rws, _, _, u = _weights()
    rows = []
    for routing in ROUTINGS:
        x_all = _tokens(max(sizes), routing, u)
        for n in sizes:
            logits = moe.MM.linear(x_all[:n], rws[routing])
            _, ids = moe.route(logits, TOPK)
            counts = torch.bincount(ids.reshape(-1).long(), minlength=E).cpu()
            inv = moe.select_config(n, TOPK, E, DTYPE, "invariant")
            var = moe.select_config(n, TOPK, E, DTYPE, "variant")
            padded = int((-(-counts // inv.block_m) * inv.block_m).sum())
            rows.append({"op": "moe_loads", "impl": "kit-invariant-router", "routing": routing, "tokens": n,
                         "experts": E, "top_k": TOPK, "counts": counts.tolist(), "max": int(counts.max()),
                         "min": int(counts.min()), "mean": n * TOPK / E, "experts_idle": int((counts == 0).sum()),
                         "padded_rows": padded, "invariant_config": inv.as_dict(), "variant_config": var.as_dict()})
            print(f"  {routing:<8} T={n:<5} max {int(counts.max())} idle {int((counts == 0).sum())}", flush=True)
    checks = [{"name": "every routed (token, expert) pair is counted once", "passed":
               all(sum(r["counts"]) == r["tokens"] * TOPK for r in rows)}]
    return rows, checks


def bench(quick: bool) -> tuple:
    sizes = token_counts(quick)
    rws, w13, w2, u = _weights()
    rw = rws["uniform"]
    x_all = _tokens(max(sizes), "uniform", u)
    rows, checks = [], []
    for n in sizes:
        x = x_all[:n].clone()
        cell = {}
        for impl in ("invariant", "variant"):
            fn = lambda a, impl=impl: moe.fused_moe(a, rw, w13, w2, TOPK, impl=impl)  # noqa: E731
            t, graph = median_us_graph_or_plain(fn, rotate=[(x,)], reps=30 if quick else 100)
            flop = 2.0 * n * TOPK * 3 * HIDDEN * INTER
            cell[impl] = t["median_us"]
            rows.append({"op": "moe", "impl": f"kit-{impl}", "tokens": n, "experts": E, "top_k": TOPK,
                         "hidden": HIDDEN, "inter": INTER, "dtype": "bfloat16", **t,
                         "tflops": flop / (t["median_us"] * 1e-6) / 1e12, "cuda_graph": graph,
                         "config": moe.select_config(n, TOPK, E, DTYPE, impl).as_dict()})
        ratio = cell["invariant"] / cell["variant"]
        print(f"  T={n:<5} invariant {cell['invariant']:.1f} us, variant {cell['variant']:.1f} us, "
              f"ratio {ratio:.2f}", flush=True)
        checks.append(goal(f"moe T={n}: invariant at least 0.85x the variant's speed", ratio <= 1 / 0.85,
                           ratio_invariant_over_variant=ratio))
    return rows, checks


#: Grouped-GEMM tiles :func:`tiles` times: (BLOCK_M, BLOCK_N, num_warps, num_stages).  The K step
#: is the dtype's (:func:`batch_invariance_kit.ops.k_order.block_k`): only the M/N tiling varies.
#: Every tile fits sm_90's 227 KB of shared memory per block (128 x 256 with three stages needs 240 KB).
TILE_GRID = ((16, 32, 4, 4), (16, 32, 4, 5), (16, 64, 4, 4), (16, 64, 4, 5), (16, 128, 4, 4), (32, 64, 4, 4),
             (64, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (64, 256, 8, 3),
             (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3))


def tile_configs(dtype: torch.dtype = DTYPE) -> list:
    """The :class:`batch_invariance_kit.ops.moe.MoEConfig` of every tile of :data:`TILE_GRID`."""
    bk = moe.k_order.block_k(dtype)
    cfgs = [moe.MoEConfig("", bm, bn, bk, 1, nw, ns) for bm, bn, nw, ns in TILE_GRID]
    return [dataclasses.replace(c, name=tile_name(c)) for c in cfgs]


def tiles(quick: bool) -> tuple:
    """The invariant MoE layer (routed experts) with every grouped-GEMM tile of :data:`TILE_GRID`
    forced, at the shapes of :data:`batch_invariance_kit.bench.moe_vllm.MODELS` (Qwen3-30B-A3B,
    DeepSeek-V2-Lite), 1 ... 8192 tokens: each tile timed (CUDA-graph replays) and checked bitwise
    against the table's pick (:data:`batch_invariance_kit.ops.moe.INVARIANT_TABLE`); vLLM's
    default ``fused_moe`` timed beside them where vLLM's CUDA build is installed.  The data for
    choosing the table's rows (:func:`best_tiles`)."""
    from . import moe_vllm as MV

    sizes = token_counts(quick)
    try:
        vllm_run, _ = MV.vllm_layer()
    except RuntimeError:
        vllm_run = None
    rows, checks = [], []
    for model, spec in MV.MODELS.items():
        spec = dict(spec, shared=0)
        w = MV.layer_weights(spec)
        g = torch.Generator(device="cuda").manual_seed(1)
        x_all = torch.randn((max(sizes), spec["hidden"]), generator=g, device="cuda").to(DTYPE)
        bad = []
        for n in sizes:
            x = x_all[:n].clone()
            pick = moe.select_config(n, spec["top_k"], spec["experts"], DTYPE)

            def run(a, cfg=None):
                return moe.fused_moe(a, w["router"], w["w13"], w["w2"], spec["top_k"],
                                     renormalize=spec["renormalize"], config=cfg)

            ref = run(x)
            timed = [("pick", None)] + [(c.name, c) for c in tile_configs()]
            for name, cfg in timed:
                if cfg is not None and not bitwise_equal(run(x, cfg), ref):
                    bad.append([n, name])
                t, graph = median_us_graph_or_plain(lambda a, cfg=cfg: run(a, cfg), rotate=[(x,)],
                                                    reps=20 if quick else 50)
                rows.append({"op": "moe_tile", "model": model, "tokens": n, "impl": "kit-invariant",
                             "config": (cfg or pick).as_dict(), "pick": pick.name, "is_pick": cfg is None, **t,
                             "cuda_graph": graph})
            if vllm_run is not None:
                t, graph = median_us_graph_or_plain(lambda a: vllm_run(a, w, spec), rotate=[(x,)],
                                                    reps=20 if quick else 50)
                rows.append({"op": "moe_tile", "model": model, "tokens": n, "impl": MV.VLLM_IMPL, **t,
                             "cuda_graph": graph})
            best = best_tiles([r for r in rows if r["model"] == model and r["tokens"] == n])[0]
            print(f"  {model:<17} T={n:<5} pick {best['pick_us']:8.1f} us, fastest {best['best']} "
                  f"{best['best_us']:8.1f} us" + (f", vLLM {best['vllm_us']:8.1f} us" if best["vllm_us"] else ""),
                  flush=True)
        checks.append({"name": f"{model}: every grouped-GEMM tile gives the bits of the table's pick at every "
                               f"token count", "passed": not bad, "differing": bad[:40]})
    return rows, checks


def table_against_sweep(rows: list) -> list:
    """Per (model, tokens) of :func:`tiles`' rows: the tile :func:`batch_invariance_kit.ops.moe.select_config`
    picks now (``table``), its time in the sweep, the fastest tile and its time, and the ratio
    ``table_over_fastest`` (1.0: the table picks the fastest tile).  ``tile_name`` names tiles as
    :func:`tile_configs` does."""
    from . import moe_vllm as MV

    cells: dict = {}
    for r in rows:
        if r.get("op") == "moe_tile" and r["impl"] == "kit-invariant" and not r["is_pick"]:
            cells.setdefault((r["model"], r["tokens"]), {})[r["config"]["name"]] = r["median_us"]
    out = []
    for (model, tokens), cell in sorted(cells.items()):
        spec = MV.MODELS[model]
        name = tile_name(moe.select_config(tokens, spec["top_k"], spec["experts"], DTYPE))
        fastest = min(cell, key=cell.get)
        out.append({"model": model, "tokens": tokens, "table": name, "table_us": cell.get(name),
                    "fastest": fastest, "fastest_us": cell[fastest],
                    "table_over_fastest": cell[name] / cell[fastest] if name in cell else None})
    return out


def tile_name(cfg) -> str:
    """``m{BLOCK_M}n{BLOCK_N}w{warps}s{stages}``: a grouped-GEMM tile's name in :func:`tiles`' rows."""
    return f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"


def best_tiles(rows: list) -> list:
    """Per (model, tokens) of :func:`tiles`' rows: the pick's time, the fastest tile and its time,
    the pick / fastest ratio and vLLM's time (``None`` where it was not timed)."""
    cells: dict = {}
    for r in rows:
        if r.get("op") != "moe_tile":
            continue
        c = cells.setdefault((r["model"], r["tokens"]), {"pick_us": None, "best": None, "best_us": None,
                                                         "vllm_us": None})
        if r["impl"] != "kit-invariant":
            c["vllm_us"] = r["median_us"]
            continue
        if r["is_pick"]:
            c["pick_us"] = r["median_us"]
        elif c["best_us"] is None or r["median_us"] < c["best_us"]:
            c["best"], c["best_us"] = r["config"]["name"], r["median_us"]
    out = []
    for (model, tokens), c in sorted(cells.items()):
        ratio = c["pick_us"] / c["best_us"] if c["pick_us"] and c["best_us"] else None
        out.append({"model": model, "tokens": tokens, **c, "pick_over_best": ratio})
    return out
