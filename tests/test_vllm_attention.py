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
