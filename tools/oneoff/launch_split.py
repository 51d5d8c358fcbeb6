"""Where the host time of one kit op call goes, at a batch small enough that the device is never
the bound (64 tokens, Qwen3-8B-shaped layer): the whole call through its torch operator, the part
of it spent inside Triton's ``JITFunction.run`` (all of the call's launches), and the parts of
``run`` replayed one by one for the call's last launch: the argument binder, the cache key,
``launch_metadata``, the compiled kernel's own ``run`` (the C launcher and ``cuLaunchKernel``),
and the current device/stream queries.

    python tools/oneoff/launch_split.py [OUT_DIR] [--tokens 64]

Needs a GPU (Triton compiled, not the interpreter).  Internal Triton names of the 3.x line
(``device_caches``, ``compute_cache_key``, ``CompiledKernel.run``); a part it cannot find is
reported as None.
"""
import argparse
import statistics
import time

import torch

import batch_invariance_kit  # noqa: F401  (device selection before Triton)
import triton
from triton.runtime import jit as TJ
from batch_invariance_kit.ops import direct_launch as DL
from batch_invariance_kit.report import results as R

DL.set_mode("off")  # every launch through JITFunction.run, the path this tool splits

p = argparse.ArgumentParser()
p.add_argument("out", nargs="?", default=None)
p.add_argument("--tokens", type=int, default=64)
args = p.parse_args()
assert torch.cuda.is_available(), "needs a GPU"
T, H, HQ, HKV, D, I = args.tokens, 4096, 32, 8, 128, 12288
g = torch.Generator(device="cuda").manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)


x, r, w = rnd(T, H), rnd(T, H), rnd(H)
W_qkv, W_d, h_d = rnd((HQ + 2 * HKV) * D, H), rnd(H, I), rnd(T, I)
OPS = torch.ops.batch_invariance_kit
calls = {
    "rms_norm": lambda: OPS.rms_norm(x, w, 1e-6),
    "fused_add_rms_norm": lambda: OPS.fused_add_rms_norm(x, r, w, 1e-6),
    "linear qkv": lambda: OPS.linear(x, W_qkv),
    "linear down": lambda: OPS.linear(h_d, W_d),
    "F.linear qkv (cuBLAS)": lambda: torch.nn.functional.linear(x, W_qkv),
}

ORIG = TJ.JITFunction.run
ACC = {"s": 0.0, "n": 0, "last": None}


def timed_run(self, *a, grid, warmup, **kw):
    t0 = time.perf_counter()
    k = ORIG(self, *a, grid=grid, warmup=warmup, **kw)
    ACC["s"] += time.perf_counter() - t0
    ACC["n"] += 1
    ACC["last"] = (self, a, kw, grid, k)
    return k


def per_call_us(fn, n=400, rounds=7):
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def parts(last):
    """The parts of ``JITFunction.run`` for the recorded launch, each timed alone (us)."""
    self, a, kw, grid, kernel = last
    kw = dict(kw)
    kw["debug"] = kw.get("debug", self.debug) or triton.knobs.runtime.debug
    kw["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    drv = triton.runtime.driver.active
    dev = drv.get_current_device()
    stream = drv.get_current_stream(dev)
    out = {}
    try:
        kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[dev]
        bound, spec, opts = binder(*a, **kw)
        out["binder_us"] = per_call_us(lambda: binder(*a, **kw))
        out["cache_key_us"] = per_call_us(lambda: TJ.compute_cache_key(kernel_key_cache, spec, opts))
        g3 = tuple(grid) + (1,) * (3 - len(grid))
        vals = list(bound.values())
        out["launch_metadata_us"] = per_call_us(lambda: kernel.launch_metadata(grid, stream, *vals))
        md = kernel.launch_metadata(grid, stream, *vals)
        out["kernel_run_us"] = per_call_us(lambda: kernel.run(g3[0], g3[1], g3[2], stream, kernel.function,
                                                              kernel.packed_metadata, md, None, None, *vals))
    except Exception as e:  # noqa: BLE001  (another Triton's internals: report what is missing)
        out["error"] = f"{type(e).__name__}: {e}"
    out["device_stream_us"] = per_call_us(lambda: drv.get_current_stream(drv.get_current_device()))
    return out


rows = []
with torch.inference_mode():
    for name, fn in calls.items():
        whole = per_call_us(fn)
        TJ.JITFunction.run = timed_run
        try:
            fn()
            ACC.update(s=0.0, n=0)
            n = 400
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            in_run = ACC["s"] / n * 1e6
            launches = ACC["n"] / n
            last = ACC["last"]
        finally:
            TJ.JITFunction.run = ORIG
        row = {"op": "launch_split", "call": name, "tokens": T, "whole_us": whole,
               "launches_per_call": launches, "in_triton_run_us": in_run if launches else None,
               "kernel": getattr(last[0], "__name__", None) if launches else None}
        if launches:
            row.update(parts(last))
        rows.append(row)
        print(row, flush=True)
if args.out:
    print(R.save("launch_split", rows, [], folder=args.out, command="python tools/oneoff/launch_split.py <dir>"))
