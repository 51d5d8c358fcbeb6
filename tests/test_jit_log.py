"""CPU tests of :mod:`batch_invariance_kit.vllm.jit_log`: the compile log an engine's processes
write through Triton's JIT hooks (modelled by a stand-in of ``triton.knobs.runtime``, called as
Triton 3.6's ``JITFunction._call_hook`` calls them), the window a benchmark run reads back, and
the benchmark worker recording each run's compiles (a stand-in engine that compiles in its
warm-up and in one timed run)."""
import inspect
import json
import types

import pytest

from batch_invariance_kit.vllm import bench as B
from batch_invariance_kit.vllm import jit_log as J
from batch_invariance_kit.vllm import plugin
from batch_invariance_kit.vllm import runner as R


@pytest.fixture
def fresh(monkeypatch):
    """A process in which the log was never installed."""
    monkeypatch.setitem(J._STATE, "path", None)


def _triton_calls(knobs, name, key, *, compiled=True):
    """What Triton does on an in-memory cache miss of kernel ``name``: the cache hook, then (unless
    it returned a true value) the compile and the post-compile hook, with Triton's keywords."""
    jf = _JIT.setdefault(name, object())

    def kw():  # Triton builds a new JitFunctionInfo for every hook call
        fn = types.SimpleNamespace(module="m", name=name, jit_function=jf)
        return dict(key=key, repr=f"{name}[...]", fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)

    skipped = knobs.jit_cache_hook(**kw()) if knobs.jit_cache_hook else None
    if not skipped and compiled:
        [object() for _ in range(100)]  # the compiler allocates: the first info object's address is reused
        knobs.jit_post_compile_hook(**kw())
    return skipped


_JIT: dict = {}


def test_compiles_are_logged_and_read_back_per_window(tmp_path, fresh):
    knobs = types.SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    log = tmp_path / "jit.jsonl"
    assert J.install(log, knobs) is True
    assert J.install(tmp_path / "other.jsonl", knobs) is False  # once per process; the first path stays
    _triton_calls(knobs, "_mm_tma_kernel", "k1")
    _triton_calls(knobs, "_mm_tma_kernel", "k2")
    _triton_calls(knobs, "_rms_norm_kernel", "k3")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["kernel"] for x in lines] == ["_mm_tma_kernel", "_mm_tma_kernel", "_rms_norm_kernel"]
    assert all(x["s"] is not None and x["s"] >= 0 for x in lines)
    w = J.window(log, lines[0]["t"], lines[-1]["t"])
    assert w["compiles"] == 3 and w["kernels"] == {"_mm_tma_kernel": 2, "_rms_norm_kernel": 1}
    assert list(w["kernels"]) == ["_mm_tma_kernel", "_rms_norm_kernel"]  # most first
    assert J.window(log, lines[-1]["t"] + 1.0, lines[-1]["t"] + 2.0)["compiles"] == 0  # a later window
    with log.open("a") as f:
        f.write('{"t": 1e300, "kern')  # a line another process is still writing
    assert J.window(log, lines[0]["t"], 1e301)["compiles"] == 3
    assert J.window(tmp_path / "missing.jsonl", 0.0, 1.0) == {"compiles": 0, "seconds": 0.0, "kernels": {}}
    with pytest.raises(ValueError, match="t1"):
        J.window(log, 2.0, 1.0)


def test_hooks_already_set_are_kept_and_their_answer_returned(tmp_path, fresh):
    """Negative control for the chaining: a cache hook that answers True (skip the compile) still
    skips it, and nothing is logged for it; the earlier post-compile hook still runs."""
    seen = []
    knobs = types.SimpleNamespace(jit_cache_hook=lambda **kw: (seen.append(("cache", kw["key"])), kw["key"] == "skip")[1],
                                  jit_post_compile_hook=lambda **kw: seen.append(("post", kw["key"])))
    log = tmp_path / "jit.jsonl"
    J.install(log, knobs)
    assert _triton_calls(knobs, "k", "skip") is True
    assert not log.exists()
    assert not _triton_calls(knobs, "k", "run")
    assert seen == [("cache", "skip"), ("cache", "run"), ("post", "run")]
    assert [json.loads(x)["kernel"] for x in log.read_text().splitlines()] == ["k"]


def test_install_refuses_a_path_that_is_not_one(fresh):
    with pytest.raises(TypeError, match="path"):
        J.install(None, types.SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None))
    with pytest.raises(TypeError, match="path"):
        J.install("", types.SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None))


