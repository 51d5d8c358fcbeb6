"""The prefill sweep's work-only launch shapes with 8 warps over 64-row programs, beside the shipped one."""
import json, os, sys
from batch_invariance_kit.bench import attention as B
rows, checks = B.prefill_sweep(False, sweep=[{}, {"num_warps": 8}, {"num_warps": 8, "num_stages": 3}])
json.dump({"rows": rows, "checks": checks}, open(os.path.join(sys.argv[1], "sweep_w8.json"), "w"), indent=1)
for c in checks:
    print(c["name"], c["passed"])
