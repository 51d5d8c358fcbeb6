"""The validation command: every invariance check and benchmark of the kit on the present device.

    python -m batch_invariance_kit.validate [--out DIR] [--quick] [--only PART,...] [--list]

It runs the parts of :data:`batch_invariance_kit.bench.parts.PARTS` (one registry): on a GPU
every CUDA part (the H200 results of the book were made by them), on a CPU the parts a CPU can
run (Triton under the interpreter, the CUDA kernels through the reduction-order emulator).
``--only`` picks parts by name (a CPU part runs anywhere, a CUDA part needs a GPU); ``--list``
prints them.  It writes one JSON file per part (the ``batch_invariance_kit.report.results``
shape, with provenance) and ``report.md`` beside them: what passed, what failed, and the
device it ran on.  Exit status 1 when a required check (invariance, correctness) failed or a
part raised.  Speed comparisons are *goals* (``batch_invariance_kit.report.results.goal``):
``report.md`` lists each as met or not met, and they never set the exit status.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import batch_invariance_kit  # noqa: F401  (device selection first)
from .bench.parts import PARTS, default_parts, runnable
from .device import HAS_CUDA
from .report import results


def _report(path: Path, done: list, prov: dict) -> None:
    lines = ["# Batch-invariance kit: validation report", "",
             f"- device: {prov.get('device')} ({prov.get('sm_count')} SMs)",
             f"- torch {prov.get('torch')}, triton {prov.get('triton')}, CUDA {prov.get('cuda')}",
             f"- date: {prov.get('date')}, commit {prov.get('git_commit')}",
             f"- command: `{prov.get('command')}`", "",
             "Required checks (invariance and correctness) set the exit status; speed goals do not.", "",
             "| part | seconds | checks passed | failed | goals met |", "| --- | --- | --- | --- | --- |"]
    goal_lines = []
    for name, secs, checks, error in done:
        if error:
            lines.append(f"| {name} | {secs:.0f} | - | raised: {error} | - |")
            continue
        req = results.of_kind(checks, "required")
        goals = results.of_kind(checks, "goal")
        bad = [c["name"] for c in req if not c["passed"]]
        met = sum(bool(c["passed"]) for c in goals)
        lines.append(f"| {name} | {secs:.0f} | {len(req) - len(bad)} of {len(req)} | {'; '.join(bad) or '-'} | "
                     f"{f'{met} of {len(goals)}' if goals else '-'} |")
        goal_lines += [f"| {name} | {c['name']} | {'met' if c['passed'] else 'not met'} |" for c in goals]
    if goal_lines:
        lines += ["", "## Speed goals (reported, never a failure)", "", "| part | goal | |", "| --- | --- | --- |",
                  *goal_lines]
    path.write_text("\n".join(lines) + "\n")


def _listing(has_cuda: bool) -> str:
    width = max(map(len, PARTS))
    lines = [f"{'part':<{width}}  device  runs here  what"]
    for name, p in PARTS.items():
        by_name = "" if getattr(p, "default", True) else " (only with --only)"
        lines.append(f"{name:<{width}}  {p.device:<6}  {'yes' if runnable(name, has_cuda) else 'no':<9}  {p.what}{by_name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batch_invariance_kit.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for the JSON files and report.md (default results/local)")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (a smoke test)")
    ap.add_argument("--only", default=None, help="comma-separated part names (see --list)")
    ap.add_argument("--list", action="store_true", help="print the parts and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(_listing(HAS_CUDA))
        return 0
    names = default_parts(HAS_CUDA) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        ap.error(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    elsewhere = [n for n in names if not runnable(n, HAS_CUDA)]
    if elsewhere:
        ap.error(f"part(s) {elsewhere} need a CUDA GPU; none is present")
    out = Path(args.out) if args.out else results.local_dir()
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m batch_invariance_kit.validate",
                        *map(results.portable, argv if argv is not None else sys.argv[1:])])
    done, failed = [], False
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        t = time.time()
        try:
            rows, checks = PARTS[name].run(args.quick, save=lambda r, c, name=name: results.save(
                name, r, c, command=command, folder=out))
        except Exception as e:
            traceback.print_exc()
            done.append((name, time.time() - t, [], repr(e)[:200]))
            failed = True
            continue
        path = results.save(name, rows, checks, command=command, folder=out)
        req = results.of_kind(checks, "required")
        bad = [c for c in req if not c["passed"]]
        goals = results.of_kind(checks, "goal")
        failed |= bool(bad)
        done.append((name, time.time() - t, checks, None))
        print(f"[{i}/{len(names)}] {name}: {len(req) - len(bad)} of {len(req)} checks passed"
              + (f", {sum(bool(c['passed']) for c in goals)} of {len(goals)} speed goals met" if goals else "")
              + f" in {time.time() - t:.0f} s -> {path}", flush=True)
        for c in bad:
            print(f"   FAILED CHECK: {c['name']}", flush=True)
        for c in goals:
            if not c["passed"]:
                print(f"   goal not met (not a failure): {c['name']}", flush=True)
    _report(out / "report.md", done, results.provenance(command))
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
