"""Which Triton kernels an engine compiled, and when: a log that a benchmark reads per run.

A Triton kernel is compiled (or loaded from Triton's disk cache) the first time a process
launches it with a new specialisation: new constexprs, or an integer argument of a new class
(1, a multiple of 16, other).  An engine whose batches change size from step to step meets new
specialisations while it serves, and each costs the step it falls in from milliseconds (a disk
cache hit) to seconds (a compile).  A timed run that compiles measures the compiler, not the
kernels.

With ``KIT_JIT_LOG=FILE`` in its environment, every process of a vLLM engine that loads the
kit's plugin (:func:`batch_invariance_kit.vllm.plugin.register`, in any mode: this log needs no
``KIT_BATCH_INVARIANT``) appends one JSON line per in-memory cache miss of a ``@triton.jit``
function to ``FILE``: the wall-clock time at its end, the process, the kernel's name and the
seconds between Triton's ``jit_cache_hook`` (called before the compile) and its
``jit_post_compile_hook`` (after).  Hooks already set are kept and called first; what the cache
hook of another returns is returned (a true value skips the compile).  In Triton's asynchronous
compile mode the seconds include the wait for the compile worker.  :func:`window` counts the
lines of one time window: :mod:`batch_invariance_kit.vllm.bench` records them for every warm-up
and timed run.  Kernels that do not go through ``JITFunction.run`` (Inductor's, which torch.compile
builds before the runs) are not counted.
"""
from __future__ import annotations

import json
import os
import threading
import time

__all__ = ["ENV", "install", "window"]

#: the environment variable that names the log file
ENV = "KIT_JIT_LOG"

_STATE = {"path": None}
_LOCK = threading.Lock()


def _name(fn) -> str:
    name = getattr(fn, "name", None)
    return str(name) if name else repr(fn)


def install(path, knobs=None) -> bool:
    """Log this process's Triton JIT compiles to ``path`` (see the module docstring).  ``knobs``:
    Triton's ``triton.knobs.runtime`` (default) or a stand-in with the two hook attributes.
    Returns ``False`` when it was installed before in this process (the first path stays)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a file path, got {path!r}")
    if knobs is None:
        from triton import knobs as _knobs

        knobs = _knobs.runtime
        _tolerate_unserialisable_constexprs()
    with _LOCK:
        if _STATE["path"] is not None:
            return False
        _STATE["path"] = os.fspath(path)
    started: dict = {}
    before, after = knobs.jit_cache_hook, knobs.jit_post_compile_hook

    def ident(fn, key):  # Triton passes a new info object to each hook: key on the function it names
        return id(getattr(fn, "jit_function", fn)), str(key)

    def cache_hook(*, key, fn, **kw):
        res = before(key=key, fn=fn, **kw) if before is not None else None
        if not res:
            started[ident(fn, key)] = time.perf_counter()
        return res

    def post_compile_hook(*, key, fn, **kw):
        res = after(key=key, fn=fn, **kw) if after is not None else None
        t0 = started.pop(ident(fn, key), None)
        line = {"t": time.time(), "pid": os.getpid(), "kernel": _name(fn),
                "s": None if t0 is None else time.perf_counter() - t0}
        with _LOCK, open(_STATE["path"], "a") as f:
            f.write(json.dumps(line) + "\n")
        return res

    knobs.jit_cache_hook, knobs.jit_post_compile_hook = cache_hook, post_compile_hook
    return True


def _tolerate_unserialisable_constexprs() -> None:
    """With a JIT hook set, Triton 3.6 serialises every compile's specialisation with
    ``json.dumps`` before calling it (``triton.runtime.jit.serialize_specialization_data``), which
    raises for a constexpr JSON cannot hold (a function, a ``tl.constexpr`` dtype).  A log must
    not make a compile fail: such a specialisation reaches the hooks as ``None`` instead."""
    from triton.runtime import jit

    original = getattr(jit, "serialize_specialization_data", None)
    if original is None or getattr(original, "_kit_tolerant", False):
        return

    def tolerant(*args, **kw):
        try:
            return original(*args, **kw)
        except (TypeError, ValueError):
            return None

    tolerant._kit_tolerant = True
    jit.serialize_specialization_data = tolerant


def window(path, t0: float, t1: float) -> dict:
    """The compiles logged in ``path`` that ended in ``[t0, t1]`` (wall-clock seconds):
    ``compiles``, ``seconds`` (their summed compile time) and ``kernels`` (name -> compiles,
    most first).  A missing file is an empty log (nothing compiled yet)."""
    if t1 < t0:
        raise ValueError(f"t1 must be >= t0, got t0={t0}, t1={t1}")
    n, secs, kernels = 0, 0.0, {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        lines = []
    for raw in lines:
        try:
            rec = json.loads(raw)
        except ValueError:  # a line another process is still writing
            continue
        if not t0 <= rec.get("t", -1.0) <= t1:
            continue
        n += 1
        secs += rec.get("s") or 0.0
        kernels[rec.get("kernel")] = kernels.get(rec.get("kernel"), 0) + 1
    return {"compiles": n, "seconds": secs, "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
