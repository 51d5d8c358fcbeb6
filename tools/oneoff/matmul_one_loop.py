"""Long-K matmul: the shipped K order (above K = 4096, fixed chunks of 2048 keys, chunk sums added
in order; its configs include stream-K over the chunks) beside one loop over every K (one fp32 accumulator: the 128 x 256 tiles fit), with
narrower thin-M tiles for the one-loop order's lack of programs along K.  Every config of an
order is checked bitwise against the first one timed, and rows at each M against the largest M.

    python tools/oneoff/matmul_one_loop.py OUT_DIR [deadline_s]
"""
import os
import sys
import time

import torch

from batch_invariance_kit.bench.timing import median_us_graph_or_plain, rotating_sets
from batch_invariance_kit.bitwise import bitwise_equal
from batch_invariance_kit.ops import k_order as KO
from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.report import results as R

out_dir = sys.argv[1]
deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 480.0
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"  # a CPU run (the interpreter, small sizes) only smoke-tests the script
KEY = not GPU  # LONG_K's key: the interpreter's rule on a CPU
SHAPES = [(5120, 5120), (4096, 12288), (5120, 13824), (7168, 18432), (5120, 32768)] if GPU else [(32, 192)]
MS = [1, 16, 64, 256, 1024, 4096] if GPU else [1, 16]
C = MM.MMConfig
NARROW = [C("t16n16s8", 16, 16, 2, 8, 1), C("t16n16tma", 16, 16, 2, 8, 1, tma=True), C("t64n16s8", 64, 16, 4, 8, 1),
          C("t16n32s8", 16, 32, 2, 8, 1)]
BY = {c.name: c for c in MM.CONFIGS + MM.TRIAL_CONFIGS}
ONE_LOOP = [BY[n] for n in ("wide_tma_ws", "tall_tma", "large_tma", "mid_tma", "m128n64_tma", "mid", "m16",
                            "t16n32tma", "t64n32s8")] + NARROW[:1] + NARROW[3:]
CHUNKED = [BY[n] for n in ("large_tma", "large_tma_sk", "mid_tma_sk", "m128n64_sk", "mid_tma", "midc", "m16c",
                           "t16n32tma")]
if os.environ.get("MM_SHAPES"):  # a narrower run: "NxK,NxK", "M,M", orders "chunked,one_loop"
    SHAPES = [tuple(int(v) for v in x.split("x")) for x in os.environ["MM_SHAPES"].split(",")]
if os.environ.get("MM_MS"):
    MS = [int(v) for v in os.environ["MM_MS"].split(",")]
ORDERS = os.environ.get("MM_ORDERS", "chunked,one_loop").split(",")
shipped = dict(KO.LONG_K)
rows, checks, t0 = [], [], time.perf_counter()
for N, K in SHAPES:
    gen = torch.Generator(device=DEV).manual_seed(N * 100003 + K)
    a_all = torch.randn((MS[-1], K), generator=gen, device=DEV).to(torch.bfloat16)
    b = (torch.randn((K, N), generator=gen, device=DEV) * K ** -0.5).to(torch.bfloat16)
    for order, cfgs in [(o, c) for o, c in (("chunked", CHUNKED), ("one_loop", ONE_LOOP)) if o in ORDERS]:
        KO.LONG_K[KEY] = shipped[KEY] if order == "chunked" else (1 << 40, shipped[KEY][1])
        MM._plan.cache_clear(), MM._select.cache_clear()
        ref_full = MM.mm(a_all, b, config=cfgs[0])
        bad = []
        for M in MS:
            a = a_all[:M]
            ref = MM.mm(a, b, config=cfgs[0])
            if not bitwise_equal(ref, ref_full[:M]):
                bad.append([M, cfgs[0].name, "rows != largest M"])
            sets = [] if not GPU else rotating_sets(lambda: (a.clone(), b.clone(), torch.empty((M, N), dtype=a.dtype, device=DEV)),
                                 (M * K + K * N + M * N) * 2)
            late = time.perf_counter() - t0 > deadline
            fit = [c for c in cfgs if (M <= 64 or c.block_m * c.block_n >= 64 * 64)
                   and (M >= 64 or (c.block_m <= 64 and c.block_n <= 128))]
            for c in ([cfgs[0]] + [c for c in fit if c is not cfgs[0]])[:1 if late else None]:
                try:
                    same = bitwise_equal(MM.mm(a, b, config=c), ref)
                    t, g = median_us_graph_or_plain(lambda x, y, z, c=c: MM.mm(x, y, config=c, out=z), reps=20,
                                                    rotate=sets) if GPU else ({"median_us": 0.0, "p25_us": 0.0,
                                                                              "p75_us": 0.0}, False)
                except Exception as e:
                    rows.append({"N": N, "K": K, "M": M, "order": order, "config": c.name, "error": repr(e)[:300]})
                    continue
                if not same:
                    bad.append([M, c.name])
                rows.append({"op": "mm", "N": N, "K": K, "M": M, "order": order, "config": c.name,
                             "median_us": t["median_us"], "p25_us": t["p25_us"], "p75_us": t["p75_us"],
                             "same_bits": same, "cuda_graph": g})
            if order == ORDERS[-1] and GPU:
                t, g = median_us_graph_or_plain(lambda x, y, z: torch.mm(x, y, out=z), reps=20, rotate=sets)
                rows.append({"op": "mm", "N": N, "K": K, "M": M, "order": "cublas", "config": "cublas",
                             "median_us": t["median_us"], "p25_us": t["p25_us"], "p75_us": t["p75_us"], "cuda_graph": g})
            best = {o: min([(r["median_us"], r["config"]) for r in rows if (r["N"], r["K"], r["M"]) == (N, K, M)
                            and r.get("order") == o and "median_us" in r] or [(None, None)]) for o in ("chunked", "one_loop", "cublas")}
            print(N, K, M, best, flush=True)
            del sets
        checks.append({"name": f"every config gives the first config's bits, rows equal across M ({order}, N={N}, K={K})",
                       "passed": not bad, "differing": bad[:40]})
    KO.LONG_K[KEY] = shipped[KEY]
    MM._plan.cache_clear(), MM._select.cache_clear()
    R.save("matmul_one_loop", rows, checks, folder=out_dir,
           command="python tools/oneoff/matmul_one_loop.py <dir>")
print("elapsed", time.perf_counter() - t0)
