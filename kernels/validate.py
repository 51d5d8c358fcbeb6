"""The validation command: every invariance check and benchmark of the kit on the present device.

    python -m batch_invariance_kit.validate [--out DIR] [--quick] [--only PART,...]

On a GPU it runs every part of :mod:`batch_invariance_kit.bench.parts` (the H200 results of the book were made by
those parts); on a CPU it runs the checks that a CPU can run (Triton under the interpreter, the
CUDA kernels through the reduction-order emulator).  It writes one JSON file per part (the
``batch_invariance_kit.report.results`` shape, with provenance) and ``report.md`` beside them: what passed, what
failed, and the device it ran on.  Exit status 1 when a required check failed or a part raised.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

import batch_invariance_kit  # noqa: F401  (device selection first)
from .report import results


def _cpu_parts() -> dict:
    from .ops import rms_norm_family as fam
    from .verify.harness import check_invariance, row_maker, seeded_normal
    from .ops import matmul as mm

    def rms_norm(quick):
        rows, checks = [], []
        seeds = range(2) if quick else range(16)
        for backend in fam.BACKENDS:
            for op in fam.OPS:
                inv = fam.seed_method(backend, op, "invariant", torch.float32, hidden=4096 if not quick else 1024,
                                      seeds=seeds)
                var = fam.seed_method(backend, op, "variant", torch.float32, hidden=4096, seeds=seeds)
                rows += [inv, var]
                checks.append({"name": f"{backend} {op} invariant: 255 vs 300 tokens bit-identical",
                               "passed": inv["rows_differing"] == 0})
                checks.append({"name": f"{backend} {op} variant differs (observed)", "informational": True,
                               "passed": True, "rows_differing": var["rows_differing"]})
        return rows, checks

    def matmul(quick):
        k, n = 512, 96
        w = seeded_normal((k, n), 5) * k ** -0.5
        make = row_maker(k, dtype=torch.float32)
        sizes = [1, 3, 17, 65] if quick else [1, 2, 3, 17, 64, 65, 127, 128, 129, 300]
        inv = check_invariance(lambda x: mm.mm(x, w), make, sizes, positions=(0, -1))
        var = check_invariance(lambda x: mm.mm(x, w, impl="variant"), make, sizes, positions=(0, -1))
        rows = [{"op": "mm", "impl": "kit-invariant", "K": k, "N": n, "row_checks": inv.checks,
                 "rows_differing": inv.rows_differing},
                {"op": "mm", "impl": "kit-variant-splitk", "K": k, "N": n, "row_checks": var.checks,
                 "rows_differing": var.rows_differing}]
        checks = [{"name": "mm invariant: every row equals the row alone", "passed": inv.passed},
                  {"name": "mm split-K variant is caught (negative control)", "passed": not var.passed}]
        return rows, checks

    return {"cpu_rms_norm": rms_norm, "cpu_matmul": matmul}


def _report(path: Path, done: list, prov: dict) -> None:
    lines = ["# Batch-invariance kit: validation report", "",
             f"- device: {prov.get('device')} ({prov.get('sm_count')} SMs)",
             f"- torch {prov.get('torch')}, triton {prov.get('triton')}, CUDA {prov.get('cuda')}",
             f"- date: {prov.get('date')}, commit {prov.get('git_commit')}",
             f"- command: `{prov.get('command')}`", "",
             "| part | seconds | checks passed | failed |", "| --- | --- | --- | --- |"]
    for name, secs, checks, error in done:
        if error:
            lines.append(f"| {name} | {secs:.0f} | - | raised: {error} |")
            continue
        req = [c for c in checks if not c.get("informational")]
        bad = [c["name"] for c in req if not c["passed"]]
        lines.append(f"| {name} | {secs:.0f} | {len(req) - len(bad)} of {len(req)} | {'; '.join(bad) or '-'} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for the JSON files and report.md (default results/local)")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps")
    ap.add_argument("--only", default=None, help="comma-separated part names")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        from .bench.parts import PARTS
        parts = dict(PARTS)
    else:
        parts = _cpu_parts()
    names = list(parts) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in parts]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known here: {list(parts)}")
    out = Path(args.out) if args.out else results.local_dir()
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m batch_invariance_kit.validate " + " ".join(argv if argv is not None else sys.argv[1:])
    done, failed = [], False
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        t = time.time()
        try:
            rows, checks = parts[name](args.quick)
        except Exception as e:
            traceback.print_exc()
            done.append((name, time.time() - t, [], repr(e)[:200]))
            failed = True
            continue
        results.save(name, rows, checks, command=command.strip(), folder=out)
        req = [c for c in checks if not c.get("informational")]
        bad = [c for c in req if not c["passed"]]
        failed |= bool(bad)
        done.append((name, time.time() - t, checks, None))
        print(f"[{i}/{len(names)}] {name}: {len(req) - len(bad)} of {len(req)} checks passed "
              f"in {time.time() - t:.0f} s", flush=True)
    _report(out / "report.md", done, results.provenance(command.strip()))
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
