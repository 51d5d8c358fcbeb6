"""Is a request's answer the same however busy the server is?  vLLM's OpenAI-compatible server
under concurrent clients, with the kit's plugin switched on or off.

The offline check (:mod:`batch_invariance_kit.vllm.runner`) queues every request before the first
step.  A server mixes the prefills and decodes of requests that arrive at other times into every
step of a target's life.  This module owns a real server, ``python -m
vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs), one per mode, and asks it::

    python -m batch_invariance_kit.vllm.online --model PATH --out DIR               # a local HF folder
    python -m batch_invariance_kit.vllm.online --models dense,moe --out DIR         # the kit's models (check.py)

Per mode (:data:`batch_invariance_kit.vllm.records.MODES`, the offline check's; the environment is
:func:`batch_invariance_kit.vllm.runner.mode_env`'s):

1. the server is started on a free loopback port in its own process group, its log kept in
   ``DIR/logs/``; ready when ``/health`` and ``/v1/models`` answer; stopped by SIGTERM to the
   group, SIGKILL after a bounded wait;
2. **alone**: every target prompt is sent alone (greedy, ``ignore_eos``, ``logprobs=k``: the
   sampled token's raw fp32 log-probability and the top ``k``), one after another;
3. **under load**, per round: ``clients`` other clients, each from its own start time, send
   requests of random lengths (prompt and output) one after another, the next when the previous
   reply is complete, until the round's targets are done (closed loop: however fast the server,
   every target runs while the clients are busy); the targets start at random times after the
   first client, a **streaming** copy of a target runs beside them, and one neighbour **is
   cancelled** after its first streamed tokens (the client closes the connection; the server
   aborts it).  Every time and every request's content is drawn from the seed: the ``k``-th
   request of a client is the same on every machine, only how many a client sends depends on the
   server's speed;
4. **after**: ``/health`` and the first target once more, alone: the server still serves, and
   the same bits.

Every completion is compared with the target's answer alone, **bitwise**
(:func:`batch_invariance_kit.vllm.records.compare`, the offline check's comparison): token ids,
and the log-probabilities as the JSON numbers the server sent (each kept as its literal text, so
two values are equal only when the server printed the same float: a float32 printed by Python's
``repr`` of its float64, which is exact), the sampled token's and the top ``k``'s.  A server's
reply is read into typed records (:class:`batch_invariance_kit.vllm.records.Choice`): a malformed
one is an error naming the field.  A run records how many other requests were in flight beside
each target (by the client's clock): a target that overlapped none proves nothing, and the check
says so.

The targets of the kit's random-weight models are the offline check's prompts, chosen by their
seeds: :data:`~batch_invariance_kit.vllm.records.TARGET` and the
:data:`~batch_invariance_kit.vllm.records.NEEDLE` first (:func:`plan_for`).

The kit's modes must be bitwise everywhere; default mode is the negative control (it must differ
somewhere on a GPU; on vLLM's CPU build the result is recorded as informational).  The results are
one JSON file with provenance, ``DIR/vllm_online.json`` (:mod:`batch_invariance_kit.report.results`'
shape; its rows are :class:`batch_invariance_kit.vllm.records.OnlineRow` records, plus ``plan`` and
``servers``).

The pure-Python parts (the plan, the parsing of the server's answers, the comparisons, the checks)
run without vLLM (``tests/test_vllm_online.py``, against a stand-in server); chapter 7 runs the
whole check live on vLLM's CPU build with SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..checks import positive_int
from . import records as RC
from . import runner as R
from .records import Comparison, OnlineRow, compare

#: The endpoint every request goes to (token-id prompts; ``return_tokens_as_token_ids``).
ENDPOINT = "/v1/completions"
#: A server that does not answer ``/health`` within this many seconds of its start is given up.
START_TIMEOUT_S = 900.0
#: Seconds between SIGTERM and SIGKILL of the server's process group.
STOP_GRACE_S = 20.0
LOG_TAIL = 4000


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """One completion as the server sent it: token ids, the sampled token's log-probability per
    position and the top ``k`` ``(token, log-probability)`` per position, each log-probability the
    literal text of the JSON number (compared as text: bitwise)."""
    tokens: tuple
    logprobs: tuple
    top: tuple
    text: str = ""
    finish_reason: str | None = None


@dataclass(frozen=True)
class Request:
    """One request of a run: ``prompt`` (token ids), ``max_tokens``, sent ``at`` seconds after the
    run starts (a client's later requests carry its start time and go as soon as the previous reply
    is complete); ``stream``: streamed; ``cancel_after``: the client closes the stream after that
    many chunks with tokens; ``target``: the index of the target it is a copy of (``None``: a
    neighbour)."""
    name: str
    prompt: tuple
    max_tokens: int
    at: float = 0.0
    stream: bool = False
    cancel_after: int | None = None
    target: int | None = None


@dataclass
class Sent:
    """What one request got: its times (seconds after the run's start, the client's clock), its
    answer, the chunks streamed, whether the client cancelled it, the error."""
    name: str
    start: float
    end: float
    answer: Answer | None = None
    chunks: int = 0
    cancelled: bool = False
    error: str | None = None


def token_id(entry: str, where: str = "token") -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) -> 123."""
    if not (isinstance(entry, str) and entry.startswith("token_id:") and entry[9:].isdigit()):
        raise ValueError(f"{where}: expected a 'token_id:N' token (return_tokens_as_token_ids), got {entry!r}")
    return int(entry[9:])


