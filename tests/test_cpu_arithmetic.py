"""The arithmetic the CPU proofs stand on is the same on every CPU.

The Triton interpreter's tile product (``tl.dot``) owes nothing to BLAS.
Under the interpreter the kit multiplies tiles with :func:`tl_numerics.fixed_order_matmul`: each
output element from its own row and column in one documented order.  These tests pin that order,
show it does not move with the tile's row count, the CPU's BLAS kernel, its thread count or
numpy's SIMD level (subprocesses with ``OPENBLAS_CORETYPE``, ``OPENBLAS_NUM_THREADS`` and
``NPY_DISABLE_CPU_FEATURES``), and keep numpy's own ``matmul`` as the variant twin that the same
invariance check catches on at least one OpenBLAS kernel.  The interpreter's row sums and the vLLM
CPU plugin's fixed-shape GEMM tiles are checked the same way, and the kit's shortcut through the
interpreter's re-wrapping of the language on helper calls is checked to compute the same values.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import batch_invariance_kit  # noqa: F401  (the interpreter is chosen before triton is imported)
import triton
import triton.language as tl
from batch_invariance_kit.device import INTERPRET
from batch_invariance_kit.ops import tl_numerics as T

# BLAS settings a reader's machine may have: OpenBLAS kernels of three CPU families, 1 or 2 threads
BLAS_SETTINGS = [{}] + [{"OPENBLAS_CORETYPE": c, "OPENBLAS_NUM_THREADS": n}
                        for c in ("Haswell", "SkylakeX", "Zen") for n in ("1", "2")]


@functools.lru_cache(maxsize=None)
def _runs_here(extra: str) -> bool:
    """Can numpy start under these settings on this CPU?  (An OpenBLAS kernel for an instruction
    set the CPU lacks, e.g. SkylakeX's AVX-512 on an AVX2 machine, dies with SIGILL at import.)"""
    env = {**os.environ, **json.loads(extra)}
    return subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True,
                          timeout=60).returncode == 0


def _settings(settings: list) -> list:
    runnable = [s for s in settings if _runs_here(json.dumps(s, sort_keys=True))]
    assert {} in runnable and len(runnable) >= 3, f"too few BLAS settings run on this CPU: {runnable}"
    return runnable


def _scalar_order(a: np.ndarray, b: np.ndarray, acc: float) -> np.float32:
    """The documented order for one element, one fp32 operation at a time (a column ``b``)."""
    p = [np.float32(np.float32(x) * np.float32(y)) for x, y in zip(a, b)]
    width = 1 << max(len(p) - 1, 0).bit_length()
    p += [np.float32(0)] * (width - len(p))
    while len(p) > 1:
        h = len(p) // 2
        p = [np.float32(p[i] + p[i + h]) for i in range(h)]
    return np.float32(np.float32(acc) + p[0])


