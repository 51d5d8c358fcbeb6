"""Sampler vs trainer: what batch invariance buys reinforcement learning.

In on-policy RL a *sampler* (the inference engine: decode steps, continuous batching, whatever
else is in the batch) generates completions and records the log-probability of every sampled
token; a *trainer* re-scores the same tokens with one forward pass over each whole sequence
(prompt + completion, prefilled at once, in batches of its own choosing) and computes the
policy gradient from its own log-probabilities.  The two are the same policy only if the two
forward passes give the same bits.  With batch-variant kernels they do not: the importance
ratio ``pi_trainer / pi_sampler`` drifts from 1 and the "on-policy" update is silently
off-policy.  With invariant kernels a token's log-probabilities depend on the token and its
context only, and prefill == decode, so the trainer reproduces the sampler bit for bit.

* :func:`trainer_logprobs`: the trainer's re-scoring: whole sequences packed into prefill steps
  of at most ``max_num_tokens`` tokens, a fresh KV cache per step (nothing reused from the
  sampler), the fp32 log-probability row of every completion token;
* :func:`row_kl`: the exact per-token ``KL(pi_sampler || pi_trainer)`` over the vocabulary, in
  float64 (bitwise-equal rows give exactly ``0.0``);
* :func:`sampler_vs_trainer`: sampled completions served by :class:`~.engine.Engine` under a
  random load (chunked prefill, prefix cache, mixed steps), re-scored by the trainer;
* :func:`policy_gradient`: a few steps of an importance-weighted policy-gradient update
  (GRPO-style group baseline, no clipping) of the ``lm_head`` of a small model, sampled by the
  engine and scored by the trainer at every step; it records every token's importance ratio.
"""
from __future__ import annotations

import math

import torch

from ..ops import attention as A
from .engine import Engine, Request, _randint, step_batch, with_random_load
from .model import Qwen3Model

__all__ = ["trainer_logprobs", "row_kl", "load_requests", "sampler_vs_trainer", "even_token_reward",
           "policy_gradient"]