def parse_choice(choice, where: str = "choices[0]") -> Answer:
    """An :class:`Answer` from one ``choices[i]`` of a completion (or the tokens of one streamed
    chunk), parsed with ``parse_float=str``: the log-probabilities stay the server's literals.  A
    malformed choice raises ``ValueError`` naming the field (``where`` is its path)."""
    c = RC.parse(RC.Choice, choice, where, extra="ignore")
    lp = c.logprobs or RC.ReplyLogprobs(tokens=[], token_logprobs=[])
    tops = lp.top_logprobs if lp.top_logprobs is not None else [None] * len(lp.tokens)
    if not (len(lp.tokens) == len(lp.token_logprobs) == len(tops)):
        raise ValueError(f"{where}.logprobs: {len(lp.tokens)} tokens, {len(lp.token_logprobs)} token_logprobs, "
                         f"{len(tops)} top_logprobs")
    top = tuple(tuple(sorted((token_id(k, f"{where}.logprobs.top_logprobs[{i}]"), v) for k, v in (t or {}).items()))
                for i, t in enumerate(tops))
    return Answer(tokens=tuple(token_id(t, f"{where}.logprobs.tokens[{i}]") for i, t in enumerate(lp.tokens)),
                  logprobs=tuple(lp.token_logprobs), top=top, text=c.text or "", finish_reason=c.finish_reason)


def first_choice(reply, where: str = "reply") -> Answer:
    """The :class:`Answer` of a completion's (or a streamed chunk's) JSON body: its ``choices[0]``."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not (isinstance(choices, list) and choices):
        raise ValueError(f"{where}.choices: expected a non-empty list, got {choices!r}")
    return parse_choice(choices[0], f"{where}.choices[0]")


def join(parts: list) -> Answer:
    """The :class:`Answer` of a streamed completion from its chunks' answers, in order."""
    return Answer(tokens=tuple(t for p in parts for t in p.tokens), logprobs=tuple(v for p in parts for v in p.logprobs),
                  top=tuple(t for p in parts for t in p.top), text="".join(p.text for p in parts),
                  finish_reason=next((p.finish_reason for p in reversed(parts) if p.finish_reason), None))


def compare_answers(ref: Answer, got: Answer) -> Comparison:
    """``got`` against ``ref``, bitwise (log-probabilities as the server's literals, top-k too)."""
    return compare(ref.tokens, ref.logprobs, got.tokens, got.logprobs, ref.top, got.top)


def overlaps(sent: list, name: str) -> int:
    """How many other requests of ``sent`` were in flight at some moment of ``name``'s life (a
    client's requests one after another count one each)."""
    me = next(s for s in sent if s.name == name)
    return sum(1 for s in sent if s.name != name and s.start < me.end and me.start < s.end)


# ---------------------------------------------------------------------------------------------
# The plan (deterministic: the same seed gives the same requests and times on every machine)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Round:
    """The schedule of one load round: ``requests``, the targets, the streamed copy and the
    cancelled neighbour at their times, in time order; ``starts``, the second at which each client
    sends its first request (its requests: :meth:`Plan.client`)."""
    requests: tuple
    starts: tuple


