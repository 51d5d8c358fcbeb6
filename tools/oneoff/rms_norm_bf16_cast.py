"""The invariant RMSNorm kernel rounding to bf16 by the GPU's conversion instruction
(``ops.rms_norm.BF16_HW_CAST``) against the integer rounding (``BF16_HW_CAST = False``): the bits of every op of
the family at hidden 4096, 5120 and 16384 (one chunk and four), T 1-4096 with random and extreme inputs
must be equal; both timed beside torch.compile in the same run.

    python tools/oneoff/rms_norm_bf16_cast.py OUT_DIR
"""
import sys

import torch

from batch_invariance_kit.bench import rms_norm as B
from batch_invariance_kit.bitwise import bitwise_equal
from batch_invariance_kit.ops import rms_norm as R
from batch_invariance_kit.report import results as RS

out_dir = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
bad, n = [], 0
for hidden in (4096, 5120, 16384):
    for t in (1, 300, 4096):
        x = (torch.randn(t, hidden, generator=g, device="cuda") * torch.logspace(-25, 15, hidden, device="cuda")).to(torch.bfloat16)
        r = torch.randn(t, hidden, generator=g, device="cuda").to(torch.bfloat16)
        w = (1 + torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16)
        scale = torch.tensor([0.05], device="cuda")
        calls = {"rms_norm": lambda: R.rms_norm(x, w),
                 "fused_add_rms_norm": lambda: R.fused_add_rms_norm(x, r, w),
                 "rms_norm_static_fp8_quant": lambda: R.rms_norm_static_fp8_quant(x, w, scale),
                 "fused_add_rms_norm_static_fp8_quant": lambda: R.fused_add_rms_norm_static_fp8_quant(x, r, w, scale),
                 "rms_norm_per_block_quant": lambda: R.rms_norm_per_block_quant(x, w)}
        for op, f in calls.items():
            outs = []
            for hw in (False, True):
                R.BF16_HW_CAST = hw
                outs.append(f())
            R.BF16_HW_CAST = True
            a, b = outs
            a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
            n += 1
            if not all(bitwise_equal(p.view(torch.uint8) if p.dtype.itemsize == 1 else p,
                                     q.view(torch.uint8) if q.dtype.itemsize == 1 else q) for p, q in zip(a, b)):
                bad.append([op, hidden, t])
print(f"bits: {n - len(bad)} of {n} cases equal; differing: {bad[:10]}", flush=True)
rows = []
for hw in (False, True):
    R.BF16_HW_CAST = hw
    got, _ = B._timed_cells((4096, 8192), (64, 256, 1024, 16384), True, with_256=False,
                            goal_checks=lambda *a: [])
    rows += [dict(r, bf16_hw_cast=hw) for r in got if r["impl"] in ("triton-invariant", "torch.compile")]
R.BF16_HW_CAST = True
for h in (4096, 8192):
    for op in ("rms_norm", "fused_add_rms_norm"):
        for t in (64, 256, 1024, 16384):
            c = {(r["impl"], r["bf16_hw_cast"]): r["median_us"] for r in rows
                 if r["hidden"] == h and r["op"] == op and r["tokens"] == t and r.get("median_us")}
            tc = min(v for (i, _), v in c.items() if i == "torch.compile")
            print(f"{op:<19} h={h} T={t:<6} compile {tc:7.2f} | int {c[('triton-invariant', False)]:7.2f} "
                  f"({tc / c[('triton-invariant', False)]:.2f})  hw {c[('triton-invariant', True)]:7.2f} "
                  f"({tc / c[('triton-invariant', True)]:.2f})", flush=True)
RS.save("rms_norm_bf16_cast", rows, [{"name": "every op, hidden and T: the same bits with either rounding",
                                      "passed": not bad, "cases": n, "differing": bad}],
        folder=out_dir, command="python tools/oneoff/rms_norm_bf16_cast.py <dir>")
