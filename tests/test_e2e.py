"""End to end: a tiny Qwen3-style model on the kit's kernels, served by :mod:`batch_invariance_kit.serving.engine`.

Invariant kernels: a request's fp32 log-probability rows (and tokens) are the same bits alone
and inside batches of several sizes, for N identical requests under a random load (exactly one
distinct completion), with chunked prefill on/off and the prefix cache on/off.  Variant kernels
(negative controls): the same experiments give more than one distinct log-probability sequence,
and the tests name the kernel that causes it by switching one kernel family at a time.

Sizes (CPU, fp32, Triton interpreter): hidden 64, 2 layers, 2 q heads / 1 kv head of dim 32,
intermediate 128, vocab 256.  What makes the variant kernels differ at these sizes:

* attention (split-KV): ``num_splits = 2*8 // num_seqs`` under the interpreter; a 70-token
  context is cut into 32-key splits (3 splits) with up to 5 sequences in the step and into
  64-key splits (2) with 6 to 8: the load experiment crosses that;
* linear (split-K): ``down_proj`` has K = 128 = 4 K-blocks of 32: 4 splits for M <= 64 tokens in
  the step, 2 for 65..255; a 40-token prompt prefilled alone (M = 40) vs together with others
  (M > 64) crosses that (the other projections have K = 64 = 2 blocks: always 2 splits < 256);
* RMSNorm: the variant's block switch at 256 tokens does not change a 64-wide row's tree
  (block = next_pow2(64) either way), so it never differs here.
"""
import json
import os
import time

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops.attention import schedule
from batch_invariance_kit.serving.model import Qwen3Config, Qwen3Model, param_names
from batch_invariance_kit.serving.engine import Engine, Request, completion_key, load_experiment, seeded_prompt

BN = A.default_config().block_n
DENSE = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, vocab_size=256, max_position_embeddings=512, seed=0)
MOE = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=256, max_position_embeddings=512,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, seed=1)


def _prompt(n, seed):
    return seeded_prompt(n, seed, 256)


@pytest.fixture(scope="module")
def dense():
    return Qwen3Model(DENSE)


@pytest.fixture(scope="module")
def moe():
    return Qwen3Model(MOE)


def _run(model, reqs, **kw):
    return Engine(model, **kw).run(reqs)


def _same(a, b):
    return completion_key(a) == completion_key(b)


# ------------------------------------------------------------------------------ the weights
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_save_pretrained_hf_layout(cfg, tmp_path):
    model = Qwen3Model(cfg)
    paths = model.save_pretrained(str(tmp_path))
    assert paths["format"] == "safetensors"
    c = json.load(open(os.path.join(tmp_path, "config.json")))
    arch = "Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM"
    assert c["architectures"] == [arch] and c["tie_word_embeddings"] is False
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "torch_dtype"):
        assert k in c
    if cfg.is_moe:
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
            assert k in c
    from safetensors.torch import load_file
    w = load_file(paths["weights"])
    assert sorted(w) == sorted(n for n, _ in param_names(cfg))
    assert "model.layers.1.self_attn.q_norm.weight" in w and "lm_head.weight" in w
    if cfg.is_moe:
        assert "model.layers.0.mlp.gate.weight" in w and "model.layers.0.mlp.experts.3.down_proj.weight" in w
    back = Qwen3Model.from_pretrained(str(tmp_path))
    assert back.cfg == cfg
    assert all(torch.equal(back.weights[k].cpu(), model.weights[k].cpu()) for k in model.weights)
    # the seed alone fixes the weights (seeded_normal: the same bits on every machine)
    again = Qwen3Model(cfg)
    assert all(torch.equal(again.weights[k], model.weights[k]) for k in model.weights)


# -------------------------------------------------------------------- bs1 vs batches of N
def _bs_requests(target, n_others, seed):
    others = [Request(_prompt(30 + 9 * i, seed + i), 1 + i % 3, req_id=f"o{i}") for i in range(n_others)]
    return [target] + others


def test_bs1_vs_batches_invariant_and_variant_linear(dense):
    """A 40-token greedy request (and a seeded sampled one): alone vs in batches of 3 and 6
    (everyone arrives at step 0: the prompts are prefilled together, M > 64).  Invariant:
    identical bits.  Negative control: the split-K variant of the linear layers alone differs
    (down_proj: 4 splits at M = 40 alone, 2 in the batch)."""
    greedy = Request(_prompt(40, 11), 4, req_id="t")
    sampled = Request(_prompt(40, 11), 4, temperature=1.0, seed=123, req_id="t")
    for target, sizes in ((greedy, (2, 5)), (sampled, (5,))):
        alone = _run(dense, [target])[0]
        for n in sizes:
            got = _run(dense, _bs_requests(target, n, seed=100 * n))[0]
            assert _same(got, alone), f"batch of {n + 1}: bits differ from bs1 (sampled={target.temperature > 0})"
    var = {"linear": "variant"}
    alone = _run(dense, [greedy], impl=var)[0]
    got = _run(dense, _bs_requests(greedy, 5, seed=500), impl=var)[0]
    assert completion_key(got)[1] != completion_key(alone)[1], "split-K linear variant did not change the bits"


