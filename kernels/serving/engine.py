"""A tiny serving loop for :class:`batch_invariance_kit.serving.model.Qwen3Model` (and
:class:`batch_invariance_kit.serving.deepseek.DeepSeekModel`, which has its interface):
continuous batching, chunked prefill, a prefix cache, greedy and seeded sampling.

One :meth:`Engine.run` takes a list of :class:`Request` (token-id prompts; each arrives at a
given step) and runs steps until all are done.  Each step is one forward pass over a varlen
batch that mixes decode tokens (one per running request) and prefill chunks, within a token
budget (``max_num_tokens``) and a sequence cap (``max_num_seqs``), like vLLM's scheduler:

* decodes first (in admission order), then the chunks of requests still prefilling, then newly
  admitted requests (in arrival order);
* chunked prefill (``chunk_size``, a multiple of the attention kernel's ``block_n``): a prompt
  is cut into chunks that all start at multiples of ``block_n`` (the kit attention's alignment
  rule, see :mod:`batch_invariance_kit.ops.attention`); a chunk is shortened to what the budget leaves, rounded
  down to a multiple of ``block_n`` (or the whole rest when it fits).  ``chunk_size=None``: a
  prompt's rest is scheduled in one piece once the budget has room for it;
* prefix cache (``prefix_cache=True``): every full KV block (``block_size`` tokens) is keyed by
  a SHA-256 chain over the token ids up to its end; a new request reuses the cached blocks of
  its longest cached prefix, rounded down to a multiple of ``lcm(block_size, block_n)`` tokens
  (a hit must end on a KV-tile boundary) and to less than the prompt (the last prompt token is
  always computed: its log-probabilities give the first output token).  Freed cached blocks
  stay reusable until evicted (LRU) for a new allocation;
* sampling: ``temperature == 0``: greedy (``argmax``, ties to the lowest token id); else
  Gumbel-max with the request's own ``torch.Generator`` seeded by ``seed`` (on the CPU):
  ``argmax(logprobs / temperature - log(-log(u)))``, so a request's draws depend only on its
  own seed and its own log-probabilities;
* speculative decoding (``drafter`` and ``num_draft = k > 0``): a decoding request's step
  feeds its last token followed by up to ``k`` tokens proposed by ``drafter(tokens, k)`` (any
  callable; :mod:`batch_invariance_kit.serving.speculative` has an n-gram drafter) and reads the
  log-probability row of every fed position: one multi-token *verify* step starting at the
  request's current position.  The rows are sampled in order exactly as plain decoding samples
  them (the same rule, the same generator draws); a draft token is accepted while it equals the
  token sampled at its position, and the first sampled token that differs (or the one after the
  last accepted draft) is emitted too, so a verify step emits 1 to ``k + 1`` tokens.  Keys and
  values written for rejected drafts lie past the request's computed positions and are
  overwritten when those positions are computed.  Whether the emitted tokens and rows equal
  plain decoding's is exactly the question of prefill == decode: the row of a position must
  not depend on how many tokens its step holds.

:class:`Completion` gives per request its tokens, the fp32 log-probability of each sampled token
and the whole fp32 log-probability row of each step (``logprob_rows``: what bitwise comparisons
should compare), plus what the scheduler did to it.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from ..ops import attention as A
from .model import Qwen3Model, StepBatch

__all__ = ["Request", "Completion", "Engine", "step_batch", "generate", "completion_key", "load_experiment",
           "seeded_prompt"]


def seeded_prompt(n: int, seed: int, vocab: int) -> list:
    """``n`` token ids in ``0..vocab-1`` drawn from ``seed`` (the same ids on every machine)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Request:
    """``prompt``: token ids; ``arrival``: the step at which the request reaches the server."""

    prompt: list
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    arrival: int = 0
    req_id: object = None