@pytest.mark.parametrize("k", [1, 5, 16, 64])
def test_fixed_order_is_the_documented_order(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((3, k)).astype(np.float32)
    b = rng.standard_normal((k, 4)).astype(np.float32)
    acc = rng.standard_normal((3, 4)).astype(np.float32)
    got = T.fixed_order_matmul(a, b, acc)
    want = np.array([[_scalar_order(a[i], b[:, j], acc[i, j]) for j in range(4)] for i in range(3)])
    assert got.dtype == np.float32
    assert (got.view(np.uint32) == want.view(np.uint32)).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fixed_order_rows_do_not_depend_on_the_tile_height(dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((128, 96)).astype(dtype)
    b = rng.standard_normal((96, 40)).astype(dtype)
    full = T.fixed_order_matmul(a, b)
    for m in (1, 2, 3, 7, 8, 16, 17, 64, 127):
        part = T.fixed_order_matmul(a[-m:], b)
        assert part.tobytes() == full[-m:].tobytes(), m
    batched = T.fixed_order_matmul(np.stack([a[:5], a[5:10]]), np.stack([b, b]))
    assert batched[1].tobytes() == full[5:10].tobytes()


def test_fixed_order_bad_shapes_raise():
    with pytest.raises(ValueError, match="do not multiply"):
        T.fixed_order_matmul(np.zeros((2, 3), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="kind"):
        with T.tile_product("mkl"):
            pass


_DIGEST = textwrap.dedent("""
    import hashlib, numpy as np
    from batch_invariance_kit.ops.tl_numerics import fixed_order_matmul
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 128)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    rows = [fixed_order_matmul(a[:m], b).tobytes() for m in (1, 2, 8, 16, 64)]
    print(hashlib.sha256(b"".join(rows)).hexdigest())
""")


def test_fixed_order_bits_are_the_same_under_every_blas_and_simd_setting():
    """One digest of fixed-order products (several tile heights) in fresh processes with other
    OpenBLAS kernels and thread counts, and with numpy's AVX-512 and AVX2 paths switched off."""
    settings = [{}, BLAS_SETTINGS[1], BLAS_SETTINGS[-1]] + [{"NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL "
                                                             "AVX512_ICL AVX512_SPR"},
                                {"NPY_DISABLE_CPU_FEATURES": "AVX2 FMA3 AVX512F AVX512CD AVX512_SKX AVX512_CLX "
                                                             "AVX512_CNL AVX512_ICL AVX512_SPR"}]
    digests = set()
    for extra in _settings(settings):
        env = {**os.environ, **extra}
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (extra, out.stderr[-2000:])
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's tl.dot: CPU (Triton interpreter) only")
def test_interpreter_dot_is_the_fixed_order_and_blas_is_the_twin():
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        acc = tl.full((M, N), 0.5, tl.float32)
        tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, acc, input_precision="ieee"))

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    c = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, c, M=16, K=32, N=16)
    want = T.fixed_order_matmul(a.numpy(), b.numpy(), np.full((16, 16), 0.5, np.float32))
    assert c.numpy().tobytes() == want.tobytes()
    with T.tile_product("blas"):
        dot_kernel[(1,)](a, b, c, M=16, K=32, N=16)
    assert c.numpy().tobytes() == (np.matmul(a.numpy(), b.numpy()) + np.float32(0.5)).tobytes()
    dot_kernel[(1,)](a, b, c, M=16, K=32, N=16)  # the block restored the fixed order
    assert c.numpy().tobytes() == want.tobytes()


_KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    import batch_invariance_kit
    from batch_invariance_kit.ops import matmul as MM, tl_numerics as T
    from batch_invariance_kit.verify import harness
    K, N = 256, 64
    W = harness.seeded_normal((K, N), 5) * K ** -0.5
    make = harness.row_maker(K, dtype=torch.float32)
    out = {}
    for kind in ("fixed", "blas"):
        with T.tile_product(kind):
            rep = harness.check_invariance(lambda x: MM.mm(x, W), make, [1, 2, 3, 5, 8, 16, 17, 33],
                                           positions=(0, -1))
        out[kind] = rep.passed
    print(json.dumps(out))
