"""The host path on the CPU: what a step costs before any kernel runs.

:func:`plan_times` times the attention planner (:func:`batch_invariance_kit.ops.attention.make_plan`)
on the steps a serving engine issues, from host ``int32`` tensors as vLLM's metadata builder
hands them over, at the production head layout (32 q heads over 8 kv heads of dim 128) and
the shipped schedule (:data:`~batch_invariance_kit.ops.attention.DEFAULT_CONFIG`), with the
plan's tensors on the CPU:

* decode of 256 sequences with contexts of 1 to 32k keys, exact and padded to a fixed size
  (``decode_capacity``, ``max_seq_len``: the plan a CUDA graph replays), and with the split-KV
  variant;
* one 16k-token prefill;
* a mixed step of 64 sequences with 8192 new tokens: 48 decodes and 16 prefill chunks starting
  at random positions.

Each figure is the median of many timed calls (``time.perf_counter`` around each call) beside
its target from the design ("The host path").  Speed is measured here, never asserted in a test.

:func:`call_times` times eager calls of the kit's ops (``linear``, ``rms_norm``,
``fused_add_rms_norm``, ``attention`` with a plan, ``fused_moe``) beside torch's nearest op:
real calls on a GPU, the kit's launches stubbed on the CPU; ``--out DIR`` writes them as
``DIR/host_calls.json`` in the results format.

    python -m batch_invariance_kit.bench.host
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..ops import attention as A
from ..report.results import goal

HQ, HKV, D = 32, 8, 128
MAX_CONTEXT = 32768


def _step(q_lens: list, contexts: list) -> tuple:
    """``(seq_lens, query_start_loc)`` int32 CPU tensors of a step whose sequence ``s`` gets
    ``q_lens[s]`` new tokens after ``contexts[s]`` cached ones."""
    ql = torch.tensor(q_lens, dtype=torch.int32)
    lens = ql + torch.tensor(contexts, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ql.cumsum(0).to(torch.int32)])
    return lens, qsl


def plan_steps(seed: int = 0) -> list:
    """The timed steps: ``(name, seq_lens, query_start_loc, make_plan keywords, target_us)``."""
    g = torch.Generator().manual_seed(seed)
    ctx = lambda n: torch.randint(0, MAX_CONTEXT, (n,), generator=g).tolist()  # noqa: E731
    dec = _step([1] * 256, ctx(256))
    chunks = 16
    per_chunk = (8192 - 48) // chunks
    mixed = _step([1] * 48 + [per_chunk] * chunks, ctx(48) + torch.randint(0, MAX_CONTEXT - per_chunk, (chunks,),
                                                                          generator=g).tolist())
    padded = dict(decode_capacity=256, max_seq_len=MAX_CONTEXT + 1)
    return [
        ("decode, 256 sequences", *dec, {}, 50.0),
        ("decode, 256 sequences, padded", *dec, padded, 50.0),
        ("decode, 256 sequences, variant", *dec, {"impl": "variant"}, 50.0),
        ("prefill, 16384 tokens", *_step([16384], [0]), {}, 200.0),
        ("mixed, 64 sequences, 8192 tokens", *mixed, {}, 200.0),
    ]


def _median_us(fn, reps: int, budget_s: float) -> tuple:
    """Median microseconds of timed calls of ``fn`` (one warm-up call; at most ``reps`` calls,
    fewer when they pass ``budget_s``, at least 3) and the number of calls timed."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(times)


def plan_times(reps: int = 2000, budget_s: float = 0.5, seed: int = 0) -> list:
    """One row per step of :func:`plan_steps`: ``{"part", "case", "median_us", "target_us",
    "calls"}`` for :func:`~batch_invariance_kit.ops.attention.make_plan` on the CPU."""
    cfg = A.AttnConfig()
    rows = []
    for name, lens, qsl, kw, target in plan_steps(seed):
        fn = lambda: A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, config=cfg,  # noqa: E731
                                 device="cpu", **kw)
        us, n = _median_us(fn, reps, budget_s)
        rows.append({"part": "attention plan", "case": name, "median_us": us, "target_us": target, "calls": n})
    return rows


