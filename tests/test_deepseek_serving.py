"""End to end, the DeepSeek family: a tiny DeepSeek-V3-style model on the kit's kernels (MLA over a
paged latent cache, grouped sigmoid routing with shared experts), served by
:mod:`batch_invariance_kit.serving.engine`.

Invariant kernels: N identical requests under a random load (chunked prefill, prefix cache)
give one completion, bitwise the request served alone, and a trainer's re-scoring (one prefill
of the whole sequence) gives the sampler's rows bit for bit (prefill == decode).  Negative
controls: the variant kernels give more than one completion under the same load; MLA's "two
forms" (prefill expanded to per-head keys and values, decode absorbed) break prefill == decode.
The model is Hugging Face's ``DeepseekV3``: transformers loads the folder it writes and computes
the same log-probabilities (fp32, to rounding), and the kit's model reads the folder of
:func:`batch_invariance_kit.vllm.deepseek_model.build`.

Sizes (CPU, fp32, Triton interpreter): one DeepSeek block (MLA, then the MoE layer), hidden 64, 4
heads, latent 32, rope 16, nope 16, values 16; 16 routed experts in 4 groups, 2 kept, top-4, one
shared expert; vocab 256 (chapter 11's model).  The transformers check adds a dense first layer, as
DeepSeek's models have.  What makes the variant kernels differ under this load: MLA's per-head
projections take their K block from the step's token count (16 below 16 tokens, else 64: the
output projection's K of 32 is one block or two) and the MoE router sums its weights as a tree from
16 tokens on; the copies' steps hold fewer and more tokens than that.
"""
import json
import time
from dataclasses import asdict, replace

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops import mla as M
from batch_invariance_kit.serving import rl
from batch_invariance_kit.serving.deepseek import DeepSeekConfig, DeepSeekModel, param_names
from batch_invariance_kit.serving.engine import Engine, Request, completion_key, load_experiment, seeded_prompt

BN = A.default_config().block_n
TINY = DeepSeekConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4, kv_lora_rank=32,
                      qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=16,
                      n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      max_position_embeddings=512, torch_dtype="float32", seed=0)
#: tests/test_e2e.py's load, lighter: 3 copies among 4 random requests of 4 to 48 tokens
LOAD = dict(copies=3, fillers=4, max_new_tokens=3, max_arrival=6, filler_len=(4, 48), seed=1, max_num_tokens=96,
            chunk_size=BN, prefix_cache=True)
#: a 70-token context at the interpreter's 32-key tiles, scaled to the device's tile
PROMPT = seeded_prompt(70 * BN // 32, 7, 256)


@pytest.fixture(scope="module")
def model():
    return DeepSeekModel(TINY)


@pytest.fixture
def eight_sms(monkeypatch):
    """The MLA variant's split-KV plans for 8 SMs on every device, as under the interpreter: with a
    GPU's count every short context would get one-tile splits at any load (see tests/test_e2e.py)."""
    monkeypatch.setattr(A, "num_sms", lambda: 8)


def _bits_equal_rows(a, b) -> list:
    return [torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b)]


def test_load_experiment_invariant(model):
    """Under load, alone, and re-scored by a trainer (one prefill of prompt + completion, the
    sampler's decode steps replaced): the same bits."""
    r = load_experiment(model, PROMPT, impl="invariant", **LOAD)
    assert len(set(map(str, r["copy_steps"].values()))) > 1, "the copies must see different loads"
    assert r["unique_token_sequences"] == 1 and r["unique_logprob_sequences"] == 1
    alone = Engine(model, max_num_tokens=max(128, len(PROMPT))).run([Request(PROMPT, LOAD["max_new_tokens"])])[0]
    assert all(completion_key(c) == completion_key(alone) for c in r["completions"])
    rows = rl.trainer_logprobs(model, [(alone.prompt, alone.tokens)])[0]
    assert all(_bits_equal_rows(alone.logprob_rows, rows))


def test_load_experiment_variant_differs(model, eight_sms):
    r = load_experiment(model, PROMPT, impl="variant", **LOAD)
    assert r["unique_logprob_sequences"] > 1