""")


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's tl.dot: CPU (Triton interpreter) only")
def test_blas_tile_product_is_caught_and_the_fixed_order_passes_under_every_blas_setting():
    """The negative control of the interpreter's arithmetic: the kit's invariant matmul with numpy's
    ``matmul`` as its tile product (the variant twin) fails the bitwise check under at least one
    OpenBLAS setting; with the fixed order it passes under every setting tried."""
    results = {}
    for extra in _settings(BLAS_SETTINGS):
        env = {**os.environ, **extra}
        out = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, (extra, out.stderr[-2000:])
        res = json.loads(out.stdout.strip().splitlines()[-1])
        results[json.dumps(extra)] = res
        assert res["fixed"], f"fixed-order tile product not invariant under {extra}"
        if not res["blas"]:
            break  # caught: the twin is batch-variant on this machine under this setting
    assert any(not r["blas"] for r in results.values()), \
        f"numpy.matmul as the tile product passed under every OpenBLAS setting tried: {results}"


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's tl.sum: CPU (Triton interpreter) only")
def test_interpreter_row_sum_does_not_depend_on_the_tile_height():
    """``tl.sum`` along a tile's rows is numpy's reduction along one axis: a row's order follows
    that axis's length, never the number of rows beside it."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_sum_kernel(x_ptr, y_ptr, ROWS: tl.constexpr, W: tl.constexpr):
        r, c = tl.arange(0, ROWS), tl.arange(0, W)
        x = tl.load(x_ptr + r[:, None] * W + c[None, :])
        tl.store(y_ptr + r, tl.sum(x * x, axis=1))

    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(2))
    full = torch.empty(16)
    row_sum_kernel[(1,)](x, full, ROWS=16, W=1024)
    for rows in (1, 2, 8):
        part = torch.empty(rows)
        row_sum_kernel[(1,)](x[:rows].contiguous(), part, ROWS=rows, W=1024)
        assert part.numpy().tobytes() == full[:rows].numpy().tobytes(), rows


_CPU_PLUGIN_CHECK = textwrap.dedent("""
    import torch
    from batch_invariance_kit.ops import fixed_shape as FS
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(37, 256, generator=g).to(torch.bfloat16)
    tm = 16 if FS.tile_is_position_free(w, 16) else 1
    full = FS.tiled_linear(x, w, tm=tm)
    ok = all(torch.equal(FS.tiled_linear(x[i:i + n], w, tm=tm), full[i:i + n]) for i, n in ((0, 1), (5, 3), (20, 17)))
    print(ok)
""")


def test_cpu_plugin_gemm_tiles_are_invariant_under_other_cpu_settings():
    """The vLLM CPU plugin's GEMMs (fixed-shape tiles, :mod:`batch_invariance_kit.ops.fixed_shape`)
    stay batch-invariant with one thread and with MKL held to AVX2 kernels."""
    for extra in ({"OMP_NUM_THREADS": "1"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "2"}):
        out = subprocess.run([sys.executable, "-c", _CPU_PLUGIN_CHECK], env={**os.environ, **extra},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (extra, out.stderr[-2000:])
        assert out.stdout.strip().splitlines()[-1] == "True", extra


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    y = _twice(_twice(x)) * T.to_f32(x)
    tl.store(out_ptr + tl.arange(0, N), y + tl.sum(y, axis=0))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's helper calls: CPU only")
def test_interpreter_helper_calls_wrap_the_language_once(monkeypatch):
    """A kernel with ``@triton.jit`` helper calls (the kit's own and a Triton library one,
    ``tl.sum``) computes the same values when its helpers skip the re-wrapping of the language
    modules; the skip happens (the wrapper runs once for the launch, once more for a helper that
    sees ``tl.core``), and every builtin is Triton's own again after the launch."""
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "kit_patch_once", False), "the helper-call patch is not installed"

    x = torch.arange(8, dtype=torch.float32) / 3
    want = 4 * x * x + (4 * x * x).sum()

    triton_patch = interpreter._patch_lang.__wrapped__  # Triton's own

    def run(once):
        wrapped = []

        def counting(fn):
            wrapped.append(fn.__name__)
            return triton_patch(fn)

        monkeypatch.setattr(interpreter, "_patch_lang", T._patch_lang_once(counting) if once else counting)
        out = torch.empty_like(x)
        _helpers_kernel[(1,)](x, out, N=8)
        return out, wrapped

    base, every = run(False)
    once, few = run(True)
    assert torch.equal(base, once) and torch.allclose(once, want)
    assert every.count("_twice") == 2 and "_twice" not in few and len(few) < len(every), (every, few)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__)