@dataclass(frozen=True)
class Plan:
    """The experiment of one server: ``targets`` (token-id prompts), each answered ``max_tokens``
    tokens; ``rounds`` load rounds of ``clients`` other clients.  A client starts at a random time
    in the first half of ``window_s`` seconds and sends requests one after another (each when the
    previous reply is complete) until the round's targets, its streamed copy and its cancelled
    neighbour are done, at least ``per_client`` of them; their prompts have ``prompt_len`` tokens
    and their outputs ``new_tokens`` (inclusive ranges).  The targets and the streamed copy start
    at random times between the first client's start and ``0.9 * window_s``, the cancelled
    neighbour in the first half.  ``top_logprobs``: the ``k`` of every request's ``logprobs``;
    ``vocab``: the neighbours' token ids are drawn below it; ``names``: the targets' request names
    (default ``t0``, ``t1``, ...)."""
    targets: tuple
    max_tokens: int = 16
    clients: int = 8
    per_client: int = 2
    rounds: int = 1
    prompt_len: tuple = (8, 160)
    new_tokens: tuple = (2, 32)
    window_s: float = 4.0
    top_logprobs: int = 5
    vocab: int = 32768
    seed: int = 0
    names: tuple = ()

    def __post_init__(self):
        if not self.targets or not all(isinstance(t, (list, tuple)) and t and all(
                isinstance(x, int) and not isinstance(x, bool) for x in t) for t in self.targets):
            raise TypeError("targets must be a non-empty list of non-empty token-id lists")
        for name in ("max_tokens", "clients", "per_client", "rounds", "top_logprobs", "vocab"):
            positive_int(name, getattr(self, name))
        for name in ("prompt_len", "new_tokens"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s must be a positive number of seconds, got {self.window_s!r}")
        object.__setattr__(self, "targets", tuple(tuple(t) for t in self.targets))
        names = tuple(self.names) or tuple(f"t{i}" for i in range(len(self.targets)))
        if len(names) != len(self.targets) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n and n not in ("stream", "cancel") and not n.startswith("c") for n in names):
            raise ValueError(f"names must give each target its own name (not 'stream', 'cancel' or c...), "
                             f"got {self.names!r}")
        object.__setattr__(self, "names", names)

    @property
    def max_model_len(self) -> int:
        longest = max([len(t) + self.max_tokens for t in self.targets]
                      + [self.prompt_len[1] + max(self.new_tokens[1], self.max_tokens)])   # the cancelled one's
        return longest + 16

    def round(self, r: int) -> Round:
        """The schedule of load round ``r``: every target once (by its name), a streamed copy of
        target ``r % len(targets)`` (``stream``) and a cancelled streamed neighbour (``cancel``,
        cancelled after 2 chunks) at seeded times, and the clients' seeded start times."""
        rng = random.Random(self.seed * 1000 + r)
        w = self.window_s
        starts = tuple(round(rng.uniform(0, w / 2), 3) for _ in range(self.clients))
        first = min(starts)
        reqs = [Request(self.names[i], t, self.max_tokens, at=round(rng.uniform(first, 0.9 * w), 3), target=i)
                for i, t in enumerate(self.targets)]
        s = r % len(self.targets)
        reqs.append(Request("stream", self.targets[s], self.max_tokens, at=round(rng.uniform(first, 0.9 * w), 3),
                            stream=True, target=s))
        n = rng.randint(*self.prompt_len)
        reqs.append(Request("cancel", tuple(rng.randrange(2, self.vocab) for _ in range(n)),
                            max(self.new_tokens[1], self.max_tokens), at=round(rng.uniform(0, 0.5 * w), 3),
                            stream=True, cancel_after=2))
        return Round(tuple(sorted(reqs, key=lambda q: q.at)), starts)

    def client(self, r: int, c: int) -> Iterator[Request]:
        """The requests of client ``c`` in round ``r``, without end, drawn one at a time from a
        generator seeded by ``(seed, r, c)``: the ``k``-th (``c{c}.{k}``) is the same however many
        the client sends.  Each carries the client's start time."""
        at = self.round(r).starts[c]
        rng = random.Random(f"client {self.seed} {r} {c}")   # str seeds hash the same on every machine
        k = 0
        while True:
            n = rng.randint(*self.prompt_len)
            yield Request(f"c{c}.{k}", tuple(rng.randrange(2, self.vocab) for _ in range(n)),
                          rng.randint(*self.new_tokens), at=at)
            k += 1


