"""Host time per call of the ops a vLLM decoder layer calls in kit mode, at a decode batch of a
Qwen3-8B-shaped layer: each op called back to back many times, timed on the host clock.  Where a
call's device work is shorter than its host work this is the host's cost; where it is longer, the
host waits on the launch queue and the time approaches the device's.  The device time of one call
is printed beside it, from CUDA-graph replays of the call (no host work between them), so a reader
can see which one binds.  ``--stub`` replaces the Triton kernels by no-ops: the host time of the
kit's Python alone (what a CPU run can measure; on a GPU it includes ``ops.direct_launch``'s
signature, whose no-op launches are never remembered).  ``--launcher``: direct launches call
Triton's launcher object as ``JITFunction.run`` does, instead of its C launch function with
remembered descriptor expansions.  ``--cprofile N`` adds each call's
functions of most own time.

    [KIT_DIRECT_LAUNCH=0] python tools/oneoff/host_cost.py [OUT_DIR] [--stub] [--launcher] [--tokens 1000]

Rows: the op through its torch operator (``torch.ops.batch_invariance_kit``, what vLLM's compiled
graph calls), the kit's Python function under it, and the peer default vLLM would run
(``torch.nn.functional.linear``: cuBLAS; attention and norms have no plain-torch peer here).
"""
import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

import batch_invariance_kit  # noqa: F401  (device selection before Triton)
import triton
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops import custom_ops as CO
from batch_invariance_kit.ops import direct_launch as DL
from batch_invariance_kit.ops import matmul as MM
from batch_invariance_kit.ops import rms_norm as RN
from batch_invariance_kit.ops.attention import cache as AC
from batch_invariance_kit.ops.attention import launcher as AL
from batch_invariance_kit.report import results as R

p = argparse.ArgumentParser()
p.add_argument("out", nargs="?", default=None)
p.add_argument("--stub", action="store_true", help="Triton kernels replaced by no-ops (host time only)")
p.add_argument("--tokens", type=int, default=None, help="decode batch (default 1000 on a GPU, 64 on a CPU)")
p.add_argument("--launcher", action="store_true",
               help="direct launches call Triton's launcher object (no raw C launch, no descriptor memo)")
p.add_argument("--cprofile", type=int, default=0, metavar="N",
               help="also profile N calls of each op with cProfile and keep the 12 functions of most own time")
args = p.parse_args()
GPU = torch.cuda.is_available()
dev = "cuda" if GPU else "cpu"
T = args.tokens or (1000 if GPU else 64)
H, HQ, HKV, D, I = (4096, 32, 8, 128, 12288) if GPU else (256, 4, 2, 32, 512)


class _NoLaunch:
    pre_run_hooks: list = []  # what ops.direct_launch reads of a kernel before launching it

    def __getitem__(self, grid):
        return lambda *a, **k: None


if args.stub:
    for mod in (MM, RN, AC, AL):
        for name, v in list(vars(mod).items()):
            if isinstance(v, triton.runtime.jit.KernelInterface):
                setattr(mod, name, _NoLaunch())
            elif isinstance(v, DL.DirectLaunch):  # the eager launch wrappers hold the kernel itself
                v.fn = _NoLaunch()

if args.launcher:
    DL._RawLaunch.of = classmethod(lambda cls, kernel: None)

g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)


