"""Every GPU check and benchmark of the kit, in one command, with results stored as JSON.

    python -m batch_invariance_kit.bench.parts [--out DIR] [--only NAME[,NAME...]] [--quick]

Writes ``<DIR>/<name>.json`` (default ``results/local``; the stored H200 results in
``results/h200`` were produced by this command, see each file's provenance).  Parts:

* ``mm_first_divergence``: where ``torch.mm`` (cuBLAS) first depends on the batch (chapter 1);
* ``decoder_under_load``: chapter 1's toy decoder, unique logprob sequences under load;
* ``rms_norm_*``: chapter 3 (emulator vs CUDA bitwise, invariance of every op, benchmark).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

import batch_invariance_kit  # noqa: F401  (device selection first)
from ..report import results


def part_mm_first_divergence(quick: bool) -> tuple:
    from ..verify.divergence import DTYPES, default_batch_sizes, mm_first_divergence

    shapes = [(4096, 4096)] if quick else [(4096, 4096), (12288, 4096), (4096, 12288)]
    limit = 1024 if quick else 4096
    sizes = default_batch_sizes(limit)
    rows = []
    for dt in ("bfloat16", "float16", "float32"):
        for n, k in shapes:
            # every row of every batch up to 64, then first / middle / last rows
            r = mm_first_divergence(DTYPES[dt], n, k, sizes,
                                    positions=lambda bs: range(bs) if bs <= 64 else (0, bs // 2, bs - 1))
            rows.append(r)
            print(f"  torch.mm {dt:<9} N={n:<6} K={k:<6} first diverging M = {r['first_divergence_M']}")
    checks = [{"name": "cuBLAS torch.mm depends on the batch for some dtype and shape",
               "passed": any(r["first_divergence_M"] is not None for r in rows)}]
    return rows, checks


def part_decoder_under_load(quick: bool) -> tuple:
    from ..serving.toy_decoder import ToyDecoder

    rows, checks = [], []
    configs = [dict(vocab=2048, hidden=512, layers=4, heads=8, ffn=1024),
               dict(vocab=8192, hidden=2048, layers=8, heads=16, ffn=5632)]
    loads = [0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63, 95, 127]
    for cfg in configs[:1] if quick else configs:
        for dtype in (torch.bfloat16, torch.float32):
            m = ToyDecoder(seed=0, dtype=dtype, **cfg)
            prompt = list(range(10, 42))
            runs = [m.generate(prompt, 48, load=n, load_seed=n) for n in loads]
            alone = [m.generate(prompt, 48, load=n, load_seed=n, alone=True) for n in loads[:4]]
            ref = alone[0].logprobs
            row = dict(op="toy_decoder", impl="torch (cuBLAS)", dtype=str(dtype).replace("torch.", ""),
                       **cfg, runs=len(runs), loads=loads,
                       unique_logprob_sequences=len({r.key() for r in runs}),
                       unique_completions=len({r.tokens for r in runs}),
                       alone_unique_logprob_sequences=len({r.key() for r in alone}),
                       max_abs_logprob_diff=max(float((r.logprobs - ref).abs().max()) for r in runs
                                                if len(r.tokens) == len(alone[0].tokens)))
            rows.append(row)
            print(f"  decoder hidden {cfg['hidden']} {row['dtype']}: {row['unique_logprob_sequences']} logprob "
                  f"sequences, {row['unique_completions']} completions of {len(runs)}; alone "
                  f"{row['alone_unique_logprob_sequences']}")
            checks.append({"name": f"decoder alone is invariant (hidden {cfg['hidden']}, {row['dtype']})",
                           "passed": row["alone_unique_logprob_sequences"] == 1})
    return rows, checks


def part_invariance_map(quick: bool, save=None) -> tuple:
    """torch.mm/bmm/linear first divergence under three cuBLAS set-ups, one process each
    (the workspace variables are read when cuBLAS starts)."""
    import json
    import os
    import subprocess

    setups = [("default", {}, []),
              ("no-split-K env", {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}, []),
              ("no-split-K env + cuBLASLt", {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"},
               ["--cublaslt"])]
    rows = []
    for label, env, flags in setups:
        e = dict(os.environ)
        e.update(env)
        cmd = [sys.executable, "-m", "batch_invariance_kit.verify.divergence", "--limit", "1024" if quick else "2048", *flags]
        if quick:
            cmd.append("--quick")
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON:")]
        if p.returncode != 0 or not line:
            raise RuntimeError(f"{label}: {p.stderr[-2000:]}")
        for r in json.loads(line[0][5:]):
            r["setup"] = label
            rows.append(r)
            print(f"  {label:<26} {r['op']:<16} {r['dtype']:<9} N={r['N']:<6} K={r['K']:<6} "
                  f"first M = {r['first_divergence_M']}", flush=True)
        if save is not None:  # keep what is done if a later set-up runs out of time
            save(rows, [{"name": f"set-ups done: {len({r['setup'] for r in rows})} of {len(setups)}",
                         "passed": True, "informational": True}])
    bf16_env = [r for r in rows if r["setup"] != "default" and r["dtype"] == "bfloat16"]
    checks = [{"name": "the no-split-K cuBLAS environment makes bf16 mm/bmm/linear batch-invariant "
                       "(observed, not required)", "passed": all(r["first_divergence_M"] is None for r in bf16_env),
               "informational": True}]
    return rows, checks


def part_matmul_sweep(quick: bool) -> tuple:
    from ..ops.matmul import gpu_sweep

    if quick:  # two shapes, six Ms, plus the vocabulary projection at decode sizes
        rows, checks = gpu_sweep([(4096, 4096), (4096, 12288)], [1, 16, 64, 256, 1024, 4096], torch.bfloat16,
                                 reps=50)
        more = gpu_sweep([(151936, 4096)], [1, 16], torch.bfloat16, reps=30)
        return rows + more[0], checks + more[1]
    shapes = [(4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
    return gpu_sweep(shapes, [1, 4, 16, 64, 256, 1024, 4096, 8192], torch.bfloat16, reps=50)


def _from(module: str, name: str):
    """A part that lives in another module (imported only when it runs)."""
    def part(quick):
        import importlib

        return getattr(importlib.import_module(f"kernels.{module}"), name)(quick)
    return part



PARTS = {
    "mm_first_divergence": part_mm_first_divergence,
    "decoder_under_load": part_decoder_under_load,
    "rms_norm_crosscheck": _from("rms_norm_bench", "crosscheck"),
    "rms_norm_invariance": _from("rms_norm_bench", "invariance"),
    "rms_norm_flips": _from("rms_norm_bench", "flips"),
    "rms_norm_bench": _from("rms_norm_bench", "bench"),
    "rms_norm_tune_warps": _from("rms_norm_bench", "tune_warps"),
    "invariance_map": part_invariance_map,
    "matmul_sweep": part_matmul_sweep,
    # issue 5 (written on CPU, not yet run on a GPU):
    "moe_invariance": _from("moe_bench", "invariance"),
    "moe_loads": _from("moe_bench", "loads"),
    "moe_bench": _from("moe_bench", "bench"),
    # issue 6 (written on CPU, not yet run on a GPU):
    "attention_consistency": _from("attention_bench", "consistency"),
    "attention_bench": _from("attention_bench", "bench"),
    "attention_tune": _from("attention_bench", "tune"),
    "attention_decode_tiles": _from("attention_bench", "decode_tiles"),
    "e2e_model": _from("e2e_bench", "e2e_model"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for the JSON files (default results/local)")
    ap.add_argument("--only", default=None, help="comma-separated part names: " + ", ".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (a smoke test)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("batch_invariance_kit.bench.parts needs a CUDA GPU; none is present.", file=sys.stderr)
        return 2
    names = list(PARTS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    command = "python -m batch_invariance_kit.bench.parts" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    failed = []
    for name in names:
        t = time.time()
        print(f"== {name}", flush=True)
        try:
            if name == "invariance_map":
                rows, checks = PARTS[name](args.quick, save=lambda r, c: results.save(
                    name, r, c, command=command, folder=args.out))
            else:
                rows, checks = PARTS[name](args.quick)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        path = results.save(name, rows, checks, command=command, folder=args.out)
        bad = [c["name"] for c in checks if not c["passed"]]
        print(f"   -> {path} ({len(rows)} rows, {len(checks)} checks, {len(bad)} failed) in {time.time() - t:.1f} s",
              flush=True)
        for b in bad:
            print(f"   FAILED CHECK: {b}")
    if failed:
        print("parts that raised:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
