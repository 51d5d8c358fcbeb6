"""The MoE chapter's GPU measurements at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048,
expert intermediate 768, bf16).  Each function returns ``(rows, checks)`` in the shape of
:mod:`batch_invariance_kit.report.results`; :mod:`.parts` names them (the ``moe_*`` parts).

* :func:`invariance`: a token alone vs the same token inside batches of 1..8192 tokens, uniform
  and skewed routing; the invariant MoE must never differ, the variant must differ somewhere;
* :func:`loads`: tokens per expert against the batch size (the chapter's histogram figure);
* :func:`bench`: median time of the invariant MoE and of the variant with its tuned table;
* :func:`vs_vllm`: the invariant MoE beside vLLM's default Triton ``fused_moe`` (its router
  top-k and ``fused_experts``), at Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (:data:`MODELS`).
"""
from __future__ import annotations

import torch

from ..ops import moe
from .timing import median_us_graph_or_plain
from ..report.results import goal
from ..verify.harness import bitwise_equal, ulp_distance

E, TOPK, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
ROUTINGS = ("uniform", "skewed")
HOT = 8  # skewed routing: most tokens prefer these experts


def _sizes(quick: bool) -> list:
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
    sizes = _sizes(quick)
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
    sizes = _sizes(quick)
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
    sizes = _sizes(quick)
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


#: The MoE layers of :func:`vs_vllm`: routed experts only (DeepSeek-V2-Lite's two shared experts
#: are a dense MLP beside them): experts, top-k, hidden, expert intermediate, renormalize the
#: top-k weights (Qwen3-MoE's ``norm_topk_prob``; DeepSeek-V2-Lite does not)
MODELS = {
    "Qwen3-30B-A3B": dict(experts=128, top_k=8, hidden=2048, inter=768, renormalize=True),
    "DeepSeek-V2-Lite": dict(experts=64, top_k=6, hidden=2048, inter=1408, renormalize=False),
}
#: vLLM's name in the rows of :func:`vs_vllm`
VLLM_IMPL = "vllm-fused_moe"


def vllm_moe():
    """vLLM's default-mode MoE layer as a function ``(x, router_weight, w13, w2, top_k,
    renormalize) -> out``: the gate as a plain ``F.linear`` (vLLM's ``ReplicatedLinear``:
    cuBLAS), ``fused_topk`` (softmax, top-k) and the Triton ``fused_experts`` with its own
    config choice (tuned tables where vLLM ships one for the device).  Needs vLLM's CUDA build;
    raises a RuntimeError naming what is missing otherwise."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    except Exception as e:  # the CPU build has no Triton fused MoE; the CUDA build lives on the GPU box
        raise RuntimeError(f"vLLM's CUDA build (vllm.model_executor.layers.fused_moe) is not importable: {e!r}") \
            from None

    def run(x, router_weight, w13, w2, top_k, renormalize):
        logits = torch.nn.functional.linear(x, router_weight)
        res = fused_topk(x, logits, top_k, renormalize)
        return fused_experts(x, w13, w2, res[0], res[1])
    return run


def _layer(spec: dict, seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = spec["experts"], spec["hidden"], spec["inter"]
    rw = (torch.randn((e, h), generator=g, device="cuda") * h ** -0.5).to(DTYPE)
    w13 = (torch.randn((e, 2 * i, h), generator=g, device="cuda") * h ** -0.5).to(DTYPE)
    w2 = (torch.randn((e, h, i), generator=g, device="cuda") * i ** -0.5).to(DTYPE)
    return rw, w13, w2


def vs_vllm(quick: bool) -> tuple:
    """The kit's invariant MoE layer (gating matmul, router, dispatch, grouped GEMMs, combine)
    and vLLM's default one (:func:`vllm_moe`), bf16, at the :data:`MODELS` shapes, 1 ... 8192
    tokens, timed from CUDA-graph replays.  Goal: the kit >= 0.9x vLLM's speed in every cell
    (reported, never a failure).  Also records how far the two outputs are apart at 64 tokens
    (observed: different summation orders, and a token whose top-k ties may pick another expert).
    About 3 minutes on an H200 (``quick``: 4 token counts)."""
    vllm_fn = vllm_moe()
    import os

    sizes = _sizes(quick)
    rows, checks = [], []
    for model, spec in MODELS.items():
        rw, w13, w2 = _layer(spec)
        k, h, i, renorm = spec["top_k"], spec["hidden"], spec["inter"], spec["renormalize"]
        g = torch.Generator(device="cuda").manual_seed(1)
        x_all = torch.randn((max(sizes), h), generator=g, device="cuda").to(DTYPE)
        fns = {"kit-invariant": lambda a: moe.fused_moe(a, rw, w13, w2, k, renormalize=renorm),
               VLLM_IMPL: lambda a: vllm_fn(a, rw, w13, w2, k, renorm)}
        x64 = x_all[:64]
        kit64, vllm64 = fns["kit-invariant"](x64).float(), fns[VLLM_IMPL](x64).float()
        rel = float((kit64 - vllm64).abs().max() / vllm64.abs().max().clamp_min(1e-30))
        checks.append({"name": f"{model}: kit and vLLM outputs at 64 tokens (observed)", "passed": True,
                       "informational": True, "max_abs_diff_over_max_abs": rel,
                       "vllm_batch_invariant_env": os.environ.get("VLLM_BATCH_INVARIANT")})
        for n in sizes:
            x = x_all[:n].clone()
            cell = {}
            for impl, fn in fns.items():
                t, graph = median_us_graph_or_plain(fn, rotate=[(x,)], reps=30 if quick else 100)
                cell[impl] = t["median_us"]
                flop = 2.0 * n * k * 3 * h * i
                rows.append({"op": "moe", "impl": impl, "model": model, "tokens": n, "experts": spec["experts"],
                             "top_k": k, "hidden": h, "inter": i, "renormalize": renorm, "dtype": "bfloat16", **t,
                             "tflops": flop / (t["median_us"] * 1e-6) / 1e12, "cuda_graph": graph})
            ratio = cell[VLLM_IMPL] / cell["kit-invariant"]
            print(f"  {model:<17} T={n:<5} kit {cell['kit-invariant']:8.1f} us  vLLM {cell[VLLM_IMPL]:8.1f} us  "
                  f"speed ratio {ratio:.2f}", flush=True)
            checks.append(goal(f"moe {model} T={n}: invariant >= 0.9x vLLM fused_moe's speed", ratio >= 0.9,
                               model=model, tokens=n, speed_ratio_vs_vllm=ratio))
    return rows, checks