def table(rows: list) -> str:
    """Rows of :func:`plan_times` (or any rows with those keys) as a text table."""
    head = ("part", "case", "median µs", "target µs", "calls")
    body = [(r["part"], r["case"], f"{r['median_us']:.1f}",
             "" if r.get("target_us") is None else f"{r['target_us']:.0f}", str(r["calls"])) for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda x: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in body])


# --------------------------------------------------------------------------------------------
# Eager calls: the host time of one call of an op, beside torch's nearest op
# --------------------------------------------------------------------------------------------
#
# :func:`call_times` times eager calls of the kit's ops as a model makes them (arguments
# checked, launch parameters looked up, kernels launched) beside torch's nearest op:
#
# * ``linear`` beside ``F.linear``;
# * ``rms_norm`` beside ``F.rms_norm``; ``fused_add_rms_norm`` beside ``x + residual`` then
#   ``F.rms_norm``;
# * ``attention`` with the step's plan (a decode step) beside ``F.scaled_dot_product_attention``
#   of the same queries over dense keys and values;
# * ``fused_moe`` beside a torch MoE without host synchronisation: router, top-k, a stable
#   argsort of the expert ids, ``torch._grouped_mm`` for gate/up and down, the weighted sum.
#
# On a GPU the calls are real and never synchronised: a batch of ``calls`` calls is timed with
# ``perf_counter`` and divided (the queue absorbs the kernels as long as they run faster than
# the host issues them).  On the CPU the kit's Triton launches are stubbed out
# (:func:`stubbed_launches`: the interpreter would run the kernels) and torch's ops run for real
# at tiny shapes, so the kit's figure is its host path alone and torch's includes its (small)
# arithmetic.  Each figure is the median over ``batches`` batches.  The design's target: the
# kit's op within about 2x of torch's.

#: Shapes of the timed calls: (CPU, GPU).  ``tokens``: rows of the call (decode sequences for
#: attention); the hidden sizes and layouts of a small model on the CPU, of Qwen3-30B-A3B-like
#: layers on the GPU.
CALL_SHAPES = {
    False: dict(tokens=(1, 32), hidden=128, heads=(4, 2, 32), context=64, experts=(16, 4, 32)),
    True: dict(tokens=(1, 32, 256), hidden=4096, heads=(32, 8, 128), context=1024, experts=(128, 8, 768)),
}
#: The design's bound on an eager call's host time, as a multiple of torch's nearest op
CALL_TARGET = 2.0


@contextlib.contextmanager
def stubbed_launches():
    """Within the block, every Triton kernel of the kit's op modules returns at once when launched
    (its ``run`` replaced on the kernel object): a call's host path runs, no kernel does."""
    from triton.runtime.jit import KernelInterface

    from ..ops import matmul, moe, rms_norm
    from ..ops.attention import cache, kernels as attention_kernels

    kernels = {id(v): v for m in (matmul, rms_norm, moe, attention_kernels, cache) for v in vars(m).values()
               if isinstance(v, KernelInterface)}
    for k in kernels.values():
        k.run = _no_launch
    try:
        yield
    finally:
        for k in kernels.values():
            del k.run


def _no_launch(*args, grid, warmup, **kwargs):
    return None


