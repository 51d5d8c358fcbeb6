"""The kit's vLLM attention backend (:mod:`batch_invariance_kit.vllm.attention_backend`).

Layer level (vLLM imported, no engine): the implementation writes the step's keys and values
into a cache in vLLM's per-layer layout and gives the bits of the kit's attention over its own
cache layout, for a mixed step (decode rows, a chunk starting at an odd position, a prefix-hit
sequence, a zero-token padding entry) with GQA; the metadata's plan is built once and shared by
the layers; the backend's declarations; unsupported features refused.

Builder level (vLLM's persistent input buffers emulated, a full-decode-graph configuration): the
CUDA-graph support declared; decode steps refill the padded plan captured once (the same
pointers at every step) and give the exact plan's bits, eagerly and replayed with the capture's
metadata; mixed steps and decode steps above the capacity keep their exact plan.
"""
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from batch_invariance_kit.device import DEVICE  # noqa: E402
from batch_invariance_kit.ops import attention as A  # noqa: E402
from batch_invariance_kit.verify.harness import bitwise_equal, seeded_normal  # noqa: E402
from batch_invariance_kit.vllm import attention_backend as KB  # noqa: E402

DEV = DEVICE
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


def test_forward_checks_a_layout_once_then_launches_unchecked(monkeypatch):
    """A layer's first forward runs write_kv's and attention's checks; later forwards with tensors
    of the same layout launch without them (``validate=False``: the same bits), and a forward over
    another cache checks again.  The unchecked calls still refuse a plan built for another call."""
    from batch_invariance_kit.ops.attention import cache as C
    from batch_invariance_kit.ops.attention import ops as O

    counts = {"tensors": 0, "write": 0}
    for mod, name, key in ((O, "check_tensors", "tensors"), (C, "_check_write", "write")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _key=key, **k: (counts.__setitem__(_key, counts[_key] + 1),
                                                                              _real(*a, **k))[1])
    dtype = torch.bfloat16
    lens, qls = [37, 20, 53, 9], [1, 1, 11, 9]
    q, k, v, hk, hv, bt, seq_lens, qsl, hist, new, nb = _step(4, dtype, lens, qls)
    md = _metadata(lens, qls, bt, seq_lens, qsl, new)
    impl = KB.KitAttentionImpl(HQ, D, D ** -0.5, HKV)
    outs = []
    kvs = [torch.zeros((nb, HKV, BS, 2 * D), dtype=dtype, device=DEV) for _ in range(2)]
    for kv in (kvs[0], kvs[0], kvs[0], kvs[1]):
        o = torch.empty((q.shape[0], HQ, D), dtype=dtype, device=DEV)
        outs.append(impl.forward(None, q, k, v, kv, md, o))
    assert counts == {"tensors": 2, "write": 2}, counts  # the first call on each cache
    assert all(bitwise_equal(o, outs[0]) for o in outs[1:])
    other = _metadata(lens[:3], qls[:3], bt[:3], seq_lens[:3], qsl[:4], new[:3])  # a plan of fewer tokens
    with pytest.raises(ValueError, match="plan was built for"):
        impl.forward(None, q, k, v, kvs[1], KB.KitAttentionMetadata(
            num_actual_tokens=q.shape[0], query_start_loc=qsl, seq_lens=seq_lens, block_table=bt,
            slot_mapping=new, plan=other.plan), torch.empty((q.shape[0], HQ, D), dtype=dtype, device=DEV))
    with pytest.raises(ValueError, match="validate=False needs a plan and out"):
        A.attention(q, *KB.kv_views(kvs[0], HKV, D), bt, seq_lens, qsl, validate=False)
    # another layout after the memo is checked again (an output of another dtype is named), and the
    # per-step sizes an unchecked launch relies on are checked on every call
    with pytest.raises(TypeError, match="out"):
        impl.forward(None, q, k, v, kvs[1], md, torch.empty((q.shape[0], HQ, D), dtype=torch.float32, device=DEV))
    short = KB.KitAttentionMetadata(num_actual_tokens=q.shape[0], query_start_loc=qsl, seq_lens=seq_lens,
                                    block_table=bt, slot_mapping=new[:-1], plan=md.plan)
    with pytest.raises(ValueError, match="slot_mapping has"):
        impl.forward(None, q, k, v, kvs[1], short, torch.empty((q.shape[0], HQ, D), dtype=dtype, device=DEV))
    assert counts["tensors"] == 3


