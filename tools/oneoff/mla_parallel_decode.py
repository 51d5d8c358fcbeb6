"""MLA: serial vs split-parallel decode (bits and time) at DeepSeek-V3 sizes."""
import json, os, sys
import torch
from batch_invariance_kit.ops import mla as M
from batch_invariance_kit.verify.harness import seeded_normal, bitwise_equal
from batch_invariance_kit.bench.timing import median_us
heads, rank, rope, bs = 128, 512, 64, 64
scale = 1.0 / (128 + rope) ** 0.5
rows = []
for S, n in ((1, 4096), (8, 4096), (1, 32768)):
    blocks = -(-n // bs)
    c = M.LatentCache(S * blocks + 1, bs, rank, rope, torch.bfloat16, device="cuda", seed=0)
    for s in range(S):
        c.write(s, seeded_normal((n, rank), 2 * s, dtype=torch.bfloat16, device="cuda"),
                seeded_normal((n, rope), 2 * s + 1, dtype=torch.bfloat16, device="cuda"))
    q = seeded_normal((S, heads, rank + rope), 7, dtype=torch.bfloat16, device="cuda")
    qq, bt, lens, qsl = c.args([(s, q[s:s + 1], n) for s in range(S)])
    outs = {}
    for mode, below in (("serial", 0), ("parallel", 132)):
        M.MLA_LAUNCH["parallel_below"] = below
        f = lambda: M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=rank, scale=scale)
        outs[mode] = f().clone()
        rows.append({"seqs": S, "context": n, "mode": mode, **median_us(f, reps=30)})
        print(rows[-1], flush=True)
    rows.append({"seqs": S, "context": n, "same_bits": bitwise_equal(outs["serial"], outs["parallel"])})
    print(rows[-1], flush=True)
    M.MLA_LAUNCH["parallel_below"] = 132
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(sys.argv[1], "mla_par.json"), "w"), indent=1)