def test_two_forms_break_prefill_equals_decode(model):
    """The sampler decodes with the absorbed form (one-token steps); the trainer re-scores the
    whole sequence in one prefill, expanded.  The first row (from the prompt's prefill on both
    sides) is equal; the decoded rows are not."""
    impl = {"attention": "two_forms"}
    c = Engine(model, impl=impl).run([Request(PROMPT[:24], 3)])[0]
    equal = _bits_equal_rows(c.logprob_rows, rl.trainer_logprobs(model, [(c.prompt, c.tokens)], impl=impl)[0])
    assert equal[0] and not any(equal[1:]), equal


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_transformers_loads_the_folder_and_agrees(q_lora_rank, tmp_path):
    """``save_pretrained`` writes a ``DeepseekV3ForCausalLM`` folder; transformers' forward of it
    gives the kit model's log-probabilities (fp32, to rounding); the folder reads back bitwise."""
    from transformers import AutoModelForCausalLM

    cfg = replace(TINY, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=q_lora_rank, seed=3)
    m = DeepSeekModel(cfg)
    m.save_pretrained(str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["q_lora_rank"] == q_lora_rank
    back = DeepSeekModel.from_pretrained(str(tmp_path))
    assert back.cfg == cfg and all(torch.equal(back.weights[k], m.weights[k]) for k in m.weights)
    prompt = seeded_prompt(24, 5, 256)
    out = Engine(m).run([Request(prompt, 3)])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.tokens[:-1]])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:]
    assert (ref - out.logprob_rows).abs().max() < 1e-4


def test_reads_the_vllm_check_builder_folder(tmp_path):
    """The folder of :func:`batch_invariance_kit.vllm.deepseek_model.build` (transformers'
    initialisation, bf16) is read by the kit's model: every parameter, the shape's config."""
    from batch_invariance_kit.vllm import deepseek_model as D

    shape = D.spec(**{**asdict(TINY), "num_hidden_layers": 2, "first_k_dense_replace": 1, "torch_dtype": "bfloat16"})
    D.build(shape).save_pretrained(tmp_path)
    m = DeepSeekModel.from_pretrained(str(tmp_path))
    assert m.cfg == shape and m.cfg.torch_dtype == "bfloat16"
    assert sorted(m.weights) == sorted(n for n, _ in param_names(m.cfg))
    lp = Engine(m).run([Request(seeded_prompt(9, 2, 256), 2)])[0].logprob_rows
    assert torch.isfinite(lp).all()


def test_bad_config_and_impl_are_refused_naming_the_argument(model):
    for field, value in (("n_group", 3), ("topk_group", 5), ("num_experts_per_tok", 9), ("qk_rope_head_dim", 15),
                         ("kv_lora_rank", 0), ("first_k_dense_replace", 2), ("q_lora_rank", -1)):
        with pytest.raises(ValueError, match=field):
            DeepSeekModel(replace(TINY, **{field: value}))
    with pytest.raises(ValueError, match="model_type"):
        DeepSeekConfig.from_hf_config({**TINY.hf_config(), "model_type": "deepseek_v2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        DeepSeekConfig.from_hf_config({**TINY.hf_config(), "rope_scaling": {"type": "yarn", "factor": 40}})
    with pytest.raises(ValueError, match="impl"):
        Engine(model, impl="fast").run([Request([1, 2, 3], 1)])
    with pytest.raises(ValueError, match="impl"):
        Engine(model, impl={"moe": "two_forms"}).run([Request([1, 2, 3], 1)])


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_load_experiment_gpu_bf16(eight_sms):
    """The load experiment compiled on a GPU, bf16, a larger DeepSeek-style model: 64 routed
    experts in 8 groups, 4 kept, top-6, 2 shared; latent 256, rope 64, 16 heads (unrun on CPU)."""
    cfg = DeepSeekConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=16, kv_lora_rank=256, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                         num_experts_per_tok=6, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                         max_position_embeddings=2048, torch_dtype="bfloat16", seed=3)
    m = DeepSeekModel(cfg)
    kw = dict(copies=8, fillers=32, max_new_tokens=16, max_arrival=20, filler_len=(8, 600), seed=2,
              max_num_tokens=1024, chunk_size=256, prefix_cache=True)
    t = time.time()
    prompt = seeded_prompt(300, 5, cfg.vocab_size)
    inv = load_experiment(m, prompt, impl="invariant", **kw)
    assert inv["unique_token_sequences"] == 1 and inv["unique_logprob_sequences"] == 1
    c = inv["completions"][0]
    rows = rl.trainer_logprobs(m, [(c.prompt, c.tokens)])[0]
    assert torch.equal(rows.view(torch.int32), c.logprob_rows.view(torch.int32)), "prefill != decode"
    var = load_experiment(m, prompt, impl="variant", **kw)
    print(f"gpu deepseek load experiment: variant {var['unique_logprob_sequences']} distinct logprob sequences, "
          f"{time.time() - t:.1f}s")
