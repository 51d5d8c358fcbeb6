"""RMSNorm at mid batch sizes: the invariant Triton kernel's warp count (a per-hidden-size
constant that shapes the reduction tree) swept at T = 64 ... 16384, beside torch.compile timed in
the same run (``bench.rms_norm``'s cells: CUDA-graph replays over rotating inputs).  The rows
say whether another warp count per hidden size would close the mid-T gap without losing at large T.

    python tools/oneoff/rms_norm_warps_mid_t.py OUT_DIR
"""
import sys

from batch_invariance_kit.bench import rms_norm as B
from batch_invariance_kit.ops import rms_norm as tri
from batch_invariance_kit.report import results as R

out_dir = sys.argv[1]
HIDDENS, TOKENS = (4096, 8192), (64, 256, 1024, 4096, 16384)
rows = []
for nw in (4, 8, 16):
    tri.NUM_WARPS_OVERRIDE.clear()
    tri.NUM_WARPS_OVERRIDE.update({h: nw for h in HIDDENS})
    tri._kernel_params.cache_clear()
    got, _ = B._timed_cells(HIDDENS, TOKENS, True, with_256=False, goal_checks=lambda *a: [])
    rows += [dict(r, num_warps=nw) for r in got if r["impl"] in ("triton-invariant", "torch.compile")]
tri.NUM_WARPS_OVERRIDE.clear()
for h in HIDDENS:
    for op in ("rms_norm", "fused_add_rms_norm"):
        for t in TOKENS:
            cell = {(r["impl"], r["num_warps"]): r["median_us"] for r in rows
                    if r["hidden"] == h and r["op"] == op and r["tokens"] == t and r.get("median_us")}
            tc = min(v for (i, _), v in cell.items() if i == "torch.compile")
            print(f"{op:<19} h={h} T={t:<6} compile {tc:7.2f} | " + " ".join(
                f"w{nw} {cell[('triton-invariant', nw)]:7.2f} ({tc / cell[('triton-invariant', nw)]:.2f})"
                for nw in (4, 8, 16) if ("triton-invariant", nw) in cell), flush=True)
R.save("rms_norm_warps_mid_t", rows, [], folder=out_dir, command="python tools/oneoff/rms_norm_warps_mid_t.py <dir>")
