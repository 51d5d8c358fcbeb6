"""Attention's GPU measurements: the four consistency properties at production head
shapes, and decode/prefill timings against SDPA.  Each function returns ``(rows, checks)`` in
the shape of :mod:`batch_invariance_kit.report.results`; :mod:`.parts` names them (``attention_*``).

Shapes: head dim 128, 32 q heads over 8 kv heads, cache blocks of 16, bf16 (fp32 for the
negative control too); the kernels run with :data:`batch_invariance_kit.ops.attention.DEFAULT_CONFIG`
(64-key tiles, splits of 64-512 keys graded by position).
"""
from __future__ import annotations

import dataclasses

import torch

from ..checks import dtype_name
from ..ops import attention as A
from .timing import median_us_graph_or_plain
from ..verify.harness import bits, bitwise_equal

HQ, HKV, D, BS = 32, 8, 128, 16


def _paged(tokens: int, dtype, seed: int = 0) -> A.PagedCache:
    """A paged cache on the GPU for ``tokens`` keys (and 64 blocks to spare), blocks shuffled by
    ``seed``; sequences get blocks on demand."""
    return A.PagedCache(tokens // BS + 64, BS, HKV, D, dtype, device="cuda", seed=seed)


def _seq(n, dtype, gen):
    return (torch.randn((n, HQ, D), generator=gen, device="cuda").to(dtype),
            torch.randn((n, HKV, D), generator=gen, device="cuda").to(dtype),
            torch.randn((n, HKV, D), generator=gen, device="cuda").to(dtype))


def consistency(quick: bool) -> tuple:
    """(a) decode rows alone == in a batch (and the variant split-KV caught by the same check),
    (b) chunked == one-chunk prefill, (c) prefix-cache hit == recompute, (d) prefill == decode."""
    cfg = A.default_config()
    bn = cfg.block_n
    rows, checks = [], []
    top = 8192 if quick else 32768
    lens = [top, 1, 513, 1000, 4097, 2 * cfg.split_size, bn - 1, top // 2 + 3] * 8  # 64 sequences
    for dtype in (torch.bfloat16, torch.float32):
        dn = dtype_name(dtype)
        gen = torch.Generator(device="cuda").manual_seed(1)
        data = [_seq(n, dtype, gen) for n in lens]
        differs = {}
        for impl in ("invariant", "variant"):
            alone_cache, batch_cache = _paged(sum(lens), dtype, seed=2), _paged(sum(lens), dtype, seed=3)
            for i, (q, k, v) in enumerate(data):
                batch_cache.write(i, k, v, 0)
            for bs in (1, 8, 64):
                outs = batch_cache.run([(i, data[i][0][-1:], lens[i]) for i in range(bs)], impl=impl)
                bad = []
                for i in sorted({0, bs // 2, bs - 1}):
                    if i not in alone_cache.tables:
                        alone_cache.write(i, data[i][1], data[i][2], 0)
                    alone = alone_cache.run([(i, data[i][0][-1:], lens[i])], impl=impl)[0]
                    if not bitwise_equal(outs[i], alone):
                        bad.append(i)
                differs[(impl, bs)] = bad
                rows.append({"op": "attention_decode", "impl": f"kit-{impl}", "dtype": dn, "batch": bs,
                             "rows_checked": len({0, bs // 2, bs - 1}), "rows_differing": len(bad),
                             "split_plan_row0": A.split_plan(lens[:bs], HKV, impl=impl, config=cfg)[0]})
        checks.append({"name": f"(a) invariant decode: rows alone == rows in batches of 1/8/64 ({dn}, "
                               f"contexts to {top})",
                       "passed": all(not differs[("invariant", b)] for b in (1, 8, 64))})
        checks.append({"name": f"(a) variant split-KV decode: the same check finds a difference ({dn})",
                       "passed": any(differs[("variant", b)] for b in (1, 8, 64)),
                       "rows_differing": {b: differs[("variant", b)] for b in (1, 8, 64)}})

    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(4)
    n = 2048 + 2 * cfg.split_size + 37 if quick else 8192 + 37
    q, k, v = _seq(n, dtype, gen)
    c = _paged(4 * n, dtype, seed=5)
    c.write("s", k, v, 0)
    pre = c.run([("s", q, n)])[0]
    # (b) chunks at multiples of block_n
    c2 = _paged(2 * n, dtype, seed=6)
    cuts = [0, bn, cfg.split_size + bn, 5 * bn * 8, n]
    got = []
    for a, b in zip(cuts, cuts[1:]):
        c2.write("s", k[a:b], v[a:b], a)
        got.append(c2.run([("s", q[a:b], b)])[0])
    checks.append({"name": f"(b) chunked prefill == one chunk (bf16, n={n}, cuts {cuts})",
                   "passed": bitwise_equal(torch.cat(got), pre)})
    # (c) prefix cache: a second sequence reuses the first's blocks for its first p keys
    p = (n // 2) // bn * bn
    qb, kb, vb = _seq(n - p, dtype, gen)
    c.write("b", kb, vb, p, shared=c.tables["s"][:p // BS])
    hit = c.run([("b", qb, n)])[0]
    c3 = _paged(2 * n, dtype, seed=7)
    c3.write("b", torch.cat([k[:p], kb]), torch.cat([v[:p], vb]), 0)
    recomputed = c3.run([("b", torch.cat([q[:p], qb]), n)])[0][p:]
    checks.append({"name": f"(c) prefix-cache hit ({p} keys) == recompute (bf16)",
                   "passed": bitwise_equal(hit, recomputed)})
    bad = _decode_positions_differing(c, q, pre, n)
    checks.append({"name": f"(d) prefill == decode at every position (bf16, n={n})", "passed": not bad,
                   "positions_differing": bad[:50]})
    ref = c.run([("s", q[-256:], n)], impl="reference")[0]
    err = (pre[-256:].double() - ref.double()).abs().max().item()
    sd = c.run([("s", q[-256:], n)], impl="sdpa")[0]
    checks.append({"name": "accuracy vs float64 (informational)", "passed": True, "informational": True,
                   "max_abs_err_kit": err, "max_abs_err_sdpa": (sd.double() - ref.double()).abs().max().item()})
    return rows, checks


def _decode_positions_differing(c, q, pre, n, config=None) -> list:
    """(d): decode every position t < n (one-token sequences sharing the blocks of "s") and
    return the positions whose output bits differ from the prefill's ``pre``."""
    for t in range(n):
        c.tables[("d", t)] = c.tables["s"]
    dec = torch.cat(c.run([(("d", t), q[t:t + 1], t + 1) for t in range(n)], config=config))
    return (bits(dec) != bits(pre)).flatten(1).any(1).nonzero().flatten().tolist()


#: Schedules compared by :func:`decode_tiles`: the shipped default and 128-key tiles with
#: 128-row, 8-warp prefill programs (another reduction order: another fixed schedule).
DECODE_TILE_CONFIGS = [
    A.AttnConfig(),
    A.AttnConfig(block_n=128, block_m=128, num_warps=8),
]


def _plan(q, seq_lens, query_start_loc, **kw):
    """The launch plan of a benchmark step (host lists) for ``q``'s heads."""
    return A.make_plan(seq_lens, query_start_loc, q_heads=q.shape[1], kv_heads=HKV, head_dim=q.shape[2],
                       device=q.device, **kw)


def decode_tiles(quick: bool, configs=None) -> tuple:
    """For each schedule of ``configs`` (:data:`DECODE_TILE_CONFIGS`): property (d), prefill ==
    decode at every position of an 8229-token prompt (2085 with ``quick``; bf16, production
    heads), then the decode and prefill timings of :func:`tune`.  A schedule is worth shipping
    only if (d) holds on the GPU."""
    configs = DECODE_TILE_CONFIGS if configs is None else configs
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(4)
    n = 2048 + 37 if quick else 8192 + 37
    q, k, v = _seq(n, dtype, gen)
    c = _paged(2 * n, dtype, seed=5)
    c.write("s", k, v, 0)
    checks = []
    for cfg in configs:
        try:
            pre = c.run([("s", q, n)], config=cfg)[0]
            bad = _decode_positions_differing(c, q, pre, n, config=cfg)
            checks.append({"name": f"(d) prefill == decode at every position (bf16, n={n}) with {cfg}",
                           "passed": not bad, "positions_differing": len(bad), "first": bad[:20],
                           "config": cfg.as_dict()})
            if cfg.serial_programs is not None:  # the serial launches against one program per split
                par = dataclasses.replace(cfg, serial_programs=None)
                pre_par = c.run([("s", q, n)], config=par)[0]
                bad_par = _decode_positions_differing(c, q, pre_par, n, config=par)
                checks.append({"name": f"serial launches == one program per split (prefill and decode of every "
                                       f"position, bf16, n={n}) with {cfg}",
                               "passed": bitwise_equal(pre, pre_par) and not bad_par and not bad,
                               "config": cfg.as_dict()})
        except Exception as e:  # a schedule that does not compile: recorded
            checks.append({"name": f"(d) with {cfg}", "passed": False, "error": repr(e)[:400], "config": cfg.as_dict()})
        print(f"  {checks[-1]['name']}: {checks[-1]['passed']} {checks[-1].get('positions_differing', '')}",
              flush=True)
    rows, _ = tune(quick, configs=configs)
    return rows, checks


def _decode_cell(B: int, L: int, dtype):
    """One decode cell of the benchmarks: B sequences of L keys (random K/V in a shuffled paged
    cache) and one query token each: ``(cache, q, block_table, seq_lens, query_start_loc)``."""
    gen = torch.Generator(device="cuda").manual_seed(B * 100003 + L)
    c = _paged(B * L, dtype, seed=B)
    for i in range(B):
        c.write(i, torch.randn((L, HKV, D), generator=gen, device="cuda").to(dtype),
                torch.randn((L, HKV, D), generator=gen, device="cuda").to(dtype), 0)
    q = torch.randn((B, HQ, D), generator=gen, device="cuda").to(dtype)
    _, bt, lens, qsl = c.args([(i, q[i:i + 1], L) for i in range(B)])
    return c, q, bt, lens, qsl


def _gathered(c, bt, B, L):
    """The cell's keys and values gathered contiguous, ``(B, kv_heads, L, D)`` each (SDPA's input)."""
    ks = torch.stack([A.gather_kv(c.k, c.v, bt, i, L)[0] for i in range(B)]).transpose(1, 2).contiguous()
    vs = torch.stack([A.gather_kv(c.k, c.v, bt, i, L)[1] for i in range(B)]).transpose(1, 2).contiguous()
    return ks, vs


def _time(fn, per=None):
    """``per``: calls per CUDA graph, to time a peer exactly like the kit kernel of its cell."""
    return median_us_graph_or_plain(fn, warmup=5, reps=50, calls_per_graph=per)


def _fa3():
    """vLLM's FlashAttention-3 varlen function where vLLM is staged (``None`` otherwise).
    Importing vLLM switches torch's cuDNN SDPA backend off (``vllm/platforms/cuda.py``):
    :func:`bench` records torch's default first and restores it before every SDPA timing."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: PLC0415
        from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE  # noqa: PLC0415
    except Exception as e:  # vLLM not staged on this machine
        print(f"  (FlashAttention-3 not available: {e!r:.120})", flush=True)
        return None
    return flash_attn_varlen_func if FA3_AVAILABLE else None


#: (sequences, prompt length) of the prefill cells: one prompt of 1k, 4k and 16k tokens, and 8 of 2k
PREFILL_CELLS = ((1, 1024), (1, 4096), (1, 16384), (8, 2048))


def _causal_flops(seqs: int, n: int) -> float:
    """FLOPs of causal prefill attention (q k^T and p v over the visible half), HQ heads of dim D."""
    return 4.0 * seqs * n * (n + 1) / 2 * HQ * D


def _prefill_cell(seqs: int, n: int, dtype) -> dict:
    """One prefill cell: ``seqs`` random prompts of ``n`` tokens (seeded by the cell) written to
    a paged cache.  A dict: the cache ``c``, the step's queries ``q`` and its own keys and values
    ``kn``, ``vn`` (tokens back to back), per prompt ``qs``, ``ks``, ``vs``, the launch metadata
    ``bt``, ``lens``, ``qsl``, ``plan_args`` (seq_lens, query_start_loc) and the rows' ``shape``."""
    gen = torch.Generator(device="cuda").manual_seed(n * seqs)
    c = _paged(seqs * n, dtype, seed=n)
    qs, ks, vs = zip(*(_seq(n, dtype, gen) for _ in range(seqs)))
    for i in range(seqs):
        c.write(i, ks[i], vs[i], 0)
    _, bt, lens, qsl = c.args([(i, qs[i], n) for i in range(seqs)])
    return {"c": c, "q": torch.cat(qs), "kn": torch.cat(ks), "vn": torch.cat(vs), "qs": qs, "ks": ks, "vs": vs,
            "bt": bt, "lens": lens, "qsl": qsl, "plan_args": ([n] * seqs, [i * n for i in range(seqs + 1)]),
            "shape": {"dtype": dtype_name(dtype), "tokens": seqs * n, "seqs": seqs, "prompt": n}}


def _sdpa_prefill_us(cell: dict, cudnn_sdp: bool = True) -> tuple:
    """SDPA's causal prefill of ``cell`` (:func:`_prefill_cell`), one batched call over its
    prompts (equal lengths) with cuDNN's backend enabled or not: :func:`_time`'s result."""
    q4 = torch.stack(cell["qs"]).transpose(1, 2)
    k4, v4 = torch.stack(cell["ks"]).transpose(1, 2), torch.stack(cell["vs"]).transpose(1, 2)
    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    return _time(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                                          scale=D ** -0.5, enable_gqa=True))


def bench(quick: bool) -> tuple:
    """Decode (batch 1/8/64 x context 1k/8k/32k) and prefill (:data:`PREFILL_CELLS`): the kit's
    invariant and variant kernels (planned once: the timed call is the kernel launches; the split
    kernels alone are timed too; prefill with the step's own keys and values, as the vLLM backend
    runs it, and through the cache alone, ``kit-invariant-cache``, checked to give the same bits)
    vs SDPA on a gathered contiguous KV (enable_gqa; the gather is not timed) and, where vLLM is
    staged, FlashAttention-3 on the same paged cache with automatic splits and with
    ``num_splits=1`` (vLLM's batch-invariant setting).  Per cell, row 0's output alone vs in the
    batch is compared bitwise for the kit and for both FA3 settings.  bf16."""
    F = torch.nn.functional
    cfg = A.default_config()
    cudnn_sdp = True  # torch's default (importing vLLM, which a result's provenance may do, switches it off)
    fa3 = _fa3()
    dtype = torch.bfloat16
    rows, checks = [], []
    batches = (1, 8, 64)
    ctxs = (1024, 8192) if quick else (1024, 8192, 32768)
    row0 = {}  # (impl, B, L) -> row 0 alone == row 0 in the batch
    same_bits = {}  # prefill cell -> the step's keys and values give the cache's bits
    for L in ctxs:
        for B in batches:
            c, q, bt, lens, qsl = _decode_cell(B, L, dtype)
            out = torch.empty_like(q)
            scale = D ** -0.5
            cell, per, first = {}, None, len(rows)
            for impl in ("invariant", "variant"):  # the invariant first: its calls per graph set the cell's
                plan = _plan(q, [L] * B, list(range(B + 1)), impl=impl, config=cfg)
                t, g = _time(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out), per)
                if per is None and g:
                    per = t["calls_per_timing"]
                cell[impl] = t["median_us"]
                extra = {}
                if impl == "invariant":
                    ts, _ = _time(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out, merge=False), per)
                    extra = {"split_kernels_us": ts["median_us"], "serial": plan.decode.serial}
                    A.launch(plan, q, c.k, c.v, bt, scale, out)
                    alone = torch.empty_like(q[:1])
                    A.launch(_plan(q[:1], [L], [0, 1], config=cfg), q[:1], c.k, c.v, bt[:1], scale, alone)
                    row0[("kit-invariant", B, L)] = bitwise_equal(out[:1], alone)
                rows.append({"op": "attention_decode", "impl": f"kit-{impl}", "dtype": "bfloat16", "batch": B,
                             "context": L, "splits": -(-L // A.split_plan([L] * B, HKV, impl=impl, config=cfg)[0]),
                             "invariant": impl == "invariant",
                             **extra, **t, "cuda_graph": g})
            ks, vs = _gathered(c, bt, B, L)
            q4 = q.unsqueeze(2)
            torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
            t, g = _time(lambda: F.scaled_dot_product_attention(q4, ks, vs, scale=scale, enable_gqa=True), per)
            cell["sdpa"] = t["median_us"]
            rows.append({"op": "attention_decode", "impl": "sdpa-gathered", "dtype": "bfloat16", "batch": B,
                         "context": L, "invariant": False, "cudnn_sdp_enabled": cudnn_sdp, **t, "cuda_graph": g})
            del ks, vs
            if fa3 is not None:
                for name, ns in (("fa3-auto-splits", 0), ("fa3-num_splits1", 1)):
                    def run_fa3(qq=q, b=bt, ln=lens, cu=qsl, o=out, ns=ns):
                        return fa3(qq, c.k, c.v, 1, cu, L, seqused_k=ln, block_table=b, softmax_scale=scale,
                                   causal=True, num_splits=ns, fa_version=3, out=o)
                    try:
                        t, g = _time(run_fa3, per)
                    except Exception as e:  # recorded, not fatal
                        rows.append({"op": "attention_decode", "impl": name, "batch": B, "context": L,
                                     "error": repr(e)[:300]})
                        continue
                    run_fa3()
                    alone = torch.empty_like(q[:1])
                    run_fa3(q[:1], bt[:1], lens[:1], qsl[:2], alone)
                    row0[(name, B, L)] = bitwise_equal(out[:1], alone)
                    cell[name] = t["median_us"]
                    rows.append({"op": "attention_decode", "impl": name, "dtype": "bfloat16", "batch": B,
                                 "context": L, "invariant": ns == 1, **t, "cuda_graph": g})
            peers = {k: v for k, v in cell.items() if k in ("variant", "sdpa", "fa3-auto-splits")}
            fastest = min(peers, key=peers.get)
            for r in rows[first:]:
                r["ratio_invariant_over_sdpa"] = cell["invariant"] / cell["sdpa"]
                r["ratio_invariant_over_variant"] = cell["invariant"] / cell["variant"]
                r["fastest_non_invariant_peer"] = fastest
                r["speed_ratio_vs_fastest_peer"] = peers[fastest] / cell["invariant"]
            print(f"  decode B={B:<3} L={L:<6} " + " ".join(f"{k} {v:.1f}us" for k, v in cell.items())
                  + f" | split kernels {rows[first]['split_kernels_us']:.1f}us", flush=True)
            del c
    for seqs, n in (((1, 1024), (1, 4096)) if quick else PREFILL_CELLS):
        pc = _prefill_cell(seqs, n, dtype)
        c, q, bt, lens, qsl, kn, vn, shape = (pc[k] for k in ("c", "q", "bt", "lens", "qsl", "kn", "vn", "shape"))
        out = torch.empty_like(q)
        scale = D ** -0.5
        plan = _plan(q, *pc["plan_args"], config=cfg)
        # the step's own keys and values (as the vLLM backend passes them) and the cache alone
        step_kv = lambda: A.launch(plan, q, c.k, c.v, bt, scale, out, key=kn, value=vn,  # noqa: E731
                                   query_start_loc=qsl)
        step_kv()
        via_step = out.clone()
        t_inv, g = _time(step_kv)
        t_cache, g_cache = _time(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out))
        same_bits[f"{seqs}x{n}"] = bitwise_equal(out, via_step)
        rows.append({"op": "attention_prefill", "impl": "kit-invariant", "step_kv": True, **shape, **t_inv,
                     "cuda_graph": g, "tflops": _causal_flops(seqs, n) / t_inv["median_us"] * 1e-6})
        rows.append({"op": "attention_prefill", "impl": "kit-invariant-cache", "step_kv": False, **shape, **t_cache,
                     "cuda_graph": g_cache, "tflops": _causal_flops(seqs, n) / t_cache["median_us"] * 1e-6})
        t_sd, g = _sdpa_prefill_us(pc, cudnn_sdp)
        rows.append({"op": "attention_prefill", "impl": "sdpa", **shape, **t_sd, "cuda_graph": g,
                     "tflops": _causal_flops(seqs, n) / t_sd["median_us"] * 1e-6,
                     "ratio_invariant_over_sdpa": t_inv["median_us"] / t_sd["median_us"]})
        line = (f"  prefill {seqs}x{n}: inv {t_inv['median_us']:.1f}us (cache only {t_cache['median_us']:.1f}us) "
                f"sdpa {t_sd['median_us']:.1f}us")
        if fa3 is not None:
            try:
                t_fa, g = _time(lambda: fa3(q, c.k, c.v, n, qsl, n, seqused_k=lens, block_table=bt, softmax_scale=scale,
                                            causal=True, fa_version=3, out=out))
                rows.append({"op": "attention_prefill", "impl": "fa3-paged", **shape, **t_fa, "cuda_graph": g,
                             "ratio_invariant_over_fa3": t_inv["median_us"] / t_fa["median_us"]})
                line += f" fa3 {t_fa['median_us']:.1f}us"
            except Exception as e:
                rows.append({"op": "attention_prefill", "impl": "fa3-paged", **shape, "error": repr(e)[:300]})
        print(line, flush=True)
        del c, pc
    checks.append({"name": "attention benchmark ran (timings are data, not pass/fail)", "passed": True,
                   "informational": True})
    checks.append({"name": "kit invariant prefill: the step's own keys and values give the cache's bits, every cell",
                   "passed": bool(same_bits) and all(same_bits.values()), "cells": same_bits})
    cells = [(B, L) for L in ctxs for B in batches]
    checks.append({"name": "kit invariant decode: row 0 alone == row 0 in its batch, every benchmark cell",
                   "passed": all(row0[("kit-invariant", B, L)] for B, L in cells)})
    if fa3 is not None:
        for name in ("fa3-auto-splits", "fa3-num_splits1"):
            same = {f"{B}x{L}": row0[(name, B, L)] for B, L in cells if (name, B, L) in row0}
            checks.append({"name": f"{name}: row 0 alone == row 0 in its batch (informational: which cells)",
                           "passed": True, "informational": True, "cells": same})
    return rows, checks


#: Candidate schedules for :func:`tune` (block_n, block_m, split_size, num_warps, num_stages[,
#: decode_block_m]; the other fields keep :class:`AttnConfig`'s defaults: :func:`tune_configs`).
#: Each one is invariant by construction (a fixed schedule); the sweep only chooses speed.
TUNE_CONFIGS = [(64, 64, 512, 4, 2), (64, 64, 256, 4, 2), (64, 64, 1024, 4, 2), (64, 64, 2048, 4, 2),
                (64, 64, 512, 4, 3), (64, 64, 512, 8, 2), (64, 32, 512, 4, 2), (64, 16, 512, 4, 2),
                (32, 32, 512, 4, 2), (128, 64, 1024, 8, 2), (128, 64, 1024, 4, 2), (128, 64, 2048, 8, 3),
                (64, 16, 1024, 4, 3), (32, 16, 256, 4, 2),
                # with 16-row decode tiles (the sixth field: decode_block_m)
                (64, 64, 512, 4, 2, 16), (64, 64, 256, 4, 2, 16), (64, 64, 1024, 4, 2, 16), (64, 64, 512, 4, 3, 16),
                (64, 32, 512, 4, 2, 16),
                # fewer, longer splits (the seventh field: split_target; None: split_size for every row):
                # fewer folds per prefill row, fewer programs per decode row.  Changes bits.
                (64, 64, 512, 4, 2, 16, 16), (64, 64, 512, 4, 2, 16, 8), (64, 64, 1024, 4, 2, 16, 8),
                (64, 64, 512, 4, 2, 16, None)]


def tune_configs() -> list:
    """:data:`TUNE_CONFIGS` as :class:`AttnConfig` objects."""
    names = ("block_n", "block_m", "split_size", "num_warps", "num_stages", "decode_block_m", "split_target")
    return [A.AttnConfig(**dict(zip(names, c))) for c in TUNE_CONFIGS]


def tune(quick: bool, configs=None, prefill: bool = True) -> tuple:
    """Decode (batch 1/8/64 x context 1k/8k/32k) and prefill (4k) time of the invariant kernels
    for every schedule in :data:`TUNE_CONFIGS`, with SDPA on the gathered KV as the yardstick.
    Chooses nothing itself: the rows say which fixed schedule is fastest where."""
    F = torch.nn.functional
    dtype = torch.bfloat16
    scale = D ** -0.5
    cells = [(1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (64, 8192), (1, 32768), (8, 32768),
             (64, 32768)]
    if quick:
        cells = cells[:4]
    configs = tune_configs() if configs is None else configs
    rows = []
    for B, L in cells:
        c, q, bt, lens, qsl = _decode_cell(B, L, dtype)
        out = torch.empty_like(q)
        ks, vs = _gathered(c, bt, B, L)
        t, _ = _time(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, scale=scale, enable_gqa=True))
        sd = t["median_us"]
        rows.append({"op": "attention_decode", "impl": "sdpa-gathered", "batch": B, "context": L, **t})
        del ks, vs
        line = []
        for cfg in configs:
            try:
                plan = _plan(q, [L] * B, list(range(B + 1)), impl="invariant", config=cfg)
                t, g = _time(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out))
            except Exception as e:  # a schedule that does not compile/fit: recorded, not fatal
                rows.append({"op": "attention_decode", "impl": "kit-invariant", "batch": B, "context": L,
                             "config": cfg.as_dict(), "error": repr(e)[:300]})
                continue
            rows.append({"op": "attention_decode", "impl": "kit-invariant", "batch": B, "context": L,
                         "config": cfg.as_dict(), **t, "cuda_graph": g, "ratio_over_sdpa": t["median_us"] / sd})
            line.append(f"{t['median_us']:.0f}")
        print(f"  B={B:<3} L={L:<6} sdpa {sd:.1f}us | " + " ".join(line), flush=True)
        del c
    done = [{"name": "attention schedule sweep ran (timings are data, not pass/fail)", "passed": True,
             "informational": True}]
    if not prefill:
        return rows, done
    n = 4096
    gen = torch.Generator(device="cuda").manual_seed(n)
    c = _paged(n, dtype, seed=n)
    k = torch.randn((n, HKV, D), generator=gen, device="cuda").to(dtype)
    v = torch.randn((n, HKV, D), generator=gen, device="cuda").to(dtype)
    c.write(0, k, v, 0)
    q = torch.randn((n, HQ, D), generator=gen, device="cuda").to(dtype)
    _, bt, lens, qsl = c.args([(0, q, n)])
    out = torch.empty_like(q)
    line = []
    for cfg in configs:
        try:
            plan = _plan(q, [n], [0, n], config=cfg)
            t, g = _time(lambda: A.launch(plan, q, c.k, c.v, bt, scale, out))
        except Exception as e:
            rows.append({"op": "attention_prefill", "impl": "kit-invariant", "tokens": n, "config": cfg.as_dict(),
                         "error": repr(e)[:300]})
            continue
        rows.append({"op": "attention_prefill", "impl": "kit-invariant", "tokens": n, "config": cfg.as_dict(), **t,
                     "cuda_graph": g})
        line.append(f"{t['median_us']:.0f}")
    print(f"  prefill n={n}: " + " ".join(line), flush=True)
    return rows, done


#: Schedules for :func:`prefill_sweep`: ``AttnConfig`` fields that differ from the shipped
#: schedule.  The first group moves work only (launch shape: rows per program, warps, stages),
#: so each must give the shipped schedule's bits; the second changes the reduction (tile,
#: split sizes) and is checked only for the step's keys == the cache's bits.
PREFILL_SWEEP = [
    {},
    {"num_stages": 3},
    {"block_m": 128, "num_warps": 8},
    {"block_m": 128, "num_warps": 8, "num_stages": 3},
    {"split_target": 8},
    {"split_target": None},
    {"split_size": 1024, "split_target": None},
    {"block_n": 128, "split_size": 1024},
    {"block_n": 128, "block_m": 128, "num_warps": 8, "split_size": 1024},
]

#: the fields of :class:`AttnConfig` that change bits (the rest move work only)
BIT_FIELDS = ("block_n", "split_size", "split_target")


def prefill_sweep(quick: bool, sweep=None) -> tuple:
    """Prefill time of each schedule of ``sweep`` (:data:`PREFILL_SWEEP`, changes to the shipped
    schedule) at the prefill cells (:data:`PREFILL_CELLS`; ``quick``: 1k and 4k), with the
    step's own keys and values (as the vLLM backend runs it) and through the cache alone, beside
    cuDNN SDPA in the same run.  Checks: in every cell the two paths give the same bits, and a
    schedule that moves work only gives the shipped schedule's bits."""
    base = A.default_config()
    sweep = PREFILL_SWEEP if sweep is None else sweep
    dtype = torch.bfloat16
    scale = D ** -0.5
    rows, paths_same, work_same = [], {}, {}
    for seqs, n in (((1, 1024), (1, 4096)) if quick else PREFILL_CELLS):
        pc = _prefill_cell(seqs, n, dtype)
        c, q, bt, qsl, kn, vn, shape = (pc[k] for k in ("c", "q", "bt", "qsl", "kn", "vn", "shape"))
        t_sd, g = _sdpa_prefill_us(pc)  # with cuDNN, torch's default (importing vLLM switches it off)
        rows.append({"op": "attention_prefill", "impl": "sdpa", **shape, **t_sd, "cuda_graph": g})
        shipped = None
        out = torch.empty_like(q)
        line = []
        for change in sweep:
            cfg = dataclasses.replace(base, **change)
            name = ",".join(f"{k}={v}" for k, v in change.items()) or "shipped"
            try:
                plan = _plan(q, *pc["plan_args"], config=cfg)
                step = lambda: A.launch(plan, q, c.k, c.v, bt, scale, out, key=kn, value=vn,  # noqa: E731
                                        query_start_loc=qsl)
                cache = lambda: A.launch(plan, q, c.k, c.v, bt, scale, out)  # noqa: E731
                step()
                via_step = out.clone()
                cache()
                paths_same[f"{seqs}x{n} {name}"] = bitwise_equal(out, via_step)
                if not change:
                    shipped = via_step
                elif not any(k in BIT_FIELDS for k in change) and shipped is not None:
                    work_same[f"{seqs}x{n} {name}"] = bitwise_equal(via_step, shipped)
                t_step, g1 = _time(step)
                t_cache, g2 = _time(cache)
            except Exception as e:  # a schedule that does not compile or fit: recorded
                rows.append({"op": "attention_prefill", "impl": "kit-invariant", **shape, "change": change,
                             "error": repr(e)[:300]})
                line.append(f"{name}: failed {e!r:.80}")
                continue
            for path, t, gr in (("step_kv", t_step, g1), ("cache", t_cache, g2)):
                rows.append({"op": "attention_prefill", "impl": "kit-invariant", "path": path, **shape,
                             "change": change, "config": cfg.as_dict(), **t, "cuda_graph": gr,
                             "speed_ratio_vs_sdpa": t_sd["median_us"] / t["median_us"],
                             "tflops": _causal_flops(seqs, n) / t["median_us"] * 1e-6})
            line.append(f"{name}: {t_sd['median_us'] / t_step['median_us']:.3f} "
                        f"(cache {t_sd['median_us'] / t_cache['median_us']:.3f})")
        print(f"  prefill {seqs}x{n}: sdpa {t_sd['median_us']:.1f}us | " + " | ".join(line), flush=True)
        del c, q, kn, vn, out, shipped, pc
        torch.cuda.empty_cache()
    checks = [{"name": "prefill sweep ran (timings are data, not pass/fail)", "passed": True, "informational": True},
              {"name": "every schedule and cell: the step's own keys and values give the cache's bits",
               "passed": bool(paths_same) and all(paths_same.values()),
               "failing": [k for k, v in paths_same.items() if not v]},
              {"name": "every schedule that moves work only gives the shipped schedule's bits",
               "passed": all(work_same.values()), "failing": [k for k, v in work_same.items() if not v]}]
    return rows, checks


def main(argv=None) -> int:
    """``python -m batch_invariance_kit.bench.attention prefill-sweep --out DIR [--quick]``: the
    prefill schedule sweep (:func:`prefill_sweep`), saved as ``attention_prefill_sweep.json``."""
    import argparse
    from ..report import results

    p = argparse.ArgumentParser(description="attention benchmarks outside the validation parts")
    p.add_argument("what", choices=["prefill-sweep"])
    p.add_argument("--out", required=True, help="folder of the result file")
    p.add_argument("--quick", action="store_true", help="the 1k and 4k cells only")
    args = p.parse_args(argv)
    rows, checks = prefill_sweep(args.quick)
    results.save("attention_prefill_sweep", rows, checks, folder=args.out)
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
