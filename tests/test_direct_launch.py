"""The direct launch (:mod:`batch_invariance_kit.ops.direct_launch`): a remembered kernel is
launched only for a call that Triton would give the same kernel, with the arguments Triton's
launcher would receive.

On the CPU the kernels run under the interpreter, where the direct launch steps aside; so these
tests drive :class:`DirectLaunch` with a model of ``JITFunction``: a function whose
``fn[grid](*args, **kw)`` specialises as Triton does (a tensor's dtype and 16-byte alignment, an
int being 1 or a multiple of 16 and its width, the constexprs' and options' values) and returns
one compiled kernel per specialisation, whose launcher records what it was called with.  A random
sequence of calls must launch, every time, the kernel the model picks (and a direct launch that
ignores alignment, the negative control, must fail the same check).  On the GPU,
``KIT_DIRECT_LAUNCH=check`` compares every direct launch with Triton's own lookup (``gpu`` test
below, and every GPU test run in that mode).
"""
import random
import types

import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import direct_launch as DL


class _Param:
    def __init__(self, name, constexpr=False, default=DL._Unsupported):
        self.name, self.is_constexpr = name, constexpr
        self.has_default = default is not DL._Unsupported
        self.default = default if self.has_default else None


class _Kernel:
    """A compiled kernel of the model: its launcher records each call."""

    def __init__(self, spec):
        self.spec, self.calls = spec, []
        self.function, self.packed_metadata = object(), ("meta", spec)

    def run(self, *a):
        self.calls.append(a)


def _triton_spec(a):
    if isinstance(a, torch.Tensor):
        return ("*", a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is bool:
        return "i1"
    if type(a) is int:
        if a == 1:
            return ("constexpr", 1)
        return ("i32" if -2 ** 31 <= a < 2 ** 31 else "i64" if a < 2 ** 63 else "u64", a % 16 == 0)
    if type(a) is float:
        return "fp32"
    if a is None:
        return ("constexpr", None)
    raise TypeError(type(a))


class _ModelJIT:
    """``fn[grid](*args, **kw)`` as Triton 3.6 runs it, for the parts the direct launch relies on."""

    OPTIONS = ("num_warps", "num_stages")

    def __init__(self, params):
        self.params = params
        self.pre_run_hooks = []
        self.kernels = {}
        self.through = []  # (grid, kernel) per launch through the model's run path

    def bind(self, args, kw):
        names = [p.name for p in self.params]
        for k in kw:
            if k not in names and k not in self.OPTIONS:
                raise KeyError(k)
        vals = list(args)
        for p in self.params[len(args):]:
            vals.append(kw[p.name] if p.name in kw else p.default)
        spec = tuple(("c", v) if p.is_constexpr else _triton_spec(v) for p, v in zip(self.params, vals))
        return vals, spec + tuple((k, kw[k]) for k in self.OPTIONS if k in kw)

    def __getitem__(self, grid):
        def run(*args, **kw):
            vals, spec = self.bind(args, kw)
            kernel = self.kernels.setdefault(repr(spec), _Kernel(spec))  # repr: a list constexpr too
            g = grid(dict(zip([p.name for p in self.params], vals))) if callable(grid) else grid
            g = tuple(g) + (1,) * (3 - len(g))
            kernel.run(*g, "stream", kernel.function, kernel.packed_metadata, None, None, None, *vals)
            self.through.append((grid, kernel))
            return kernel
        return run


@pytest.fixture
def model(monkeypatch):
    """A DirectLaunch over a model kernel, in the mode where it launches directly."""
    monkeypatch.setattr(DL, "_SUPPORTED", True)
    monkeypatch.setattr(DL, "_current_device", lambda: 0)
    monkeypatch.setattr(DL, "_driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_stream=lambda device: "stream")))
    monkeypatch.setattr(DL, "_knobs", types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode="")))
    prev = DL.set_mode("on")
    fn = _ModelJIT([_Param("x"), _Param("w"), _Param("out"), _Param("n"), _Param("eps"),
                    _Param("flag", default=False), _Param("BLOCK", constexpr=True),
                    _Param("ROWS", constexpr=True, default=4)])
    yield fn, DL.DirectLaunch(fn)
    DL.set_mode(prev)


