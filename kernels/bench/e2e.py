"""End-to-end GPU measurements: the kit's Qwen3-style model served by
:mod:`batch_invariance_kit.serving.engine` on a GPU, at sizes where default kernels do show batch variance.

* :data:`DENSE`: hidden 2048, 8 layers, 16 q / 8 kv heads of dim 128, intermediate 6144, vocab
  32768, bf16 (the size at which vLLM's default mode was seen to vary on the H200);
* :data:`MOE`: hidden 2048, 4 layers, 32 q / 4 kv heads, 64 experts top-8 of intermediate 768.

:func:`e2e_model` (the ``e2e_model`` part of ``python -m batch_invariance_kit.validate``): for each model and
each ``impl`` (variant, invariant), a request alone (bs1, no chunking, no prefix cache), then
``trials`` runs of :func:`batch_invariance_kit.serving.engine.load_experiment` (8 copies of that request among 48
random fillers arriving at random steps, chunked prefill, prefix cache on): the number of
distinct completions among all copies, as token sequences and as bitwise fp32 log-probability
sequences, how many equal the bs1 run, the prefix-cache hits, and tokens/s of the whole serving
loop (Python scheduling included; a serving-loop number, not a kernel benchmark).

:func:`decoder_under_load` (chapter 1): the torch-only toy decoder of
:mod:`batch_invariance_kit.serving.toy_decoder` on cuBLAS, one prompt under 14 loads.

Weights: drawn on the GPU with a seeded ``torch.Generator`` (``seeded_normal`` on the CPU is
far too slow for a billion parameters); :func:`build` returns the model and the same weights
are what :func:`batch_invariance_kit.serving.model.Qwen3Model.save_pretrained` writes for vLLM.
"""
from __future__ import annotations

import time

import torch

from ..checks import dtype_name
from ..serving.toy_decoder import ToyDecoder
from ..serving.model import Qwen3Config, Qwen3Model, _seed_of, init_weight, param_names
from ..serving.engine import Engine, Request, completion_key, load_experiment

DENSE = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, vocab_size=32768, max_position_embeddings=4096,
                    torch_dtype="bfloat16", seed=7)
MOE = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, vocab_size=32768, max_position_embeddings=4096,
                  torch_dtype="bfloat16", num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                  seed=8)
MODELS = {"dense": DENSE, "moe": MOE}


def device_random_weights(cfg: Qwen3Config, device="cuda") -> dict:
    """The distribution of :func:`batch_invariance_kit.serving.model.random_weights` (:func:`batch_invariance_kit.serving.model.init_weight`),
    drawn on ``device`` from a per-parameter seeded generator; stored in ``cfg.dtype``."""
    w = {}
    for name, shape in param_names(cfg):
        g = torch.Generator(device=device).manual_seed(_seed_of(cfg.seed, name) % 2 ** 63)
        w[name] = init_weight(name, shape, torch.randn(shape, generator=g, device=device,
                                                       dtype=torch.float32)).to(cfg.dtype)
    return w


def build(name: str, device="cuda") -> Qwen3Model:
    if name not in MODELS:
        raise ValueError(f"model name must be one of {list(MODELS)}, got {name!r}")
    cfg = MODELS[name]
    return Qwen3Model(cfg, weights=device_random_weights(cfg, device), device=device)