@dataclass
class Completion:
    req_id: object
    prompt: list
    tokens: list
    logprobs: torch.Tensor          # (n,) fp32: log-probability of each sampled token
    logprob_rows: torch.Tensor      # (n, vocab) fp32: the whole row each token was sampled from
    prefix_hit_tokens: int = 0      # prompt tokens taken from the prefix cache
    steps: list = field(default_factory=list)  # (step, tokens in the step, sequences in the step)
    drafted: int = 0                # speculative decoding: draft tokens proposed for this request
    accepted: int = 0               # draft tokens accepted


class _Seq:
    def __init__(self, req: Request, index: int):
        self.req, self.index = req, index
        self.tokens = list(req.prompt)
        self.n_prompt = len(req.prompt)
        self.computed = 0
        self.blocks: list = []
        self.keys: list = []          # prefix-cache key of each full block, in order
        self.rows: list = []
        self.out: list = []
        self.hit = 0
        self.admitted = False
        self.steps: list = []
        self.draft: list = []
        self.drafted = self.accepted = 0
        self.gen = None
        if req.temperature and req.temperature > 0:
            if req.seed is None:
                raise ValueError("a sampled request (temperature > 0) needs a seed")
            self.gen = torch.Generator(device="cpu").manual_seed(int(req.seed))

    @property
    def prefilling(self) -> bool:
        return self.computed < self.n_prompt

    @property
    def done(self) -> bool:
        return len(self.out) >= self.req.max_new_tokens


