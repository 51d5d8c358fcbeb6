"""Sampler vs trainer (:mod:`batch_invariance_kit.serving.rl`): with invariant kernels the
trainer's re-scoring of sampled completions is bitwise the sampler's (KL exactly 0, every
importance ratio exactly 1); with variant kernels it is not (the negative controls).

Sizes (CPU, fp32, Triton interpreter): one layer, hidden 64, 2 q heads / 1 kv head of dim 32,
intermediate 128, vocab 128.  What makes the variant differ here: the trainer prefills all
completions in one step of more than 64 tokens (``down_proj``'s split-K: 2 splits) while the
sampler's decode steps hold a few tokens (4 splits), and split-KV attention's split count
follows the number of sequences in the step.
"""
import pytest
import torch

from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.serving import rl
from batch_invariance_kit.serving.engine import seeded_prompt
from batch_invariance_kit.serving.model import Qwen3Config, Qwen3Model

V = 128
CFG = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=V, max_position_embeddings=512, seed=0)
BN = A.default_config().block_n
SERVE = dict(chunk_size=BN, prefix_cache=True, max_num_tokens=64)


def _prompt(n, seed):
    return seeded_prompt(n, seed, V)


@pytest.fixture(scope="module")
def model():
    return Qwen3Model(CFG, linear_config="mid")


# The shared prefix spans at least one prefix-cache unit (the engine's hits are whole units of
# lcm(cache block, block_n) tokens: 32 under the interpreter, 64 with the GPU's block_n).
PREFIX = max(32, BN)
PROMPTS = [_prompt(PREFIX, 99) + _prompt(6 + 5 * i, i) for i in range(3)]


@pytest.mark.parametrize("impl", ["invariant", "variant"])
def test_sampler_vs_trainer(model, impl):
    """Sampled completions under load (chunked prefill, prefix-cache hits on the shared
    prefix, mixed steps), re-scored by the trainer in one prefill step: invariant -> every row
    bitwise equal and KL exactly 0; variant (negative control) -> rows differ, KL != 0."""
    r = rl.sampler_vs_trainer(model, PROMPTS, impl=impl, max_new_tokens=4, fillers=2, seed=1, **SERVE)
    assert len(r["kl"]) == len(r["rows_equal"]) == 12
    assert sum(c.prefix_hit_tokens for c in r["completions"]) > 0, "the prefix cache was not used"
    assert r["mean_seqs_per_step"] > 1, "the rollouts never shared a step"
    if impl == "invariant":
        assert bool(r["rows_equal"].all())
        assert bool((r["kl"] == 0).all()) and bool((r["logprob_diff"] == 0).all())
    else:
        assert not bool(r["rows_equal"].all()), "variant kernels: the trainer reproduced the sampler"
        assert bool((r["kl"] != 0).any())


@pytest.mark.parametrize("impl", ["invariant", "variant"])
def test_policy_gradient_importance_ratio(impl):
    """On-policy updates of lm_head: invariant -> every token's ratio is exactly 1.0 at both
    steps (the second samples the updated policy) and the update moves the weights; variant
    (negative control, one step) -> some ratio != 1."""
    m = Qwen3Model(CFG, linear_config="mid")
    before = m.lm_head.clone()
    steps = 2 if impl == "invariant" else 1
    hist = rl.policy_gradient(m, PROMPTS[:2], impl=impl, steps=steps, group=2, max_new_tokens=4, fillers=1, seed=3,
                              lr=2.0, **SERVE)
    ratios = torch.cat([h["ratios"] for h in hist])
    assert len(ratios) == steps * 2 * 2 * 4
    assert not torch.equal(m.lm_head, before) and all(h["grad_norm"] > 0 for h in hist)
    if impl == "invariant":
        assert bool((ratios == 1.0).all())
    else:
        assert bool((ratios != 1.0).any()), "variant kernels: every importance ratio was exactly 1"


def test_row_kl_exact():
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(3, 50, generator=g), -1)
    assert bool((rl.row_kl(a, a.clone()) == 0).all())
    b = a.clone()
    b[1, 7] = torch.nextafter(b[1, 7], torch.tensor(0.0))
    kl = rl.row_kl(a, b)
    assert kl[0] == 0 and kl[2] == 0 and kl[1] != 0
    with pytest.raises(ValueError, match="trainer_rows"):
        rl.row_kl(a, a[:, :10])


def test_trainer_logprobs_bad_input(model):
    with pytest.raises(ValueError, match="sequences"):
        rl.trainer_logprobs(model, [])
    with pytest.raises(TypeError, match=r"sequences\[0\]"):
        rl.trainer_logprobs(model, [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"sequences\[0\]"):
        rl.trainer_logprobs(model, [([1, 2], [])])
    with pytest.raises(ValueError, match="max_num_tokens"):
        rl.trainer_logprobs(model, [([1, 2], [3])], max_num_tokens=0)
    with pytest.raises(ValueError, match="steps"):
        rl.policy_gradient(model, PROMPTS[:1], steps=0)