def test_write_kv_unchecked_writes_what_the_checked_call_writes():
    """``write_kv(validate=False)`` stores the bits the checked call stores: int32 and int64 slots,
    skipped tokens (-1), no tokens, and with the slot range check kept."""
    dtype = torch.bfloat16
    key, value = seeded_normal((9, HKV, D), 1, dtype=dtype, device=DEV), seeded_normal((9, HKV, D), 2, dtype=dtype,
                                                                                        device=DEV)
    slots = torch.tensor([5, -1, 17, 0, 40, -1, 3, 63, 22], device=DEV)
    for sl in (slots, slots.to(torch.int32)):
        for n in (9, 0):
            got, want = [A.new_cache(4, BS, HKV, D, dtype, device=DEV) for _ in range(2)]
            A.write_kv(key[:n], value[:n], *want, sl[:n])
            A.write_kv(key[:n], value[:n], *got, sl[:n], validate=False)
            assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])
    with pytest.raises(ValueError, match="slot_mapping holds slots"):
        A.write_kv(key, value, *A.new_cache(2, BS, HKV, D, dtype, device=DEV), slots, validate=False)


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


def test_profiling_run_returns_zeros_and_leaves_the_cache():
    """A profiling / warm-up run (no metadata) returns the output buffer zeroed, whatever it held,
    and writes nothing to the cache."""
    q = torch.randn((5, HQ, D), device=DEV)
    kv = torch.full((2, HKV, BS, 2 * D), 7.0, device=DEV)
    o = torch.full((5, HQ, D), float("nan"), device=DEV)
    r = KB.KitAttentionImpl(HQ, D, D ** -0.5, HKV).forward(None, q, q[:, :HKV], q[:, :HKV], kv, None, o)
    assert r is o and bool((o == 0).all()) and not torch.signbit(o).any()
    assert bool((kv == 7.0).all())


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
# Builder level: the padded decode plan in persistent buffers (full CUDA graphs of decode steps)
# ---------------------------------------------------------------------------------------------

MAX_LEN, CAPACITY = 256, 8


def _vllm_config(mode="FULL_AND_PIECEWISE", max_capture=16, max_num_seqs=CAPACITY):
    """What the builder reads of a ``VllmConfig``: the head count, ``max_model_len``,
    ``max_num_seqs`` and the CUDA-graph settings (a capture size above ``max_num_seqs``: vLLM
    captures no decode graph of more requests than that)."""
    from vllm.config import CUDAGraphMode

    ns = types.SimpleNamespace
    sizes = [s for s in (1, 2, 4, 8, 16) if s <= max_capture]
    return ns(model_config=ns(get_num_attention_heads=lambda parallel_config: HQ, max_model_len=MAX_LEN),
              parallel_config=None, scheduler_config=ns(max_num_seqs=max_num_seqs),
              compilation_config=ns(cudagraph_mode=CUDAGraphMode[mode], cudagraph_capture_sizes=sizes,
                                    max_cudagraph_capture_size=max_capture))


def _builder(**config):
    spec = types.SimpleNamespace(num_kv_heads=HKV, head_size=D, block_size=BS)
    return KB.KitAttentionMetadataBuilder(spec, ["layer.0"], _vllm_config(**config), DEV)