class _Blocks:
    """Physical KV blocks: a free list, reference counts, and the prefix cache (key -> block)
    with an LRU of cached blocks no request holds."""

    def __init__(self, num_blocks: int, prefix_cache: bool):
        self.free = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.prefix_cache = prefix_cache
        self.by_key: dict = {}
        self.key_of: dict = {}
        self.lru: OrderedDict = OrderedDict()

    def alloc(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            del self.by_key[self.key_of.pop(b)]
        else:
            raise RuntimeError("out of KV blocks: raise num_blocks or lower max_num_seqs")
        self.ref[b] = 1
        return b

    def take(self, b: int) -> None:
        self.ref[b] += 1
        self.lru.pop(b, None)

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.key_of:
                self.lru[b] = True
            else:
                self.free.append(b)

    def register(self, key: str, b: int) -> None:
        if self.prefix_cache and key not in self.by_key and b not in self.key_of:
            self.by_key[key] = b
            self.key_of[b] = key


def _chain(parent: str, toks) -> str:
    h = hashlib.sha256(parent.encode())
    h.update(torch.tensor(list(toks), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def step_batch(tokens, positions, slots, block_table, seq_lens, query_start_loc, logits_indices, device) -> StepBatch:
    """A :class:`~.model.StepBatch` on ``device`` from host lists (``block_table``: an int32 tensor)."""
    def t(x, dt):
        return torch.tensor(x, dtype=dt, device=device)
    return StepBatch(tokens=t(tokens, torch.long), positions=t(positions, torch.long), slot_mapping=t(slots, torch.long),
                     block_table=block_table.to(device), seq_lens=t(seq_lens, torch.int32),
                     query_start_loc=t(query_start_loc, torch.int32), logits_indices=t(logits_indices, torch.long))


class Engine:
    """The serving loop.  ``impl`` goes to every kernel of the model; ``drafter`` and
    ``num_draft``: speculative decoding (``num_draft = 0``: plain decoding)."""

    def __init__(self, model: Qwen3Model, *, impl: str = "invariant", block_size: int = 16,
                 num_blocks: int = 512, max_num_tokens: int = 128, max_num_seqs: int = 16,
                 chunk_size: int | None = None, prefix_cache: bool = False, drafter=None, num_draft: int = 0):
        self.model, self.impl = model, impl
        if not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 0:
            raise ValueError(f"num_draft must be an int >= 0, got {num_draft!r}")
        if num_draft and not callable(drafter):
            raise TypeError(f"drafter must be a callable (tokens, k) -> list of token ids when num_draft > 0, "
                            f"got {type(drafter).__name__}")
        self.drafter, self.num_draft = drafter, num_draft
        self.block_n = A.default_config().block_n
        if chunk_size is not None and (chunk_size <= 0 or chunk_size % self.block_n):
            raise ValueError(f"chunk_size must be a positive multiple of the attention block_n={self.block_n}, "
                             f"got {chunk_size}")
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_tokens and max_num_seqs must be >= 1")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.chunk_size, self.prefix_cache = chunk_size, prefix_cache
        self.unit = block_size * self.block_n // math.gcd(block_size, self.block_n)
        self.blocks = _Blocks(num_blocks, prefix_cache)
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.step_log: list = []     # (step, tokens, sequences) of every step run

    # ------------------------------------------------------------------------ scheduling
    def _propose(self, s: _Seq, budget: int) -> list:
        """Draft tokens for a decoding request: at most ``num_draft``, what the budget leaves
        after its last token, and one less than the tokens it still has to emit."""
        k = min(self.num_draft, budget - 1, s.req.max_new_tokens - len(s.out) - 1)
        if k <= 0:
            return []
        draft = [int(t) for t in list(self.drafter(list(s.tokens), k))[:k]]
        V = self.model.cfg.vocab_size
        if any(t < 0 or t >= V for t in draft):
            raise ValueError(f"drafter proposed a token outside the vocabulary 0..{V - 1}: {draft}")
        return draft

    def _chunk(self, s: _Seq, budget: int) -> int:
        """Prompt tokens ``s`` feeds in a step with ``budget`` tokens left, or 1 for a decoding
        request (its draft tokens come on top: :meth:`_schedule`); a query, no side effect."""
        rest = len(s.tokens) - s.computed
        if not s.prefilling:
            return 1 if budget >= 1 else 0
        cap = budget if self.chunk_size is None else min(budget, self.chunk_size)
        if rest <= cap:
            return rest
        if self.chunk_size is None:
            return 0
        return (cap // self.block_n) * self.block_n

    def _schedule(self, s: _Seq, budget: int) -> int:
        """Tokens ``s`` feeds this step (:meth:`_chunk`); a decoding request's draft for the step
        is proposed here and kept in ``s.draft``."""
        n = self._chunk(s, budget)
        if n and not s.prefilling:
            s.draft = self._propose(s, budget) if self.num_draft else []
            n += len(s.draft)
        return n

    def _admit(self, s: _Seq) -> None:
        bs = self.block_size
        key = ""
        for j in range(s.n_prompt // bs):
            key = _chain(key, s.tokens[j * bs:(j + 1) * bs])
            s.keys.append(key)
        if not self.prefix_cache:
            return
        n = 0
        while n < len(s.keys) and s.keys[n] in self.blocks.by_key:
            n += 1
        hit = min(n * bs // self.unit * self.unit, (s.n_prompt - 1) // self.unit * self.unit)
        for j in range(hit // bs):
            b = self.blocks.by_key[s.keys[j]]
            self.blocks.take(b)
            s.blocks.append(b)
        s.computed = s.hit = hit

    def _register_full_blocks(self, s: _Seq) -> None:
        bs = self.block_size
        full = s.computed // bs
        while len(s.keys) < full:        # keys of full blocks that include generated tokens
            j = len(s.keys)
            s.keys.append(_chain(s.keys[-1] if s.keys else "", s.tokens[j * bs:(j + 1) * bs]))
        for j in range(full):
            self.blocks.register(s.keys[j], s.blocks[j])

    def _free(self, s: _Seq) -> None:
        for b in s.blocks:
            self.blocks.release(b)
        s.blocks = []

    def _sample(self, s: _Seq, row: torch.Tensor) -> int:
        if s.gen is None:
            return int(torch.argmax(row))
        u = torch.rand(row.shape[0], generator=s.gen, dtype=torch.float64)
        g = row.double() / float(s.req.temperature) - torch.log(-torch.log(u))
        return int(torch.argmax(g))

    # ------------------------------------------------------------------------------- run
    def run(self, requests: list) -> list:
        """Serve ``requests``; returns a :class:`Completion` per request, in the input order."""
        seqs = [_Seq(r, i) for i, r in enumerate(requests)]
        for s in seqs:
            if not s.tokens:
                raise ValueError(f"request {s.index} has an empty prompt")
            if s.req.max_new_tokens < 1:
                raise ValueError(f"request {s.index}: max_new_tokens must be >= 1")
            if self.chunk_size is None and s.n_prompt > self.max_num_tokens:
                raise ValueError(f"request {s.index}: a {s.n_prompt}-token prompt cannot fit a "
                                 f"{self.max_num_tokens}-token step without chunked prefill")
            need = s.n_prompt + s.req.max_new_tokens - 1
            if need > self.model.cfg.max_position_embeddings:
                raise ValueError(f"request {s.index} needs {need} positions, the model has "
                                 f"{self.model.cfg.max_position_embeddings}")
        pending = sorted(seqs, key=lambda s: (s.req.arrival, s.index))
        waiting: deque = deque()
        running: list = []
        step = 0
        dev = self.model.device
        bs = self.block_size
        while pending or waiting or running:
            while pending and pending[0].req.arrival <= step:
                waiting.append(pending.pop(0))
            budget = self.max_num_tokens
            sched = []
            for s in running:
                n = self._schedule(s, budget)
                if n:
                    sched.append((s, n))
                    budget -= n
            while waiting and len(running) < self.max_num_seqs and budget > 0:
                s = waiting[0]
                if not s.admitted:
                    self._admit(s)
                    s.admitted = True
                n = self._schedule(s, budget)
                if n == 0:
                    break
                waiting.popleft()
                running.append(s)
                sched.append((s, n))
                budget -= n
            if not sched:
                step += 1
                continue
            toks, pos, spans, lens, qsl, want, rows_of = [], [], [], [], [0], [], []
            for s, n in sched:
                lo, hi = s.computed, s.computed + n
                A.grow_blocks(s.blocks, hi, bs, self.blocks.alloc)
                spans.append((lo, hi))
                fed = s.tokens[lo:hi] if s.prefilling else s.tokens[lo:] + s.draft
                toks += fed
                pos += list(range(lo, hi))
                lens.append(hi)
                qsl.append(qsl[-1] + n)
                if hi >= len(s.tokens):          # the last prompt token, or a decode / verify step
                    k = hi - len(s.tokens) + 1   # rows read: 1, or 1 + the draft tokens
                    rows_of.append((s, len(want), k))
                    want += range(qsl[-1] - k, qsl[-1])
            table = A.block_table([s.blocks for s, _ in sched], "cpu")
            slot = torch.cat([A.slots(table, i, lo, hi, bs) for i, (lo, hi) in enumerate(spans)])
            batch = step_batch(toks, pos, slot.tolist(), table, lens, qsl, want, dev)
            lp = self.model.forward(batch, self.kv, impl=self.impl).cpu()
            self.step_log.append((step, len(toks), len(sched)))
            decoding = {s.index for s, _ in sched if not s.prefilling}
            # positions whose keys/values this step made valid: a prefill chunk's tokens, or a
            # decode / verify step's fed last token and its accepted drafts
            valid = {s.index: 0 if s.index in decoding else n for s, n in sched}
            for s, _ in sched:
                s.steps.append((step, len(toks), len(sched)))
            for s, first, k in rows_of:
                draft, s.draft = s.draft, []
                if s.index in decoding:
                    valid[s.index] += 1
                s.drafted += len(draft)
                for j in range(k):
                    row = lp[first + j].clone()
                    t = self._sample(s, row)
                    s.rows.append(row)
                    s.out.append(t)
                    s.tokens.append(t)
                    if j == len(draft) or t != draft[j]:
                        break
                    s.accepted += 1
                    valid[s.index] += 1
            for s, _ in sched:
                s.computed += valid[s.index]
                self._register_full_blocks(s)
            for s in [s for s, _ in sched if s.done]:
                running.remove(s)
                self._free(s)
            step += 1
        out = []
        for s in seqs:
            rows = torch.stack(s.rows)
            idx = torch.tensor(s.out, dtype=torch.long)
            out.append(Completion(req_id=s.req.req_id if s.req.req_id is not None else s.index, prompt=list(s.req.prompt),
                                  tokens=list(s.out), logprobs=rows.gather(1, idx[:, None])[:, 0].clone(),
                                  logprob_rows=rows, prefix_hit_tokens=s.hit, steps=s.steps,
                                  drafted=s.drafted, accepted=s.accepted))
        return out


def generate(model: Qwen3Model, requests: list, **engine_kwargs) -> list:
    """``Engine(model, **engine_kwargs).run(requests)`` on a fresh engine (empty caches)."""
    return Engine(model, **engine_kwargs).run(requests)


def completion_key(c: Completion) -> tuple:
    """``(token ids, bytes of the fp32 log-probability rows)``: two completions are the same
    bits iff their keys are equal."""
    return tuple(c.tokens), c.logprob_rows.contiguous().view(torch.int32).numpy().tobytes()


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """One integer in ``lo..hi`` (inclusive) from ``g``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def with_random_load(requests: list, g: torch.Generator, *, fillers: int, vocab: int, filler_len: tuple,
                     filler_max_new: int, max_arrival: int) -> list:
    """``requests`` among ``fillers`` random greedy requests (``"filler{j}"``: a random prompt of
    ``filler_len`` tokens, 1..``filler_max_new`` new tokens, arriving at a random step
    ``0..max_arrival``), all drawn from ``g`` after whatever the caller drew, then shuffled by
    ``g``."""
    reqs = list(requests)
    for j in range(fillers):
        n = _randint(g, *filler_len)
        reqs.append(Request(torch.randint(0, vocab, (n,), generator=g).tolist(), _randint(g, 1, filler_max_new),
                            arrival=_randint(g, 0, max_arrival), req_id=f"filler{j}"))
    order = torch.randperm(len(reqs), generator=g).tolist()
    return [reqs[i] for i in order]


def load_experiment(model: Qwen3Model, prompt: list, *, copies: int = 4, fillers: int = 6,
                    max_new_tokens: int = 4, max_arrival: int = 6, filler_len: tuple = (4, 96),
                    seed: int = 0, **engine_kwargs) -> dict:
    """N identical requests under a random load: ``copies`` copies of ``prompt`` (greedy) and
    ``fillers`` random requests (random prompts of ``filler_len`` tokens, 1..6 new tokens),
    each arriving at a random step ``0..max_arrival`` (a ``torch.Generator`` seeded by ``seed``
    draws all of it).  Returns the number of distinct token sequences and of distinct bitwise
    log-probability sequences among the copies, with the step sizes each copy saw."""
    g = torch.Generator().manual_seed(int(seed))
    reqs = [Request(list(prompt), max_new_tokens, arrival=_randint(g, 0, max_arrival), req_id=f"copy{i}")
            for i in range(copies)]
    reqs = with_random_load(reqs, g, fillers=fillers, vocab=model.cfg.vocab_size, filler_len=filler_len,
                            filler_max_new=6, max_arrival=max_arrival)
    eng = Engine(model, **engine_kwargs)
    out = eng.run(reqs)
    mine = [c for c in out if str(c.req_id).startswith("copy")]
    keys = [completion_key(c) for c in mine]
    return {"copies": copies, "fillers": fillers, "seed": seed,
            "unique_token_sequences": len({k[0] for k in keys}),
            "unique_logprob_sequences": len({k[1] for k in keys}),
            "copy_steps": {c.req_id: [(t, s) for _, t, s in c.steps] for c in mine},
            "steps": len(eng.step_log), "completions": mine,
            "generated_tokens": sum(len(c.tokens) for c in out)}