def prompt(n: int, vocab: int, seed: int = 5) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def e2e_model(quick: bool) -> tuple:
    trials = 2 if quick else 3
    new_tokens = 16 if quick else 32
    engine = dict(max_num_tokens=2048, max_num_seqs=64, num_blocks=4096)
    load = dict(copies=8, fillers=24 if quick else 48, max_new_tokens=new_tokens, max_arrival=24,
                filler_len=(8, 600), chunk_size=256, prefix_cache=True, **engine)
    rows, checks = [], []
    for mname in MODELS:
        t0 = time.time()
        m = build(mname)
        cfg = m.cfg
        p = prompt(300, cfg.vocab_size)
        print(f"  {mname}: built in {time.time() - t0:.1f} s", flush=True)
        for impl in ("variant", "invariant"):
            Engine(m, impl=impl, **engine).run([Request(p, 2, req_id="warm")])  # compile outside the timing
            _sync()
            t = time.time()
            alone = Engine(m, impl=impl, **engine).run([Request(p, new_tokens, req_id="alone")])[0]
            _sync()
            bs1_s = time.time() - t
            ref = completion_key(alone)
            keys, per_trial, gen_tokens, wall, hits = [], [], 0, 0.0, []
            for seed in range(trials):
                _sync()
                t = time.time()
                r = load_experiment(m, p, seed=seed, impl=impl, **load)
                _sync()
                wall += time.time() - t
                ks = [completion_key(c) for c in r["completions"]]
                keys += ks
                hits += [c.prefix_hit_tokens for c in r["completions"]]
                per_trial.append({"seed": seed, "unique_token_sequences": r["unique_token_sequences"],
                                  "unique_logprob_sequences": r["unique_logprob_sequences"],
                                  "equal_to_bs1": sum(k == ref for k in ks), "steps": r["steps"],
                                  "step_tokens_seen_by_copies": sorted({tok for st in r["copy_steps"].values()
                                                                        for tok, _ in st})})
                gen_tokens += r["generated_tokens"]
            row = {"op": "e2e_serve", "model": mname, "impl": f"kit-{impl}", "dtype": cfg.torch_dtype,
                   "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
                   "prompt_tokens": len(p), "new_tokens": new_tokens, "copies": len(keys), "trials": trials,
                   "unique_token_sequences": len({k[0] for k in keys}),
                   "unique_logprob_sequences": len({k[1] for k in keys}),
                   "copies_equal_to_bs1": sum(k == ref for k in keys),
                   "prefix_hit_tokens": hits, "per_trial": per_trial,
                   "generated_tokens": gen_tokens, "serve_seconds": wall,
                   "tokens_per_s": gen_tokens / wall if wall > 0 else None,
                   "bs1_tokens_per_s": new_tokens / bs1_s}
            rows.append(row)
            print(f"  {mname} {impl:<9}: {row['unique_token_sequences']} token seqs, "
                  f"{row['unique_logprob_sequences']} logprob seqs, {row['copies_equal_to_bs1']}/{len(keys)} == bs1, "
                  f"{row['tokens_per_s']:.0f} tok/s", flush=True)
        inv = [r for r in rows if r["model"] == mname and r["impl"] == "kit-invariant"][0]
        var = [r for r in rows if r["model"] == mname and r["impl"] == "kit-variant"][0]
        checks.append({"name": f"{mname}: invariant kernels, every copy under load == the bs1 run, bitwise "
                               f"(tokens and fp32 logprob rows)",
                       "passed": inv["unique_logprob_sequences"] == 1 and inv["copies_equal_to_bs1"] == inv["copies"],
                       "copies": inv["copies"]})
        checks.append({"name": f"{mname}: the prefix cache was hit in the load runs", "passed": any(inv["prefix_hit_tokens"])})
        checks.append({"name": f"{mname}: variant kernels, the same experiment gives > 1 distinct logprob sequence "
                               f"(negative control)", "passed": var["unique_logprob_sequences"] > 1,
                       "unique_logprob_sequences": var["unique_logprob_sequences"]})
        del m
        torch.cuda.empty_cache()
    return rows, checks


def decoder_under_load(quick: bool) -> tuple:
    """Chapter 1's torch-only toy decoder on cuBLAS: unique logprob sequences and completions of
    one prompt under 14 loads, and of the prompt alone (which must give one sequence)."""
    rows, checks = [], []
    configs = [dict(vocab=2048, hidden=512, layers=4, heads=8, ffn=1024),
               dict(vocab=8192, hidden=2048, layers=8, heads=16, ffn=5632)]
    loads = [0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63, 95, 127]
    for cfg in configs[:1] if quick else configs:
        for dtype in (torch.bfloat16, torch.float32):
            m = ToyDecoder(seed=0, dtype=dtype, **cfg)
            prompt = list(range(10, 42))
            runs = [m.generate(prompt, 48, load=n, load_seed=n) for n in loads]
            alone = [m.generate(prompt, 48, load=n, load_seed=n, alone=True) for n in loads[:4]]
            ref = alone[0].logprobs
            row = dict(op="toy_decoder", impl="torch (cuBLAS)", dtype=dtype_name(dtype),
                       **cfg, runs=len(runs), loads=loads,
                       unique_logprob_sequences=len({r.key() for r in runs}),
                       unique_completions=len({r.tokens for r in runs}),
                       alone_unique_logprob_sequences=len({r.key() for r in alone}),
                       max_abs_logprob_diff=max(float((r.logprobs - ref).abs().max()) for r in runs
                                                if len(r.tokens) == len(alone[0].tokens)))
            rows.append(row)
            print(f"  decoder hidden {cfg['hidden']} {row['dtype']}: {row['unique_logprob_sequences']} logprob "
                  f"sequences, {row['unique_completions']} completions of {len(runs)}; alone "
                  f"{row['alone_unique_logprob_sequences']}")
            checks.append({"name": f"decoder alone is invariant (hidden {cfg['hidden']}, {row['dtype']})",
                           "passed": row["alone_unique_logprob_sequences"] == 1})
    return rows, checks
