"""One-off sweep: the attention kernel's per-tile loop variants on the H200, prefill and decode.

Each variant is the same arithmetic with another code shape (native fp32->bf16 conversion of
the probabilities, masks on the diagonal tile only, the serial fold under a branch or by
selects) or another launch (warps, rows per program); every output is compared bitwise with the
first variant's, then timed (CUDA graphs, the kit's timer) beside cuDNN SDPA on a contiguous
cache.  Writes attention_loop_sweep.json (results shape, with provenance) to the folder given.
"""
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import batch_invariance_kit  # noqa: F401
from batch_invariance_kit.bench.timing import median_us_graph_or_plain
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.report import results

HQ, HKV, D = 32, 8, 128
SWITCHES = ("NATIVE_CVT", "EDGE_LOOPS", "FOLD_BRANCH", "NEUTRAL_FOLD")
VARIANTS = [
    ("base", (False, False, False, False), {}),
    ("cvt+edge", (True, True, False, False), {}),
    ("cvt+edge+neutral", (True, True, False, True), {}),
    ("cvt+neutral+branch", (True, False, True, True), {}),
    ("cvt+edge+neutral+branch", (True, True, True, True), {}),
    ("cvt+edge+neutral+branch bm128 w8", (True, True, True, True), dict(block_m=128, num_warps=8)),
    ("cvt+edge+neutral+branch s3", (True, True, True, True), dict(num_stages=3)),
    ("cvt+edge+neutral+branch serial dec w4", (True, True, True, True), dict(serial_decode_warps=4)),
]
PREFILL = [("prefill 1x1k", [1024]), ("prefill 1x4k", [4096]), ("prefill 1x16k", [16384]), ("prefill 8x2k", [2048] * 8)]
DECODE = [("decode 8x8k", 8, 8192), ("decode 64x8k", 64, 8192), ("decode 16x32k", 16, 32768), ("decode 1x32k", 1, 32768)]


def cell_prefill(lens, gen):
    c = A.PagedCache(sum(-(-n // 16) for n in lens) + 8, 16, HKV, D, torch.bfloat16, device="cuda", seed=1)
    qs, ks, vs = [], [], []
    for i, n in enumerate(lens):
        k = torch.randn((n, HKV, D), generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn((n, HKV, D), generator=gen, device="cuda").to(torch.bfloat16)
        c.write(i, k, v, 0)
        qs.append(torch.randn((n, HQ, D), generator=gen, device="cuda").to(torch.bfloat16))
        ks.append(k)
        vs.append(v)
    _, bt, sl, qsl = c.args([(i, qs[i], n) for i, n in enumerate(lens)])
    q = torch.cat(qs)
    q4 = torch.stack(qs).transpose(1, 2).contiguous()
    k4 = torch.stack(ks).transpose(1, 2).contiguous()
    v4 = torch.stack(vs).transpose(1, 2).contiguous()
    return c, q, bt, lens, [0] + list(torch.tensor(lens).cumsum(0).tolist()), (q4, k4, v4, True)


def cell_decode(B, L, gen):
    c = A.PagedCache(B * (-(-L // 16)) + 8, 16, HKV, D, torch.bfloat16, device="cuda", seed=2)
    ks, vs = [], []
    for i in range(B):
        k = torch.randn((L, HKV, D), generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn((L, HKV, D), generator=gen, device="cuda").to(torch.bfloat16)
        c.write(i, k, v, 0)
        ks.append(k)
        vs.append(v)
    q = torch.randn((B, HQ, D), generator=gen, device="cuda").to(torch.bfloat16)
    _, bt, sl, qsl = c.args([(i, q[i:i + 1], L) for i in range(B)])
    q4 = q.unsqueeze(2)
    k4 = torch.stack(ks).transpose(1, 2).contiguous()
    v4 = torch.stack(vs).transpose(1, 2).contiguous()
    return c, q, bt, [L] * B, list(range(B + 1)), (q4, k4, v4, False)


def main(out_dir):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = [(name, cell_prefill(lens, gen)) for name, lens in PREFILL]
    cells += [(name, cell_decode(B, L, gen)) for name, B, L in DECODE]
    rows, checks = [], []
    scale = D ** -0.5
    for name, (c, q, bt, lens, qsl, (q4, k4, v4, causal)) in cells:
        sd, _ = median_us_graph_or_plain(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal,
                                                                               scale=scale, enable_gqa=True),
                                         warmup=5, reps=50)
        rows.append({"op": name, "impl": "sdpa-cudnn-contiguous", **sd})
        ref = None
        line = f"{name:<16} sdpa {sd['median_us']:8.1f}"
        for vname, sw, cfg_kw in VARIANTS:
            for k, v in zip(SWITCHES, sw):
                setattr(A, k, v)
            cfg = replace(A.DEFAULT_CONFIG, **cfg_kw)
            try:
                plan = A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, config=cfg, device="cuda")
                out = torch.empty_like(q)
                A.launch(plan, q, c.k, c.v, bt, scale, out)
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.clone()
                same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                t, g = median_us_graph_or_plain(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out), warmup=5, reps=50)
                rows.append({"op": name, "impl": vname, "switches": dict(zip(SWITCHES, sw)), "config": cfg.as_dict(),
                             **t, "cuda_graph": g, "ratio_sdpa_over_kit": sd["median_us"] / t["median_us"],
                             "bitwise_equal_to_base": same})
                checks.append({"name": f"{name} {vname}: bitwise equal to base", "passed": same})
                line += f" | {vname} {t['median_us']:.1f}{'' if same else ' BITS DIFFER'}"
            except Exception as e:  # a variant that fails to compile or run is data
                rows.append({"op": name, "impl": vname, "error": repr(e)[:400]})
                checks.append({"name": f"{name} {vname}: ran", "passed": False, "error": repr(e)[:400]})
                line += f" | {vname} ERROR {e!r:.80}"
            print(line, flush=True)
            line = " " * 16
        del c
    results.save("attention_loop_sweep", rows, checks, folder=out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