class _Runner:
    """What the builder and a layer see of vLLM's GPU runner: persistent input buffers refilled in
    place every step (int32 ``query_start_loc`` and ``seq_lens`` on host and device (the host
    ``seq_lens`` as ``seq_lens_cpu_upper_bound``, exact without speculative decoding; none with
    ``host_copy=False``), block table;
    int64 slot mapping; the query, key, value and output rows) and one KV cache in vLLM's 4-D
    layer layout.  A decode batch padded to ``pad_to`` requests (a capture size) gets padding
    requests of no token and no context, zero block-table rows, slots -1 and zero token rows, as
    vLLM pads a batch that a full graph replays."""

    def __init__(self, dtype=torch.float32, max_reqs=12, max_tokens=64, num_blocks=128, host_copy=True):
        i32 = dict(dtype=torch.int32, device=DEV)
        self.dtype, self.num_blocks, self.host_copy = dtype, num_blocks, host_copy
        self.qsl_cpu = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.qsl = torch.zeros(max_reqs + 1, **i32)
        self.lens_cpu = torch.zeros(max_reqs, dtype=torch.int32)
        self.lens = torch.zeros(max_reqs, **i32)
        self.bt = torch.zeros((max_reqs, -(-MAX_LEN // BS)), **i32)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=DEV)
        self.q = torch.zeros((max_tokens, HQ, D), dtype=dtype, device=DEV)
        self.k = torch.zeros((max_tokens, HKV, D), dtype=dtype, device=DEV)
        self.v = torch.zeros((max_tokens, HKV, D), dtype=dtype, device=DEV)
        self.out = torch.zeros((max_tokens, HQ, D), dtype=dtype, device=DEV)
        self.kv = torch.zeros((num_blocks, HKV, BS, 2 * D), dtype=dtype, device=DEV)
        self.k_view, self.v_view = KB.kv_views(self.kv, HKV, D)
        self.impl = KB.KitAttentionImpl(HQ, D, D ** -0.5, HKV)

    def step(self, seed, lens, qls, pad_to=None):
        """Sequence ``s`` has context ``lens[s]`` after the step and ``qls[s]`` new tokens (their
        history written to the cache now, the new keys by the layer); returns vLLM's common
        metadata over the buffers."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n, T = len(lens), sum(qls)
        R = pad_to or n
        Tp = T + R - n  # vLLM's padded token count: one padding token per padding request
        bt = A.allocate_blocks(lens, BS, self.num_blocks, seed=seed, device=DEV)
        self.bt.zero_()
        self.bt[:n, :bt.shape[1]] = bt
        g = seed * 101  # draws of fixed sizes: a sequence's values do not depend on the others
        hist = torch.cat([A.slots(bt, s, 0, lens[s] - qls[s], BS) for s in range(n)])
        if hist.numel():
            H, hist_rows = hist.shape[0], (self.num_blocks * BS, HKV, D)
            A.write_kv(seeded_normal(hist_rows, g + 4, dtype=self.dtype, device=DEV)[:H],
                       seeded_normal(hist_rows, g + 5, dtype=self.dtype, device=DEV)[:H],
                       self.k_view, self.v_view, hist)
        for buf, off in ((self.q, 1), (self.k, 2), (self.v, 3)):
            buf.zero_()
            buf[:T] = seeded_normal(tuple(buf.shape), g + off, dtype=self.dtype, device=DEV)[:T]
        self.slots.fill_(-1)
        self.slots[:T] = torch.cat([A.slots(bt, s, lens[s] - qls[s], lens[s], BS) for s in range(n)])
        qsl = np.concatenate([[0], np.cumsum(qls), np.full(R - n, T)]).astype(np.int32)
        self.qsl_cpu.zero_()
        self.qsl_cpu[:R + 1] = torch.from_numpy(qsl)
        self.qsl.copy_(self.qsl_cpu)
        self.lens_cpu.zero_()
        self.lens_cpu[:n] = torch.tensor(lens, dtype=torch.int32)
        self.lens.copy_(self.lens_cpu)
        self.T = T
        host = {"seq_lens_cpu_upper_bound": self.lens_cpu[:R]} if self.host_copy else {}
        return CommonAttentionMetadata(
            query_start_loc=self.qsl[:R + 1], query_start_loc_cpu=self.qsl_cpu[:R + 1], seq_lens=self.lens[:R],
            num_reqs=R, num_actual_tokens=Tp, max_query_len=max(qls), max_seq_len=max(lens),
            block_table_tensor=self.bt[:R], slot_mapping=self.slots[:Tp], **host)

    def run(self, md):
        """One layer over the buffers with ``md``: the output rows of the step's tokens.  With
        the metadata of a capture (``md.num_actual_tokens``: the capture batch) after another
        step refilled the buffers, this is what a replay of the captured graph computes."""
        n = md.num_actual_tokens
        self.out.fill_(7.0)
        self.impl.forward(None, self.q[:n], self.k[:n], self.v[:n], self.kv, md, self.out[:n])
        self.padding_written = not bool((self.out[self.T:n] == 7.0).all())  # rows past the step's tokens
        return self.out[:self.T].clone()

    def exact(self, lens, qls):
        """The kit's attention of the step with its exact plan (``make_plan`` without padding)."""
        n, T = len(lens), sum(qls)
        plan = A.make_plan(lens, [0, *np.cumsum(qls).tolist()], q_heads=HQ, kv_heads=HKV, head_dim=D, device=DEV)
        assert plan.decode.seq.numel() == sum(q == 1 for q in qls)  # no padding
        return A.attention(self.q[:T], self.k_view, self.v_view, self.bt[:n], self.lens[:n], self.qsl[:n + 1],
                           scale=D ** -0.5, plan=plan)


def _pointers(md) -> list:
    return [t.data_ptr() for t in (*md.plan.tensors(), md.plan.merge.acc, md.plan.merge.ml, md.query_start_loc,
                                   md.seq_lens, md.block_table, md.slot_mapping)]


def test_builder_declares_full_graphs_for_single_token_decode():
    from vllm.v1.attention.backend import AttentionCGSupport

    B = KB.KitAttentionMetadataBuilder
    level = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert B.get_cudagraph_support(_vllm_config(), None) is level and B._cudagraph_support is level
    assert KB.decode_graph_capacity(_vllm_config()) == CAPACITY  # capture sizes up to 16, max_num_seqs 8
    assert KB.decode_graph_capacity(_vllm_config(max_capture=4)) == 4
    for mode in ("NONE", "PIECEWISE"):
        assert KB.decode_graph_capacity(_vllm_config(mode)) is None
    cpu_build = _vllm_config()  # no capture size (vLLM's CPU build empties the list)
    cpu_build.compilation_config.cudagraph_capture_sizes = []
    assert KB.decode_graph_capacity(cpu_build) is None
    assert KB.decode_graph_capacity(_vllm_config("FULL_DECODE_ONLY")) == CAPACITY


def test_decode_steps_refill_the_captured_buffers():
    """A capture of 8 requests, then decode steps of 3 requests (padded to 4) and 5 (padded to
    8): every plan and metadata tensor at the capture's address, the layer's output the exact
    plan's bits, eagerly and replayed with the capture's metadata (its plan object, its
    tensor views, its token count)."""
    r, b = _Runner(), _builder()
    md_cap = b.build_for_cudagraph_capture(r.step(1, [1] * CAPACITY, [1] * CAPACITY))
    assert md_cap.persistent and md_cap.plan.decode.seq.numel() == CAPACITY
    before = KB.CALLS["padded_plans"]
    for seed, lens, pad in ((2, [37, 100, 236], 4), (3, [9, 130, 64, 33, 250], 8)):
        qls = [1] * len(lens)
        md = b.build(0, r.step(seed, lens, qls, pad_to=pad))
        assert md.persistent and md.num_actual_tokens == len(lens)
        assert _pointers(md) == _pointers(md_cap)
        got = r.run(md)
        want = r.exact(lens, qls)
        assert bitwise_equal(got, want)
        assert bitwise_equal(r.run(md_cap), want), "a replay of the captured launch is not the step's"
        assert not r.padding_written, "the capture batch's rows past the step's tokens were written"
    assert KB.CALLS["padded_plans"] - before == 2


def test_padded_decode_plan_bs1_equals_bsn_and_variant_is_caught():
    """A long decode row alone (padded to 1 request) and beside seven others (8), both through
    the refilled padded plan: the invariant kernels give equal bits, the split-KV variant (its
    split chosen from the batch) does not (the negative control of this check)."""
    n = 3 * 64 + 44
    lens = [n, 9, 40, 77, 5, 130, 64, 33]
    res = {}
    try:
        for impl in ("invariant", "variant"):
            KB.set_impl(impl)
            r, b = _Runner(), _builder()
            rows, ptrs = [], []
            for m in (1, len(lens)):
                md = b.build(0, r.step(5, lens[:m], [1] * m, pad_to=m))
                assert md.persistent and md.plan.impl == impl
                ptrs.append(_pointers(md))
                rows.append(r.run(md)[0])
            assert ptrs[0] == ptrs[1]
            res[impl] = bitwise_equal(rows[0], rows[1])
    finally:
        KB.set_impl("invariant")
    assert res == {"invariant": True, "variant": False}, res


def test_mixed_step_after_decode_keeps_the_exact_plan():
    """Decode, then a mixed step (decodes, a chunk from an odd position, a prefix hit, a padding
    entry), then decode again: the mixed step gets its exact plan (its own tensors) and the exact
    bits; the next decode step refills the same buffers as the first."""
    r, b = _Runner(), _builder()
    md1 = b.build(0, r.step(6, [37, 20, 90], [1, 1, 1], pad_to=4))
    ptrs = _pointers(md1)
    lens, qls = [37, 20, 53, 0, 9], [1, 1, 11, 0, 9]
    md = b.build(0, r.step(7, lens, qls))
    assert not md.persistent and md.plan.decode.seq.numel() == 2 and md.plan.tiles.seq.numel() > 0
    assert bitwise_equal(r.run(md), r.exact(lens, qls))
    md2 = b.build(0, r.step(8, [12, 200], [1, 1], pad_to=2))
    assert md2.persistent and _pointers(md2) == ptrs
    assert bitwise_equal(r.run(md2), r.exact([12, 200], [1, 1]))


def test_decode_above_capacity_or_without_full_graphs_keeps_the_exact_plan(monkeypatch):
    """A decode step of more requests than the largest decode graph (vLLM runs it eagerly) gets
    its exact plan and bits, and so does a capture batch of that size, which the layer then
    refuses to run inside a graph capture (a capture is simulated: there is no GPU here); without
    full decode graphs (``cudagraph_mode`` NONE) every step keeps its exact plan; switching the
    impl after a capture is refused (the graphs hold the other plan's buffers)."""
    r, b = _Runner(), _builder()
    lens = [5, 17, 33, 48, 64, 65, 80, 96, 120, 7]
    md = b.build(0, r.step(9, lens, [1] * len(lens)))
    assert not md.persistent and md.plan.decode.seq.numel() == len(lens)
    assert bitwise_equal(r.run(md), r.exact(lens, [1] * len(lens)))
    md_big = b.build_for_cudagraph_capture(r.step(10, [1] * 10, [1] * 10))
    md_cap = b.build_for_cudagraph_capture(r.step(10, [1] * 4, [1] * 4))
    assert not md_big.persistent and md_cap.persistent
    monkeypatch.setattr(KB, "_capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="per-step plan"):
        r.run(md_big)
    r.run(md_cap)  # the persistent plan runs under a capture
    monkeypatch.undo()
    md = _builder(mode="NONE").build(0, r.step(11, [37, 100], [1, 1]))
    assert not md.persistent and md.plan.decode.seq.numel() == 2
    try:
        KB.set_impl("variant")
        with pytest.raises(RuntimeError, match="after CUDA-graph capture"):
            b.build(0, r.step(13, [37, 100], [1, 1]))
    finally:
        KB.set_impl("invariant")


class _DeviceOnly(torch.Tensor):
    """A tensor standing for one in GPU memory: any read of its values on the host (``.cpu()``,
    ``.to("cpu")``, ``.item()``, ``.tolist()``, ``.numpy()``, ``int()``, ``bool()``) raises,
    as a wait for the GPU would stall a real step.  Device-side use (slicing, ``copy_``, dtype
    conversion on the device) passes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_host = name == "to" and any(a == "cpu" or a == torch.device("cpu") for a in (*args[1:], kwargs.get("device")))
        if name in ("cpu", "item", "tolist", "numpy", "__int__", "__index__", "__bool__", "__float__") or to_host:
            raise AssertionError(f"a host read of device metadata in the builder: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs)


def _on_device_only(m):
    """``m`` with its device tensors (``query_start_loc``, ``seq_lens``, block table, slot mapping)
    as :class:`_DeviceOnly`."""
    return m.replace(**{k: getattr(m, k).as_subclass(_DeviceOnly)
                        for k in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")})


def test_builder_reads_no_device_metadata_on_the_host():
    """Every step, decode (the padded plan) and mixed (the exact plan), is planned from vLLM's host
    copies of ``query_start_loc`` and ``seq_lens``: the builder reads nothing of the device
    tensors (they raise on a host read), makes the same plan as ``make_plan`` of the host lists,
    and counts no device read.  Without vLLM's host copy of ``seq_lens`` (or with speculative
    decoding, whose host copy is an upper bound) the builder has to read the device's: the same
    check catches it."""
    probe = _DeviceOnly(torch.zeros(3, dtype=torch.int32))
    for read in (probe.cpu, probe.tolist, lambda: int(probe[0]), lambda: probe.to("cpu"), probe.numpy):
        with pytest.raises(AssertionError, match="host read"):
            read()
    r, b = _Runner(), _builder()
    before = KB.CALLS["seq_lens_device_reads"]
    b.build_for_cudagraph_capture(_on_device_only(r.step(1, [1] * CAPACITY, [1] * CAPACITY)))
    for seed, lens, qls, pad in ((2, [37, 100, 236], [1, 1, 1], 4), (7, [37, 20, 53, 0, 9], [1, 1, 11, 0, 9], None)):
        md = b.build(0, _on_device_only(r.step(seed, lens, qls, pad_to=pad)))
        assert md.persistent == (pad is not None)
        n = pad or len(lens)
        want = A.make_plan(lens + [0] * (n - len(lens)), [0, *np.cumsum(qls + [0] * (n - len(lens))).tolist()],
                           q_heads=HQ, kv_heads=HKV, head_dim=D, device=DEV,
                           **({"decode_capacity": CAPACITY, "max_seq_len": MAX_LEN} if md.persistent else {}))
        got = [t[:w.numel()] for t, w in zip(md.plan.tensors(), want.tensors())]
        assert all(bitwise_equal(g, w) for g, w in zip(got, want.tensors()))
    assert KB.CALLS["seq_lens_device_reads"] == before
    for runner, builder in ((_Runner(host_copy=False), _builder()), (_Runner(), _builder())):
        if runner.host_copy:
            builder.speculative = True  # the host copy counts draft tokens as accepted: not used
        with pytest.raises(AssertionError, match="host read"):
            builder.build(0, _on_device_only(runner.step(3, [37, 100], [1, 1], pad_to=2)))
        md = builder.build(0, runner.step(3, [37, 100], [1, 1], pad_to=2))
        assert bitwise_equal(runner.run(md), runner.exact([37, 100], [1, 1]))
    assert KB.CALLS["seq_lens_device_reads"] - before == 4


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
    the split-KV variant changes some log-probability (the negative control).  Every step is
    planned from vLLM's host copy of ``seq_lens`` (no read of the device's)."""
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
    assert inv["calls"].get("seq_lens_device_reads", 0) == 0, "vLLM's host copy of seq_lens was not used"
    assert inv["alone"] == inv["batch"], "kit attention: a prompt's tokens/log-probabilities depend on the batch"
    assert var["calls"]["launches"] > inv["calls"]["launches"]
    assert var["alone"] != var["batch"], "the split-KV variant was expected to change a log-probability"
