"""The invariant MoE layer with each program order of its grouped GEMM
(``ops.moe.TILE_ORDER``: ``m_fast``, the blocks of one N tile next to each other, and ``n_fast``,
the N tiles of one block next to each other), at the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes of
``bench.moe_vllm.MODELS``, 1-8192 tokens: each cell timed from CUDA-graph replays
(``bench.timing.median_us_graph_or_plain``) with both orders in the same run, and the two outputs
compared bitwise.

    python tools/oneoff/moe_tile_order.py OUT_DIR
"""
import sys

import torch

import batch_invariance_kit  # noqa: F401  (device selection before Triton)
from batch_invariance_kit.bench import moe_vllm as MV
from batch_invariance_kit.bench.timing import median_us_graph_or_plain
from batch_invariance_kit.ops import moe
from batch_invariance_kit.report import results as RS

rows, checks = [], []
shipped = moe.TILE_ORDER
for model, spec in MV.MODELS.items():
    w = MV.layer_weights(spec)
    for n in (1, 16, 64, 256, 1024, 2048, 4096, 8192):
        x = torch.randn(n, spec["hidden"], device="cuda", dtype=torch.bfloat16)
        out, cell = {}, {}
        for order in moe.TILE_ORDERS:
            moe.TILE_ORDER = order
            try:
                out[order] = MV.kit_layer(x, w, spec)
                t, graph = median_us_graph_or_plain(lambda a: MV.kit_layer(a, w, spec), rotate=[(x,)], reps=50)
            finally:
                moe.TILE_ORDER = shipped
            cell[order] = t["median_us"]
            rows.append({"op": "moe_tile_order", "model": model, "tokens": n, "order": order, **t,
                         "cuda_graph": graph})
        same = bool(torch.equal(out["m_fast"].view(torch.int16), out["n_fast"].view(torch.int16)))
        checks.append({"name": f"{model} T={n}: both orders give the same bits", "passed": same})
        print(f"{model:<17} T={n:<5} m_fast {cell['m_fast']:8.1f} us  n_fast {cell['n_fast']:8.1f} us  "
              f"m_fast / n_fast {cell['m_fast'] / cell['n_fast']:.3f}  bits equal {same}")
print(RS.save("moe_tile_order", rows, checks, folder=sys.argv[1], command="python tools/oneoff/moe_tile_order.py <dir>"))
sys.exit(0 if all(c["passed"] for c in checks) else 1)
