"""Session 5, run 34: the left-fold merge's load schedule (states per step, columns per program)
and the parallel decode programs' pipeline stages (one-off; stored for provenance).  Every variant
is checked bitwise against the shipped default's output on each timed cell.

    PYTHONPATH=$PWD python results/h200/session5_schedules/attn_sweep_run34.py OUT.json
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
#: (name, config, FOLD_CHUNK, MERGE_COLUMNS)
VARIANTS = [("default", D0, 16, 32), ("fold32", D0, 32, 32), ("fold8", D0, 8, 32), ("cols64", D0, 16, 64),
            ("cols128", D0, 16, 128), ("fold32_cols64", D0, 32, 64),
            ("dec_stages3", R(D0, decode_num_stages=3), 16, 32), ("dec_stages4", R(D0, decode_num_stages=4), 16, 32)]
CELLS = [(1, 1024), (8, 1024), (1, 8192), (8, 8192), (1, 32768), (8, 32768)]

if __name__ == "__main__":
    path = sys.argv[1]
    t0 = time.time()
    rows, checks = [], []
    dtype = torch.bfloat16
    for B, L in CELLS:
        gen = torch.Generator(device="cuda").manual_seed(B * 100003 + L)
        c = AB._Paged(B * L, dtype, seed=B)
        for i in range(B):
            c.write(i, torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype),
                    torch.randn((L, AB.HKV, AB.D), generator=gen, device="cuda").to(dtype), 0)
        q = torch.randn((B, AB.HQ, AB.D), generator=gen, device="cuda").to(dtype)
        _, bt, lens, qsl = c.args([(i, q[i:i + 1], L) for i in range(B)])
        ks = torch.stack([A.gather_kv(c.k, c.v, bt, i, L)[0] for i in range(B)]).transpose(1, 2).contiguous()
        vs = torch.stack([A.gather_kv(c.k, c.v, bt, i, L)[1] for i in range(B)]).transpose(1, 2).contiguous()
        sd = AB._time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, scale=AB.D ** -0.5, enable_gqa=True))[0]["median_us"]
        del ks, vs
        ref = None
        line = []
        for name, cfg, fold, cols in VARIANTS:
            A.FOLD_CHUNK, A.MERGE_COLUMNS = fold, cols
            out = torch.empty_like(q)
            plan = A.make_plan(q, AB.HKV, [L] * B, list(range(B + 1)), config=cfg)
            t, g = AB._time(lambda: A.launch(plan, q, c.k, c.v, bt, lens, qsl, AB.D ** -0.5, out))
            A.launch(plan, q, c.k, c.v, bt, lens, qsl, AB.D ** -0.5, out)
            ref = out.clone() if ref is None else ref
            same = bitwise_equal(out, ref)
            rows.append({"op": "attention_decode", "variant": name, "batch": B, "context": L, "fold_chunk": fold,
                         "merge_columns": cols, "config": cfg.as_dict(), **t, "cuda_graph": g, "sdpa_us": sd,
                         "same_bits_as_default": same})
            checks.append({"name": f"{name} == default bits, B={B} L={L}", "passed": same})
            line.append(f"{name} {t['median_us']:.1f}")
        A.FOLD_CHUNK, A.MERGE_COLUMNS = 16, 32
        print(f"  B={B:<3} L={L:<6} sdpa {sd:.1f} | " + " ".join(line), flush=True)
        del c
    json.dump({"provenance": results.provenance(
        "python results/h200/session5_schedules/attn_sweep_run34.py OUT.json"), "rows": rows, "checks": checks},
        open(path, "w"), indent=1)
    print("total s", time.time() - t0, "failed", sum(not c["passed"] for c in checks), flush=True)
