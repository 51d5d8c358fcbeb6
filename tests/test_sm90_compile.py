"""Every Triton kernel of the kit compiles for sm_90 (Hopper) at every shipped config, with no
GPU: Triton's own compiler and its bundled ptxas (:mod:`batch_invariance_kit.verify.sm90`).

The CPU tests run the kernels under the interpreter, which never compiles them: this is the
test that fails when a change breaks the compiled path (a TMA load, the warp-specialised loop,
the merge's programmatic dependent launch, a type only the compiler checks) instead of the
next GPU run.  It runs in a process of its own (the kit must be imported in compiled mode)
and prints each kernel's registers, spills and shared memory (``pytest -s`` shows the table).
"""
import json
import os
import subprocess
import sys

import pytest


def _compile(tmp_path, *args):
    out = tmp_path / "sm90.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # compile, never reuse
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "batch_invariance_kit.verify.sm90", "--json", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout[-20000:])
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("sm90"), "--jobs", str(min(4, len(os.sched_getaffinity(0)))))


def test_every_kernel_compiles_for_sm90(compiled):
    proc, report = compiled
    assert report is not None, proc.stdout[-5000:] + proc.stderr[-5000:]
    failed = [(r["kernel"], r["labels"][0], r["error"][-1500:]) for r in report["results"] if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_kernel_of_the_kit_is_reached(compiled):
    _, report = compiled
    assert report is not None
    reached = {r["kernel"] for r in report["results"]}
    assert not report["missing"] and set(report["kernels"]) <= reached
    # the op modules' kernels, each found and compiled (a kernel no driver reaches fails above)
    for name in ("_rms_norm_kernel", "_mm_kernel", "_mm_tma_kernel", "chunk_reduce_kernel", "_attn_split_kernel",
                 "_attn_merge_kernel", "_write_kv_kernel", "_router_kernel", "_grouped_gemm_kernel",
                 "_splitk_silu_kernel", "_combine_kernel", "_silu_mul_kernel", "_log_softmax_kernel",
                 "_row_mean_kernel"):
        assert name in reached


def test_the_shipped_schedules_are_compiled(compiled):
    """The GPU-only paths the interpreter never takes are among the compiled kernels, and
    every config of matmul's tables is reached."""
    _, report = compiled
    assert report is not None
    res = report["results"]
    cx = [(r["kernel"], r["constexprs"]) for r in res]
    assert all(c.get("UPCAST", False) is False for _, c in cx)  # the compiled path, not the interpreter's
    assert any(k == "_attn_merge_kernel" and c["PDL"] for k, c in cx)  # Hopper's dependent launch
    assert any(k == "_attn_split_kernel" and c["SERIAL"] for k, c in cx)
    assert any(k == "_attn_split_kernel" and not c["SERIAL"] for k, c in cx)
    assert any(k == "_mm_tma_kernel" and c["WARP_SPEC"] for k, c in cx)
    assert any(k == "_mm_tma_kernel" and c["CHUNK_BLOCKS"] > 0 for k, c in cx)  # a long K, chunked
    # the MoE grouped GEMM: matmul's chunked K order over a long hidden size; the variant's
    # unfused split-K, whose second pass is matmul's own
    assert any(k == "_grouped_gemm_kernel" and c["CHUNK_BLOCKS"] > 0 and c["FUSE_SILU"] for k, c in cx)
    assert any(k == "_grouped_gemm_kernel" and c["SPLIT_K"] > 1 and not c["FUSE_SILU"] for k, c in cx)
    assert any(r["kernel"] == "chunk_reduce_kernel" and any("moe down" in x for x in r["labels"]) for r in res)
    # the DeepSeek layer's shared experts: their output added inside the combine, their activation
    assert any(k == "_combine_kernel" and c["HAS_SHARED"] for k, c in cx)
    assert any(k == "_rms_norm_kernel" and c["NUM_CHUNKS"] > 1 for k, c in cx)
    labels = " ".join(label for r in res for label in r["labels"])
    from batch_invariance_kit.ops import matmul as MM

    for name in sorted(c.name for c in MM.CONFIGS):
        assert f" {name} " in labels, f"matmul config {name} was not compiled"
    for r in res:  # the table's numbers are ptxas's: every compiled kernel has them
        assert r["registers"] > 0 and r["spill_stores"] >= 0 and r["shared"] >= 0


def test_packed_head_dim_rows_are_summed_like_one_row_programs(tmp_path):
    """RMSNorm packs head-dim rows (at most 512 bytes: 256 columns of bf16, 128 of fp32) one warp
    each, four to a program: Triton lays the tile out so that every row is summed in the order of
    a one-row, one-warp program (the same elements per thread, the same lanes).  The controls,
    eight rows sharing one warp's lanes and fp32 rows of 256 split over two warps, are told apart
    by the same comparison, and the kit does not pack the latter."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "batch_invariance_kit.verify.sm90", "--row-layouts", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    shipped = [r for r in rows if not r.get("control")]
    assert {(r["dtype"], r["block"]) for r in shipped} == {
        ("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float16", 128), ("float16", 256),
        ("float32", 64), ("float32", 128)}
    assert all(r["rows"] == 4 for r in shipped)
    assert all(r["same"] for r in shipped), [r for r in shipped if not r["same"]]
    controls = {r["control"]: r for r in rows if r.get("control")}
    assert set(controls) == {"eight rows in one warp", "fp32 rows of 256 packed"}
    assert not any(r["same"] for r in controls.values())
    assert controls["fp32 rows of 256 packed"]["shipped_rows"] == 1  # the kit keeps those one per program