# ---------------------------------------------------------------------------------------------
# The clients
# ---------------------------------------------------------------------------------------------

def body(req: Request, model: str, top_logprobs: int) -> dict:
    """The JSON body of ``req``: greedy, every token generated (``ignore_eos``), token ids back."""
    return {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": top_logprobs, "return_tokens_as_token_ids": True,
            "stream": req.stream}


async def send(client, req: Request, model: str, top_logprobs: int, t0: float) -> Sent:
    """Send ``req`` at ``t0 + req.at`` (``client``: an ``httpx.AsyncClient`` on the server)."""
    await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
    s = Sent(req.name, start=time.monotonic() - t0, end=0.0)
    try:
        if not req.stream:
            r = await client.post(ENDPOINT, json=body(req, model, top_logprobs))
            r.raise_for_status()
            s.answer = first_choice(json.loads(r.text, parse_float=str), f"the reply to {req.name}")
        else:
            parts = []
            async with client.stream("POST", ENDPOINT, json=body(req, model, top_logprobs)) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:], parse_float=str)
                    if isinstance(chunk, dict) and chunk.get("choices"):
                        parts.append(first_choice(chunk, f"chunk {len(parts)} of {req.name}"))
                        s.chunks += bool(parts[-1].tokens)
                    if req.cancel_after is not None and s.chunks >= req.cancel_after:
                        s.cancelled = True
                        break   # leaving the block closes the connection: the server aborts the request
            s.answer = join(parts)
    except Exception as e:  # recorded; the checks fail on a missing answer
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.monotonic() - t0
    return s


async def run_requests(base_url: str, model: str, reqs: list, top_logprobs: int, timeout_s: float,
                       clients: tuple = (), at_least: int = 0) -> list:
    """Every request of ``reqs`` at its time, concurrently, beside ``clients`` (each an iterator of
    requests, :meth:`Plan.client`): a client sends its requests one after another, each when the
    previous reply is complete, until every request of ``reqs`` is done and it has sent
    ``at_least``; a client whose request fails stops there (the error is recorded).  Returns the
    :class:`Sent` of ``reqs`` in their order, then each client's in the order sent."""
    import httpx

    done = asyncio.Event()
    n = len(reqs) + len(clients) + 4
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()

        async def fixed():
            try:
                return list(await asyncio.gather(*(send(client, q, model, top_logprobs, t0) for q in reqs)))
            finally:
                done.set()

        async def closed_loop(queue: Iterator[Request]):
            out = []
            for req in queue:
                if done.is_set() and len(out) >= at_least:
                    return out
                out.append(await send(client, req, model, top_logprobs, t0))
                if out[-1].error:
                    return out
            return out

        first, *loads = await asyncio.gather(fixed(), *(closed_loop(q) for q in clients))
    return first + [s for load in loads for s in load]


def run_sync(coro):
    """Run ``coro`` to its end and return its result, from plain code or from code that already runs
    inside an event loop (a notebook's kernel: there ``asyncio.run`` refuses, so a thread of its own
    runs it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def one(base_url: str, model: str, req: Request, top_logprobs: int, timeout_s: float) -> Sent:
    """``req`` alone (nothing else in flight)."""
    return run_sync(run_requests(base_url, model, [req], top_logprobs, timeout_s))[0]


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(mode: str, *, gpu: bool, report_dir=None, base: dict | None = None) -> dict:
    """The server's environment: the mode's (:func:`batch_invariance_kit.vllm.runner.mode_env`)
    with vLLM's own process layout (an engine-core process beside the API server), and on a
    machine without CUDA ``TRITON_INTERPRET=1`` (vLLM's CPU build imports Triton before it loads
    the kit's plugin, and the kit's Triton code runs only under the interpreter there)."""
    env = R.mode_env(mode, base, gpu=gpu)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    if report_dir is not None and RC.check_mode(mode) in RC.KIT_MODES:
        env["KIT_PLUGIN_REPORT"] = str(report_dir)
    return env


def server_command(model, port: int, *, max_model_len: int, top_logprobs: int, eager: bool, gpu: bool,
                   tokenizer: bool, attention_backend: str | None = None, extra: tuple = ()) -> list:
    """``python -m vllm.entrypoints.openai.api_server`` on ``127.0.0.1:port``: bf16, prefix cache
    off (a hit would change the prefill's shape between the runs compared), raw fp32 logprobs,
    seed 0; on the CPU a 1 GiB KV cache, on a GPU half its memory."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--logprobs-mode", "raw_logprobs",
           "--max-logprobs", str(top_logprobs), "--seed", "0", "--disable-uvicorn-access-log"]
    cmd += ["--gpu-memory-utilization", "0.5"] if gpu else ["--kv-cache-memory-bytes", str(2 ** 30)]
    if eager:
        cmd.append("--enforce-eager")
    if not tokenizer:
        cmd.append("--skip-tokenizer-init")
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    return cmd + list(extra)


