"""Scratch (not committed): decode schedule sweep 2 + ncu profile helper."""
import json, sys, time
import torch
from kernels import attention as A
from kernels import attention_bench as AB
from kernels import results

T = dict(decode_block_m=16, row_sum="tree", tree_merge=True)
C = A.AttnConfig
CONFIGS = [
    C(64, 64, 512, decode_num_warps=4, **T),
    C(64, 64, 512, decode_num_warps=2, **T),
    C(64, 64, 512, decode_num_warps=4, decode_num_stages=3, **T),
    C(64, 64, 512, decode_num_warps=4, decode_num_stages=4, **T),
    C(64, 64, 512, decode_num_warps=2, decode_num_stages=3, decode_prefetch=1, **T),
    C(64, 64, 512, decode_num_warps=2, decode_prefetch=1, **T),
    C(128, 64, 512, decode_num_warps=4, **T),
    C(128, 64, 512, decode_num_warps=4, decode_num_stages=3, **T),
    C(128, 64, 512, decode_num_warps=8, **T),
    C(64, 64, 512, decode_num_warps=2, split_target=16, **T),
    C(64, 64, 512, decode_num_warps=2, split_target=32, **T),
    C(64, 64, 512, decode_num_warps=4, split_target=32, **T),
    C(128, 64, 1024, decode_num_warps=4, split_target=16, **T),
    C(64, 64, 512, decode_num_warps=2, decode_block_m=16, row_sum="mma", tree_merge=True),
]

if __name__ == "__main__":
    out = sys.argv[1]
    t0 = time.time()
    rows, _ = AB.tune(False, configs=CONFIGS, prefill=True)
    json.dump({"provenance": results.provenance("python scratch/attn_sweep2.py"), "rows": rows,
               "configs": [c.as_dict() for c in CONFIGS]}, open(out, "w"), indent=1)
    print("sweep s", time.time() - t0)
