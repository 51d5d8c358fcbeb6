"""The kit's invariant MoE layer beside vLLM's default Triton ``fused_moe``, on a GPU with vLLM's
CUDA build: bf16, Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (:data:`MODELS`), 1 ... 8192 tokens.

Both layers start from the same hidden states and weights and end with the layer's output:

* the kit (``kit-invariant``): :func:`batch_invariance_kit.ops.moe.fused_moe` (gating matmul,
  router, dispatch, grouped GEMMs, combine) and, for DeepSeek-V2-Lite, the shared experts
  (:func:`batch_invariance_kit.ops.routing.shared_mlp`, whose output the combine adds in fp32
  inside its one rounding);
* vLLM as a model runs it by default (``vllm-fused_moe``): the gate as ``F.linear`` (cuBLAS),
  ``fused_topk`` (softmax top-k), ``fused_experts`` (its Triton kernels with its own config
  choice: a tuned table where vLLM ships one for the device) and the shared experts as
  ``F.linear``, vLLM's ``silu_and_mul``, ``F.linear``, added in bf16.

Each cell is timed from CUDA-graph replays (:func:`.timing.median_us_graph_or_plain`: median and
quartiles); the speed ratio (vLLM's time / the kit's) is a goal, never a failure.  In the same
run every batch's outputs are compared bitwise with the same tokens run alone: the kit's must
be equal (a required check); vLLM's are recorded as observed.

    python -m batch_invariance_kit.bench.moe_vllm --out DIR [--quick] [--tokens 1 64 4096] [--models ...]

writes ``DIR/moe_vs_vllm.json`` (the validation command's ``moe_vs_vllm`` part runs the same function).
:func:`stages` (the ``moe_stages`` part, by name only) times each step of both layers alone at
thin batches: where a layer's time goes when its weights, not its FLOPs, set the pace.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..ops import moe, routing
from ..report.results import goal
from ..verify.harness import bitwise_equal
from .moe import DTYPE, token_counts
from .timing import median_us_graph_or_plain

#: The MoE layers compared: routed experts (experts, top-k, hidden, expert intermediate); whether
#: the top-k weights are renormalised (Qwen3-MoE's ``norm_topk_prob``; off in DeepSeek-V2-Lite,
#: whose routing is a softmax top-6 without groups, scaling factor 1); shared experts (DeepSeek-V2-Lite:
#: two, one MLP of twice the expert intermediate beside the routed ones)
MODELS = {
    "Qwen3-30B-A3B": dict(experts=128, top_k=8, hidden=2048, inter=768, renormalize=True, shared=0),
    "DeepSeek-V2-Lite": dict(experts=64, top_k=6, hidden=2048, inter=1408, renormalize=False, shared=2),
}
KIT_IMPL = "kit-invariant"
#: vLLM's name in the rows
VLLM_IMPL = "vllm-fused_moe"
#: token positions compared with the token alone (those inside the batch, and its last token)
PROBES = (0, 1, 7, 100, 1000, 5000)
#: the speed goal: the kit at least this fraction of vLLM's speed in every cell
GOAL = 0.9


def layer_weights(spec: dict, seed: int = 0, device="cuda", dtype: torch.dtype = DTYPE) -> dict:
    """Seeded weights (bf16 by default) of one MoE layer of ``spec`` (an entry of :data:`MODELS`) on ``device``:
    ``router`` (E, H), ``w13`` (E, 2I, H) (gate rows, then up), ``w2`` (E, H, I), and for shared
    experts ``shared_gate_up`` (2 I_s, H), ``shared_down`` (H, I_s) with ``I_s = shared * I``."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = spec["experts"], spec["hidden"], spec["inter"]

    def draw(*shape):
        return (torch.randn(shape, generator=g, device=device) * shape[-1] ** -0.5).to(dtype)

    w = {"router": draw(e, h), "w13": draw(e, 2 * i, h), "w2": draw(e, h, i),
         "shared_gate_up": None, "shared_down": None}
    if spec["shared"]:
        i_s = spec["shared"] * i
        w["shared_gate_up"], w["shared_down"] = draw(2 * i_s, h), draw(h, i_s)
    return w


