"""MLA on a GPU: the kit's absorbed kernel (decode and prefill) and its split-KV variant beside an
SDPA formulation of the same absorbed math (one call per sequence), at DeepSeek-V3 sizes (128
heads, latent 512, rope 64).  The SDPA rows are a correctness-level peer, not a fast MLA kernel.
Where vLLM is importable, decode cells also time vLLM's Triton MLA decode kernel (what its
``TRITON_MLA`` backend calls) with the KV-split count that backend picks (``vllm-triton-mla``)
and with one split, as it runs under ``VLLM_BATCH_INVARIANT=1`` (``vllm-triton-mla-1split``),
each row with its largest difference from the kit's output.  Rows in the results shape
``{"op", "impl", <shape keys>, "median_us", "p25_us", "p75_us", ...}``.

    python -m batch_invariance_kit.bench.mla [--out DIR]     # on a GPU: mla_bench.json
"""
from __future__ import annotations

import torch

from ..ops import mla as M
from ..verify.harness import seeded_normal
from .timing import median_us

__all__ = ["mla_rows", "vllm_mla_decode"]


def vllm_mla_decode():
    """vLLM's Triton MLA decode function (``decode_attention_fwd``), or ``None`` where vLLM (or
    that module) is not importable."""
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception:  # no vLLM, or a build without its Triton ops
        return None
    return decode_attention_fwd


def vllm_kv_splits(seq_len: int, sm_count: int) -> int:
    """The KV-split count vLLM's ``TRITON_MLA`` backend uses for a longest context of ``seq_len``
    keys (a power of two, about 512 keys per split, at most two per SM)."""
    import triton

    return min(triton.next_power_of_2(max(1, seq_len // 512)), 2 * sm_count)


def mla_rows(*, heads: int = 128, kv_lora_rank: int = 512, rope_dim: int = 64, block_size: int = 64,
             cases=((64, 1, 4096), (1, 4096, 4096)), dtype=torch.bfloat16, reps: int = 50, device="cuda") -> list:
    """``cases``: ``(num_seqs, q_len, seq_len)``; one row per (case, impl) for ``impl`` in
    ``invariant`` (the kit), ``variant`` (its split-KV twin) and ``sdpa`` (``F.scaled_dot_product_attention``
    of the absorbed queries over each sequence's gathered latent, one call per sequence)."""
    rows = []
    dim = kv_lora_rank + rope_dim
    scale = 1.0 / (128 + rope_dim) ** 0.5
    for S, q_len, n in cases:
        blocks = -(-n // block_size)
        c = M.LatentCache(S * blocks + 1, block_size, kv_lora_rank, rope_dim, dtype, device=device, seed=0)
        for s in range(S):
            c.write(s, seeded_normal((n, kv_lora_rank), 2 * s, dtype=dtype, device=device),
                    seeded_normal((n, rope_dim), 2 * s + 1, dtype=dtype, device=device))
        q = seeded_normal((S * q_len, heads, dim), 7, dtype=dtype, device=device)
        qq, bt, lens, qsl = c.args([(s, q[s * q_len:(s + 1) * q_len], n) for s in range(S)])
        for impl in ("invariant", "variant"):
            t = median_us(lambda: M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=kv_lora_rank,
                                                  scale=scale, impl=impl), reps=reps)
            rows.append({"op": "mla_attention", "impl": impl, "num_seqs": S, "q_len": q_len, "seq_len": n,
                         "heads": heads, "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, **t})
        if q_len == 1 and vllm_mla_decode() is not None:
            rows += _vllm_rows(qq, c.cache, bt, lens, kv_lora_rank, scale, heads, rope_dim, n, reps,
                               M.mla_attention(qq, c.cache, bt, lens, qsl, kv_lora_rank=kv_lora_rank, scale=scale))
        pos = torch.arange(n, device=device)
        lat = [c.cache[bt[s, pos // block_size].long(), pos % block_size] for s in range(S)]
        mask = (pos[None, :] <= torch.arange(n - q_len, n, device=device)[:, None])

        def sdpa():
            for s in range(S):
                qs = qq[s * q_len:(s + 1) * q_len].transpose(0, 1)            # (H, q_len, dim)
                k = lat[s][None].expand(heads, n, dim)
                v = lat[s][None, :, :kv_lora_rank].expand(heads, n, kv_lora_rank)
                torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        rows.append({"op": "mla_attention", "impl": "sdpa", "num_seqs": S, "q_len": q_len, "seq_len": n,
                     "heads": heads, "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, **median_us(sdpa, reps=reps)})
    return rows


def _vllm_rows(q, cache, bt, lens, kv_lora_rank, scale, heads, rope_dim, n, reps, kit_out) -> list:
    """vLLM's Triton MLA decode over the same cache, block table and queries (one token per
    sequence), at its backend's split count and at one split."""
    from ..device import sm_count

    fwd = vllm_mla_decode()
    S, H = q.shape[0], q.shape[1]
    kv = cache.unsqueeze(2)                      # (blocks, block_size, 1 kv head, latent + rope)
    v = kv[..., :kv_lora_rank]
    rows = []
    for impl, splits in (("vllm-triton-mla", vllm_kv_splits(n, sm_count())), ("vllm-triton-mla-1split", 1)):
        o = torch.zeros((S, H, kv_lora_rank), dtype=q.dtype, device=q.device)
        lse = torch.zeros((S, H), dtype=q.dtype, device=q.device)
        logits = torch.empty((S, H, splits, kv_lora_rank + 1), dtype=torch.float32, device=q.device)

        def run():
            fwd(q, kv, v, o, lse, bt, lens, logits, splits, scale, cache.shape[1], is_mla=True)
        row = {"op": "mla_attention", "impl": impl, "num_seqs": S, "q_len": 1, "seq_len": n, "heads": heads,
               "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "num_kv_splits": splits}
        try:  # a peer that fails (another vLLM's signature) is recorded with its error, not timed
            run()
            row["max_abs_diff_vs_kit"] = (o.float() - kit_out.float()).abs().max().item()
            row.update(median_us(run, reps=reps))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    """``python -m batch_invariance_kit.bench.mla [--out DIR]``: :func:`mla_rows` on this GPU,
    printed and saved as ``DIR/mla_bench.json`` (default ``results/local``) with provenance."""
    import argparse

    from ..report import results

    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder of mla_bench.json (default: results/local)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.mla times CUDA kernels: run it on a GPU box")
    rows = mla_rows()
    for r in rows:
        print(f"{r['impl']:>22}  seqs {r['num_seqs']:>3}  q_len {r['q_len']:>5}  seq_len {r['seq_len']:>5}  "
              + (f"{r['median_us']:10.1f} us" if "median_us" in r else f"failed: {r['error']}"))
    print(f"wrote {results.save('mla_bench', rows, [], folder=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