class Server:
    """A vLLM server process group: started by :meth:`start`, ready after :meth:`wait_ready`,
    stopped by :meth:`stop` (also on leaving a ``with`` block)."""

    def __init__(self, cmd: list, env: dict, log_path):
        self.cmd, self.env, self.log_path = cmd, env, Path(log_path)
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start_s = self.ready_s = None

    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL:] if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll ``/health`` then ``/v1/models`` until both answer 200; returns the seconds it took.
        Raises ``RuntimeError`` (with the log's tail) when the server exits or the time is up."""
        import httpx

        deadline = self._t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was ready:\n"
                                   + self.log_tail())
            try:
                if (httpx.get(self.base_url + "/health", timeout=2).status_code == 200
                        and httpx.get(self.base_url + "/v1/models", timeout=2).status_code == 200):
                    self.ready_s = time.monotonic() - self._t0
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n" + self.log_tail())

    def healthy(self) -> bool:
        import httpx

        try:
            return self.proc.poll() is None and httpx.get(self.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the group's other processes (the engine core) after the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------------------------
# One server's experiment, and its checks
# ---------------------------------------------------------------------------------------------

def _copy(ref: Answer | None, s: Sent, rnd, overlap: int | None = None) -> dict:
    """One compared copy of a target: the fields of its :class:`~batch_invariance_kit.vllm.records.OnlineRow`."""
    return {"round": rnd, "name": s.name, "start_s": round(s.start, 3), "end_s": round(s.end, 3), "error": s.error,
            "in_flight_beside": overlap, "tokens": len(s.answer.tokens) if s.answer else None,
            "compared": compare_answers(ref, s.answer) if ref is not None and s.answer is not None else None}


def experiment(base_url: str, plan: Plan, *, timeout_s: float = 600.0, healthy=None) -> dict:
    """The experiment of one running server: the targets alone, ``plan.rounds`` load rounds, the
    first target after them.  ``healthy()``: is the server still serving (default: ``/health``).
    Returns ``alone`` (each target's answer), ``copies`` (every compared copy of a target, the
    one ``after`` the rounds last), ``rounds`` (per round: how many requests it sent, the cancelled
    neighbour, the neighbours' requests per client and errors) and ``healthy_after``."""
    import httpx

    model = "model"
    k = plan.top_logprobs
    alone = [one(base_url, model, Request(plan.names[i], t, plan.max_tokens, target=i), k, timeout_s)
             for i, t in enumerate(plan.targets)]
    refs = [s.answer for s in alone]
    rounds, copies = [], []
    for r in range(plan.rounds):
        reqs = plan.round(r).requests
        clients = tuple(plan.client(r, c) for c in range(plan.clients))
        t1 = time.monotonic()
        sent = run_sync(run_requests(base_url, model, reqs, k, timeout_s, clients, at_least=plan.per_client))
        copies += [_copy(refs[q.target], s, r, overlaps(sent, s.name)) for q, s in zip(reqs, sent)
                   if q.target is not None]
        (cancel_req, cancel), = ((q, s) for q, s in zip(reqs, sent) if q.name == "cancel")
        neighbours = [s for q, s in zip(reqs, sent) if q.target is None] + sent[len(reqs):]
        per_client = [sum(s.name.startswith(f"c{c}.") for s in neighbours) for c in range(plan.clients)]
        rounds.append({"round": r, "seconds": time.monotonic() - t1, "requests": len(sent),
                       "cancelled": {"name": cancel.name, "cancelled": cancel.cancelled, "chunks": cancel.chunks,
                                     "tokens": len(cancel.answer.tokens) if cancel.answer else 0,
                                     "max_tokens": cancel_req.max_tokens, "error": cancel.error},
                       "neighbours": {"sent": len(neighbours), "per_client": per_client,
                                      "errors": [s.error for s in neighbours if s.error],
                                      "cancelled": sum(s.cancelled for s in neighbours)}})
    health = (healthy or (lambda: httpx.get(base_url + "/health", timeout=5).status_code == 200))()
    after = one(base_url, model, Request(plan.names[0], plan.targets[0], plan.max_tokens, target=0), k, timeout_s)
    copies.append(_copy(refs[0], after, "after"))
    return {"alone": [{"name": s.name, "error": s.error, "seconds": s.end - s.start,
                       **({"tokens": list(s.answer.tokens), "logprobs": list(s.answer.logprobs),
                           "text": s.answer.text} if s.answer else {})} for s in alone],
            "copies": copies, "rounds": rounds, "healthy_after": bool(health)}


def _bitwise(copy: dict) -> bool:
    return copy["compared"] is not None and copy["compared"].bitwise


def checks(label: str, mode: str, res: dict, *, platform: str, plugin_calls: dict | None = None) -> list:
    """The checks of one mode's experiment (:func:`experiment`) on the model ``label``.  The
    batch-invariant modes: every copy of a target bitwise its answer alone, the streamed copy too,
    the cancelled neighbour cancelled mid-flight with the server still serving the same bits after
    it, every target in flight beside others; the kit's modes: the plugin's replacements ran.
    Default: differs somewhere, required on a GPU, informational on the CPU
    (:func:`~batch_invariance_kit.vllm.records.informational` says which checks are)."""
    name = f"{label} {RC.check_mode(mode)}"
    info = RC.informational(mode, platform)
    if res.get("error"):
        return [{"name": f"{name}: the server ran the experiment", "passed": False, "informational": info,
                 **RC.failure(res["error"])}]
    copies = res["copies"]
    answered = all(a.get("error") is None for a in res["alone"]) and all(c["compared"] is not None for c in copies)
    loaded = [c for c in copies if c["round"] != "after"]
    streams = [c for c in loaded if c["name"] == "stream"]
    targets = [c for c in loaded if c["name"] != "stream"]
    max_diff = max((c["compared"].max_abs_diff for c in loaded if c["compared"]), default=0.0)
    if mode == "default":   # the negative control: required on a GPU, what vLLM's CPU build does is recorded
        differs = answered and not all(map(_bitwise, loaded))
        return [{"name": f"{name}: some target under load differs from its answer alone "
                         f"({'informational on the CPU' if platform == 'cpu' else 'the negative control'})",
                 "passed": answered and (differs or platform == "cpu"), "informational": platform == "cpu",
                 "differs": differs,
                 "targets_differing": sum(not _bitwise(c) for c in loaded), "copies": len(loaded),
                 "max_abs_diff": max_diff}]
    out = [{"name": f"{name}: {len(targets)} target copies under load (over {len(res['rounds'])} round(s), "
                    f"{len(res['alone'])} targets) == alone, bitwise (tokens, sampled and top-k logprobs)",
            "passed": answered and all(map(_bitwise, targets)), "informational": info, "max_abs_diff": max_diff},
           {"name": f"{name}: the streamed copy == alone, bitwise",
            "passed": bool(streams) and all(map(_bitwise, streams)), "informational": info},
           {"name": f"{name}: every target was in flight beside other requests",
            "passed": all((c["in_flight_beside"] or 0) > 0 for c in loaded), "informational": info,
            "min_in_flight_beside": min((c["in_flight_beside"] or 0 for c in loaded), default=0)}]
    cancels = [r["cancelled"] for r in res["rounds"]]
    out.append({"name": f"{name}: the cancelled neighbour stopped mid-flight; afterwards the server is healthy and "
                        f"the first target alone is bitwise its first answer",
                "passed": all(c["cancelled"] and c["tokens"] < c["max_tokens"] for c in cancels)
                and res["healthy_after"] and _bitwise(copies[-1]), "informational": info})
    if mode in RC.KIT_MODES:
        out.append(RC.kit_calls_check(name, plugin_calls, RC.KIT_CALLS_NEEDED[platform]))
    return out


def run_mode(model, mode: str, plan: Plan, log_dir, *, eager: bool, gpu: bool, attention_backend=None,
             start_timeout_s: float = START_TIMEOUT_S, timeout_s: float = 600.0) -> dict:
    """Start the server of ``mode`` on ``model``, run :func:`experiment`, stop it.  Returns the
    experiment's results with ``server`` (command, seconds to ready, exit code, log file) or
    ``error`` (the server did not come up, or the experiment raised).  ``attention_backend``:
    vLLM's backend (``None``: vLLM's choice); ``kit+attention`` asks for the kit's
    (:func:`~batch_invariance_kit.vllm.records.attention_backend`)."""
    from .plugin import read_report

    log_dir = Path(log_dir)
    name = RC.check_mode(mode)
    report = log_dir / f"plugin-{name}"
    cmd = server_command(model, free_port(), max_model_len=plan.max_model_len, top_logprobs=plan.top_logprobs,
                         eager=eager, gpu=gpu, tokenizer=R.has_tokenizer(model),
                         attention_backend=RC.attention_backend(name, attention_backend, gpu=gpu))
    srv = Server(cmd, server_env(name, gpu=gpu, report_dir=report), log_dir / f"server-{name}.log")
    t0 = time.monotonic()
    res: dict = {}
    try:
        with srv:
            srv.wait_ready(start_timeout_s)
            res = experiment(srv.base_url, plan, timeout_s=timeout_s, healthy=srv.healthy)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"}
    res["server"] = {"command": " ".join(["python", "-m"] + cmd[2:3] + ["--model", "<model>"]
                                         + cmd[cmd.index("--served-model-name"):]),
                     "ready_s": srv.ready_s, "exit_code": srv.proc.returncode if srv.proc else None,
                     "seconds": time.monotonic() - t0, "log": srv.log_path.name}
    if name in RC.KIT_MODES:
        res["plugin"] = read_report(report) if report.exists() else None
    return res


def rows_of(mode: str, model: str, res: dict) -> list:
    """The rows of one mode's experiment: an :class:`~batch_invariance_kit.vllm.records.OnlineRow`
    per compared copy."""
    return [OnlineRow(op="vllm_online", impl=RC.check_mode(mode), model=model, **c) for c in res.get("copies", [])]


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def plan_for(folder, args) -> Plan:
    """The :class:`Plan` of a model folder: chat questions through its template when it has a
    tokenizer (:mod:`.chat`); otherwise the offline check's prompts below its ``vocab_size``, chosen
    by their seeds: :data:`~batch_invariance_kit.vllm.records.TARGET`, the
    :data:`~batch_invariance_kit.vllm.records.NEEDLE`, then seeded random prompts."""
    from . import chat

    with open(os.path.join(folder, "config.json")) as f:
        vocab = int(json.load(f).get("vocab_size", RC.VOCAB))
    if R.has_tokenizer(folder):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        targets, names = [chat.encode(tok, q) for q in chat.TARGETS[:args.targets]], ()
    else:
        fixed = (RC.TARGET, RC.NEEDLE)[:args.targets]
        targets = [p.tokens(vocab) for p in fixed] + [RC.random_prompt(64 + 48 * i, seed=11 + i, vocab=vocab)
                                                      for i in range(len(fixed), args.targets)]
        names = tuple(p.name for p in fixed) + tuple(f"t{i}" for i in range(len(fixed), args.targets))
    return Plan(tuple(targets), max_tokens=args.max_tokens, clients=args.clients, per_client=args.per_client,
                rounds=args.rounds, prompt_len=(8, args.max_prompt), new_tokens=(2, args.max_new),
                window_s=args.window_s, top_logprobs=args.top_logprobs, vocab=vocab, seed=args.seed, names=names)


def parser() -> argparse.ArgumentParser:
    from .check import MODEL_NAMES

    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.vllm.online",
                                description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of vllm_online.json and logs/")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face model folder")
    src.add_argument("--models", help=f"the kit's random-weight models (comma-separated subset of "
                                      f"{','.join(MODEL_NAMES)}), built once by batch_invariance_kit.vllm.check")
    p.add_argument("--model-dir", default=None, help="where --models are saved (default: <tempdir>/kit-models)")
    p.add_argument("--modes", default="default,kit", help=f"comma-separated subset of {','.join(RC.MODES)}")
    p.add_argument("--targets", type=int, default=4, help="target prompts (default 4: the target, the needle, 2 more)")
    p.add_argument("--clients", type=int, default=16, help="other clients per round (default 16)")
    p.add_argument("--per-client", type=int, default=2,
                   help="requests each client sends per round at least; it goes on until the round's targets are "
                        "done (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="load rounds (default 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per target (default 32)")
    p.add_argument("--max-prompt", type=int, default=400, help="longest neighbour prompt (tokens; default 400)")
    p.add_argument("--max-new", type=int, default=64, help="longest neighbour output (tokens; default 64)")
    p.add_argument("--window-s", type=float, default=4.0,
                   help="seconds over which a round's clients and targets start (default 4)")
    p.add_argument("--top-logprobs", type=int, default=5, help="k of logprobs=k (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (default: compiled, as vLLM ships)")
    p.add_argument("--attention-backend", default=None,
                   help="vLLM's --attention-backend of every mode but kit+attention, for the non-MLA models "
                        "(default: vLLM's choice); the kit's attention is the mode kit+attention")
    p.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S)
    return p


def main(argv=None) -> int:
    from ..report import results
    from . import chat
    from .check import MLA_MODELS, MODEL_NAMES, csv_arg, not_applicable

    a = parser().parse_args(argv)
    try:
        modes = csv_arg("modes", a.modes, RC.MODES)
        for n in ("targets", "clients", "per_client", "rounds", "max_tokens", "max_prompt", "max_new", "top_logprobs"):
            positive_int(f"--{n.replace('_', '-')}", getattr(a, n))
        if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
            raise ValueError(f"--model must be a local Hugging Face folder with a config.json, got {a.model!r}")
        if a.model is not None and R.has_tokenizer(a.model) and a.targets > len(chat.TARGETS):
            raise ValueError(f"--targets must be at most {len(chat.TARGETS)} with a tokenizer, got {a.targets}")
        if a.attention_backend == RC.KIT_ATTENTION_BACKEND:
            raise ValueError(f"--attention-backend {RC.KIT_ATTENTION_BACKEND} (the kit's attention) is the mode "
                             f"kit+attention: use --modes kit+attention")
        models = csv_arg("models", a.models, MODEL_NAMES) if a.models else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    gpu = torch.cuda.is_available()
    platform = "cuda" if gpu else "cpu"
    out = Path(a.out)
    if models:
        import tempfile

        model_dir = a.model_dir or os.path.join(tempfile.gettempdir(), "kit-models")
        b = R.run_process([sys.executable, "-m", "batch_invariance_kit.vllm.check", "--build", "--models",
                           ",".join(models), "--model-dir", model_dir], os.environ.copy(), 3600, out / "logs" / "build.log")
        if b["rc"] != 0:
            print(f"the model build failed:\n{b['log_tail']}", file=sys.stderr)
            return 3
        folders = {m: os.path.join(model_dir, m) for m in models}
    else:
        folders = {Path(a.model).name: a.model}
    rows, all_checks, servers, plans, skipped = [], [], {}, {}, []
    for label, folder in folders.items():
        plan = plan_for(folder, a)
        plans[label] = {k: v for k, v in asdict(plan).items() if k != "targets"} | {
            "target_lens": [len(t) for t in plan.targets], "max_model_len": plan.max_model_len}
        for mode in modes:
            why = not_applicable(label, mode) if models else None
            if why:
                skipped.append(why)
                continue
            res = run_mode(folder, mode, plan, out / "logs" / label, eager=a.eager, gpu=gpu,
                           attention_backend=None if label in MLA_MODELS and models else a.attention_backend,
                           start_timeout_s=a.start_timeout_s)
            cs = checks(label, mode, res, platform=platform, plugin_calls=(res.get("plugin") or {}).get("calls"))
            rows += rows_of(mode, label, res)
            all_checks += cs
            servers[f"{label} {mode}"] = {"server": res["server"], "error": res.get("error"),
                                          "healthy_after": res.get("healthy_after"),
                                          "rounds": res.get("rounds", []), "alone": res.get("alone"),
                                          "plugin": res.get("plugin")}
            for c in cs:
                tag = "INFO" if c.get("informational") else ("PASS" if c["passed"] else "FAIL")
                print(f"  {tag}  {c['name']}", flush=True)
            results.save("vllm_online", [RC.to_dict(r) for r in rows], all_checks, folder=out,
                         extra={"plan": {"platform": platform, "modes": modes, "eager": a.eager,
                                         "attention_backend": a.attention_backend, "models": plans,
                                         "not_applicable": skipped},
                                "servers": servers})
    print(f"wrote {out / 'vllm_online.json'}")
    hard = [c for c in all_checks if not c.get("informational")]
    return 0 if all(c["passed"] for c in hard) else 1


if __name__ == "__main__":
    sys.exit(main())
