"""Batch-invariant ops out of a library that is not: call it only at shapes fixed per layer,
and reduce across a row in a fixed tree.

A CPU GEMM library (oneDNN, MKL, an AMX packed-weight kernel) chooses its blocking, its K order
and its threading from the shape it is given; so does PyTorch's reduction of a row.  These ops
never let the batch reach that choice:

* :func:`tiled_linear`: ``x @ weight.T + bias`` as GEMMs of exactly ``tm`` rows each (the last tile
  padded with zero rows), so the library sees one shape per layer whatever the batch.  The one
  property a fixed shape cannot give, that a row's bits do not depend on its place in the tile, is
  checked on the present CPU by :func:`tile_is_position_free` (a shape that fails it runs ``tm = 1``);
* :func:`tree_sum_last` and :func:`rms_norm_fixed_tree`: a row's sum of squares by a fixed pairwise
  tree of elementwise fp32 additions, each one IEEE operation on two known operands;
* :func:`moe_experts_tiled`: a top-k MoE's experts through :func:`tiled_linear`, a token's k outputs
  added in rank order in fp32.

They are the CPU replacements of the kit's vLLM plugin (:mod:`batch_invariance_kit.vllm.plugin`),
called through the torch custom ops of :mod:`.custom_ops` (``cpu_linear``, ``cpu_rms_norm``,
``cpu_fused_add_rms_norm``, ``cpu_moe_experts``) so a compiled vLLM model calls them as opaque
nodes.  Plain torch: no Triton.
"""
from __future__ import annotations

import torch

__all__ = ["tile_is_position_free", "tiled_linear", "tree_sum_last", "rms_norm_fixed_tree", "moe_experts_tiled"]


def _check_2d_weight(weight) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")


def _check_tm(tm) -> None:
    if not (isinstance(tm, int) and not isinstance(tm, bool) and tm >= 1):
        raise ValueError(f"tm must be a positive int, got {tm!r}")


def tile_is_position_free(weight: torch.Tensor, tm: int, seed: int = 0) -> bool:
    """Does a ``(tm, K) @ (K, N)`` GEMM give each row the same bits wherever it sits in the tile?

    One random tile and its rows rotated by 1 and by ``tm // 2 + 1``: every output row must be
    bitwise the row of the unrotated tile.  (The shape is fixed, so this is the only way the
    batch could still reach a row's bits.)"""
    _check_2d_weight(weight)
    _check_tm(tm)
    if tm == 1:
        return True
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tm, weight.shape[1], generator=g).to(weight.dtype)
    y = torch.mm(x, weight.t())
    for shift in sorted({1, tm // 2 + 1}):
        if not torch.equal(torch.mm(torch.roll(x, shift, 0), weight.t()), torch.roll(y, shift, 0)):
            return False
    return True


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 tm: int) -> torch.Tensor:
    """``x @ weight.T + bias`` with every GEMM of shape ``(tm, K) @ (K, N)``, whatever ``x``'s rows.

    ``x``: ``(..., K)``; ``weight``: ``(N, K)``; the bias is added afterwards (elementwise: no
    reduction).  Rows are cut into tiles of ``tm``, the last tile padded with zero rows; each
    output row depends only on its input row."""
    _check_2d_weight(weight)
    _check_tm(tm)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal weight's K ({weight.shape[1]})")
    if x.dtype != weight.dtype:
        raise TypeError(f"x ({x.dtype}) and weight ({weight.dtype}) must have one dtype")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, n = x2.shape[0], weight.shape[0]
    out = x2.new_empty(m, n)
    wt = weight.t()
    full = m - m % tm
    for s in range(0, full, tm):
        torch.mm(x2[s:s + tm], wt, out=out[s:s + tm])
    if full < m:
        pad = x2.new_zeros(tm, x2.shape[1])
        pad[: m - full] = x2[full:]
        out[full:] = torch.mm(pad, wt)[: m - full]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)


def tree_sum_last(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension by a fixed pairwise tree of elementwise additions.

    The row is padded with zeros to a power of two, then halved ``log2`` times (``v[..., :h] +
    v[..., h:]``): every addition is one IEEE operation on two known operands, so a row's sum is
    the same bits whatever other rows the tensor holds.  Returns ``(..., 1)``."""
    n = v.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        v = torch.nn.functional.pad(v, (0, p - n))
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v


def rms_norm_fixed_tree(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        residual: torch.Tensor | None = None):
    """vLLM's RMSNorm semantics (fp32 math, residual added in fp32 and returned in ``x``'s
    dtype) with the row's sum of squares taken by :func:`tree_sum_last`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    orig = x.dtype
    xf = x.to(torch.float32)
    if residual is not None:
        xf = xf + residual.to(torch.float32)
        new_residual = xf.to(orig)
    var = tree_sum_last(xf * xf) / x.shape[-1]
    y = xf * torch.rsqrt(var + eps)
    if weight is not None:
        y = y.to(weight.dtype) * weight
    y = y.to(orig)
    return y if residual is None else (y, new_residual)


def moe_experts_tiled(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, tm_gate_up: int, tm_down: int) -> torch.Tensor:
    """Experts of a top-k MoE, one fixed-shape path: for each expert, its tokens' rows through
    :func:`tiled_linear` with ``w13[e]`` (gate rows then up rows; tiles of ``tm_gate_up``),
    SiLU(gate) * up, then ``w2[e]`` (tiles of ``tm_down``); a token's output is the sum over its
    k choices in rank order, in fp32, weighted by ``topk_weights``.  No reduction crosses tokens."""
    T, k = topk_ids.shape
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32)
    ys = torch.zeros(T, k, w2.shape[1], dtype=torch.float32)
    for e in torch.unique(topk_ids).tolist():
        tok, rank = (topk_ids == e).nonzero(as_tuple=True)
        h = tiled_linear(x[tok], w13[e], tm=tm_gate_up)
        inter = h.shape[-1] // 2
        a = torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()
        ys[tok, rank] = tiled_linear(a.to(x.dtype), w2[e], tm=tm_down).float()
    for r in range(k):
        out = out + ys[:, r] * topk_weights[:, r:r + 1].float()
    return out.to(x.dtype)
