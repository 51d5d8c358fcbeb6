"""The public ops: :func:`attention` over a varlen batch (prefill, decode, mixed steps) and
:func:`decode`, one new token per sequence."""
from __future__ import annotations

import math

import torch

from ... import checks
from .launcher import launch
from .plan import AttnPlan, make_plan
from .reference import reference_attention, sdpa_attention
from .schedule import resolve_config
from .validate import check_blocks, check_metadata, check_new_kv, check_tensors, host_ints

__all__ = ["attention", "prefill", "decode"]


def attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, scale=None, impl="invariant",
              config=None, out=None, plan: AttnPlan | None = None, key=None, value=None,
              validate: bool = True) -> torch.Tensor:
    """Causal GQA attention of a varlen batch over the paged cache; returns ``out``
    ``(num_tokens, q_heads, head_dim)`` in q's dtype.  See :mod:`batch_invariance_kit.ops.attention`
    for the arguments and the reduction schedule.  ``plan``: the step's :func:`~.plan.make_plan`
    (built once from host metadata, shared by the layers): then nothing is read back from the
    device.

    ``key``, ``value``: optionally the step's new keys and values ``(num_tokens, kv_heads,
    head_dim)`` in the cache's dtype, *exactly as written to the cache* (:func:`~.cache.write_kv`).
    The multi-token tiles then read the KV tiles that lie wholly inside their sequence's new
    chunk from them, token-major and contiguous, instead of gathering them through the block
    table.  The values are the same, so are the bits (the tests check it); a caller that passes
    other values than it wrote gets other results, as with any wrong cache.

    ``validate=False`` (with a ``plan`` and ``out``) skips the checks of the tensors' dtypes,
    shapes, devices and strides and of ``scale``, keeping the check that the plan was built for
    this call: for an engine layer that passed them once for its cache and calls again with
    tensors of the same layout (the vLLM backend), since the checks cost more host time than the
    launches."""
    if validate:
        check_tensors(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, impl, out)
        check_new_kv(key, value, k_cache, q)
    elif plan is None or out is None:
        raise ValueError("validate=False needs a plan and out (the unchecked call launches a prepared plan)")
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif validate:
        scale = checks.positive_float("scale", scale)
    if out is None:
        out = torch.empty_like(q)
    new = {} if key is None else {"key": key, "value": value, "query_start_loc": query_start_loc}
    if plan is not None:
        if not isinstance(plan, AttnPlan):
            raise TypeError(f"plan must be None or an AttnPlan, got {type(plan).__name__}")
        if (plan.impl, plan.num_tokens, plan.q_heads, plan.kv_heads, plan.head_dim) != (impl, T, hq, hkv, d):
            raise ValueError(f"plan was built for impl={plan.impl!r}, {plan.num_tokens} tokens, {plan.q_heads}/"
                             f"{plan.kv_heads} heads of dim {plan.head_dim}; the call has impl={impl!r}, {T} "
                             f"tokens, {hq}/{hkv} heads of dim {d}")
        if config is not None and resolve_config(config) != plan.config:
            raise ValueError("config differs from the plan's config")
        return launch(plan, q, k_cache, v_cache, block_table, scale, out, **new)
    cfg = resolve_config(config)
    lens, qsl = host_ints("seq_lens", seq_lens), host_ints("query_start_loc", query_start_loc)
    check_metadata(lens, qsl, T)
    check_blocks(block_table, lens, nb, bs)
    if impl in ("reference", "sdpa"):
        ref = reference_attention if impl == "reference" else sdpa_attention
        return ref(q, k_cache, v_cache, block_table, lens.tolist(), qsl.tolist(), scale, out)
    return launch(make_plan(lens, qsl, q_heads=hq, kv_heads=hkv, head_dim=d, impl=impl, config=cfg, device=q.device),
                  q, k_cache, v_cache, block_table, scale, out, **new)


prefill = attention


def decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, impl="invariant", config=None,
           out=None) -> torch.Tensor:
    """One new token per sequence: ``q`` ``(num_seqs, q_heads, head_dim)``, the token of
    sequence ``s`` at position ``seq_lens[s] - 1`` (its key already written to the cache)."""
    checks.tensor("q", q, dim=3, contiguous=False)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale=scale, impl=impl, config=config,
                     out=out)
