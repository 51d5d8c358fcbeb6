"""Session 5, run 32: one decode step of the shipped schedule to profile under Nsight Compute
(B, L from argv; one-off, stored for provenance).

    ncu -k regex:_attn --launch-skip 10 --launch-count 2 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python attn_prof_run32.py 1 8192
"""
import sys

import torch

import kernels  # noqa: F401
from kernels import attention as A
from kernels import attention_bench as AB

B, L = int(sys.argv[1]), int(sys.argv[2])
cfg = A.default_config()
dtype = torch.bfloat16
gen = torch.Generator(device="cuda").manual_seed(1)
c = AB._Paged(B * L, dtype, seed=B)
for i in range(B):
    c.write(i, torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype),
            torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype), 0)
q = torch.randn((B, AB.HQ, AB.D), generator=gen, device="cuda").to(dtype)
_, bt, lens, qsl = c.args([(i, q[i:i + 1], L) for i in range(B)])
out = torch.empty_like(q)
plan = A.make_plan(q, AB.HKV, [L] * B, list(range(B + 1)), config=cfg)
for _ in range(8):
    A.launch(plan, q, c.k, c.v, bt, lens, qsl, AB.D ** -0.5, out)
torch.cuda.synchronize()
