"""Head-dim RMSNorm rows (Qwen3's q/k norms: ``(tokens * heads, head_dim)``) with the shipped launch,
four rows to a program of four warps, beside one row per program of one warp
(``NUM_WARPS_OVERRIDE = {head_dim: 1}``), and whether the two give the same bits.  Each time: a
CUDA graph of 10 calls, replayed 25 times; median, min and max per call.

    python tools/oneoff/rms_norm_head_dim.py OUT_DIR
"""
import statistics
import sys

import torch

import batch_invariance_kit  # noqa: F401  (device selection before Triton)
from batch_invariance_kit.ops import rms_norm as R
from batch_invariance_kit.report import results as RS


def timed(f):
    g = torch.cuda.CUDAGraph()
    f()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(10):
            f()
    ts = []
    for _ in range(25):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 100)  # ms per 10 calls -> us per call
    return statistics.median(ts), min(ts), max(ts)


rows = []
for T in (1, 64, 512, 1000, 4096, 16384):
    for h, heads in ((128, 32), (128, 8), (64, 32), (256, 16)):
        x = torch.randn(T * heads, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        R.NUM_WARPS_OVERRIDE.clear()
        new = timed(lambda: R.rms_norm(x, w, 1e-6))
        o1 = R.rms_norm(x, w, 1e-6)
        R.NUM_WARPS_OVERRIDE[h] = 1
        old = timed(lambda: R.rms_norm(x, w, 1e-6))
        o2 = R.rms_norm(x, w, 1e-6)
        R.NUM_WARPS_OVERRIDE.clear()
        rows.append({"op": "rms_norm_head_dim", "tokens": T, "heads": heads, "hidden": h, "rows": T * heads,
                     "packed_us": new[0], "packed_min_us": new[1], "packed_max_us": new[2],
                     "one_row_us": old[0], "one_row_min_us": old[1], "one_row_max_us": old[2],
                     "one_row_over_packed": old[0] / new[0],
                     "bits_equal": bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))})
print(RS.save("rms_norm_head_dim", rows, [], folder=sys.argv[1],
              command="python tools/oneoff/rms_norm_head_dim.py <dir>"))
print(all(r["bits_equal"] for r in rows), min(r["one_row_over_packed"] for r in rows))
