"""Session 5, run 28: decode/prefill schedule sweep on the H200 (one-off; stored for provenance).

For each candidate config: (d) prefill == decode at 8229 positions, serial == one program per
split (the parallel launch with ``fused_merge`` where set: the last split program folds), then
the decode cells (batch 1/8/64 x 1k/8k/32k) and prefill 4k via ``attention_bench.tune``.  Then a
race stress of the fused merge: the same launch replayed many times, bitwise against the merge
kernel's output.

    PYTHONPATH=$PWD python results/h200/session5_schedules/attn_sweep_run28.py OUT.json
"""
import dataclasses
import json
import sys
import time

import torch

import kernels  # noqa: F401
from kernels import attention as A
from kernels import attention_bench as AB
from kernels import results
from kernels.harness import bitwise_equal

R = dataclasses.replace
D0 = A.DEFAULT_CONFIG
F = R(D0, fused_merge=True)
F5 = R(F, decode_num_stages=5)
F5s4 = R(F5, serial_decode_warps=4)  # 2-warp serial programs spill at 5 stages (offline ptxas: 255 regs)
CONFIGS = [
    D0,
    F,
    R(F, decode_num_stages=3),
    F5,
    F5s4,
    R(F5s4, decode_num_warps=8),
    R(F5s4, split_target=64),
    R(F5s4, split_target=16),
    R(F5s4, split_size=1024),
    A.AttnConfig(128, 64, 1024, decode_block_m=16, decode_num_warps=4, row_sum="tree", split_target=32,
                 serial_programs=512, serial_decode_warps=4, fused_merge=True, decode_num_stages=5),
    R(F5s4, num_warps=8),  # prefill: 4-warp 64-row programs spill (offline ptxas), 8 warps do not
    R(F5s4, num_warps=8, num_stages=3),
    R(F5s4, block_m=128, num_warps=8),
]


def stress(configs, reps=200):
    """Fused merge replayed ``reps`` times at batch 1 and 8 x 32k: every output == the merge kernel's."""
    out = []
    dtype = torch.bfloat16
    for B, L in ((1, 32768), (8, 32768), (8, 1024)):
        gen = torch.Generator(device="cuda").manual_seed(B * 7 + L)
        c = AB._Paged(B * L, dtype, seed=B)
        for i in range(B):
            c.write(i, torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype),
                    torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype), 0)
        q = torch.randn((B, AB.HQ, AB.D), generator=gen, device="cuda").to(dtype)
        _, bt, lens, qsl = c.args([(i, q[i:i + 1], L) for i in range(B)])
        ref = torch.empty_like(q)
        p0 = A.make_plan(q, AB.HKV, [L] * B, list(range(B + 1)), config=R(D0, serial_programs=None))
        A.launch(p0, q, c.k, c.v, bt, lens, qsl, AB.D ** -0.5, ref)
        for cfg in configs:
            if not cfg.fused_merge:
                continue
            plan = A.make_plan(q, AB.HKV, [L] * B, list(range(B + 1)), config=R(cfg, serial_programs=None))
            bad = 0
            o = torch.empty_like(q)
            for _ in range(reps):
                o.fill_(0)
                A.launch(plan, q, c.k, c.v, bt, lens, qsl, AB.D ** -0.5, o)
                bad += not bitwise_equal(o, ref)
            same_counters = int(plan.counters.abs().sum().item())
            out.append({"name": f"fused merge == merge kernel, {reps} launches, B={B} L={L}, {cfg}",
                        "passed": bad == 0 and same_counters == 0, "launches_differing": bad,
                        "counters_left": same_counters, "config": cfg.as_dict()})
            print("  ", out[-1]["name"][:90], out[-1]["passed"], bad, flush=True)
    return out


if __name__ == "__main__":
    path = sys.argv[1]
    t0 = time.time()
    rows, checks = AB.decode_tiles(False, configs=CONFIGS)
    print("decode_tiles s", time.time() - t0, flush=True)
    checks += stress(CONFIGS[1:6])
    json.dump({"provenance": results.provenance(
        "python results/h200/session5_schedules/attn_sweep_run28.py OUT.json"), "rows": rows, "checks": checks,
        "configs": [c.as_dict() for c in CONFIGS]}, open(path, "w"), indent=1)
    print("total s", time.time() - t0, "failed", sum(not c["passed"] for c in checks), flush=True)
