"""The kit's ops as torch custom ops: ``torch.compile(fullgraph=True)`` traces through each one
(one graph, no break: the fake implementation gives shapes) and the compiled function gives the
eager bits; the in-place forms mutate their arguments as declared, and each schema declares
exactly the arguments its op writes; a call that would need a derivative is refused, naming the
op; a second import of the module defines nothing twice.  Small sizes (the Triton interpreter runs
the kernels on CPU)."""
import subprocess
import sys

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops import custom_ops as K
from batch_invariance_kit.verify.harness import bitwise_equal, seeded_normal

DEV = batch_invariance_kit.DEVICE
OPS = torch.ops.batch_invariance_kit


def _compiled_equals_eager(fn, *args):
    """``fn`` compiled with fullgraph=True (a graph break would raise) gives eager's bits."""
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    eager, compiled = (eager, compiled) if isinstance(eager, tuple) else ((eager,), (compiled,))
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert bitwise_equal(c, e)


def _x(shape, seed, dtype=torch.bfloat16):
    return seeded_normal(shape, seed, dtype=dtype, device=DEV)


def test_fake_implementations_give_shapes_without_running():
    """Every op is registered in ``torch.ops.batch_invariance_kit`` and its fake implementation
    answers on fake tensors (what torch.compile traces with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in (n for n in K.__all__ if n not in ("NAMESPACE", "CALLS", "ON_CALL")):
        assert isinstance(getattr(OPS, name), torch._ops.OpOverloadPacket), name
    with FakeTensorMode():
        x, w = torch.empty((5, 64), dtype=torch.bfloat16), torch.empty((64,), dtype=torch.bfloat16)
        assert OPS.rms_norm(x, w, 1e-6).shape == (5, 64)
        assert OPS.linear(x, torch.empty((7, 64), dtype=torch.bfloat16)).shape == (5, 7)
        q = torch.empty((3, 4, 32), dtype=torch.bfloat16)
        kc = torch.empty((8, 16, 2, 32), dtype=torch.bfloat16)
        i32 = torch.empty((2,), dtype=torch.int32)
        assert OPS.attention(q, kc, kc, torch.empty((2, 4), dtype=torch.int32), i32,
                             torch.empty((3,), dtype=torch.int32)).shape == (3, 4, 32)


def test_norms_compiled_equal_eager():
    x, r, w = _x((37, 256), 1), _x((37, 256), 2), _x((256,), 3)

    def f(x, r, w):
        h = OPS.rms_norm(x, w, 1e-6)
        return OPS.fused_add_rms_norm(h, r, w, 1e-6)

    _compiled_equals_eager(f, x, r, w)
    # the in-place form: residual <- x + residual, x <- rms_norm(residual)
    want_out, want_res = K.fused_add_rms_norm(x, r, w, 1e-6)
    x2, r2 = x.clone(), r.clone()
    torch.compile(lambda a, b: OPS.fused_add_rms_norm_(a, b, w, 1e-6), fullgraph=True, backend="aot_eager")(x2, r2)
    assert bitwise_equal(x2, want_out) and bitwise_equal(r2, want_res)


def test_linear_and_moe_compiled_equal_eager():
    x, w, b = _x((19, 64), 4), _x((48, 64), 5), _x((48,), 6)
    _compiled_equals_eager(lambda x, w, b: OPS.linear(x, w, b) + OPS.linear(x, w), x, w, b)
    E, H, I = 4, 64, 32
    xm = _x((11, H), 7)
    router, gu, down = _x((E, H), 8), _x((E, 2 * I, H), 9), _x((E, H, I), 10)
    _compiled_equals_eager(lambda x: OPS.fused_moe(x, router, gu, down, 2), xm)


def test_moe_from_logits_compiled_equals_eager_and_fused_moe():
    """vLLM's call form of the MoE (router logits given) under torch.compile: the eager bits,
    which are those of :func:`fused_moe` with the same router."""
    E, H, I = 4, 64, 32
    xm = _x((11, H), 11)
    router, gu, down = _x((E, H), 12), _x((E, 2 * I, H), 13), _x((E, H, I), 14)
    logits = OPS.linear(xm, router)
    _compiled_equals_eager(lambda x, lg: OPS.moe_from_logits(x, lg, gu, down, 2, True), xm, logits)
    assert bitwise_equal(K.moe_from_logits(xm, logits, gu, down, 2, True), K.fused_moe(xm, router, gu, down, 2))


def test_moe_grouped_from_logits_compiled_equals_eager():
    """DeepSeek-V3's routed experts in vLLM's call form (router logits and correction bias given)
    under torch.compile: the eager bits."""
    E, H, I = 8, 64, 32
    xm = _x((11, H), 15)
    router, gu, down = _x((E, H), 16), _x((E, 2 * I, H), 17), _x((E, H, I), 18)
    bias = 0.1 * _x((E,), 19).float()
    logits = OPS.linear(xm, router)
    _compiled_equals_eager(lambda x, lg: OPS.moe_grouped_from_logits(x, lg, bias, gu, down, 4, 2, 3, True, 2.5),
                           xm, logits)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cpu_ops_compiled_equal_eager_and_count_every_call(backend):
    """The CPU replacements of the vLLM plugin (plain torch on CPU tensors) in one compiled
    graph, by Inductor as vLLM's CPU build compiles: the eager bits, and every call of the
    compiled graph counted by the ops themselves (the count vLLM's plugin reports)."""
    g = torch.Generator().manual_seed(0)
    T, H, N, E, I = 21, 64, 48, 4, 32
    x, r = torch.randn(T, H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()
    w, wn = torch.randn(N, H, generator=g).bfloat16(), (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    w13, w2 = torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16()
    tw, ti = torch.softmax(torch.randn(T, E, generator=g), -1).topk(2, -1)

    def f(x, r):
        h, res = OPS.cpu_fused_add_rms_norm(x, r, wn, 1e-6)
        y = OPS.cpu_moe_experts(h, w13, w2, tw, ti, 16, 16) + OPS.cpu_rms_norm(res, None, 1e-6)
        return OPS.cpu_linear(y, w, None, 16)

    torch._dynamo.reset()
    eager = f(x, r)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    assert bitwise_equal(compiled(x, r), eager)
    before = dict(K.CALLS)
    for _ in range(3):
        compiled(x, r)
    for name in ("linear", "rms_norm", "fused_add_rms_norm", "moe"):
        assert K.CALLS[name] - before.get(name, 0) == 3, (name, K.CALLS)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_attention_and_write_kv_compiled_equal_eager(backend):
    """A mixed step (a chunk starting at an odd position, a decode step): write the new keys,
    then attend, inside one compiled graph (traced only, and compiled by Inductor as vLLM
    does); the same bits and the same cache as eager."""
    HQ, HKV, D, BS = 4, 2, 32, 16
    lens, qls = [45, 20], [9, 1]
    T = sum(qls)
    q, k, v = _x((T, HQ, D), 11), _x((T, HKV, D), 12), _x((T, HKV, D), 13)
    hist_k, hist_v = _x((sum(lens), HKV, D), 14), _x((sum(lens), HKV, D), 15)
    bt = A.allocate_blocks(lens, BS, 8, seed=1, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, **i32)
    qsl = torch.tensor([0, qls[0], T], **i32)
    new_slots = torch.cat([A.slots(bt, s, lens[s] - qls[s], lens[s], BS) for s in range(2)])
    old_slots = torch.cat([A.slots(bt, s, 0, lens[s], BS) for s in range(2)])

    def caches():
        kc, vc = A.new_cache(8, BS, HKV, D, torch.bfloat16, device=DEV)
        A.write_kv(hist_k, hist_v, kc, vc, old_slots)
        return kc, vc

    def f(q, k, v, kc, vc):
        OPS.write_kv(k, v, kc, vc, new_slots)
        return OPS.attention(q, kc, vc, bt, seq_lens, qsl)

    ke, ve = caches()
    eager = f(q, k, v, ke, ve)
    torch._dynamo.reset()
    kc, vc = caches()
    compiled = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, kc, vc)
    assert bitwise_equal(compiled, eager) and bitwise_equal(kc, ke) and bitwise_equal(vc, ve)
    assert bitwise_equal(eager, A.attention(q, ke, ve, bt, seq_lens, qsl))


@pytest.mark.parametrize("op", ["rms_norm", "linear"])
def test_variant_passes_through_the_op(op):
    """The ``impl`` argument reaches the kernel: the variant's launch is the one the plain
    function picks for the same input (the same bits as calling it directly)."""
    x, w = _x((300, 256), 16), _x((256,), 17)
    if op == "rms_norm":
        got = OPS.rms_norm(x, w, 1e-6, "variant")
        want = batch_invariance_kit.ops.rms_norm.rms_norm(x, w, 1e-6, impl="variant")
    else:
        wl = _x((32, 256), 18)
        got = OPS.linear(x, wl, None, "variant")
        want = batch_invariance_kit.ops.matmul.linear(x, wl, impl="variant")
    assert bitwise_equal(got, want)


#: The arguments each op writes (its schema's ``Tensor(a!)``); every other op writes none.
MUTATED = {"fused_add_rms_norm_": {"x", "residual"}, "write_kv": {"k_cache", "v_cache"}}


def test_schemas_declare_exactly_the_mutated_arguments():
    """Each op's schema marks as written exactly the arguments its kernel writes, each in an
    alias set of its own, and no op returns an alias of an argument: torch.compile keeps these
    writes and no others, so a missing or extra annotation would compile to wrong bits."""
    for name in (n for n in K.__all__ if n not in ("NAMESPACE", "CALLS", "ON_CALL")):
        schema = getattr(OPS, name).default._schema
        written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert {a.name for a in written} == MUTATED.get(name, set()), (name, str(schema))
        sets = [frozenset(a.alias_info.before_set) for a in written]
        assert len(set(sets)) == len(sets), str(schema)
        assert all(a.alias_info is None for a in schema.arguments if a not in written), str(schema)
        assert all(r.alias_info is None for r in schema.returns), str(schema)


def test_written_arguments_bump_their_version():
    """The in-place op bumps the version counters of the arguments it writes (and of no other),
    so autograd still refuses a backward through a tensor it saved and the op then overwrote."""
    x, r, w = _x((5, 64), 23), _x((5, 64), 24), _x((64,), 25)
    a = torch.ones(5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = a * x                                                     # saves x for the backward
    before = (x._version, r._version, w._version)
    with torch.no_grad():
        OPS.fused_add_rms_norm_(x, r, w, 1e-6)
    assert (x._version, r._version, w._version) == (before[0] + 1, before[1] + 1, before[2])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_grad_refused_with_the_op_named():
    """The ops have no derivative: called with grad mode on and an argument that requires grad,
    an op raises naming itself and the argument, before its kernel runs (nothing counted or
    written), eager and when torch.compile traces it; under no_grad the same call runs."""
    x, r, w = _x((5, 64), 20), _x((5, 64), 21), _x((64,), 22)
    wg = w.clone().requires_grad_(True)
    n0 = K.CALLS["rms_norm"]
    with pytest.raises(RuntimeError, match=r"batch_invariance_kit::rms_norm has no autograd formula.*weight"):
        OPS.rms_norm(x, wg, 1e-6)
    xg, r2 = x.clone().requires_grad_(True), r.clone()
    with pytest.raises(RuntimeError, match=r"batch_invariance_kit::fused_add_rms_norm_ has no autograd.*\bx\b"):
        K.fused_add_rms_norm_(xg, r2, w, 1e-6)
    assert bitwise_equal(xg.detach(), x) and bitwise_equal(r2, r) and K.CALLS["rms_norm"] == n0
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"batch_invariance_kit::linear has no autograd formula.*weight"):
        torch.compile(lambda a: OPS.linear(a, wg.view(1, 64)), fullgraph=True, backend="aot_eager")(x)
    with torch.no_grad():
        assert bitwise_equal(OPS.rms_norm(x, wg, 1e-6), OPS.rms_norm(x, w, 1e-6))
    assert K.CALLS["rms_norm"] == n0 + 2


def test_importing_again_keeps_the_ops():
    """A reload of the module, and a new import once it is gone from ``sys.modules``, define
    nothing twice: both run, the ops stay callable, and after the reload the module's
    :data:`CALLS` counts their calls."""
    code = ("import importlib, sys, torch\n"
            "import batch_invariance_kit.ops.custom_ops as K\n"
            "x, w = torch.randn(3, 64), torch.randn(8, 64)\n"
            "want = K.cpu_linear(x, w, None, 4)\n"
            "K = importlib.reload(K)\n"
            "assert torch.equal(torch.ops.batch_invariance_kit.cpu_linear(x, w, None, 4), want)\n"
            "assert K.CALLS['linear'] == 1, K.CALLS\n"
            "del sys.modules['batch_invariance_kit.ops.custom_ops']\n"
            "import batch_invariance_kit.ops.custom_ops as K2\n"
            "assert K2 is not K and torch.equal(K2.cpu_linear(x, w, None, 4), want)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
