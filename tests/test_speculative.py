"""Speculative decoding in :class:`batch_invariance_kit.serving.engine.Engine`: with invariant
kernels the output is bitwise plain decoding's (tokens and fp32 rows) for every ``k`` and every
acceptance pattern (all drafts accepted, none, a mix, n-gram lookup), greedy and sampled; with
variant kernels under load it is not (the negative control).

Sizes as in ``tests/test_rl.py``.  What makes the variant differ: a verify step of ``1 + k``
tokens per request beside a filler's prefill changes the step's token count (split-K of
``down_proj``) and the split-KV plan of the rows (the split size comes from the sequence's
length after the step, not the row's own position).
"""
import pytest
import torch

from batch_invariance_kit.serving import speculative as SP
from batch_invariance_kit.serving.engine import Engine, Request, completion_key, seeded_prompt
from batch_invariance_kit.serving.model import Qwen3Config, Qwen3Model

V = 128
CFG = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=V, max_position_embeddings=512, seed=0)


def _prompt(n, seed):
    return seeded_prompt(n, seed, V)


@pytest.fixture(scope="module")
def model():
    return Qwen3Model(CFG, linear_config="mid")


def test_ngram_drafter():
    d = SP.NgramDrafter(max_n=2)
    assert d([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert d([1, 2, 3, 9, 3], 2) == [9, 3]          # n = 1: the most recent earlier 3
    assert d([1, 2, 3, 4], 2) == []
    assert d([7], 4) == []
    with pytest.raises(ValueError, match="min_n"):
        SP.NgramDrafter(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="max_n"):
        SP.NgramDrafter(max_n=0)


def test_reference_drafter_patterns():
    seq = list(range(10))
    assert SP.ReferenceDrafter([seq], V)(seq[:4], 3) == [4, 5, 6]
    assert SP.ReferenceDrafter([seq], V, corrupt=1.0)(seq[:4], 3) == [5, 6, 7]
    assert SP.ReferenceDrafter([seq], V)([9, 9], 3) == []
    with pytest.raises(ValueError, match="corrupt"):
        SP.ReferenceDrafter([seq], V, corrupt=1.5)


REQS = [Request(_prompt(20, 1), 7, req_id="a"), Request(_prompt(27, 2), 7, req_id="b"),
        Request(_prompt(40, 3), 5, temperature=1.0, seed=5, arrival=1, req_id="sampled")]


def test_speculative_equals_plain_invariant(model):
    """Every acceptance pattern at k = 3 (reference drafts: all right, half wrong, all wrong):
    every request, the sampled one included, is bitwise plain decoding."""
    plain_engine = Engine(model)
    plain = plain_engine.run(REQS)
    seqs = [c.prompt + c.tokens for c in plain]
    cases = [("all accepted", SP.ReferenceDrafter(seqs, V), 3), ("mixed", SP.ReferenceDrafter(seqs, V, 0.5, 1), 3),
             ("none accepted", SP.ReferenceDrafter(seqs, V, 1.0), 3)]
    for name, drafter, k in cases:
        eng = Engine(model, drafter=drafter, num_draft=k)
        out = eng.run(REQS)
        for a, b in zip(out, plain):
            assert completion_key(a) == completion_key(b), f"{name}: request {a.req_id} differs from plain decoding"
        drafted, accepted = sum(c.drafted for c in out), sum(c.accepted for c in out)
        assert drafted > 0
        if name == "all accepted":
            assert accepted == drafted and len(eng.step_log) < len(plain_engine.step_log)
        if name == "none accepted":
            assert accepted == 0
        if name == "mixed":
            assert 0 < accepted < drafted


def test_speculative_variant_differs(model):
    """Negative control: the same comparison with the variant kernels under load: a filler's
    66-token prefill arrives at step 2, so the step holding it (more than 64 tokens: 2 K-splits
    of ``down_proj`` instead of 4) computes other positions of the request in the two runs;
    the request's bits differ from plain decoding."""
    reqs = [Request(_prompt(30, 10), 7, req_id="r"), Request(_prompt(66, 20), 1, arrival=2, req_id="filler")]
    plain = Engine(model, impl="variant").run(reqs)
    seqs = [c.prompt + c.tokens for c in plain]
    out = Engine(model, impl="variant", drafter=SP.ReferenceDrafter(seqs, V), num_draft=4).run(reqs)
    assert out[0].accepted == out[0].drafted > 0
    assert completion_key(out[0]) != completion_key(plain[0]), \
        "variant kernels: speculative decoding reproduced plain decoding bitwise"


def test_compare_with_plain_counts(model):
    r = SP.compare_with_plain(model, REQS[:1], ks=(2,), drafter=SP.NgramDrafter())
    x = r[2]
    assert x["equal_requests"] == 1 and x["equal_rows"] == x["rows"] == 7
    assert x["generated"] == r["plain"]["generated"] == 7
    assert 0 <= x["accepted"] <= x["drafted"] and x["steps"] <= r["plain"]["steps"]


def test_engine_speculative_bad_input(model):
    with pytest.raises(ValueError, match="num_draft"):
        Engine(model, num_draft=-1)
    with pytest.raises(TypeError, match="drafter"):
        Engine(model, num_draft=2)
    with pytest.raises(ValueError, match="drafter proposed"):
        Engine(model, drafter=lambda toks, k: [V] * k, num_draft=2).run([Request(_prompt(5, 0), 3)])
