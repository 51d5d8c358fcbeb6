"""The kit's vLLM attention backend (:mod:`batch_invariance_kit.vllm.attention_backend`).

Layer level (vLLM imported, no engine): the implementation writes the step's keys and values
into a cache in vLLM's per-layer layout and gives the bits of the kit's attention over its own
cache layout, for a mixed step (decode rows, a chunk starting at an odd position, a prefix-hit
sequence, a zero-token padding entry) with GQA; the metadata's plan is built once and shared by
the layers; the backend's declarations; unsupported features refused.
"""
import pytest
import torch

pytest.importorskip("vllm")

from batch_invariance_kit.ops import attention as A  # noqa: E402
from batch_invariance_kit.verify.harness import bitwise_equal, seeded_normal  # noqa: E402
from batch_invariance_kit.vllm import attention_backend as KB  # noqa: E402

DEV = A.DEVICE
HQ, HKV, D, BS = 4, 2, 32, 16


def _step(seed, dtype, lens, qls):
    """A step's queries/keys/values, the cache history, a block table (shuffled blocks) and
    the metadata tensors: sequence s has seq_len lens[s] and qls[s] new tokens."""
    T = sum(qls)
    g = seed * 101
    q = seeded_normal((T, HQ, D), g + 1, dtype=dtype, device=DEV)
    k = seeded_normal((T, HKV, D), g + 2, dtype=dtype, device=DEV)
    v = seeded_normal((T, HKV, D), g + 3, dtype=dtype, device=DEV)
    hk = seeded_normal((max(sum(lens), 1), HKV, D), g + 4, dtype=dtype, device=DEV)
    hv = seeded_normal((max(sum(lens), 1), HKV, D), g + 5, dtype=dtype, device=DEV)
    nb = sum(-(-n // BS) for n in lens) + 2
    bt = A.allocate_blocks(lens, BS, nb, seed=seed, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0] + torch.tensor(qls).cumsum(0).tolist(), **i32)
    hist = torch.cat([A.slots(bt, s, 0, lens[s] - qls[s], BS) for s in range(len(lens))])
    new = torch.cat([A.slots(bt, s, lens[s] - qls[s], lens[s], BS) for s in range(len(lens))])
    return q, k, v, hk[:hist.shape[0]], hv[:hist.shape[0]], bt, torch.tensor(lens, **i32), qsl, hist, new, nb


def _metadata(lens, qls, bt, seq_lens, qsl, new, impl="invariant"):
    plan = A.make_plan(lens, [0] + torch.tensor(qls).cumsum(0).tolist(), q_heads=HQ, kv_heads=HKV, head_dim=D,
                       impl=impl, device=DEV)
    return KB.KitAttentionMetadata(num_actual_tokens=sum(qls), query_start_loc=qsl, seq_lens=seq_lens,
                                   block_table=bt, slot_mapping=new, plan=plan)


@pytest.mark.parametrize("layout", ["vllm-4d", "split-5d"])
def test_impl_equals_kit_attention_over_its_own_cache(layout):
    dtype = torch.bfloat16
    lens, qls = [37, 20, 53, 0, 9], [1, 1, 11, 0, 9]  # decode, decode, chunk from 42, padding, prefill
    q, k, v, hk, hv, bt, seq_lens, qsl, hist, new, nb = _step(3, dtype, lens, qls)
    # the kit's own cache layout, written and read by the kit
    kc, vc = A.new_cache(nb, BS, HKV, D, dtype, device=DEV)
    A.write_kv(hk, hv, kc, vc, hist)
    A.write_kv(k, v, kc, vc, new)
    want = A.attention(q, kc, vc, bt, seq_lens, qsl)
    # vLLM's per-layer cache: [num_blocks, kv_heads, block_size, 2 * head_dim] (or the 5-D form)
    if layout == "vllm-4d":
        kv = torch.zeros((nb, HKV, BS, 2 * D), dtype=dtype, device=DEV)
    else:
        kv = torch.zeros(KB.KitAttentionBackend.get_kv_cache_shape(nb, BS, HKV, D), dtype=dtype, device=DEV)
    k_view, v_view = KB.kv_views(kv, HKV, D)
    A.write_kv(hk, hv, k_view, v_view, hist)
    impl = KB.KitAttentionImpl(HQ, D, D ** -0.5, HKV)
    md = _metadata(lens, qls, bt, seq_lens, qsl, new)
    before = dict(KB.CALLS)
    out = torch.full((q.shape[0] + 3, HQ, D), 7.0, dtype=dtype, device=DEV)  # vLLM may pad the batch
    for _ in range(2):  # two layers share the step's metadata (one plan)
        got = impl.forward(None, torch.cat([q, q[:3]]), torch.cat([k, k[:3]]), torch.cat([v, v[:3]]), kv, md, out)
        assert bitwise_equal(got[:q.shape[0]], want)
    assert bitwise_equal(out[q.shape[0]:], torch.full_like(out[q.shape[0]:], 7.0)), "padding rows written"
    assert KB.CALLS["launches"] - before.get("launches", 0) == 2
    # the keys landed where the kit's layout has them
    for s_ in range(len(lens)):
        if lens[s_]:
            kk, _ = A.gather_kv(k_view, v_view, bt, s_, lens[s_])
            kw, _ = A.gather_kv(kc, vc, bt, s_, lens[s_])
            assert bitwise_equal(kk, kw)


def test_variant_plan_is_caught():
    """With a variant plan (what ``set_impl("variant")`` makes the builder build), a long decode
    row alone and beside seven others differ (the batch-chosen split); invariant: equal."""
    dtype = torch.float32
    n = 3 * 64 + 44
    lens = [n] + [9, 40, 77, 5, 130, 64, 33]
    qls = [1] * len(lens)
    q, k, v, hk, hv, bt, seq_lens, qsl, hist, new, nb = _step(5, dtype, lens, qls)
    res = {}
    for impl in ("invariant", "variant"):
        outs = []
        for m in (1, len(lens)):
            kv = torch.zeros((nb, HKV, BS, 2 * D), dtype=dtype, device=DEV)
            kview, vview = KB.kv_views(kv, HKV, D)
            A.write_kv(hk, hv, kview, vview, hist)
            md = _metadata(lens[:m], qls[:m], bt[:m], seq_lens[:m], qsl[:m + 1], new[:m], impl=impl)
            o = torch.empty((m, HQ, D), dtype=dtype, device=DEV)
            KB.KitAttentionImpl(HQ, D, D ** -0.5, HKV).forward(None, q[:m], k[:m], v[:m], kv, md, o)
            outs.append(o[0])
        res[impl] = bitwise_equal(outs[0], outs[1])
    assert res == {"invariant": True, "variant": False}, res


def test_backend_declarations_and_refusals():
    B = KB.KitAttentionBackend
    assert B.get_impl_cls() is KB.KitAttentionImpl and B.get_builder_cls() is KB.KitAttentionMetadataBuilder
    assert B.forward_includes_kv_cache_update and B.supports_batch_invariance()
    assert B.supports_attn_type("decoder") and not B.supports_attn_type("encoder")
    with pytest.raises(ValueError, match="sliding_window"):
        KB.KitAttentionImpl(HQ, D, 0.1, HKV, sliding_window=128)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KB.KitAttentionImpl(HQ, D, 0.1, HKV, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="impl"):
        KB.set_impl("fast")
    with pytest.raises(ValueError, match="kv_cache must be"):
        KB.kv_views(torch.zeros((4, HKV, BS, D)), HKV, D)


# ---------------------------------------------------------------------------------------------
# Engine level: vLLM's CPU engine with the kit's attention in place of CPU_ATTN
# ---------------------------------------------------------------------------------------------

def _engine_worker(folder: str) -> dict:
    """In a fresh process: a tiny random Llama (2 layers, 4 q / 2 kv heads of 32, fp32) saved
    to ``folder``; vLLM's CPU engine in-process with the kit's backend registered over CPU_ATTN,
    a 24-token batch budget (prefill chunks start at 24, 48, ...: not multiples of the kit's
    tile) and the prefix cache on (a shared 50-token prefix hits 3 blocks of 16: 48 tokens).
    Weights drawn with std 1 (HF's default 0.02 leaves the log-probabilities blind to a last-bit
    change in attention).  Greedy, raw fp32 log-probabilities; each prompt alone, then all in one
    batch; then the two long prompts again with the kit's split-KV variant.  Returns the token/log-probability sequences and the
    backend's call counters."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import batch_invariance_kit  # noqa: F401  (chooses the Triton interpreter before vLLM imports triton)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=1.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{KB.__name__}.KitAttentionBackend")
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
              enable_prefix_caching=True, block_size=16, max_num_seqs=8, max_num_batched_tokens=24, seed=0,
              logprobs_mode="raw_logprobs", kv_cache_memory_bytes=32 << 20)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 23, 56, 70)]
    prompts.append(prompts[2][:50] + torch.randint(0, 512, (9,), generator=g).tolist())
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True, detokenize=False)

    def run(ps):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    res = {}
    for impl, which in (("invariant", range(len(prompts))), ("variant", (2, 3))):
        KB.set_impl(impl)
        llm.reset_prefix_cache()
        alone = [run([prompts[i]])[0] for i in which]
        batch = run(prompts)
        res[impl] = {"alone": alone, "batch": [batch[i] for i in which], "calls": dict(KB.CALLS)}
    return res


def test_engine_bs1_equals_bsn_with_the_kit_attention(tmp_path):
    """vLLM's CPU engine, kit attention: every prompt's greedy tokens and fp32 log-probabilities
    alone == in a batch of five, bitwise, with chunked prefill at odd starts and a prefix-cache
    hit; the counters show the kit's kernels ran every layer of every step.  The same run with
    the split-KV variant changes some log-probability (the negative control)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "engine.json"
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_vllm_attention as t; "
            "json.dump(t._engine_worker(sys.argv[2]), open(sys.argv[3], 'w'))")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path / "model"), str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    inv, var = res["invariant"], res["variant"]
    assert inv["calls"]["launches"] == 2 * inv["calls"]["plans"] > 0, inv["calls"]  # 2 layers per planned step
    assert inv["alone"] == inv["batch"], "kit attention: a prompt's tokens/log-probabilities depend on the batch"
    assert var["calls"]["launches"] > inv["calls"]["launches"]
    assert var["alone"] != var["batch"], "the split-KV variant was expected to change a log-probability"
