"""One cell of a kit kernel and its fastest peer, for Nsight Compute: warm-up launches outside
the profiled range, then each kernel a few times inside an NVTX range named ``prof``.

    python tools/oneoff/ncu_cells.py rms_norm [T] [HIDDEN]     # the kit's RMSNorm, fused-add too, beside torch.compile
    python tools/oneoff/ncu_cells.py matmul [M] [N] [K] [CFG]  # linear(x, W) with a forced config beside cuBLAS

Run under ``ncu --nvtx --nvtx-include "prof/" --section SpeedOfLight ...``; with
``TORCH_LOGS=output_code`` the log also holds Inductor's generated kernel.  Without ncu it
prints each kernel's median time (CUDA events) so the cell can be checked against the sweeps.
"""
import sys

import torch

from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.ops import rms_norm as RN

what = sys.argv[1]
args = [a for a in sys.argv[2:]]
dev = "cuda"
torch.manual_seed(0)


def timed(name, fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    print(f"{name:<40} median {ts[len(ts) // 2]:8.2f} us  (min {ts[0]:.2f}, max {ts[-1]:.2f})", flush=True)


def profiled(fns, reps=3):
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    for _ in range(reps):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if what == "rms_norm":
    T = int(args[0]) if args else 256
    H = int(args[1]) if len(args) > 1 else 4096
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    r = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(H, device=dev, dtype=torch.bfloat16)

    def norm(x, w, eps=1e-6):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def add_norm(x, r, w, eps=1e-6):
        z = x + r
        zf = z.float()
        return (zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w, z

    cn = torch.compile(norm, dynamic=False)
    ca = torch.compile(add_norm, dynamic=False)
    fns = {"kit rms_norm": lambda: RN.rms_norm(x, w),
           "torch.compile rms_norm": lambda: cn(x, w),
           "kit fused_add_rms_norm": lambda: RN.fused_add_rms_norm(x, r, w),
           "torch.compile fused_add_rms_norm": lambda: ca(x, r, w)}
    print(RN.launch_info(T, H))
elif what == "matmul":
    M = int(args[0]) if args else 1024
    N = int(args[1]) if len(args) > 1 else 5120
    K = int(args[2]) if len(args) > 2 else 5120
    name = args[3] if len(args) > 3 else "large_tma"
    cfg = {c.name: c for c in MM.CONFIGS + MM.TRIAL_CONFIGS}[name]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    fns = {f"kit linear {name}": lambda: MM.linear(x, W, config=cfg),
           "cublas linear": lambda: torch.nn.functional.linear(x, W)}
    print(MM.launch_info(M, N, K, config=cfg))
else:
    raise SystemExit(f"what must be rms_norm or matmul, got {what!r}")

for n, fn in fns.items():
    timed(n, fn)
profiled(list(fns.values()))