# ------------------------------------------------------------ N identical requests, random load
LOAD = dict(copies=4, fillers=6, max_new_tokens=4, max_arrival=6, seed=1, max_num_tokens=96, chunk_size=BN,
            prefix_cache=True)


def test_load_experiment_invariant(dense):
    r = load_experiment(dense, _prompt(70, 7), impl="invariant", **LOAD)
    assert len(set(map(str, r["copy_steps"].values()))) > 1, "the copies must see different loads"
    assert r["unique_token_sequences"] == 1
    assert r["unique_logprob_sequences"] == 1


def test_load_experiment_attention_variant_differs(dense, monkeypatch):
    """Negative control: the same experiment with the attention variant alone (split-KV from the
    number of sequences; chapter 7 runs it with every family variant) gives > 1 distinct
    log-probability sequence.

    The variant cuts a row into ``2*SMs // (seqs*kv_heads)`` splits of whole KV tiles.  With a
    GPU's SM count (132 on an H200), this model's single kv head and at most 10 sequences, every
    row of its <= 512 positions gets one-tile splits at any load: the variant would be batch-free
    here.  So the variant plans for 8 SMs (the interpreter's count) on every device, and the
    prompt is 70 * block_n / 32 tokens, which scales the interpreter's case (32-key tiles,
    70 tokens) to the active tile: copies at the same position then get splits of different
    numbers of tiles, depending on how many sequences share their step."""
    monkeypatch.setattr(schedule, "num_sms", lambda: 8)
    r = load_experiment(dense, _prompt(70 * BN // 32, 7), impl={"attention": "variant"}, **LOAD)
    assert r["unique_logprob_sequences"] > 1


# -------------------------------------------------------------- chunked prefill, prefix cache
def test_chunked_prefill_and_prefix_cache_same_bits(dense):
    """Three requests sharing a 70-token prefix (the later ones can hit the cache) and a
    filler: chunk_size None / block_n and prefix cache off / on give the same bits."""
    base = _prompt(70, 21)
    reqs = [Request(base + _prompt(5, 22), 3, req_id="a"),
            Request(base + _prompt(20, 23), 3, arrival=2, req_id="b"),
            Request(_prompt(50, 24), 2, arrival=1, req_id="f"),
            Request(base, 3, temperature=0.8, seed=9, arrival=3, req_id="c")]
    runs = {}
    for chunk in (None, BN):
        for pc in (False, True):
            runs[(chunk, pc)] = _run(dense, reqs, chunk_size=chunk, prefix_cache=pc, max_num_tokens=96)
    ref = runs[(None, False)]
    for key, out in runs.items():
        for a, b in zip(out, ref):
            assert _same(a, b), f"chunk_size={key[0]} prefix_cache={key[1]}: request {a.req_id} differs"
    hits = [c.prefix_hit_tokens for c in runs[(BN, True)]]
    assert hits[1] > 0 and hits[3] > 0, f"the prefix cache was not used: {hits}"
    assert hits[1] % BN == 0 and hits[3] < len(base)
    assert any(n < 70 for _, n, _ in runs[(BN, False)][0].steps[:1]), "the first prompt was not chunked"


# --------------------------------------------------------------------------------- the MoE model
def test_moe_model_runs_invariant_and_variant(moe):
    target = Request(_prompt(40, 31), 3, req_id="t")
    alone = _run(moe, [target])[0]
    got = _run(moe, _bs_requests(target, 4, seed=700))[0]
    assert _same(got, alone)
    assert torch.isfinite(alone.logprob_rows).all()
    assert torch.allclose(alone.logprob_rows.exp().sum(1), torch.ones(3), atol=1e-5)
    var = _run(moe, _bs_requests(target, 4, seed=700), impl="variant")[0]
    assert torch.isfinite(var.logprob_rows).all()
    assert torch.allclose(var.logprob_rows, alone.logprob_rows, atol=1e-3)


def test_dense_variant_close_to_invariant(dense):
    target = Request(_prompt(40, 41), 3, req_id="t")
    inv = _run(dense, [target])[0]
    var = _run(dense, [target], impl="variant")[0]
    assert torch.allclose(var.logprob_rows, inv.logprob_rows, atol=1e-4)


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_load_experiment_gpu_bf16():
    """The load experiment compiled on a GPU, bf16, a larger model (unrun on CPU)."""
    cfg = Qwen3Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=4096, torch_dtype="bfloat16", seed=3)
    m = Qwen3Model(cfg)
    kw = dict(copies=8, fillers=32, max_new_tokens=16, max_arrival=20, filler_len=(8, 600), seed=2,
              max_num_tokens=1024, chunk_size=256, prefix_cache=True)
    t = time.time()
    inv = load_experiment(m, _prompt(300, 5), impl="invariant", **kw)
    assert inv["unique_token_sequences"] == 1 and inv["unique_logprob_sequences"] == 1
    var = load_experiment(m, _prompt(300, 5), impl="variant", **kw)
    print(f"gpu load experiment: variant {var['unique_logprob_sequences']} distinct logprob sequences, "
          f"{time.time() - t:.1f}s")