x, r, w = rnd(T, H), rnd(T, H), rnd(H)
W_qkv, W_o, W_gu, W_d = rnd((HQ + 2 * HKV) * D, H), rnd(H, HQ * D), rnd(2 * I, H), rnd(H, I)
h_o, h_d = rnd(T, HQ * D), rnd(T, I)
ctx, bs = 200, 16
nblk = T * (-(-ctx // bs)) + 1
kc = torch.zeros(nblk, bs, HKV, D, dtype=torch.bfloat16, device=dev)
vc = torch.zeros_like(kc)
bt = torch.arange(nblk - 1, dtype=torch.int32, device=dev).view(T, -1)
lens = torch.full((T,), ctx, dtype=torch.int32)
qsl = torch.arange(T + 1, dtype=torch.int32)
plan = A.make_plan(lens, qsl, q_heads=HQ, kv_heads=HKV, head_dim=D, impl="invariant", device=dev)
q, kn = rnd(T, HQ, D), rnd(T, HKV, D)
out = torch.empty_like(q)
slots = (torch.arange(T, device=dev) * (-(-ctx // bs)) * bs + ctx - 1).long()
lens_d, qsl_d = lens.to(dev), qsl.to(dev)
OPS = torch.ops.batch_invariance_kit

calls = {
    "linear qkv (op)": lambda: OPS.linear(x, W_qkv),
    "linear qkv (MM.linear)": lambda: MM.linear(x, W_qkv),
    "linear qkv (F.linear, cuBLAS)": lambda: torch.nn.functional.linear(x, W_qkv),
    "linear o (op)": lambda: OPS.linear(h_o, W_o),
    "linear gate_up (op)": lambda: OPS.linear(x, W_gu),
    "linear down (op)": lambda: OPS.linear(h_d, W_d),
    "rms_norm (op)": lambda: OPS.rms_norm(x, w, 1e-6),
    "rms_norm (RN.rms_norm)": lambda: RN.rms_norm(x, w, 1e-6),
    "fused_add_rms_norm (op)": lambda: OPS.fused_add_rms_norm(x, r, w, 1e-6),
    "write_kv (checked)": lambda: A.write_kv(kn, kn, kc, vc, slots, check_slots=False),
    "write_kv (validate=False)": lambda: A.write_kv(kn, kn, kc, vc, slots, check_slots=False, validate=False),
    "attention (checked, plan)": lambda: A.attention(q, kc, vc, bt, lens_d, qsl_d, out=out, plan=plan, key=kn, value=kn),
    "attention (validate=False)": lambda: A.attention(q, kc, vc, bt, lens_d, qsl_d, out=out, plan=plan, key=kn,
                                                      value=kn, validate=False),
}


def sync():
    if GPU:
        torch.cuda.synchronize()


def host_us(fn, n=200, rounds=7):
    """Median over rounds of the host time per call of n calls issued back to back."""
    fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return statistics.median(per), min(per), max(per)


def top_functions(fn, n, keep=12):
    """cProfile of ``n`` calls: the functions of most own time, as (name, own us per call, calls per call)."""
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    sync()
    st = pstats.Stats(prof).stats
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:keep]
    return [{"function": f"{os.path.basename(k[0])}:{k[1]}({k[2]})", "own_us": v[2] / n * 1e6, "calls": v[1] / n}
            for k, v in top]


def device_us(fn, n=50):
    """Device time per call from ``n`` replays of a CUDA graph of one call (None on a CPU, with
    ``--stub``, or where the call cannot be captured)."""
    if not GPU or args.stub:
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


rows = []
with torch.inference_mode():
    for name, fn in calls.items():
        med, lo, hi = host_us(fn)
        dev_t = device_us(fn)
        rows.append({"op": "host_cost", "call": name, "tokens": T, "hidden": H, "stub": args.stub,
                     "direct_launch": DL.mode(),
                     "raw_launch": DL._SUPPORTED and DL.mode() != "off" and not (args.launcher or args.stub),
                     "host_us": med, "host_min_us": lo, "host_max_us": hi, "device_us": dev_t,
                     **({"cprofile_top": top_functions(fn, args.cprofile)} if args.cprofile else {})})
        print(f"{name:<34} host {med:7.1f} us (min {lo:.1f}, max {hi:.1f})"
              + ("" if dev_t is None else f"   device {dev_t:8.1f} us"), flush=True)
if args.out:
    print(R.save("host_cost", rows, [], folder=args.out,
                 command=f"KIT_DIRECT_LAUNCH={DL.mode()} python tools/oneoff/host_cost.py <dir>"
                 + (" --stub" if args.stub else "") + (" --launcher" if args.launcher else "")
                 + (f" --cprofile {args.cprofile}" if args.cprofile else "")
                 + (f" --tokens {args.tokens}" if args.tokens else "")))
