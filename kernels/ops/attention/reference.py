"""The references of attention, on keys gathered from the paged cache: float64 math
(:func:`reference_attention`, ``impl="reference"``) and torch's SDPA (:func:`sdpa_attention`,
``impl="sdpa"``, the peer: one call per sequence, in q's dtype)."""
from __future__ import annotations

import torch

__all__ = ["gather_kv", "reference_attention", "sdpa_attention"]


def gather_kv(k_cache, v_cache, block_table, seq: int, length: int) -> tuple:
    """Keys and values ``(length, kv_heads, head_dim)`` of sequence ``seq``, contiguous."""
    bs = k_cache.shape[1]
    pos = torch.arange(length, device=k_cache.device)
    blk = block_table[seq, pos // bs].long()
    return k_cache[blk, pos % bs], v_cache[blk, pos % bs]


def reference_attention(q, k_cache, v_cache, block_table, lens, qsl, scale, out):
    """The step's causal GQA attention in float64 (``softmax(q k^T * scale + causal mask) v``),
    rounded once to q's dtype into ``out``; ``lens``, ``qsl``: host lists."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        k, v = gather_kv(k_cache, v_cache, block_table, s, lens[s])
        k = k.double().repeat_interleave(hq // hkv, dim=1)  # (L, Hq, D)
        v = v.double().repeat_interleave(hq // hkv, dim=1)
        qs = q[a:b].double()
        pos = torch.arange(lens[s] - (b - a), lens[s], device=q.device)
        sc = torch.einsum("thd,lhd->htl", qs, k) * scale
        mask = torch.arange(lens[s], device=q.device)[None, :] > pos[:, None]
        sc = sc.masked_fill(mask[None], float("-inf"))
        out[a:b] = torch.einsum("htl,lhd->thd", torch.softmax(sc, dim=-1), v).to(q.dtype)
    return out


def sdpa_attention(q, k_cache, v_cache, block_table, lens, qsl, scale, out):
    """The step's attention by ``torch.nn.functional.scaled_dot_product_attention``, one call per
    sequence on its gathered keys and values, in q's dtype, into ``out``."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    F = torch.nn.functional
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        k, v = gather_kv(k_cache, v_cache, block_table, s, lens[s])
        pos = torch.arange(lens[s] - (b - a), lens[s], device=q.device)
        mask = torch.arange(lens[s], device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k.transpose(0, 1).repeat_interleave(hq // hkv, 0),
                                           v.transpose(0, 1).repeat_interleave(hq // hkv, 0), attn_mask=mask,
                                           scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out