def kit_layer(x: torch.Tensor, w: dict, spec: dict, impl: str = "invariant") -> torch.Tensor:
    """The kit's MoE layer of ``spec`` on ``x`` (T, H) with the weights ``w`` of :func:`layer_weights`."""
    shared = None if w["shared_gate_up"] is None else routing.shared_mlp(x, w["shared_gate_up"], w["shared_down"],
                                                                          impl=impl)
    return moe.fused_moe(x, w["router"], w["w13"], w["w2"], spec["top_k"], renormalize=spec["renormalize"],
                         impl=impl, shared=shared)


def _silu_and_mul():
    """``(function, name)``: vLLM's fused ``silu_and_mul`` op where its CUDA build registered it,
    else the same formula in torch."""
    try:
        op = torch.ops._C.silu_and_mul
    except (AttributeError, RuntimeError):
        op = None
    if op is None:
        return (lambda gu: F.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]), "torch silu * up"

    def fused(gu):
        out = gu.new_empty((gu.shape[0], gu.shape[1] // 2))
        op(out, gu)
        return out
    return fused, "vllm _C.silu_and_mul"


def vllm_layer():
    """vLLM's default-mode MoE layer as ``(run, parts)``: ``run(x, w, spec) -> out`` and a line
    naming what it calls.  Needs vLLM's CUDA build; raises a RuntimeError naming what is missing
    otherwise."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    except Exception as e:  # the CPU build has no Triton fused MoE; the CUDA build lives on the GPU box
        raise RuntimeError(f"vLLM's CUDA build (vllm.model_executor.layers.fused_moe) is not importable: {e!r}") \
            from None
    silu_and_mul, act = _silu_and_mul()

    def run(x, w, spec):
        logits = F.linear(x, w["router"])
        topk = fused_topk(x, logits, spec["top_k"], spec["renormalize"])  # (weights, ids[, token indices])
        out = fused_experts(x, w["w13"], w["w2"], topk[0], topk[1])
        if w["shared_gate_up"] is None:
            return out
        return out + F.linear(silu_and_mul(F.linear(x, w["shared_gate_up"])), w["shared_down"])
    return run, f"F.linear gate, fused_topk, fused_experts; shared experts: F.linear, {act}, F.linear, bf16 add"


def _invariant_mode_env() -> str | None:
    """``VLLM_BATCH_INVARIANT`` when set to anything but off: vLLM's own invariant mode is then on."""
    v = os.environ.get("VLLM_BATCH_INVARIANT")
    return v if v not in (None, "", "0", "false", "False") else None


def _narrow(tokens, models) -> tuple:
    """``(sorted token counts, model names)`` of a run, checked: positive counts, names of :data:`MODELS`."""
    sizes = sorted({int(n) for n in tokens})
    if sizes[0] < 1:
        raise ValueError(f"tokens must be positive, got {sizes}")
    names = list(MODELS) if not models else list(models)
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise ValueError(f"models must be among {list(MODELS)}, got {unknown}")
    return sizes, names


def _layer_inputs(spec: dict, max_tokens: int) -> tuple:
    """``(weights, x_all)``: :func:`layer_weights` of ``spec`` and ``max_tokens`` seeded hidden states."""
    w = layer_weights(spec)
    dev = w["router"].device
    g = torch.Generator(device=dev).manual_seed(1)
    return w, torch.randn((max_tokens, spec["hidden"]), generator=g, device=dev).to(w["router"].dtype)


def vs_vllm(quick: bool, *, tokens=None, models=None) -> tuple:
    """Rows (one per model, token count and implementation: median, quartiles, TFLOP/s, rows
    differing from the token alone) and checks: per model, the kit's layer gives every probed
    token the bits of the token alone (required) and what vLLM's does (observed); how far the
    two outputs are apart at 64 tokens (observed: other summation orders, and a token whose
    top-k ties may pick another expert); per cell, the goal kit >= :data:`GOAL` x vLLM's speed.
    ``tokens`` (default 1 ... 8192; ``quick``: 4 counts) and ``models`` (default all of
    :data:`MODELS`) narrow the run.  About 4 minutes on an H200."""
    vllm_run, vllm_parts = vllm_layer()
    sizes, names = _narrow(tokens or token_counts(quick), models)
    reps = 30 if quick else 100
    rows, checks = [], []
    for model in names:
        spec = MODELS[model]
        k, h, i = spec["top_k"], spec["hidden"], spec["inter"]
        w, x_all = _layer_inputs(spec, max(sizes))
        fns = {KIT_IMPL: lambda a: kit_layer(a, w, spec), VLLM_IMPL: lambda a: vllm_run(a, w, spec)}
        alone: dict = {impl: {} for impl in fns}

        def token_alone(impl, p):
            if p not in alone[impl]:
                alone[impl][p] = fns[impl](x_all[p:p + 1].clone())[0].clone()
            return alone[impl][p]

        n_cmp = min(64, max(sizes))
        kit_o, vllm_o = (fns[impl](x_all[:n_cmp].clone()).float() for impl in (KIT_IMPL, VLLM_IMPL))
        checks.append({"name": f"{model}: kit and vLLM outputs at {n_cmp} tokens (observed)", "passed": True,
                       "informational": True, "max_abs_diff_over_max_abs":
                       float((kit_o - vllm_o).abs().max() / vllm_o.abs().max().clamp_min(1e-30))})
        flops_per_token = 2.0 * k * 3 * h * i + (2.0 * 3 * h * spec["shared"] * i if spec["shared"] else 0.0)
        for n in sizes:
            x = x_all[:n].clone()
            positions = sorted({p for p in PROBES if p < n} | {n - 1})
            cell = {}
            for impl, fn in fns.items():
                out = fn(x)
                differ = [p for p in positions if not bitwise_equal(out[p], token_alone(impl, p))]
                t, graph = median_us_graph_or_plain(fn, rotate=[(x,)], reps=reps)
                cell[impl] = t
                rows.append({"op": "moe", "impl": impl, "model": model, "tokens": n, "experts": spec["experts"],
                             "top_k": k, "hidden": h, "inter": i, "shared_experts": spec["shared"],
                             "renormalize": spec["renormalize"], "dtype": "bfloat16", **t,
                             "tflops": flops_per_token * n / (t["median_us"] * 1e-6) / 1e12, "cuda_graph": graph,
                             "rows_compared": len(positions), "rows_differing_from_alone": len(differ),
                             "positions_differing": differ,
                             **({"layer_calls": vllm_parts} if impl == VLLM_IMPL else {})})
            kit_t, vllm_t = cell[KIT_IMPL], cell[VLLM_IMPL]
            ratio = vllm_t["median_us"] / kit_t["median_us"]
            print(f"  {model:<17} T={n:<5} kit {kit_t['median_us']:8.1f} us [{kit_t['p25_us']:.1f}, "
                  f"{kit_t['p75_us']:.1f}]  vLLM {vllm_t['median_us']:8.1f} us [{vllm_t['p25_us']:.1f}, "
                  f"{vllm_t['p75_us']:.1f}]  speed ratio {ratio:.2f}", flush=True)
            checks.append(goal(f"moe {model} T={n}: invariant >= {GOAL}x vLLM fused_moe's speed", ratio >= GOAL,
                               model=model, tokens=n, speed_ratio_vs_vllm=ratio,
                               kit_p25_p75_us=[kit_t["p25_us"], kit_t["p75_us"]],
                               vllm_p25_p75_us=[vllm_t["p25_us"], vllm_t["p75_us"]]))
        mine = [r for r in rows if r["model"] == model]
        checks.append({"name": f"{model}: the kit's invariant MoE layer gives every probed token the bits of the "
                               f"token alone at every batch size", "passed":
                       all(r["rows_differing_from_alone"] == 0 for r in mine if r["impl"] == KIT_IMPL),
                       "rows_compared": sum(r["rows_compared"] for r in mine if r["impl"] == KIT_IMPL)})
        checks.append({"name": f"{model}: vLLM's default fused_moe, batch sizes where a token differs from the "
                               f"token alone (observed)", "passed": True, "informational": True,
                       "tokens_differing": [r["tokens"] for r in mine
                                            if r["impl"] == VLLM_IMPL and r["rows_differing_from_alone"]],
                       "vllm_batch_invariant_env": os.environ.get("VLLM_BATCH_INVARIANT")})
    return rows, checks


#: The steps of each layer that :func:`stages` times one at a time, in the order they run
KIT_STAGES = ("shared", "gating", "route", "dispatch", "gate_up", "down", "combine")
VLLM_STAGES = ("gating", "topk", "experts", "shared")
#: token counts of :func:`stages` (the thin batches, where a layer's fixed costs show)
STAGE_TOKENS = (1, 2, 8, 64)


def kit_steps(x: torch.Tensor, w: dict, spec: dict) -> dict:
    """The kit's invariant layer (:func:`kit_layer`) cut into its steps: ``{stage: (fn, args)}``
    in :data:`KIT_STAGES` order (``shared`` only with shared experts), each step's inputs computed
    once beforehand by the steps before it, so that ``fn(*args)`` launches that step alone.  The
    last step's output is the layer's (a test checks the bits under the interpreter)."""
    from ..ops import matmul as MM

    E, k = spec["experts"], spec["top_k"]
    cfg = moe.select_config(x.shape[0], k, E, x.dtype)
    steps = {}
    shared = None
    if w["shared_gate_up"] is not None:
        steps["shared"] = (lambda a: routing.shared_mlp(a, w["shared_gate_up"], w["shared_down"]), (x,))
        shared = steps["shared"][0](x)
    steps["gating"] = (lambda a: MM.linear(a, w["router"]), (x,))
    logits = steps["gating"][0](x)
    steps["route"] = (lambda lg: moe.route(lg, k, renormalize=spec["renormalize"]), (logits,))
    wts, ids = steps["route"][0](logits)
    steps["dispatch"] = (lambda i: moe.dispatch(i, E, cfg.block_m, validate=False), (ids,))
    disp = steps["dispatch"][0](ids)
    steps["gate_up"] = (lambda a, d: moe.grouped_gemm(a, w["w13"], d, activation="silu_mul", gather_tokens=True,
                                                      config=cfg), (x, disp))
    h = steps["gate_up"][0](x, disp)
    steps["down"] = (lambda a, d: moe.grouped_gemm(a, w["w2"], d, config=cfg), (h, disp))
    y = steps["down"][0](h, disp)
    steps["combine"] = (lambda a, t, sh: moe.combine(a, t, shared=sh), (y, wts, shared))
    return steps


def vllm_steps(x: torch.Tensor, w: dict, spec: dict) -> dict:
    """vLLM's default layer (:func:`vllm_layer`) cut the same way: ``{stage: (fn, args)}`` in
    :data:`VLLM_STAGES` order (``shared`` with shared experts: its MLP and the bf16 add)."""
    from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk

    silu_and_mul, _ = _silu_and_mul()
    steps = {"gating": (lambda a: F.linear(a, w["router"]), (x,))}
    logits = steps["gating"][0](x)
    steps["topk"] = (lambda a, lg: fused_topk(a, lg, spec["top_k"], spec["renormalize"]), (x, logits))
    topk = steps["topk"][0](x, logits)
    steps["experts"] = (lambda a, t, i: fused_experts(a, w["w13"], w["w2"], t, i), (x, topk[0], topk[1]))
    if w["shared_gate_up"] is not None:
        out = steps["experts"][0](x, topk[0], topk[1])
        steps["shared"] = (lambda a, o: o + F.linear(silu_and_mul(F.linear(a, w["shared_gate_up"])),
                                                      w["shared_down"]), (x, out))
    return steps


def stages(quick: bool, *, tokens=None, models=None) -> tuple:
    """Where each layer's time goes at thin batches: every step of :func:`kit_steps` and
    :func:`vllm_steps` timed alone (CUDA-graph replays), beside the whole layer, at
    :data:`STAGE_TOKENS` tokens (``tokens`` and ``models`` narrow the run).  Rows ``op
    "moe_stage"`` (``stage`` a step's name, or ``"layer"``); no speed goal (the layers' goals are
    :func:`vs_vllm`'s).  The check: the kit's steps run in order give the layer's bits."""
    vllm_run, _ = vllm_layer()
    sizes, names = _narrow(tokens or STAGE_TOKENS, models)
    reps = 30 if quick else 100
    rows, checks = [], []
    for model in names:
        spec = MODELS[model]
        w, x_all = _layer_inputs(spec, max(sizes))
        same = []
        for n in sizes:
            x = x_all[:n].clone()
            layers = {KIT_IMPL: (lambda a: kit_layer(a, w, spec), kit_steps(x, w, spec)),
                      VLLM_IMPL: (lambda a: vllm_run(a, w, spec), vllm_steps(x, w, spec))}
            fn, args = layers[KIT_IMPL][1]["combine"]
            same.append(bitwise_equal(fn(*args), kit_layer(x, w, spec)))
            for impl, (layer, steps) in layers.items():
                parts = {"layer": (layer, (x,)), **steps}
                times = {}
                for stage, (fn, args) in parts.items():
                    t, graph = median_us_graph_or_plain(lambda fn=fn, args=args: fn(*args), reps=reps)
                    times[stage] = t["median_us"]
                    rows.append({"op": "moe_stage", "impl": impl, "model": model, "tokens": n, "stage": stage,
                                 **t, "cuda_graph": graph})
                print(f"  {model:<17} T={n:<5} {impl:<15} layer {times.pop('layer'):7.1f} us = "
                      + ", ".join(f"{s} {v:.1f}" for s, v in times.items()), flush=True)
        checks.append({"name": f"{model}: the kit's steps, run one by one, give the layer's bits at every token count",
                       "passed": all(same)})
    return rows, checks


def main(argv=None) -> int:
    """``python -m batch_invariance_kit.bench.moe_vllm --out DIR``: :func:`vs_vllm` on this GPU,
    saved as ``DIR/moe_vs_vllm.json`` (default ``results/local``) with provenance.  Exits with a
    message, before measuring anything, on a machine without CUDA, without vLLM's CUDA build,
    or with vLLM's own invariant mode switched on (the peer is vLLM's default mode)."""
    import argparse

    from ..report import results

    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.bench.moe_vllm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder of moe_vs_vllm.json (default: results/local)")
    p.add_argument("--quick", action="store_true", help="4 token counts and fewer replays")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts (default 1 ... 8192)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: every model")
    args = p.parse_args(argv)
    if args.tokens is not None and min(args.tokens) < 1:
        p.error(f"--tokens must be positive, got {args.tokens}")
    if _invariant_mode_env():
        raise SystemExit(f"VLLM_BATCH_INVARIANT={os.environ['VLLM_BATCH_INVARIANT']}: the peer is vLLM's default "
                         f"mode; unset it (or set it to 0) and run again")
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_vllm times CUDA kernels beside vLLM's fused_moe: run it on a GPU box "
                         "with vLLM's CUDA build")
    try:
        vllm_layer()
    except RuntimeError as e:
        raise SystemExit(f"bench.moe_vllm: {e}") from None
    rows, checks = vs_vllm(args.quick, tokens=args.tokens, models=args.models)
    print(f"wrote {results.save('moe_vs_vllm', rows, checks, folder=args.out)}")
    failed = [c["name"] for c in results.of_kind(checks, "required") if not c["passed"]]
    for name in failed:
        print(f"FAILED: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