def _per_call_us(fn, calls: int, batches: int, sync, budget_s: float) -> tuple:
    """Median over ``batches`` of the microseconds per call of ``calls`` back-to-back calls
    (``sync`` before each batch, outside the timing), and the calls timed: fewer per batch
    (at least 5, or ``calls`` if fewer) when the warm-up calls say that ``calls`` would take
    more than ``budget_s``.  A first call before them compiles what it needs."""
    warm = max(3, calls // 10)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(warm):
        fn()
    sync()
    calls = max(min(5, calls), min(calls, int(budget_s / batches * warm / (time.perf_counter() - t0))))
    per = []
    for _ in range(batches):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(per), calls * batches


def _torch_moe(x, router_weight, w13_t, w2_t, top_k, experts):
    """A torch MoE with no device-to-host copy (the peer of ``fused_moe``): softmax router,
    top-k renormalised, rows sorted by expert (stable), ``torch._grouped_mm`` over the experts'
    row groups (``w13_t``, ``w2_t``: the weights as (E, K, N) views), rows put back, weighted sum."""
    F = torch.nn.functional
    T = x.shape[0]
    w, ids = torch.topk(torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float32), top_k)
    w = w / w.sum(dim=-1, keepdim=True)
    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], experts, right=True, out_int32=True)
    h = torch._grouped_mm(x[order // top_k], w13_t, offs=ends)
    inter = h.shape[1] // 2
    y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2_t, offs=ends)
    back = torch.empty_like(y)
    back[order] = y
    return (back.view(T, top_k, -1) * w.unsqueeze(-1).to(x.dtype)).sum(dim=1)


def _call_cases(on_gpu: bool, dtype) -> list:
    """``(op, shape keys, kit call, torch call)`` of every timed case (torch call ``None``: the
    peer cannot run here)."""
    from ..ops import attention as A
    from ..ops import matmul as MM
    from ..ops import moe as MOE
    from ..ops import rms_norm as R

    s = CALL_SHAPES[on_gpu]
    dev = torch.device("cuda" if on_gpu else "cpu")
    F = torch.nn.functional
    g = torch.Generator(dev).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=dtype)  # noqa: E731
    H = s["hidden"]
    cases = []
    w, nw = rand(H, H), rand(H)
    for t in s["tokens"]:
        x, r = rand(t, H), rand(t, H)
        shape = {"tokens": t, "hidden": H}
        cases.append(("linear", dict(shape, out_features=H), lambda x=x: MM.linear(x, w), lambda x=x: F.linear(x, w)))
        cases.append(("rms_norm", shape, lambda x=x: R.rms_norm(x, nw), lambda x=x: F.rms_norm(x, (H,), nw, 1e-6)))
        cases.append(("fused_add_rms_norm", shape, lambda x=x, r=r: R.fused_add_rms_norm(x, r, nw),
                      lambda x=x, r=r: F.rms_norm(x + r, (H,), nw, 1e-6)))
    hq, hkv, d = s["heads"]
    ctx, bs = s["context"], 16
    for seqs in s["tokens"]:
        cache = A.PagedCache(seqs * -(-ctx // bs), bs, hkv, d, dtype, device=dev)
        for i in range(seqs):
            cache.table(i, ctx)
        q, bt, lens, qsl = cache.args([(i, rand(1, hq, d), ctx) for i in range(seqs)])
        plan = A.make_plan(lens.cpu(), qsl.cpu(), q_heads=hq, kv_heads=hkv, head_dim=d, device=dev)
        qd, kd = q.view(seqs, 1, hq, d).transpose(1, 2), rand(seqs, hkv, ctx, d)
        cases.append(("attention", {"tokens": seqs, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
                      lambda q=q, bt=bt, lens=lens, qsl=qsl, plan=plan, cache=cache:
                      A.attention(q, cache.k, cache.v, bt, lens, qsl, plan=plan),
                      lambda qd=qd, kd=kd: F.scaled_dot_product_attention(qd, kd, kd, enable_gqa=True)))
    E, k, inter = s["experts"]
    rw, w13, w2 = rand(E, H) * H ** -0.5, rand(E, 2 * inter, H), rand(E, H, inter)
    ends = torch.arange(E, device=dev)
    for t in s["tokens"][:2]:
        x = rand(t, H)
        peer = lambda x=x: _torch_moe(x, rw, w13.transpose(1, 2), w2.transpose(1, 2), k, ends)  # noqa: E731
        try:
            peer()
        except RuntimeError:  # no torch._grouped_mm for this device, dtype or torch build: the kit alone
            peer = None
        cases.append(("fused_moe", {"tokens": t, "hidden": H, "experts": E, "top_k": k, "intermediate": inter},
                      lambda x=x: MOE.fused_moe(x, rw, w13, w2, k), peer))
    return cases


def call_times(calls: int = 300, batches: int = 5, dtype: torch.dtype | None = None, budget_s: float = 0.2) -> tuple:
    """Host time per eager call of the kit's ops and of torch's nearest op (see the section's
    comment): ``(rows, checks)`` in the results format, one row per (op, shape, impl) with
    ``median_us``, one speed goal per (op, shape): the kit within :data:`CALL_TARGET` x torch
    (:func:`batch_invariance_kit.report.results.goal`: reported, never a failure).
    ``dtype``: bf16 on a GPU, fp32 on the CPU (where torch's bf16 arithmetic is slow) by
    default; ``budget_s``: about the most time one (op, shape, impl) may take."""
    on_gpu = torch.cuda.is_available()
    dtype = dtype if dtype is not None else torch.bfloat16 if on_gpu else torch.float32
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    stub = contextlib.nullcontext() if on_gpu else stubbed_launches()
    mode = "eager, no sync" if on_gpu else "kit launches stubbed on the CPU"
    rows, checks = [], []
    with stub:
        for op, shape, kit, peer in _call_cases(on_gpu, dtype):
            us = {}
            for impl, fn in (("kit-invariant", kit), ("torch", peer)):
                if fn is None:
                    continue
                us[impl], n = _per_call_us(fn, calls, batches, sync, budget_s)
                rows.append({"op": op, "impl": impl, **shape, "dtype": str(dtype).replace("torch.", ""),
                             "median_us": round(us[impl], 2), "calls": n, "mode": mode})
            if "torch" not in us:
                continue
            ratio = us["kit-invariant"] / us["torch"]
            case = " ".join(f"{k}={v}" for k, v in shape.items())
            checks.append(goal(f"{op} {case}: host time within {CALL_TARGET:g}x of torch", ratio <= CALL_TARGET,
                               op=op, ratio=round(ratio, 4), mode=mode))
    return rows, checks


def call_table(rows: list) -> str:
    """Rows of :func:`call_times` as a text table: one line per (op, shape), kit beside torch."""
    keyed = {}
    for r in rows:
        case = " ".join(f"{k}={v}" for k, v in r.items()
                        if k not in ("op", "impl", "dtype", "median_us", "calls", "mode"))
        keyed.setdefault((r["op"], case), {})[r["impl"]] = r["median_us"]
    head = ("op", "case", "kit µs", "torch µs", "kit/torch")
    body = [(op, case, f"{v['kit-invariant']:.1f}", f"{v['torch']:.1f}" if "torch" in v else "-",
             f"{v['kit-invariant'] / v['torch']:.2f}" if "torch" in v else "-") for (op, case), v in keyed.items()]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = [head, ["-" * w for w in widths]] + body
    mode = rows[0]["mode"] if rows else ""
    return "\n".join([f"eager calls ({mode})"] + ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                                             for i, (c, w) in enumerate(zip(x, widths))) for x in lines])


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m batch_invariance_kit.bench.host",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", metavar="DIR", help="also write the eager-call rows and checks to DIR/host_calls.json")
    args = parser.parse_args(argv)
    print(f"host path on the CPU (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(table(plan_times()))
    print()
    rows, checks = call_times()
    print(call_table(rows))
    if args.out:
        from ..report.results import save

        print(f"wrote {save('host_calls', rows, checks, folder=args.out)}")


if __name__ == "__main__":
    main()