def _tensors(dtype=torch.float32, offset=0, n=64):
    base = torch.zeros(n * 4 + 16, dtype=dtype)
    return base[offset:offset + n], base[offset:offset + n], base[offset:offset + n]


def test_second_call_launches_directly_with_every_parameter(model):
    fn, dl = model
    x, w, out = _tensors()
    k1 = dl((3,), x, w, out, 64, 1e-6, BLOCK=32, num_warps=4)
    assert len(fn.through) == 1
    before = DL.stats()["direct"]
    k2 = dl((3,), x, w, out, 96, 1e-5, BLOCK=32, num_warps=4)
    assert k2 is k1 and len(fn.through) == 1 and DL.stats()["direct"] == before + 1
    # grid padded to three, the current stream, the kernel's handles, no hooks, then every
    # parameter in order: positional ones, the defaulted runtime flag, BLOCK from kw, ROWS' default
    assert k1.calls[-1] == (3, 1, 1, "stream", k1.function, k1.packed_metadata, None, None, None,
                            x, w, out, 96, 1e-5, False, 32, 4)


@pytest.mark.parametrize("change", ["alignment", "dtype", "n_is_1", "n_mult_16", "n_int64", "n_uint64", "n_bool",
                                    "constexpr", "constexpr_type", "option", "none", "debug"])
def test_a_different_specialisation_goes_through_triton(model, change):
    fn, dl = model
    x, w, out = _tensors()
    dl((2,), x, w, out, 64, 1e-6, BLOCK=32, num_warps=4)
    args, kw = [x, w, out, 64, 1e-6], dict(BLOCK=32, num_warps=4)
    if change == "alignment":
        args[0] = _tensors(offset=1)[0]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = _tensors(torch.bfloat16)[1]
    elif change == "n_is_1":
        args[3] = 1
    elif change == "n_mult_16":
        args[3] = 65
    elif change == "n_int64":
        args[3] = 2 ** 40
    elif change == "n_uint64":
        args[3] = 2 ** 63 + 16
    elif change == "n_bool":
        args[3] = True
    elif change == "constexpr":
        kw["BLOCK"] = 64
    elif change == "constexpr_type":
        kw["BLOCK"] = 32.0  # equal to 32 in Python, another constexpr to Triton
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "none":
        args[2] = None
    elif change == "debug":
        DL._knobs.runtime.debug = True  # a compile option of every kernel
    dl((2,), *args, **kw)
    assert len(fn.through) == 2, "a call Triton specialises differently must not reuse the remembered kernel"
    if change != "debug":  # the model does not compile debug kernels
        assert fn.through[-1][1] is not fn.through[0][1]
    dl((2,), *args, **kw)  # and that signature launches directly from then on
    assert len(fn.through) == 2


def test_a_runtime_keyword_is_passed_per_call(model):
    """A runtime argument given by keyword reaches the launcher with this call's value."""
    fn, dl = model
    x, w, out = _tensors()
    dl((2,), x, w, out, 64, 1e-6, flag=False, BLOCK=32)
    k = dl((2,), x, w, out, 64, 1e-6, flag=False, BLOCK=32)
    assert len(fn.through) == 1 and k.calls[-1][9 + 5] is False
    dl((2,), x, w, out, 64, 1e-6, flag=True, BLOCK=32)  # the bool's value is in the signature: once through Triton
    k = dl((2,), x, w, out, 64, 1e-6, flag=True, BLOCK=32)
    assert len(fn.through) == 2 and k.calls[-1][9 + 5] is True


