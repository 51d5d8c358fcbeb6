"""Speculative decoding that changes nothing: drafters for :class:`~.engine.Engine` and the
check that speculative output is bitwise plain decoding's.

A drafter is any callable ``drafter(tokens, k) -> list`` of at most ``k`` proposed token ids
following ``tokens`` (the request's prompt and everything emitted so far).  The engine feeds
them after the request's last token in one multi-token verify step (see
:mod:`batch_invariance_kit.serving.engine`).  Which tokens a drafter proposes decides only how
many are accepted per step, never which tokens come out, *if* the model gives a position the
same log-probability row in a verify step of ``1 + k`` tokens as in a one-token decode step.

* :class:`NgramDrafter`: prompt-lookup decoding: the most recent earlier occurrence of the
  last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) proposes the tokens that followed it;
* :class:`ReferenceDrafter`: proposes a known continuation with a seeded fraction of its
  tokens replaced by wrong ones, to force every acceptance pattern from "all accepted"
  (``corrupt=0``) to "none accepted" (``corrupt=1``);
* :func:`compare_with_plain`: the same greedy requests served plainly and with speculation at
  several ``k``: per ``k``, how many requests are bitwise plain decoding's (tokens and fp32
  rows), the acceptance rate, the engine steps and the wall time.
"""
from __future__ import annotations

import hashlib
import time

from .engine import Engine, completion_key

__all__ = ["NgramDrafter", "ReferenceDrafter", "compare_with_plain"]


class NgramDrafter:
    """Propose the ``k`` tokens that followed the most recent earlier occurrence of the last
    ``n`` tokens, trying ``n = max_n`` down to ``min_n``; no match: no proposal."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        for name, v in (("max_n", max_n), ("min_n", min_n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if min_n > max_n:
            raise ValueError(f"min_n ({min_n}) must be <= max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n

    def __call__(self, tokens: list, k: int) -> list:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = tokens[L - n:]
            for start in range(L - n - 1, -1, -1):       # most recent occurrence first
                if tokens[start:start + n] == tail:
                    return list(tokens[start + n:start + n + k])
        return []


class ReferenceDrafter:
    """Propose the continuation of ``tokens`` found in ``sequences`` (full token lists, e.g.
    prompt + plain-decoding output), each proposed token replaced by a wrong one (its
    successor modulo ``vocab``) with probability ``corrupt``, decided by a hash of
    ``(seed, position)`` (the same pattern on every machine and in every run)."""

    def __init__(self, sequences: list, vocab: int, corrupt: float = 0.0, seed: int = 0):
        if not 0.0 <= float(corrupt) <= 1.0:
            raise ValueError(f"corrupt must be in [0, 1], got {corrupt!r}")
        if not isinstance(vocab, int) or vocab < 2:
            raise ValueError(f"vocab must be an int >= 2, got {vocab!r}")
        self.sequences = [list(s) for s in sequences]
        self.vocab, self.corrupt, self.seed = vocab, float(corrupt), int(seed)

    def _wrong(self, pos: int) -> bool:
        h = hashlib.sha256(f"{self.seed}:{pos}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2.0 ** 64 < self.corrupt

    def __call__(self, tokens: list, k: int) -> list:
        L = len(tokens)
        for seq in self.sequences:
            if len(seq) > L and seq[:L] == list(tokens):
                return [(t + 1) % self.vocab if self._wrong(L + j) else t for j, t in enumerate(seq[L:L + k])]
        return []


def compare_with_plain(model, requests: list, *, ks=(1, 2, 4), drafter=None, impl="invariant",
                       **engine_kwargs) -> dict:
    """Serve ``requests`` plainly, then with speculation (``drafter``, default
    :class:`NgramDrafter`) at each ``k`` in ``ks``, on fresh engines.  Returns ``{"plain":
    {...}, k: {...}}`` with, per run: ``completions``, ``steps`` (engine steps), ``seconds``
    (wall time), ``generated`` (tokens); for speculative runs also ``equal_requests`` (requests
    whose tokens and fp32 rows are bitwise the plain run's), ``equal_rows`` / ``rows`` (token
    rows bitwise equal, position by position, while the tokens agree), ``drafted``,
    ``accepted`` and ``acceptance`` (accepted / drafted)."""
    drafter = NgramDrafter() if drafter is None else drafter

    def serve(**kw):
        eng = Engine(model, impl=impl, **engine_kwargs, **kw)
        t = time.perf_counter()
        out = eng.run(requests)
        return {"completions": out, "steps": len(eng.step_log), "seconds": time.perf_counter() - t,
                "generated": sum(len(c.tokens) for c in out)}

    res = {"plain": serve()}
    plain = res["plain"]["completions"]
    for k in ks:
        r = serve(drafter=drafter, num_draft=int(k))
        out = r["completions"]
        r["equal_requests"] = sum(completion_key(a) == completion_key(b) for a, b in zip(out, plain))
        rows = eq = 0
        for a, b in zip(out, plain):
            for j, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
                rows += 1
                eq += int(ta == tb and a.logprob_rows[j].numpy().tobytes() == b.logprob_rows[j].numpy().tobytes())
                if ta != tb:
                    break
        r["equal_rows"], r["rows"] = eq, rows
        r["drafted"] = sum(c.drafted for c in out)
        r["accepted"] = sum(c.accepted for c in out)
        r["acceptance"] = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        res[k] = r
    return res
