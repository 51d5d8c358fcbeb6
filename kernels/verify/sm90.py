"""Compile every Triton kernel of the kit for ``sm_90`` (Hopper) without a GPU.

The CPU tests run the kernels under the Triton interpreter, which never sees the compiled
path: the TMA loads, the warp-specialised K loop, the programmatic dependent launch of the
attention merge, the register budget of a 64-row attention tile.  This module compiles that
path offline, with Triton's own compiler and its bundled ``ptxas``
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``), so that a change which
breaks it fails on any machine, and reports each compiled kernel's registers, spills, stack and
shared memory (ptxas's ``-v`` report; also a profiler of sorts when no GPU is at hand).  A
kernel whose shared memory exceeds what an sm_90 block may use fails as a compile error does:
it would compile on the GPU too, and then refuse to launch.

Which launches: the ones the ops' own host code makes. In a process of its own, the kit is
imported *as on a GPU* (``INTERPRET`` false, so every launch rule of the compiled path applies:
one row per RMSNorm program, ``UPCAST`` off, the GPU's long-K rule, the GPU's attention
schedule; on a CPU the SM count and PDL support of an H200 stand in for the device queries),
``JITFunction.run`` is replaced by a recorder, and each op is called through its public function
at shapes that reach every shipped config: every matmul config the cost model may pick (16-bit,
``mm`` and ``linear``, short and long K) and the model's own picks (16-bit and fp32), the attention
schedule's launches (prefill and decode, split programs with the merge and serial programs),
each RMSNorm op at the invariant block sizes and both variant blocks, the MoE router, grouped
GEMM (every row of both tables, and a long hidden size, whose K is chunked, at every invariant
row), both split-K passes and combine, the override's row kernels. The recorder turns each
launch's arguments into the compiler's signature, constexprs and attributes exactly as ``run``
would (Triton's binder), so what is compiled is what the GPU would compile. A config added to
:data:`CONFIGS` is compiled without any change here; a kernel of the kit that no driver reaches
(:func:`kit_kernels`) fails the run.

Run it in its own process (``python -m batch_invariance_kit.verify.sm90``): the kit must be
imported in compiled mode before any op module, which a process that already runs the
interpreter cannot undo.  ``--jobs`` compiles in parallel processes; ``--json`` writes the
table.  Exit status 1 when any kernel fails to compile or a kernel is not covered.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

#: The compile target: Hopper (sm_90), 32 threads per warp.
ARCH = 90
#: Compile matmul's trial configs too (``--trials``: :data:`batch_invariance_kit.ops.matmul.TRIAL_CONFIGS`,
#: measured by a refit sweep, not shipped)
TRIALS = False
#: SMs of an H200 (and H100 SXM): the device query a CPU process answers with this.
SMS = 132
#: Shared memory one block may use on sm_90 (227 KiB, opt-in): a kernel that needs more
#: compiles but cannot launch, so it fails here too.
MAX_SHARED = 232448


# --------------------------------------------------------------------------------------------
# Compiled mode and the launch recorder
# --------------------------------------------------------------------------------------------

@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its arguments, and where it came from."""

    label: str
    fn: object
    args: tuple
    kwargs: dict


@dataclass
class Result:
    kernel: str
    labels: list
    num_warps: int
    num_stages: int
    ok: bool = False
    error: str = ""
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack: int = -1
    shared: int = -1
    seconds: float = 0.0
    constexprs: dict = field(default_factory=dict)