def _random_call(rng, aligned_only=False):
    dtype = rng.choice([torch.float32, torch.bfloat16])
    offs = [0 if aligned_only else rng.choice([0, 0, 1, 8]) for _ in range(3)]
    x, w, out = (_tensors(dtype, o)[i] for i, o in enumerate(offs))
    n = rng.choice([1, 2, 16, 17, 32, 1000, 2 ** 33, 2 ** 40 + 1, 2 ** 63 + 5, False, True, 0])
    kw = {"BLOCK": rng.choice([16, 32])}
    if rng.random() < 0.5:
        kw["num_warps"] = rng.choice([4, 8])
    if rng.random() < 0.3:
        kw["flag"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["ROWS"] = rng.choice([1, 4])
    return (rng.choice([(1,), (2, 3), (4, 1, 2)]), [x, w, out, n, rng.random()], kw)


def _replay(fn, dl, calls):
    """Launch each call through ``dl``; return the calls whose launch used another kernel than the
    model's ``fn[grid]`` picks, or other arguments."""
    wrong = []
    for grid, args, kw in calls:
        vals, spec = fn.bind(args, kw)
        kernel = dl(grid, *args, **kw)
        if kernel.spec != spec:  # compiled for another specialisation than this call's
            wrong.append((args, kw))
            continue
        g = tuple(grid) + (1,) * (3 - len(grid))
        got = kernel.calls[-1]
        if got[:3] != g or len(got) != 9 + len(vals) or any(a is not b and a != b for a, b in zip(got[9:], vals)):
            wrong.append((args, kw))
    return wrong


def test_random_calls_launch_the_kernel_triton_picks(model):
    fn, dl = model
    rng = random.Random(0)
    calls = [_random_call(rng) for _ in range(1500)]
    before = DL.stats()["direct"]
    assert _replay(fn, dl, calls) == []
    assert DL.stats()["direct"] - before > 500  # many calls repeat a signature and launch directly


def test_negative_control_a_signature_without_alignment_is_caught(model, monkeypatch):
    """The same check fails for a direct launch whose signature leaves out the 16-byte alignment."""
    fn, dl = model
    spec = DL._spec

    def no_alignment(a):
        return a.dtype if isinstance(a, torch.Tensor) else spec(a)

    monkeypatch.setattr(DL, "_spec", no_alignment)
    monkeypatch.setattr(DL._Layout, "signature", lambda self, args, kw: (
        tuple(no_alignment(a) for a in args), tuple(kw.values())))
    rng = random.Random(0)
    assert _replay(fn, dl, [_random_call(rng) for _ in range(400)]) != []
    # while with aligned tensors only, the same flawed signature happens to agree
    fn2 = _ModelJIT(fn.params)
    dl2 = DL.DirectLaunch(fn2)
    rng = random.Random(1)
    assert _replay(fn2, dl2, [_random_call(rng, aligned_only=True) for _ in range(200)]) == []


def test_steps_aside(model, monkeypatch):
    fn, dl = model
    x, w, out = _tensors()
    call = lambda: dl((2,), x, w, out, 64, 1e-6, BLOCK=32)  # noqa: E731
    call()
    call()
    assert len(fn.through) == 1
    DL.set_mode("off")
    call()
    assert len(fn.through) == 2
    DL.set_mode("on")
    fn.pre_run_hooks.append(lambda *a, **k: None)  # a pre-run hook must see every launch
    call()
    assert len(fn.through) == 3
    fn.pre_run_hooks.clear()
    DL._knobs.runtime.launch_enter_hook = lambda *a: None  # so must a launch hook
    call()
    assert len(fn.through) == 4
    from triton.knobs import HookChain  # Triton's own hook chain: empty is no hook, one call is
    chain = HookChain()
    DL._knobs.runtime.launch_enter_hook = chain
    call()
    assert len(fn.through) == 4
    chain.add(lambda *a: None)
    call()
    assert len(fn.through) == 5
    DL._knobs.runtime.launch_enter_hook = None
    dl(lambda meta: (2,), x, w, out, 64, 1e-6, BLOCK=32)  # a callable grid
    assert len(fn.through) == 6
    dl((2,), x, w, out, 64, 1e-6, BLOCK=[32])  # an unhashable constexpr
    assert len(fn.through) == 7
    dl((2,), x, w, out, 64, 1e-6, BLOCK=32, ROWS=object())  # a new constexpr value: a new signature
    call()  # the first signature still launches directly
    assert len(fn.through) == 8


def test_unknown_argument_type_goes_through_triton(model):
    fn, dl = model
    x, w, out = _tensors()

    class Odd:
        pass

    with pytest.raises(TypeError):  # the model refuses it as Triton would; the direct launch did not hide it
        dl((2,), x, w, out, Odd(), 1e-6, BLOCK=32)
    assert DL.stats()["through_triton"] >= 1


def test_off_under_the_interpreter_and_mode_errors():
    if batch_invariance_kit.device.INTERPRET:
        assert DL._SUPPORTED is False
    with pytest.raises(ValueError, match="mode"):
        DL.set_mode("fast")


def test_env_mode_parsing(monkeypatch):
    for raw, want in (("", "on"), ("1", "on"), ("0", "off"), ("check", "check"), (" OFF ", "off")):
        monkeypatch.setenv("KIT_DIRECT_LAUNCH", raw)
        assert DL._env_mode() == want
    monkeypatch.setenv("KIT_DIRECT_LAUNCH", "yes")
    with pytest.raises(ValueError, match="KIT_DIRECT_LAUNCH"):
        DL._env_mode()


# --------------------------------------------------------------------------------------------
# The launcher called without its Python frames (Triton 3.6's CUDA launcher, modelled)
# --------------------------------------------------------------------------------------------

class _CLaunch:
    """The C launch function of a compiled kernel: records what it receives."""

    def __init__(self):
        self.calls = []

    def __call__(self, *a):
        self.calls.append(a)


def _descriptor_wrapper(launcher, signature, metas):
    """A launcher's descriptor-expanding wrapper, shaped as Triton 3.6 builds it: a closure over
    ``launcher``, ``tensordesc_indices`` and ``tensordesc_meta`` that expands each descriptor
    parameter on every call."""
    tensordesc_indices = {i for i, t in enumerate(signature.values()) if t.startswith("tensordesc")}
    tensordesc_meta = list(metas) if metas else [None] * len(tensordesc_indices)

    def inner(*args):
        out, k = list(args[:DL._BASE_ARGS]), 0
        for i, a in enumerate(args[DL._BASE_ARGS:]):
            if i in tensordesc_indices:
                out.extend(DL._expand_descriptor(a, tensordesc_meta[k]))
                k += 1
            else:
                out.append(a)
        return launcher(*out)
    return inner


class _Launcher:
    """Triton 3.6's ``CudaLauncher`` as the direct launch sees it."""

    def __init__(self, indices=(), metas=(), scratch=0):
        self.c = _CLaunch()
        sig = {i: "tensordesc<bf16[8,64]>" if i in indices else "*bf16" for i in range(5)}
        self.launch = _descriptor_wrapper(self.c, sig, metas) if indices else self.c
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size, self.profile_scratch_size = scratch, 0

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class PyCUtensorMap:
    """A tensor map of the model (named as Triton's): its bytes are the fields it was built from."""

    def __init__(self, payload):
        self.payload = payload


class _DescJIT:
    """A kernel ``(a_desc, b_desc, c, M, BLOCK: constexpr)`` whose compiled kernels carry a
    :class:`_Launcher`; one compiled kernel per (BLOCK, metas)."""

    def __init__(self, metas, scratch=0):
        self.params = [_Param("a_desc"), _Param("b_desc"), _Param("c"), _Param("M"), _Param("BLOCK", constexpr=True)]
        self.pre_run_hooks, self.metas, self.scratch, self.kernels, self.through = [], metas, scratch, {}, 0

    def __getitem__(self, grid):
        def run(*args, **kw):
            vals = list(args) + [kw["BLOCK"]]
            k = self.kernels.get(kw["BLOCK"])
            if k is None:
                k = self.kernels[kw["BLOCK"]] = types.SimpleNamespace(
                    run=_Launcher((0, 1), self.metas, self.scratch), function=object(), packed_metadata=("m",),
                    src=types.SimpleNamespace(signature={"a_desc": "tensordesc<bf16[8,64]>",
                                                         "b_desc": "tensordesc<bf16[16,64]>", "c": "*fp32",
                                                         "M": "i32", "BLOCK": "constexpr"}))
            g = tuple(grid) + (1,) * (3 - len(grid))
            k.run(*g, "stream", k.function, k.packed_metadata, None, None, None, *vals)
            self.through += 1
            return k
        return run


@pytest.fixture
def desc_model(model, monkeypatch):
    """The expansion Triton's driver makes, counted (a ``_Map`` for a lowered descriptor; the base
    tensor and its fields for one the compiler kept in memory)."""
    made = []

    def expand(d, meta):
        made.append(d)
        if meta is None:
            return [d.base, *d.shape, *d.strides, d.padding == "nan", *d.shape, *d.strides]
        return [PyCUtensorMap((d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding, meta["swizzle"])),
                *d.shape, *d.strides]

    monkeypatch.setattr(DL, "_expand_descriptor", expand)
    monkeypatch.setattr(DL, "_map_bytes", lambda m: m.payload)
    monkeypatch.setattr(DL, "_CudaLauncher", _Launcher)
    monkeypatch.setattr(DL, "_is_c_function", lambda f: type(f) is _CLaunch)
    monkeypatch.setattr(DL, "_WRAPPER_CODE", _descriptor_wrapper(None, {}, None).__code__)
    monkeypatch.setattr(DL, "_wrap_descriptors", _descriptor_wrapper)
    return made


def _descs(a_off=0, n=64):
    from batch_invariance_kit.ops.tma import descriptor
    base = torch.zeros(4096, dtype=torch.bfloat16)
    w = torch.zeros(n, 64, dtype=torch.bfloat16)
    a = base[a_off * 64:a_off * 64 + 8 * 64].view(8, 64)
    return descriptor(a, [8, 64], [64, 1], [8, 64]), descriptor(w, [n, 64], [64, 1], [16, 64])


def _normal(call):
    return tuple(("map", a.payload) if isinstance(a, PyCUtensorMap) else a for a in call)


@pytest.mark.parametrize("lowered", [True, False])
def test_the_raw_launch_passes_what_the_launcher_would(model, desc_model, lowered):
    """Every direct launch reaches the C launch function with the arguments Triton's launcher
    would give it; a lowered descriptor is expanded once per (base, shape, strides), the weight's
    once in all; one kept in memory (its expansion holds the tensor) on every call."""
    metas = [{"swizzle": 3}, {"swizzle": 2}] if lowered else [None, None]
    fn = _DescJIT(metas)
    dl = DL.DirectLaunch(fn)
    a0, w = _descs(0)
    a1, _ = _descs(8)
    out = torch.zeros(8, 64)
    dl((4,), a0, w, out, 8, BLOCK=16)
    (kernel,) = fn.kernels.values()
    assert DL._RawLaunch.of(kernel) is not None
    expanded_through_triton = len(desc_model)
    for i, (a, grid) in enumerate([(a0, (4,)), (a1, (2, 3)), (a0, (4, 1, 2)), (a1, (2,))] * 2):
        dl(grid, a, w, out, 8 + i, BLOCK=16)
        mine = kernel.run.c.calls[-1]
        g = tuple(grid) + (1,) * (3 - len(grid))
        kernel.run(*g, "stream", kernel.function, kernel.packed_metadata, None, None, None, a, w, out, 8 + i, 16)
        assert _normal(mine) == _normal(kernel.run.c.calls[-1])
    assert fn.through == 1
    direct_expansions = len(desc_model) - expanded_through_triton - 8 * 2  # minus the reference calls'
    assert direct_expansions == (3 if lowered else 16)  # a0, a1 and w once each; or every call


def test_descriptors_of_other_shapes_share_the_kernel(model, desc_model):
    """Triton keys a host descriptor on its base's dtype and block shape alone (its shape and
    strides are launch arguments), so a weight of another row count, one not a multiple of 16,
    reuses the remembered kernel, and its own expansion reaches the C launch function."""
    fn = _DescJIT([{"swizzle": 3}, {"swizzle": 2}])
    dl = DL.DirectLaunch(fn)
    a0, w = _descs(0)
    _, w50 = _descs(0, n=50)
    out = torch.zeros(8, 64)
    dl((4,), a0, w, out, 8, BLOCK=16)
    dl((4,), a0, w50, out, 8, BLOCK=16)
    assert fn.through == 1 and len(dl._kernels) == 1
    (kernel,) = fn.kernels.values()
    mine = kernel.run.c.calls[-1]
    kernel.run(4, 1, 1, "stream", kernel.function, kernel.packed_metadata, None, None, None, a0, w50, out, 8, 16)
    assert _normal(mine) == _normal(kernel.run.c.calls[-1])
    assert 50 in mine  # the second weight's row count, passed with its tensor map


def _launched_twice(scratch=0):
    """A DirectLaunch over a descriptor kernel, called twice with one signature (the second call
    direct): ``(model, wrapper, its remembered entry, the call's parameters)``."""
    fn = _DescJIT([{"swizzle": 3}, {"swizzle": 2}], scratch=scratch)
    dl = DL.DirectLaunch(fn)
    a0, w = _descs(0)
    out = torch.zeros(8, 64)
    dl((4,), a0, w, out, 8, BLOCK=16)
    dl((4,), a0, w, out, 8, BLOCK=16)
    (entry,) = dl._kernels.values()
    return fn, dl, entry, (a0, w, out, 8, 16)


def test_check_mode_catches_a_stale_expansion(model, desc_model):
    """Negative controls: a remembered expansion that no longer matches the descriptor (as if the
    memo ignored the strides), or a wrong fixed launch argument, fails the comparison with
    Triton's launcher that check mode makes after each direct launch."""
    fn, _, entry, full = _launched_twice()
    raw = entry[2]
    (key,) = raw.memo[1]
    raw.memo[1][key] = [PyCUtensorMap("stale"), *raw.memo[1][key][1:]]
    (kernel,) = fn.kernels.values()
    with pytest.raises(AssertionError, match="differ"):
        raw.check(kernel, 4, 1, 1, "stream", full)
    raw.memo[1].clear()
    raw.check(kernel, 4, 1, 1, "stream", full)
    raw.head = raw.head[:1] + (True,) + raw.head[2:]  # a wrong cooperative-grid flag: caught too
    with pytest.raises(AssertionError, match="differ"):
        raw.check(kernel, 4, 1, 1, "stream", full)


def test_raw_launch_steps_aside_for_scratch_and_stand_ins(model, desc_model):
    """A launcher with a scratch buffer is called as it is (it allocates per call); so is a kernel
    whose ``run`` is not a launcher of this shape."""
    _, _, entry, (a0, w, out, _, _) = _launched_twice(scratch=64)
    assert entry[2] is None and len(entry[0].run.c.calls) == 2
    assert DL._RawLaunch.of(types.SimpleNamespace(run=lambda *a: None)) is None
    other = _DescJIT([{"swizzle": 3}, {"swizzle": 2}])
    dl = DL.DirectLaunch(other)
    dl((4,), a0, w, out, 8, BLOCK=16)
    (kernel,) = other.kernels.values()
    kernel.run.launch = lambda *a: None  # a launch function that is neither the C one nor Triton's wrapper
    assert DL._RawLaunch.of(kernel) is None


def test_the_descriptor_memo_is_bounded(model, desc_model, monkeypatch):
    monkeypatch.setattr(DL, "MAX_DESCRIPTORS", 4)
    fn = _DescJIT([{"swizzle": 3}, {"swizzle": 2}])
    dl = DL.DirectLaunch(fn)
    out = torch.zeros(8, 64)
    for off in range(0, 56, 8):
        a, w = _descs(off)
        dl((4,), a, w, out, 8, BLOCK=16)
    (entry,) = dl._kernels.values()
    assert all(len(m) <= 4 for m in entry[2].memo)


@pytest.mark.gpu
def test_check_mode_on_the_gpu():
    """Triton's own binder and cache lookup agree with every direct launch of a few kit ops."""
    from batch_invariance_kit.ops import matmul as MM
    from batch_invariance_kit.ops import rms_norm as R
    if not DL._SUPPORTED:
        pytest.skip(f"the direct launch follows Triton {DL.SUPPORTED_TRITON}")
    prev = DL.set_mode("check")
    try:
        before = DL.stats()["checked"]
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in (1, 17, 64, 1000):
            x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
            W = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2):
                R.rms_norm(x, w, 1e-6)
                R.rms_norm(x[1:], w, 1e-6) if t > 1 else None  # a view 8 KiB in: still aligned
                MM.linear(x, W)
        torch.cuda.synchronize()
        assert DL.stats()["checked"] > before
    finally:
        DL.set_mode(prev)