def test_real_triton_knobs_take_the_hooks(tmp_path, fresh, monkeypatch):
    """With Triton's own knobs (the default), the hooks are set and accept Triton's keywords, and
    a specialisation JSON cannot hold (which Triton serialises for the hooks) no longer fails the
    compile; one it can hold is serialised as before."""
    from triton import knobs
    from triton.runtime import jit

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(jit, "serialize_specialization_data", jit.serialize_specialization_data)
    opts = types.SimpleNamespace(num_warps=4)
    # Triton 3.6 takes six arguments, later releases also the target
    extra = {"target": types.SimpleNamespace(arch=90)} if "target" in inspect.signature(
        jit.serialize_specialization_data).parameters else {}

    def serialise(value):
        return jit.serialize_specialization_data("k", {}, {(0,): value}, {}, opts, "key", **extra)

    with pytest.raises(TypeError):
        serialise(object())
    assert J.install(tmp_path / "jit.jsonl")
    assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_post_compile_hook is not None
    assert serialise(object()) is None
    assert json.loads(serialise(3))["constant_vals"] == [3]
    _triton_calls(knobs.runtime, "_attn_split_kernel", "k")
    assert J.window(tmp_path / "jit.jsonl", 0.0, 1e12)["kernels"] == {"_attn_split_kernel": 1}


def test_plugin_logs_compiles_in_any_mode(tmp_path, fresh, monkeypatch):
    """``KIT_JIT_LOG`` alone (the plugin otherwise inert) installs the log in the process."""
    calls = []
    monkeypatch.setattr(J, "install", lambda path, knobs=None: calls.append(path))
    monkeypatch.delenv("KIT_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("KIT_JIT_LOG", str(tmp_path / "jit.jsonl"))
    plugin.register()
    assert calls == [str(tmp_path / "jit.jsonl")]
    monkeypatch.delenv("KIT_JIT_LOG")
    plugin.register()
    assert len(calls) == 1

    def no_triton(path, knobs=None):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(J, "install", no_triton)
    monkeypatch.setenv("KIT_JIT_LOG", str(tmp_path / "jit.jsonl"))
    plugin.register()  # a process without Triton still starts


def test_mode_env_drops_the_callers_log():
    env = R.mode_env("default", {"KIT_JIT_LOG": "/elsewhere.jsonl", "PATH": "p"}, gpu=True)
    assert "KIT_JIT_LOG" not in env


class _CompilingBench:
    """A stand-in engine whose process logs compiles: three in its first run (the warm-up), one
    in the second, none after."""
    runner = "stand-in"

    def __init__(self, clock, log):
        self.clock, self.log, self.runs = clock, log, 0

    def run(self, s, seed):
        self.clock.t += 10.0
        with self.log.open("a") as f:
            for k in range({0: 3, 1: 1}.get(self.runs, 0)):
                f.write(json.dumps({"t": self.clock.t - 1.0, "pid": 1, "kernel": f"kern{k}", "s": 0.5}) + "\n")
        self.runs += 1
        return B.offline_measures(10.0, 100, 100, 10)

    def info(self):
        return {}


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_worker_records_each_runs_compiles(tmp_path, monkeypatch):
    log = tmp_path / "jit.jsonl"
    monkeypatch.setenv("KIT_JIT_LOG", str(log))
    clock = _Clock()
    job = {"model": "tiny", "mode": "default", "label": "default", "vllm_invariant": None,
           "attention_backend": "vLLM's choice", "flags": [],
           "scenarios": [B.dataclasses.asdict(B.SCENARIOS["decode"])], "warmups": 1, "repeats": 3, "deadline": None}
    part = tmp_path / "part.json"
    assert B.run_worker(job, part, build=lambda j: _CompilingBench(clock, log), clock=clock) == 0
    res = json.loads(part.read_text())["scenarios"]["decode"]
    assert res["warmups"][0]["jit"]["compiles"] == 3 and res["warmups"][0]["jit"]["seconds"] == 1.5
    assert [r["jit"]["compiles"] for r in res["repeats"]] == [1, 0, 0]
    row = B.part_rows(json.loads(part.read_text()))[0]
    assert "Triton compiles in timed runs: 1 (0.5 s)" in B.table([row], [])
    monkeypatch.delenv("KIT_JIT_LOG")
    clock = _Clock()
    assert B.run_worker(job, part, build=lambda j: _CompilingBench(clock, log), clock=clock) == 0
    res = json.loads(part.read_text())["scenarios"]["decode"]
    assert all("jit" not in r for r in res["warmups"] + res["repeats"])
