"""The invariant MoE layer's grouped-GEMM tile (BLOCK_M, BLOCK_N, warps, stages) at Qwen3-30B-A3B and
DeepSeek-V2-Lite shapes (routed experts only), 1-8192 tokens: each tile timed (CUDA-graph replays)
and checked bitwise against the shipped table's pick; vLLM's default fused_moe beside it when vLLM
is importable.

    python tools/oneoff/moe_tiles.py OUT_DIR [deadline_s]
"""
import sys
import time

import torch

from batch_invariance_kit.bench import moe_vllm as MV
from batch_invariance_kit.bench.timing import median_us_graph_or_plain
from batch_invariance_kit.bitwise import bitwise_equal
from batch_invariance_kit.ops import moe
from batch_invariance_kit.report import results as R

out_dir = sys.argv[1]
deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 300.0
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"  # a CPU run (the interpreter, tiny sizes) only smoke-tests the script
TILES = [(16, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4),
         (64, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3)]
TOKENS = [1, 8, 64, 256, 512, 1024, 2048, 4096, 8192] if GPU else [1, 5]
models = dict(MV.MODELS) if GPU else {"tiny": dict(experts=8, top_k=2, hidden=64, inter=32, renormalize=True, shared=0)}
try:
    vllm_run, vllm_parts = MV.vllm_layer() if GPU else (None, None)
except Exception as e:  # vLLM not installed: the kit's tiles only
    vllm_run, vllm_parts = None, repr(e)[:200]
rows, checks, t0 = [], [], time.perf_counter()
for model, spec in models.items():
    spec = dict(spec, shared=0)
    w = MV.layer_weights(spec, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    x_all = torch.randn((max(TOKENS), spec["hidden"]), generator=g, device=DEV).to(w["router"].dtype)
    bad = []
    for n in TOKENS:
        x = x_all[:n].clone()
        pick = moe.select_config(n, spec["top_k"], spec["experts"], x.dtype)

        def run(a, cfg=None):
            return moe.fused_moe(a, w["router"], w["w13"], w["w2"], spec["top_k"], renormalize=spec["renormalize"],
                                 config=cfg)

        ref = run(x)
        late = time.perf_counter() - t0 > deadline
        cands = [None] + ([] if late else [moe.MoEConfig(f"m{bm}n{bn}w{nw}s{ns}", bm, bn, moe.k_order.block_k(x.dtype), 1, nw, ns)
                                           for bm, bn, nw, ns in TILES])
        for cfg in cands:
            name = "pick:" + pick.name if cfg is None else cfg.name
            try:
                same = bitwise_equal(run(x, cfg), ref)
                t, gr = median_us_graph_or_plain(lambda a, cfg=cfg: run(a, cfg), rotate=[(x,)], reps=50) if GPU \
                    else ({"median_us": 0.0, "p25_us": 0.0, "p75_us": 0.0}, False)
            except Exception as e:
                rows.append({"model": model, "tokens": n, "config": name, "error": repr(e)[:300]})
                continue
            if not same:
                bad.append([n, name])
            rows.append({"op": "moe", "model": model, "tokens": n, "config": name, "median_us": t["median_us"],
                         "p25_us": t["p25_us"], "p75_us": t["p75_us"], "same_bits": same, "cuda_graph": gr,
                         **({"tile": list(cfg.as_dict().values())[1:]} if cfg is not None else {})})
        if vllm_run is not None:
            t, gr = median_us_graph_or_plain(lambda a: vllm_run(a, w, spec), rotate=[(x,)], reps=50)
            rows.append({"op": "moe", "model": model, "tokens": n, "config": "vllm-fused_moe", "median_us": t["median_us"],
                         "p25_us": t["p25_us"], "p75_us": t["p75_us"], "cuda_graph": gr})
        cell = sorted((r["median_us"], r["config"]) for r in rows if r["model"] == model and r["tokens"] == n
                      and "median_us" in r)
        print(model, n, [(round(u, 1), c) for u, c in cell[:4]], flush=True)
    checks.append({"name": f"{model}: every tile gives the bits of the table's pick at every token count",
                   "passed": not bad, "differing": bad[:40]})
    R.save("moe_tiles", rows, checks, folder=out_dir, command="python tools/oneoff/moe_tiles.py <dir>",
           extra={"vllm_layer": vllm_parts})
print("elapsed", time.perf_counter() - t0)