def _compiled_mode():
    """Import the kit so that its op modules take the compiled path (no interpreter).  On a
    machine with CUDA that is the normal import; without, ``INTERPRET`` is switched off before
    any op module is imported, and the device queries of the launch code answer as an H200."""
    import batch_invariance_kit
    from batch_invariance_kit import device

    loaded = [m for m in sys.modules if m.startswith("batch_invariance_kit.ops")]
    if device.INTERPRET and (loaded or "triton" in sys.modules):
        raise RuntimeError("triton or the kit's op modules are already imported under the Triton interpreter: "
                           "compile for sm_90 in a process of its own (python -m batch_invariance_kit.verify.sm90)")
    if device.INTERPRET:
        os.environ["TRITON_INTERPRET"] = "0"
        device.INTERPRET = False
        batch_invariance_kit.INTERPRET = False
        import torch

        class _Props:
            multi_processor_count = SMS
            major, minor = ARCH // 10, ARCH % 10

        torch.cuda.current_device = lambda: 0
        torch.cuda.get_device_properties = lambda *a, **k: _Props()
        torch.cuda.get_device_capability = lambda *a, **k: (ARCH // 10, ARCH % 10)
    from batch_invariance_kit.ops.attention import launcher

    if device.DEVICE.type != "cuda":
        launcher._pdl = lambda dev: True  # sm_90 launches the merge with PDL
    return device.DEVICE


class _Recorder:
    """Replaces ``JITFunction.run``: a launch is recorded, never executed."""

    def __init__(self):
        self.launches: list = []
        self.label = ""

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._orig = JITFunction.run
        rec = self

        def run(fn, *args, grid, warmup, **kwargs):
            rec.launches.append(Launch(rec.label, fn, args, dict(kwargs)))
            return None

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._orig
        return False

    def call(self, label, f, *args, **kwargs):
        self.label = label
        f(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Drivers: each op called through its public functions at shapes that reach every shipped config
# --------------------------------------------------------------------------------------------

def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _rms_norm(rec, dev):
    import torch
    from ..ops import rms_norm as R

    one = torch.ones(1, dtype=torch.float32, device=dev)
    # hidden sizes: a head dim (rows one warp each), the e2e models' 2048, the benchmarks' 4096,
    # and a row longer than the largest fused block (processed in fixed chunks); the variant on
    # both sides of its switch
    invariant = [(16, h, torch.bfloat16) for h in (128, 2048, 4096, 2 * R._MAX_FUSED)]
    invariant += [(16, 4096, torch.float16), (16, 4096, torch.float32)]
    variant = [(255, 4096, torch.bfloat16), (300, 4096, torch.bfloat16)]
    for impl, shapes in (("invariant", invariant), ("variant", variant)):
        for n, h, dt in shapes:
            for op, f in R.OPS.items():
                if dt != torch.bfloat16 and op not in ("rms_norm", "fused_add_rms_norm"):
                    continue
                x = torch.empty((n, h), dtype=dt, device=dev)
                w = torch.ones(h, dtype=dt, device=dev)
                args = [x] + ([torch.empty_like(x)] if "fused_add" in op else []) + [w] + \
                    ([one] if "static_fp8" in op else [])
                rec.call(f"{op} {impl} {_dname(dt)} tokens={n} hidden={h}", f, *args, impl=impl)


def _matmul_ks():
    """A K summed in one loop and a long K (cut into chunks by :func:`k_chunk`'s rule for
    compiled kernels, with a partial last chunk)."""
    import torch
    from ..ops import matmul as MM

    short_k = 4096  # the benchmarks' hidden size
    long_k = short_k
    while MM.k_chunk(long_k, torch.bfloat16, compiled=True) == long_k:
        long_k *= 2
    if MM.k_chunk(short_k, torch.bfloat16, compiled=True) != short_k:
        short_k = MM.block_k(torch.bfloat16)
    return [short_k, 3 * long_k // 2 + MM.k_chunk(long_k, torch.bfloat16, compiled=True) // 2]


def _matmul(rec, dev):
    import torch
    from ..ops import matmul as MM

    ks = _matmul_ks()
    for dt in (torch.bfloat16, torch.float32):  # fp32 weighs tiles up to 128x128 only
        for K in ks:
            w = torch.empty((8192, K), dtype=dt, device=dev)
            b = torch.empty((K, 8192), dtype=dt, device=dev)
            bias = torch.empty(8192, dtype=dt, device=dev)
            a = torch.empty((300, K), dtype=dt, device=dev)
            # every config the cost model may pick, forced (16-bit; fp32 compiles its picks below):
            # with a bias and B as (N, K) over the short K, without and B as (K, N) rows over the
            # long one (chunked)
            # trial configs: all with --trials; else one stream-K config, so that its kernel is compiled
            trials = MM.TRIAL_CONFIGS if TRIALS else [c for c in MM.TRIAL_CONFIGS if c.stream_k][:1]
            for cfg in (MM._candidates(dt) + trials) if dt == torch.bfloat16 else []:
                tag = f"{_dname(dt)} M=300 N=8192 K={K}"
                if K == ks[0]:
                    rec.call(f"linear+bias invariant {cfg.name} {tag}", MM.linear, a, w, bias, config=cfg)
                else:
                    rec.call(f"mm invariant {cfg.name} {tag}", MM.mm, a, b, config=cfg)
            for M in (1, 16, 64, 256, 4096):  # the model's own picks (config=None)
                a = torch.empty((M, K), dtype=dt, device=dev)
                tag = f"{_dname(dt)} M={M} N=8192 K={K}"
                cfg = MM.select_config(M, 8192, K, dt).name
                rec.call(f"linear+bias invariant {cfg} {tag}", MM.linear, a, w, bias)
                if dt == torch.bfloat16 and K == ks[0]:
                    rec.call(f"mm variant {tag}", MM.mm, a, b, impl="variant")
                    rec.call(f"bmm invariant {cfg} {tag}", MM.bmm, a[None], b[None])


def _attention(rec, dev):
    import torch
    from ..ops import attention as A

    bs = 16
    for hq, hkv, d in ((32, 8, 128), (16, 8, 128), (32, 4, 128)):
        # decode at batch 1, 8 and 256 (a long context: parallel splits and the merge; short
        # ones at a large batch: serial programs); prefill of a short and a long prompt
        cases = [("decode", [4096]), ("decode", [1024] * 8), ("decode", [96] * 256),
                 ("prefill", [256]), ("prefill", [4096])]
        for kind, lens in cases:
            nblocks = sum(-(-n // bs) for n in lens)
            kc, vc = A.new_cache(nblocks, bs, hkv, d, torch.bfloat16, device=dev)
            table = A.allocate_blocks(lens, bs, nblocks, device=dev)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            q_lens = [1] * len(lens) if kind == "decode" else lens
            qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.empty((sum(q_lens), hq, d), dtype=torch.bfloat16, device=dev)
            tag = f"{kind} seqs={len(lens)} context={lens[0]} heads={hq}/{hkv}x{d}"
            for impl in ("invariant", "variant"):
                rec.call(f"attention {impl} {tag}", A.attention, q, kc, vc, table, seq_lens, qsl, impl=impl)
            if kind == "prefill" and (hq, hkv) == (32, 8):  # the step's own keys and values, not the cache's
                qkv = torch.empty((lens[0], hq + 2 * hkv, d), dtype=torch.bfloat16, device=dev)
                k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]  # views of a fused projection, as in vLLM
                rec.call(f"attention invariant {tag} key/value", A.attention, q, kc, vc, table, seq_lens, qsl,
                         key=k, value=v)
                rec.call(f"write_kv {tag}", A.write_kv, k, v, kc, vc, A.slots(table, 0, 0, lens[0], bs))


def _moe(rec, dev):
    import torch
    from ..ops import matmul as MM
    from ..ops import moe as M

    E, k, H, inter = 128, 8, 2048, 768  # Qwen3-30B-A3B's MoE layer
    dt = torch.bfloat16
    router = torch.empty((E, H), dtype=dt, device=dev)
    w13 = torch.empty((E, 2 * inter, H), dtype=dt, device=dev)
    w2 = torch.empty((E, H, inter), dtype=dt, device=dev)
    # token counts whose load (tokens per expert) lands in every row of both tables
    loads = sorted({b for b, *_ in M.INVARIANT_TABLE + M.VARIANT_TABLE if b is not None})
    tokens = sorted({1, 8, 64} | {max(1, b * E // k) for b in loads} | {2 * loads[-1] * E // k})
    for T in tokens:
        x = torch.empty((T, H), dtype=dt, device=dev)
        ids = (torch.arange(T * k, device=dev) % E).reshape(T, k).to(torch.int32)
        wts = torch.empty((T, k), dtype=torch.float32, device=dev)
        for impl in ("invariant", "variant"):
            tag = f"{impl} tokens={T} experts={E} top{k} hidden={H} inter={inter}"
            rec.call(f"moe gating {tag}", MM.linear, x, router, impl=impl)
            rec.call(f"moe route {tag}", M.route, torch.empty((T, E), dtype=dt, device=dev), k, impl=impl)
            cfg = M.select_config(T, k, E, dt, impl)
            disp = M.dispatch(ids, E, cfg.block_m)
            rec.call(f"moe gate_up {cfg.name} {tag}", M.grouped_gemm, x, w13, disp, activation="silu_mul",
                     gather_tokens=True, impl=impl)
            h = torch.empty((T * k, inter), dtype=dt, device=dev)
            rec.call(f"moe down {cfg.name} {tag}", M.grouped_gemm, h, w2, disp, impl=impl)
            rec.call(f"moe combine {tag}", M.combine, torch.empty((T * k, H), dtype=dt, device=dev), wts, impl=impl)
            rec.call(f"moe combine with shared experts {tag}", M.combine, torch.empty((T * k, H), dtype=dt, device=dev),
                     wts, shared=x, impl=impl)
        # DeepSeek-V2-Lite's shared experts' activation (two experts of 1408): one launch shape
        rec.call(f"shared experts silu_mul tokens={T} inter=2816", M.silu_mul,
                 torch.empty((T, 2 * 2816), dtype=dt, device=dev))
    # a long hidden size (DeepSeek-V3's 7168): the invariant gate/up GEMM sums K in matmul's
    # fixed chunks (CHUNK_BLOCKS > 0), at every row of the invariant table.  8 experts and a
    # narrow intermediate keep the (never touched) weights small: the compile sees dtypes,
    # alignment and constexprs, not sizes.
    E, H, inter = 8, 7168, 256
    w13 = torch.empty((E, 2 * inter, H), dtype=dt, device=dev)
    bounds = [b for b, *_ in M.INVARIANT_TABLE if b is not None]
    for T in sorted({max(1, b * E // k) for b in bounds} | {2 * bounds[-1] * E // k}):  # + the unbounded row
        x = torch.empty((T, H), dtype=dt, device=dev)
        ids = (torch.arange(T * k, device=dev) % E).reshape(T, k).to(torch.int32)
        cfg = M.select_config(T, k, E, dt)
        tag = f"invariant tokens={T} experts={E} top{k} hidden={H} inter={inter}"
        rec.call(f"moe gate_up long-K {cfg.name} {tag}", M.grouped_gemm, x, w13, M.dispatch(ids, E, cfg.block_m),
                 activation="silu_mul", gather_tokens=True)


def _override(rec, dev):
    import torch
    from ..ops import override as O

    for rows, L, dt in ((4, 151936, torch.bfloat16), (256, 151936, torch.float32), (16, 4096, torch.bfloat16)):
        x = torch.empty((rows, L), dtype=dt, device=dev)
        for impl in ("invariant", "variant"):
            tag = f"{impl} {_dname(dt)} rows={rows} L={L}"
            rec.call(f"log_softmax {tag}", O.log_softmax, x, -1, impl=impl)
            rec.call(f"mean {tag}", O.mean, x, -1, impl=impl)


def _mla(rec, dev):
    import torch
    from ..ops import attention as A
    from ..ops import mla as MLA

    # DeepSeek-V3's latent (512 + 64 rope) and 128 heads: decode of a long context (many
    # splits), a batch of short ones, and a prefill; the per-head projections at both K orders
    rank, rope, heads, bs = 512, 64, 128, 16
    for kind, lens in (("decode", [4096]), ("decode", [256] * 16), ("prefill", [512])):
        nblocks = sum(-(-n // bs) for n in lens)
        cache = MLA.new_latent_cache(nblocks, bs, rank, rope, torch.bfloat16, device=dev)
        table = A.allocate_blocks(lens, bs, nblocks, device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        q_lens = [1] * len(lens) if kind == "decode" else lens
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
        q = torch.empty((sum(q_lens), heads, rank + rope), dtype=torch.bfloat16, device=dev)
        for impl in ("invariant", "variant"):
            rec.call(f"mla {impl} {kind} seqs={len(lens)} context={lens[0]} heads={heads} latent={rank}+{rope}",
                     MLA.mla_attention, q, cache, table, seq_lens, qsl, kv_lora_rank=rank, scale=0.1, impl=impl)
    w = torch.empty((heads, 128, rank), dtype=torch.bfloat16, device=dev)
    for T in (4, 64):
        x = torch.empty((T, heads, 128), dtype=torch.bfloat16, device=dev)
        for impl in ("invariant", "variant"):
            rec.call(f"mla head_matmul {impl} tokens={T} heads={heads} 128->{rank}", MLA.head_matmul, x, w, impl=impl)


def _routing(rec, dev):
    import torch
    from ..ops import routing as R

    cfg = R.RoutingConfig(256, 8, 4, 8, routed_scaling_factor=2.5)  # DeepSeek-V3's routing
    bias = torch.empty(256, dtype=torch.float32, device=dev)
    for T in (1, 64):
        logits = torch.empty((T, 256), dtype=torch.float32, device=dev)
        for impl in ("invariant", "variant"):
            rec.call(f"deepseek route {impl} tokens={T} experts=256 groups=8/4 top8", R.route, logits, bias, cfg,
                     impl=impl)


DRIVERS = {"rms_norm": _rms_norm, "matmul": _matmul, "attention": _attention, "moe": _moe,
           "override": _override, "mla": _mla, "routing": _routing}


def record_launches(only=None) -> list:
    """Every launch the drivers make (compiled mode; nothing runs), in driver order."""
    dev = _compiled_mode()
    rec = _Recorder()
    with rec:
        for name, drive in DRIVERS.items():
            if only is None or name in only:
                drive(rec, dev)
    return rec.launches


# --------------------------------------------------------------------------------------------
# The kernels of the kit, and compiling one launch
# --------------------------------------------------------------------------------------------

def kit_kernels() -> set:
    """Names of the kit's Triton *kernels*: the ``@triton.jit`` functions of the op modules
    (every module of ``ops/`` and of its packages that holds one) that no other jit function of
    the kit calls (the rest are device functions, compiled inside the kernels that call them)."""
    import importlib
    import pathlib

    from triton.runtime.jit import JITFunction

    from .. import ops

    found = []  # (jit function, whether another jit function of its module calls it)
    root = pathlib.Path(ops.__file__).parent
    for path in sorted(root.rglob("*.py")):  # the op modules, and the modules of op packages (attention/)
        if "@triton.jit" not in path.read_text():
            continue
        parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
        mod = importlib.import_module(".".join(["batch_invariance_kit.ops", *parts]))
        fns = {n: f for n, f in vars(mod).items() if isinstance(f, JITFunction)}
        for n, f in fns.items():
            pat = re.compile(rf"\b{re.escape(n)}\s*\(")
            found.append((f, any(pat.search(g.src) for g in fns.values() if g is not f)))
    called = {id(f) for f, c in found if c}
    return {f.__name__ for f, _ in found if id(f) not in called}


def _signature(launch, backend):
    """``(signature, constexprs, attrs, options)`` of a launch, as ``JITFunction.run`` builds
    them (Triton's binder: pointer dtypes, integer specialisation, 16-byte alignment)."""
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def _constexpr_repr(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


def prepare(launches) -> list:
    """Unique compile jobs ``(launch, signature, constexprs, attrs, options, labels)``: launches
    with the same kernel, signature, constexprs, attributes and options compile once."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", ARCH, 32))
    jobs, seen = [], {}
    for ln in launches:
        options, sig, constexprs, attrs = _signature(ln, backend)
        key = (ln.fn.__name__, ln.fn.__module__, tuple(sorted(sig.items())),
               repr(sorted((k, repr(v)) for k, v in constexprs.items())), repr(sorted(attrs.items())),
               repr(sorted(options.__dict__.items())))
        if key in seen:
            seen[key][5].append(ln.label)
            continue
        seen[key] = (ln, sig, constexprs, attrs, options, [ln.label])
        jobs.append(seen[key])
    return jobs


def compile_job(job) -> Result:
    """Compile one job for sm_90 with Triton's compiler and bundled ptxas; parse ptxas's report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ln, sig, constexprs, attrs, options, labels = job
    fn = ln.fn
    names = fn.arg_names
    res = Result(fn.__name__, list(labels), options.num_warps, options.num_stages,
                 constexprs={names[k[0]]: _constexpr_repr(v) for k, v in constexprs.items() if len(k) == 1})
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", ARCH, 32),
                                    options=options.__dict__)
        res.shared = int(kernel.metadata.shared)
        text = log.getvalue()
        for name, pat in _PTXAS.items():
            m = pat.search(text)
            if m:
                setattr(res, name, int(m.group(1)))
        res.ok = res.registers >= 0 and "cubin" in kernel.asm
        if not res.ok:
            res.error = "no cubin or no ptxas report:\n" + text[-2000:]
        elif res.shared > MAX_SHARED:
            res.ok = False
            res.error = f"needs {res.shared} bytes of shared memory; sm_{ARCH} gives a block at most {MAX_SHARED}"
    except Exception as e:  # a compile error is the result: reported, never raised
        res.error = f"{type(e).__name__}: {e}"[-4000:]
    res.seconds = time.perf_counter() - t0
    return res


_JOBS: list = []


def _compile_index(i: int) -> Result:
    return compile_job(_JOBS[i])


def compile_all(jobs, processes: int = 1) -> list:
    """Compile the jobs, in ``processes`` forked workers (each compiles whole kernels).
    Longest first: the biggest kernels do not end up last on one worker."""
    global _JOBS
    _JOBS = list(jobs)
    if processes <= 1 or len(_JOBS) <= 1:
        return [compile_job(j) for j in _JOBS]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(processes, maxtasksperchild=None) as pool:
        return pool.map(_compile_index, range(len(_JOBS)), chunksize=1)


_BLOCKED = re.compile(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>$", re.M)
_FIELD = re.compile(r"(\w+) = \[([\d, ]*)\]")


def sum_layouts(ttgir: str) -> list:
    """The blocked layout of each additive reduction's operand (a ``tt.reduce`` whose body adds)
    in a kernel's TTGIR, as ``{"sizePerThread": [...], "threadsPerWarp": [...], "warpsPerCTA":
    [...], "order": [...], "axis": reduced axis}`` (only the axis for a layout that is not
    blocked).  The layout is the reduction's order: each thread adds its own
    elements, then the lanes combine in the warp's shuffle tree, then the warps."""
    layouts = {name: {k: [int(v) for v in vals.split(",")] for k, vals in _FIELD.findall(body)}
               for name, body in _BLOCKED.findall(ttgir)}
    lines, found = ttgir.splitlines(), []
    for i, line in enumerate(lines):
        if '"tt.reduce"' not in line:
            continue
        body = []
        for nxt in lines[i + 1:]:
            body.append(nxt)
            if re.search(r"\}\) : \(tensor<", nxt):
                break
        if any("arith.addf" in b for b in body):
            m = re.search(r": \(tensor<[^,]*, (#\w+)>", body[-1])
            axis = re.search(r"axis = (\d+)", line + "".join(body))
            found.append(dict(layouts.get(m.group(1), {}), axis=int(axis.group(1)) if axis else None))
    return found


def same_row_order(a: dict, b: dict) -> bool:
    """Whether two layouts of a ``[ROWS, BLOCK]`` tile reduced along axis 1 sum every row in the
    same order: each row in one warp's lanes alone (one thread and one warp along axis 0), with
    the same elements per thread, lanes and warps along the row, in the same order."""
    def row_only(x):
        return x.get("axis") == 1 and "order" in x and x["sizePerThread"][0] == 1 and x["threadsPerWarp"][0] == 1
    return (row_only(a) and row_only(b) and a["order"] == b["order"]
            and all(a[k][1] == b[k][1] for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")))


def rms_norm_row_layouts() -> list:
    """For each RMSNorm op at each row shape whose rows are packed one warp each
    (:func:`batch_invariance_kit.ops.rms_norm._packed`: head dims 64-256 in bf16 and fp16, 64-128
    in fp32): the sum's layout as shipped and as a program of one row and one warp compiles it,
    and whether they sum a row alike (:func:`same_row_order`).  Then two controls that must
    differ: eight rows in one warp (lanes shared between rows), and fp32 rows of 256 packed four
    to four warps (a row split over two warps), which the kit does not pack (its entry records
    one row per program).  Needs compiled mode (:func:`_compiled_mode`)."""
    dev = _compiled_mode()
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ..ops import rms_norm as R

    one = torch.ones(1, dtype=torch.float32, device=dev)

    def layout(ln, rows, warps):
        kw = dict(ln.kwargs, ROWS=rows, num_warps=warps)
        _, sig, cx, attrs, opts, _ = prepare([Launch(ln.label, ln.fn, ln.args, kw)])[0]
        k = triton.compile(ASTSource(ln.fn, sig, cx, attrs), target=GPUTarget("cuda", ARCH, 32),
                           options=opts.__dict__)
        (lay,) = sum_layouts(k.asm["ttgir"])
        return lay

    def launch(op, h, dt):
        rec = _Recorder()
        with rec:
            x = torch.empty((16, h), dtype=dt, device=dev)
            args = [x] + ([torch.empty_like(x)] if "fused_add" in op else []) + \
                [torch.ones(h, dtype=dt, device=dev)] + ([one] if "static_fp8" in op else [])
            rec.call(f"{op} {_dname(dt)} hidden={h}", R.OPS[op], *args)
        (ln,) = rec.launches
        return ln

    def entry(ln, dt, rows, warps, **extra):
        lay, single = layout(ln, rows, warps), layout(ln, 1, 1)
        return {"op": ln.label.split()[0], "dtype": _dname(dt), "block": ln.kwargs["BLOCK"], "rows": rows,
                "num_warps": warps, "shipped": lay, "one_row": single, "same": same_row_order(lay, single), **extra}

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = []
    for dt, h in ((bf16, 64), (bf16, 128), (bf16, 256), (fp16, 128), (fp16, 256), (fp32, 64), (fp32, 128)):
        for op in ("rms_norm", "fused_add_rms_norm", "rms_norm_static_fp8_quant"):
            ln = launch(op, h, dt)
            out.append(entry(ln, dt, ln.kwargs["ROWS"], ln.kwargs["num_warps"]))
    ln = launch("rms_norm", 128, bf16)
    out.append(entry(ln, bf16, 8, 1, control="eight rows in one warp"))
    ln = launch("rms_norm", 256, fp32)
    out.append(entry(ln, fp32, 4, 4, control="fp32 rows of 256 packed", shipped_rows=ln.kwargs["ROWS"]))
    return out


def table(results) -> str:
    """A fixed-width table: kernel, warps, stages, registers, spills, stack, shared, seconds, first label."""
    head = f"{'kernel':<24}{'warps':>6}{'stages':>7}{'regs':>6}{'spill st/ld':>13}{'stack':>7}{'smem':>8}" \
           f"{'s':>6}  config (first launch reaching it; +N more)"
    lines = [head, "-" * len(head)]
    for r in results:
        more = f" (+{len(r.labels) - 1})" if len(r.labels) > 1 else ""
        if r.ok:
            lines.append(f"{r.kernel:<24}{r.num_warps:>6}{r.num_stages:>7}{r.registers:>6}"
                         f"{f'{r.spill_stores}/{r.spill_loads}':>13}{r.stack:>7}{r.shared:>8}{r.seconds:>6.1f}  "
                         f"{r.labels[0]}{more}")
        else:
            lines.append(f"{r.kernel:<24}{r.num_warps:>6}{r.num_stages:>7}  COMPILE ERROR  {r.labels[0]}{more}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="parallel compile processes")
    p.add_argument("--only", nargs="*", choices=sorted(DRIVERS), help="drivers to run (default: all)")
    p.add_argument("--json", help="write the results here (a list of objects, one per compiled kernel)")
    p.add_argument("--trials", action="store_true", help="also compile matmul's trial configs (not shipped)")
    p.add_argument("--row-layouts", metavar="JSON",
                   help="only compare RMSNorm's packed head-dim rows with one-row programs; write the layouts here")
    a = p.parse_args(argv)
    if a.row_layouts:
        rows = rms_norm_row_layouts()
        with open(a.row_layouts, "w") as f:
            json.dump(rows, f, indent=1)
        for r in rows:
            order = "same row order" if r["same"] else "DIFFERENT row order"
            print(f"{r['op']:<28} {r['dtype']:<9} block {r['block']:>4}  {r['rows']} rows, {r['num_warps']} warps: "
                  f"{order}{' (control)' if r.get('control') else ''}")
        return 0 if all(r["same"] != bool(r.get("control")) for r in rows) else 1
    global TRIALS
    TRIALS = a.trials
    t0 = time.perf_counter()
    launches = record_launches(a.only)
    jobs = prepare(launches)
    t1 = time.perf_counter()
    results = compile_all(jobs, a.jobs)
    t2 = time.perf_counter()
    failed = [r for r in results if not r.ok]
    covered = {r.kernel for r in results}
    missing = sorted(kit_kernels() - covered) if a.only is None else []
    print(table(results))
    print(f"\n{len(launches)} launches recorded, {len(jobs)} distinct compiles for sm_{ARCH} "
          f"({t1 - t0:.1f} s to record, {t2 - t1:.1f} s to compile with {a.jobs} processes); "
          f"{len(failed)} failed; kernels not reached: {'(not checked: --only)' if a.only else missing or 'none'}")
    for r in failed:
        print(f"\n--- {r.kernel} [{r.labels[0]}] constexprs {r.constexprs}\n{r.error}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": ARCH, "kernels": sorted(kit_kernels()), "missing": missing,
                       "results": [r.__dict__ for r in results]}, f, indent=1, default=str)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
