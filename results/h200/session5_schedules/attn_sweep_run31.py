"""Session 5, run 31: the column-wise merge with programmatic dependent launch and the flat
prologue (one-off; stored for provenance).  For each candidate: (d) at 8229 positions, serial ==
one program per split, and the decode cells + prefill 4k (``attention_bench.decode_tiles``).

    PYTHONPATH=$PWD python results/h200/session5_schedules/attn_sweep_run31.py OUT.json
"""
import dataclasses
import json
import sys
import time

import kernels  # noqa: F401
from kernels import attention as A
from kernels import attention_bench as AB
from kernels import results

R = dataclasses.replace
D0 = A.DEFAULT_CONFIG
CONFIGS = [
    D0,
    R(D0, serial_decode_warps=4),
    R(D0, split_target=64),
    R(D0, split_target=16),
    R(D0, split_size=1024),
    R(D0, split_size=256),
    R(D0, decode_num_warps=2),
]

if __name__ == "__main__":
    path = sys.argv[1]
    t0 = time.time()
    rows, checks = AB.decode_tiles(False, configs=CONFIGS)
    json.dump({"provenance": results.provenance(
        "python results/h200/session5_schedules/attn_sweep_run31.py OUT.json"), "rows": rows, "checks": checks,
        "configs": [c.as_dict() for c in CONFIGS]}, open(path, "w"), indent=1)
    print("total s", time.time() - t0, "failed", sum(not c["passed"] for c in checks), flush=True)