def _pack(lengths: list, max_num_tokens: int) -> list:
    """Consecutive groups of indices whose lengths add up to at most ``max_num_tokens`` (a longer
    sequence gets a step of its own)."""
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > max_num_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def trainer_logprobs(model: Qwen3Model, sequences: list, *, impl="invariant", max_num_tokens: int = 256,
                     block_size: int = 16, return_hidden: bool = False) -> list:
    """Re-score ``sequences`` (a list of ``(prompt, completion)`` token-id lists) as a trainer does.

    Each sequence is one prefill of ``prompt + completion[:-1]`` (the last completion token is
    scored, never fed); sequences are packed, in the given order, into steps of at most
    ``max_num_tokens`` tokens, and each step runs on a fresh paged KV cache.  Returns per
    sequence the ``(len(completion), vocab)`` fp32 log-probability rows (row ``t``: the
    distribution the completion's token ``t`` was drawn from), or ``(rows, hidden)`` pairs with
    ``return_hidden`` (the final-norm hidden states of those rows: ``lm_head``'s input)."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise ValueError("sequences must be a non-empty list of (prompt, completion) pairs")
    if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
    feeds = []
    for i, pair in enumerate(sequences):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"sequences[{i}] must be a (prompt, completion) pair")
        prompt, completion = list(pair[0]), list(pair[1])
        if not prompt or not completion:
            raise ValueError(f"sequences[{i}]: prompt and completion must both be non-empty")
        feeds.append((prompt + completion[:-1], len(prompt) - 1, len(completion)))
    if max(len(f) for f, _, _ in feeds) > model.cfg.max_position_embeddings:
        raise ValueError(f"a sequence is longer than the model's {model.cfg.max_position_embeddings} positions")
    dev, bs = model.device, block_size
    out: list = [None] * len(feeds)
    for group in _pack([len(f) for f, _, _ in feeds], max_num_tokens):
        lens = [len(feeds[i][0]) for i in group]
        nblocks = sum(math.ceil(n / bs) for n in lens)
        kv = model.new_kv_cache(nblocks, bs)
        table = A.allocate_blocks(lens, bs, nblocks, device="cpu")  # each sequence its own blocks, in order
        toks, pos, slot, qsl, want = [], [], [], [0], []
        for j, i in enumerate(group):
            feed, lo, n = feeds[i]
            toks += feed
            pos += list(range(len(feed)))
            slot += A.slots(table, j, 0, len(feed), bs).tolist()
            want += [qsl[-1] + p for p in range(lo, lo + n)]
            qsl.append(qsl[-1] + len(feed))
        batch = step_batch(toks, pos, slot, table, lens, qsl, want, dev)
        lp, h = model.forward(batch, kv, impl=impl, return_hidden=True)
        lp, h = lp.cpu(), h.cpu()
        at = 0
        for i in group:
            n = feeds[i][2]
            out[i] = (lp[at:at + n].clone(), h[at:at + n].clone()) if return_hidden else lp[at:at + n].clone()
            at += n
    return out


def row_kl(sampler_rows: torch.Tensor, trainer_rows: torch.Tensor) -> torch.Tensor:
    """Per row, ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` in float64 from two ``(n, vocab)``
    log-probability tensors (``p``: the sampler's, ``q``: the trainer's), each row renormalised
    in float64 first (an fp32 row sums to 1 only up to its rounding, which would leave a KL
    of either sign of the size of that rounding).  Rows that are bitwise equal give exactly
    ``0.0`` (the same float64 operations on the same bits, then every term is ``p_v * 0``)."""
    if sampler_rows.shape != trainer_rows.shape or sampler_rows.dim() != 2:
        raise ValueError(f"sampler_rows {tuple(sampler_rows.shape)} and trainer_rows "
                         f"{tuple(trainer_rows.shape)} must be (n, vocab) tensors of one shape")
    ls = torch.log_softmax(sampler_rows.double(), dim=1)
    lt = torch.log_softmax(trainer_rows.double(), dim=1)
    p = ls.exp()
    return torch.where(p > 0, p * (ls - lt), torch.zeros_like(p)).sum(1)


def load_requests(prompts: list, *, max_new_tokens: int, fillers: int, vocab: int, seed: int = 0,
                  temperature: float = 1.0, max_arrival: int = 4, filler_len: tuple = (8, 48)) -> list:
    """Sampled requests for ``prompts`` (request ``i``: ``temperature``, seed ``seed*1000 + i``,
    id ``"rollout{i}"``) among ``fillers`` random greedy requests (prompts of ``filler_len``
    tokens, 1 to ``max_new_tokens`` new tokens); every request arrives at a random step
    ``0..max_arrival``, all drawn by one ``torch.Generator`` seeded by ``seed``."""
    g = torch.Generator().manual_seed(int(seed))
    reqs = [Request(list(p), max_new_tokens, temperature=temperature, seed=seed * 1000 + i,
                    arrival=_randint(g, 0, max_arrival), req_id=f"rollout{i}") for i, p in enumerate(prompts)]
    return with_random_load(reqs, g, fillers=fillers, vocab=vocab, filler_len=filler_len,
                            filler_max_new=max_new_tokens, max_arrival=max_arrival)


def _rollouts(completions: list) -> list:
    mine = [c for c in completions if str(c.req_id).startswith("rollout")]
    return sorted(mine, key=lambda c: int(str(c.req_id)[len("rollout"):]))


def sampler_vs_trainer(model: Qwen3Model, prompts: list, *, impl="invariant", max_new_tokens: int = 8,
                       fillers: int = 4, seed: int = 0, temperature: float = 1.0, trainer_tokens: int = 256,
                       max_arrival: int = 4, filler_len: tuple = (8, 48), **engine_kwargs) -> dict:
    """Sample a completion of every prompt with :class:`~.engine.Engine` under a random load
    (:func:`load_requests`; ``engine_kwargs``: chunked prefill, prefix cache, budgets), then
    re-score all of them with :func:`trainer_logprobs` in the reverse order (other batches than
    the sampler's).  Returns per-token arrays over all completions: ``logprob_diff`` (sampler
    minus trainer log-probability of the sampled token, float64), ``kl`` (:func:`row_kl`),
    ``rows_equal`` (bool: the whole fp32 row bitwise equal), plus ``mean_seqs_per_step`` (the
    load: sequences per step seen by the rollouts' steps) and the completions."""
    reqs = load_requests(prompts, max_new_tokens=max_new_tokens, fillers=fillers, vocab=model.cfg.vocab_size,
                         seed=seed, temperature=temperature, max_arrival=max_arrival, filler_len=filler_len)
    eng = Engine(model, impl=impl, **engine_kwargs)
    mine = _rollouts(eng.run(reqs))
    trainer = trainer_logprobs(model, [(c.prompt, c.tokens) for c in reversed(mine)], impl=impl,
                               max_num_tokens=trainer_tokens)[::-1]
    diff, kl, equal = [], [], []
    for c, rows in zip(mine, trainer):
        idx = torch.tensor(c.tokens, dtype=torch.long)[:, None]
        diff.append(c.logprobs.double() - rows.gather(1, idx)[:, 0].double())
        kl.append(row_kl(c.logprob_rows, rows))
        equal += [torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(c.logprob_rows, rows)]
    seqs = [s for c in mine for _, _, s in c.steps]
    return {"impl": impl, "fillers": fillers, "seed": seed, "completions": mine,
            "logprob_diff": torch.cat(diff), "kl": torch.cat(kl), "rows_equal": torch.tensor(equal),
            "mean_seqs_per_step": sum(seqs) / len(seqs), "engine_steps": len(eng.step_log)}


def even_token_reward(tokens: list) -> float:
    """The fraction of even token ids in a completion: a verifiable reward the ``lm_head`` can learn."""
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens)


def policy_gradient(model: Qwen3Model, prompts: list, *, impl="invariant", steps: int = 3, group: int = 3,
                    max_new_tokens: int = 6, lr: float = 1.0, fillers: int = 2, seed: int = 0,
                    reward=even_token_reward, trainer_tokens: int = 256, **engine_kwargs) -> list:
    """``steps`` on-policy updates of ``model.lm_head`` (in place: pass a model of your own).

    Per step: every prompt is sampled ``group`` times (temperature 1, seeds from ``seed`` and the
    step) by the engine under ``fillers`` random requests; the trainer re-scores every completion
    (:func:`trainer_logprobs`, its own batches); the advantage of a completion is its reward minus
    its group's mean; the objective is the importance-weighted surrogate
    ``mean_t ratio_t * A`` with ``ratio_t = exp(logp_trainer - logp_sampler)`` of each token, whose
    gradient with respect to ``lm_head`` is ``A * ratio_t * (onehot(y_t) - p_t) h_t^T`` (``p_t``
    the trainer's probabilities, ``h_t`` its final hidden state), computed in float64 and applied
    by gradient ascent with step ``lr``.  On-policy data means ``ratio_t == 1``: the record of each
    step holds every token's ratio (float64), the mean reward and the gradient's norm."""
    if not isinstance(steps, int) or steps < 1 or not isinstance(group, int) or group < 1:
        raise ValueError(f"steps and group must be positive ints, got steps={steps!r}, group={group!r}")
    history = []
    for step in range(steps):
        batch_prompts = [p for p in prompts for _ in range(group)]
        reqs = load_requests(batch_prompts, max_new_tokens=max_new_tokens, fillers=fillers,
                             vocab=model.cfg.vocab_size, seed=seed * 100 + step + 1)
        mine = _rollouts(Engine(model, impl=impl, **engine_kwargs).run(reqs))
        scored = trainer_logprobs(model, [(c.prompt, c.tokens) for c in reversed(mine)], impl=impl,
                                  max_num_tokens=trainer_tokens, return_hidden=True)[::-1]
        rewards = torch.tensor([reward(c.tokens) for c in mine], dtype=torch.float64)
        adv = (rewards.view(-1, group) - rewards.view(-1, group).mean(1, keepdim=True)).flatten()
        W = model.lm_head
        grad = torch.zeros(W.shape, dtype=torch.float64)
        ratios, ntok = [], 0
        for c, (rows, h), a in zip(mine, scored, adv.tolist()):
            idx = torch.tensor(c.tokens, dtype=torch.long)
            lt = rows.double().gather(1, idx[:, None])[:, 0]
            ratio = torch.exp(lt - c.logprobs.double())
            ratios.append(ratio)
            coef = -rows.double().exp()
            coef[torch.arange(len(idx)), idx] += 1.0
            grad += (a * ratio[:, None] * coef).T @ h.double()
            ntok += len(idx)
        grad /= ntok
        model.lm_head = (W.double().cpu() + lr * grad).to(W.dtype).to(W.device).contiguous()
        model.weights["lm_head.weight"] = model.lm_head.cpu()
        history.append({"step": step, "ratios": torch.cat(ratios), "mean_reward": float(rewards.mean()),
                        "grad_norm": float(grad.norm())})
    return history
