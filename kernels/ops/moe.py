"""Mixture of Experts: a float64 reference, a batch-*invariant* Triton MoE and its *variant* twin.

The pipeline of one MoE layer (Qwen3-MoE / Mixtral / DeepSeek style), one public function each:

1. :func:`route`  router scores (softmax, or DeepSeek's sigmoid) of the gating logits, top-k
   with a fixed tie rule (equal scores: the *lower expert index* wins), optional renormalization
   of the k chosen weights (summed in rank order 0..k-1);
2. :func:`dispatch`  the (token, expert) pairs grouped by expert, then by token (then rank),
   each expert's rows padded to a multiple of ``BLOCK_M``: sorted row ids, one expert id per
   block, padded counts.  One Triton kernel computes them with prefix sums over one-hot tiles
   of the ids, no atomics: nothing about the *order* in which threads ran can leak into the
   result (and only the *place* of a row depends on the batch; the next steps compute every
   row on its own).  Its buffers are sized from the shapes (a bound on the number of blocks;
   the GEMM programs of spare blocks exit at once), so nothing is read back to the host;
3. :func:`grouped_gemm`  each block multiplies its rows by its expert's weight: gate/up with
   SiLU-and-mul fused (``silu(x W_g^T) * (x W_u^T)``, one rounding), then down;
4. :func:`combine`  a token's output = sum over its k experts of ``weight * y`` in rank order
   ``k = 0..top_k-1`` in fp32 (then a DeepSeek layer's shared experts' output, when given),
   rounded once (:func:`combine_launch` gives its launch).

:func:`silu_mul` is the grouped GEMM's activation as a kernel of its own, for a dense SwiGLU MLP
(the shared experts of :func:`batch_invariance_kit.ops.routing.deepseek_moe`).

:func:`fused_moe` runs all four, the gating matmul (``x @ router_weight.T``, by
:func:`batch_invariance_kit.ops.matmul.linear`'s kernels) first: its arguments are checked
once, then each step launches its kernels with launch parameters cached per shape.

``impl``:

* ``"invariant"``: every reduction has one schedule whatever the batch: the router's per-token
  softmax sum has block size and warps chosen from the number of experts only
  (:func:`router_launch`); the grouped GEMM has one K schedule for every expert load, the kit
  matmul's: ``BLOCK_K`` from the dtype (:func:`batch_invariance_kit.ops.k_order.block_k`), no
  split-K, each K block the matmul's own step (``k_order.ptr_step``) from block 0 upward, and a
  long K in the matmul's fixed chunks (:func:`batch_invariance_kit.ops.k_order.k_chunk`: over
  4096 keys, chunks of 2048 summed from zero, added in order), so a row of an expert's GEMM is
  bitwise the kit's matmul of that token by the expert's weight.  The M/N tile is taken from a
  table keyed by tokens per expert (:data:`INVARIANT_TABLE`) but it only decides *which
  program* computes a row, never *how*: any config may be forced with ``config=`` and gives
  the same bits;
* ``"variant"``: launched like production: the router's rows per program, warps and the lanes
  that share a token's softmax sum are picked from the token count (a different tree for the
  sum), the gating matmul is :func:`batch_invariance_kit.ops.matmul` 's split-K variant, and the grouped GEMM takes
  ``BLOCK_K`` and split-K from a table keyed by tokens per expert (:data:`VARIANT_TABLE`, as
  tuned tables do: vLLM's fused-MoE JSON configs pick ``BLOCK_SIZE_K`` by M; split-K for thin
  loads is the other common knob; one loop over its K range, no chunks; the split partials added
  in order by matmul's second pass), and the combine is launched decode-style for few tokens: a
  token's k contributions are spread over 4 or 2 ``lanes`` (lane ``l`` sums ranks ``l, l +
  lanes, ...``, then the lanes are added), one chain for large batches (:func:`combine_launch`).
  It fails the invariance check (negative control);
* ``"reference"``: float64 torch from the gating logits (rounded to ``x``'s dtype like the
  kernels' logits) to the output, one rounding at the end.

Numerics: inputs fp32, fp16 or bf16 (all weights in ``x``'s dtype); router scores and top-k
weights fp32; GEMMs accumulate in fp32 (fp32 inputs with ``input_precision="ieee"``); the
SiLU-and-mul activation and the down projection are rounded to ``x``'s dtype (as in vLLM's
intermediate caches); the combine is fp32, rounded once.

Token counts (the router's and combine's ``T``, the dispatch's ``n``, ``num_blocks`` and
``n_tiles``, the grouped GEMM's and its split-K pass's ``n_valid``, :func:`silu_mul`'s ``T``)
reach the kernels unspecialised
(``do_not_specialize``): Triton compiles once per launch config, not once per integer class of a
token count (1, a multiple of 16, other).

Under the Triton interpreter 16-bit tiles are widened to fp32 before ``tl.dot`` (exact), as in
:mod:`batch_invariance_kit.ops.matmul`.  Only plain pointer loads, ``tl.dot(a, b, acc)``, ``tl.reshape`` and
``tl.static_range`` are used (Triton 3.0 features).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from .. import checks
from . import k_order
from . import matmul as MM
from ..device import INTERPRET

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .tl_numerics import from_f32, to_f32  # noqa: E402
from .direct_launch import DirectLaunch  # noqa: E402

__all__ = [
    "IMPLS",
    "MoEConfig",
    "tokens_per_expert",
    "select_config",
    "router_launch",
    "combine_launch",
    "launch_info",
    "route",
    "dispatch",
    "grouped_gemm",
    "combine",
    "silu_mul",
    "fused_moe",
    "reference_route",
]

IMPLS = ("invariant", "variant", "reference")
SCORINGS = ("softmax", "sigmoid")


# --------------------------------------------------------------------------------------------
# Launch configurations (pure data: the book prints them)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEConfig:
    """A grouped-GEMM launch.  For the invariant kernel ``block_k`` is the dtype's (fixed) and
    ``split_k`` is 1; the variant's table sets both by the load."""

    name: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return asdict(self)


#: Invariant grouped GEMM: (largest tokens per expert, BLOCK_M, BLOCK_N, num_warps, num_stages).
#: BLOCK_K is :func:`batch_invariance_kit.ops.k_order.block_k` of the dtype for every row of the table.
#: The rows come from the ``moe_tiles`` part (``results/h100/moe_tiles.json``: every tile of
#: :data:`batch_invariance_kit.bench.moe.TILE_GRID` timed at Qwen3-30B-A3B and DeepSeek-V2-Lite
#: shapes, 1 ... 8192 tokens, in the ``n_fast`` program order, and checked bitwise against the
#: table's pick): at every token count of both models the row's tile is within 5 % of the fastest
#: tile (:func:`batch_invariance_kit.bench.moe.table_against_sweep` of the stored rows, asserted by
#: ``tests/test_moe.py``).  16 x 64 with four stages while an expert sees a token or two: there
#: the 16-row tiles (``BLOCK_N`` 32, 64 or 128, four or five stages) lie within a few per cent of
#: one another and none is the fastest at every token count.  Then 64 x 64 (wgmma) up to 64
#: tokens per expert, then 128 x 128.  A fused gate/up launch over a long K narrows ``BLOCK_N``
#: (:data:`_FUSED_LONG_K_VALUES`).  The variant's table below is set by hand, as production
#: tables are tuned per GPU.
INVARIANT_TABLE = [(2, 16, 64, 4, 4), (64, 64, 64, 4, 3), (None, 128, 128, 8, 3)]

#: Variant grouped GEMM, like a tuned production table: (largest tokens per expert, BLOCK_M,
#: BLOCK_N, BLOCK_K for 16-bit inputs, SPLIT_K, num_warps, num_stages).  fp32 halves BLOCK_K
#: (not below 32).  Thin loads split K to fill the GPU; the K step changes with the load too.
VARIANT_TABLE = [(4, 16, 32, 128, 4, 4, 4), (32, 16, 64, 64, 2, 4, 4), (256, 64, 64, 32, 1, 4, 4),
                 (None, 64, 128, 64, 1, 8, 3)]


def tokens_per_expert(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The average load the tables are keyed by: ``ceil(num_tokens * top_k / num_experts)``.
    It comes from the *shapes* only (no device sync, CUDA-graph friendly)."""
    return -(-int(num_tokens) * int(top_k) // int(num_experts))


def select_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype = torch.bfloat16,
                  impl: str = "invariant") -> MoEConfig:
    """The grouped-GEMM config ``impl`` uses for this batch."""
    _check_impl(impl)
    load = tokens_per_expert(num_tokens, top_k, num_experts)
    bk = k_order.block_k(dtype)
    if impl == "variant":
        for bound, bm, bn, bk16, split, nw, ns in VARIANT_TABLE:
            if bound is None or load <= bound:
                k = bk16 if dtype != torch.float32 else max(32, bk16 // 2)
                return MoEConfig(f"variant<={bound}", bm, bn, k, split, nw, ns)
    for bound, bm, bn, nw, ns in INVARIANT_TABLE:
        if bound is None or load <= bound:
            if dtype == torch.float32 and bn > 64:
                bn = 64  # register budget
            return MoEConfig(f"invariant<={bound}", bm, bn, bk, 1, nw, ns)
    raise AssertionError("unreachable: the tables end with an unbounded row")


def router_launch(num_tokens: int, num_experts: int, impl: str = "invariant") -> dict:
    """Rows per program (``block_t``), experts per row (``block_e``), ``num_warps`` and ``lanes``
    of the router kernel.  ``lanes`` = 0: the softmax sum is one ``tl.sum`` over the row; else
    lane ``l`` first sums experts ``l, l + lanes, ...`` (as threads striding over a row do)
    and the lanes are then summed: another ``lanes``, another tree.  The invariant launch depends
    on ``num_experts`` only; the variant's on ``num_tokens`` too."""
    block_e = triton.next_power_of_2(max(1, int(num_experts)))
    if impl == "variant":
        if num_tokens <= 32:  # decode: one token per program, one warp, a lane per expert
            return {"block_t": 1, "block_e": block_e, "num_warps": 1, "lanes": min(32, block_e)}
        return {"block_t": 16, "block_e": block_e, "num_warps": 4, "lanes": min(4, block_e)}
    return {"block_t": 16, "block_e": block_e, "num_warps": 4 if block_e <= 256 else 8, "lanes": 0}


def combine_launch(num_tokens: int, top_k: int, hidden: int, impl: str = "invariant") -> dict:
    """Tokens per program (``block_t``), columns per program (``block_h``), ``num_warps`` and
    ``lanes`` of the combine kernel.  ``lanes`` = 1: a token's ``k`` terms ``w_r * y_r`` are
    added in one chain, rank 0 first.  ``lanes`` = L > 1: lane ``l`` sums ranks ``l, l + L,
    ...`` (in rank order), then the L partials are added in lane order: another tree.

    Invariant: a function of ``hidden`` only (``lanes`` 1).  Variant, like a combine tuned for
    decode: a few tokens give too few (token, column-block) programs to fill the GPU, so each
    program takes one token (or 4) and spreads its k ranks over 4 (or 2) lanes; from 65
    tokens up there is parallelism enough along the tokens and the ranks are one chain again.
    (The tree differs from the chain only when ``1 < lanes < top_k``, e.g. top-8 (Qwen3-MoE,
    DeepSeek-V3): with ``lanes >= top_k`` every lane holds one term and the lanes are added in
    rank order, the chain; so ``lanes`` is capped at ``top_k``.  With top-2, as in the kit's
    small tests, both are ``w_0 y_0 + w_1 y_1`` unless a compiler fuses ``part + w * y`` into
    one FMA: there the variant layer's bits move through its router and GEMMs.)"""
    _check_impl(impl)
    num_tokens = checks.positive_int("num_tokens", num_tokens)
    top_k = checks.positive_int("top_k", top_k)
    hidden = checks.positive_int("hidden", hidden)
    block_h = min(256, triton.next_power_of_2(hidden))
    if impl == "variant" and num_tokens <= 64:
        block_t, lanes = (1, 4) if num_tokens <= 8 else (4, 2)
        return {"block_t": block_t, "block_h": block_h, "num_warps": 4, "lanes": min(lanes, top_k)}
    return {"block_t": 16, "block_h": block_h, "num_warps": 4, "lanes": 1}


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# --------------------------------------------------------------------------------------------
# 1. Router
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _router_kernel(logits_ptr, w_ptr, ids_ptr, T, E, s_lt,
                   TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   LANES: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    r64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + r64[:, None] * s_lt + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    x = to_f32(x)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(cmask[None, :], x, float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])  # padding experts: exp(-inf) = 0
        if LANES == 0:
            den = tl.sum(e, axis=1)
        else:  # lane l holds experts l, l + LANES, ...; then the lanes are summed
            part = tl.sum(tl.reshape(e, (BLOCK_T, BLOCK_E // LANES, LANES)), axis=1)
            den = tl.sum(part, axis=1)
        s = e / den[:, None]
    s = tl.where(cmask[None, :], s, float("-inf"))

    kcols = tl.arange(0, BLOCK_K)
    wsel = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    isel = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for kk in tl.static_range(TOPK):
        best = tl.max(s, axis=1)
        # tie rule: among equal scores the lowest expert index wins
        idx = tl.min(tl.where(s == best[:, None], cols[None, :], BLOCK_E), axis=1)
        wsel = tl.where(kcols[None, :] == kk, best[:, None], wsel)
        isel = tl.where(kcols[None, :] == kk, idx[:, None], isel)
        total = total + best  # rank order 0, 1, ..., TOPK-1
        s = tl.where(cols[None, :] == idx[:, None], float("-inf"), s)
    if RENORM:
        wsel = wsel / total[:, None]
    omask = rmask[:, None] & (kcols[None, :] < TOPK)
    offs = r64[:, None] * TOPK + kcols[None, :]
    tl.store(w_ptr + offs, wsel, mask=omask)
    tl.store(ids_ptr + offs, isel, mask=omask)


def _check_top_k(top_k, num_experts):
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")


def _check_options(scoring, renormalize):
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")


def _on_kernel_device(name, t, impl):
    if impl in ("invariant", "variant"):
        checks.kernel_device(name, t)


def _check_out(name, t, shape, dtype, like):
    return checks.output(name, t, shape, dtype, like, like_name="the input")


def reference_route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True):
    """float64 router: ``(weights fp32 (T, k), ids int32 (T, k))``; a stable descending sort
    keeps the lower expert index first among equal scores (the kernels' tie rule)."""
    l64 = logits.double()
    s = torch.softmax(l64, dim=-1) if scoring == "softmax" else torch.sigmoid(l64)
    vals, ids = torch.sort(s, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k], ids[:, :top_k]
    if renormalize:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    return vals.float(), ids.to(torch.int32)


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          impl: str = "invariant", out: tuple | None = None) -> tuple:
    """Router: ``logits`` (T, E) of a float dtype -> ``(topk_weights fp32 (T, k), topk_ids int32
    (T, k))``, ranks ordered by score (highest first; ties: lower expert index first).
    ``out``: an optional ``(weights, ids)`` pair to write (contiguous, those dtypes and shapes)."""
    _check_impl(impl)
    checks.tensor("logits", logits, dim=2)
    _check_top_k(top_k, logits.shape[1])
    _check_options(scoring, renormalize)
    _on_kernel_device("logits", logits, impl)
    if impl == "reference":
        return reference_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    T = logits.shape[0]
    if out is None:
        w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
        ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a (weights, ids) pair")
        w = _check_out("out[0]", out[0], (T, top_k), torch.float32, logits)
        ids = _check_out("out[1]", out[1], (T, top_k), torch.int32, logits)
    _route(logits, top_k, scoring, renormalize, impl, w, ids)
    return w, ids


@functools.lru_cache(maxsize=4096)
def _router_params(T: int, E: int, top_k: int, scoring: str, renormalize: bool, impl: str) -> tuple:
    """``(grid, constexprs)`` of the router kernel (:func:`router_launch`), cached per shape."""
    lc = router_launch(T, E, impl)
    return (-(-T // lc["block_t"]),), dict(TOPK=top_k, BLOCK_T=lc["block_t"], BLOCK_E=lc["block_e"],
                                           BLOCK_K=triton.next_power_of_2(top_k), LANES=lc["lanes"], SIGMOID=scoring == "sigmoid",
                                           RENORM=renormalize, num_warps=lc["num_warps"])


def _route(logits, top_k, scoring, renormalize, impl, w, ids) -> None:
    """The router kernel on checked arguments: ``w`` and ``ids`` (T, k) written."""
    T, E = logits.shape
    grid, kw = _router_params(T, E, top_k, scoring, renormalize, impl)
    _ROUTER(grid, logits, w, ids, T, E, logits.stride(0), **kw)


# --------------------------------------------------------------------------------------------
# 2. Dispatch
# --------------------------------------------------------------------------------------------

@dataclass
class Dispatch:
    """Where each (token, rank) row goes.  Row id ``i = token * top_k + rank``.

    ``sorted_ids`` (int32, ``num_blocks * block_m``): row ids grouped by expert (then by id),
    each expert's group padded with ``num_valid`` (the "no row" marker) to a multiple of
    ``block_m``; ``block_expert`` (int32, ``num_blocks``): the expert of each block, -1 for the
    spare blocks at the end (the length is a bound from the shapes: ``num_valid + min(E,
    num_valid) * (block_m - 1)`` rows, so nothing waits for the device); ``counts`` and
    ``padded_counts`` (int64, E): rows per expert before and after padding."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    counts: torch.Tensor
    padded_counts: torch.Tensor
    num_valid: int
    num_experts: int
    top_k: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


#: Elements of the (rows x experts) one-hot tile a dispatch program holds: its rows per tile
#: are ``_DISPATCH_TILE // next_power_of_2(E)`` (16 to 1024).  One tile of rows takes one launch;
#: more take two (:func:`dispatch`).
_DISPATCH_TILE = 16384
#: Blocks of ``block_m`` rows whose expert and padding one program writes at a time
_DISPATCH_BLOCKS = 64


@triton.jit
def _tile_ranks(ids_ptr, row0, n, E, ROWS: tl.constexpr, E_PAD: tl.constexpr):
    """Rows ``row0 ..`` of the flat id table: their ids (int32; -1 past the end or for an id
    outside ``0..E-1``), each row's one-hot over the experts ``[ROWS, E_PAD]``, its rank among
    the tile's earlier rows of the same expert (an exclusive prefix sum of the one-hot down the
    rows: row order, no atomics) and the tile's per-expert counts."""
    rows = row0 + tl.arange(0, ROWS)
    raw = tl.load(ids_ptr + rows, mask=rows < n, other=-1)
    e = tl.where((raw >= 0) & (raw < E), raw, -1).to(tl.int32)
    hot = (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(hot, axis=0) - hot) * hot, axis=1)
    return rows, e, hot, rank, tl.sum(hot, axis=0)


@triton.jit
def _expert_layout(counts, BLOCK_M: tl.constexpr):
    """Each expert's rows padded to a multiple of BLOCK_M, laid out in expert order: padded
    counts, first and one-past-last slot of each expert's group."""
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    return padded, end - padded, end


@triton.jit
def _place_rows(sorted_ptr, rows, e, hot, rank, first):
    """Row ``rows[i]`` to slot ``first[e] + rank`` of its expert ``e`` (rows with no expert: nowhere)."""
    slot = tl.sum(hot * first[None, :], axis=1) + rank
    tl.store(sorted_ptr + slot, rows, mask=e >= 0)


@triton.jit
def _write_blocks(sorted_ptr, block_expert_ptr, counts, start, end, b0, n, E, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCKS: tl.constexpr):
    """Blocks ``b0 ..``: the expert of each block (the number of group ends at or before the
    block's first slot: a search in the sorted ends; -1 past the last group) and the no-row
    marker ``n`` in every slot that no row fills (each group's tail, the spare blocks)."""
    b = b0 + tl.arange(0, BLOCKS)
    experts = tl.arange(0, E_PAD)
    first = b * BLOCK_M
    be = tl.sum(((end[None, :] <= first[:, None]) & (experts[None, :] < E)).to(tl.int32), axis=1)
    inside = be < E
    tl.store(block_expert_ptr + b, tl.where(inside, be, -1), mask=b < num_blocks)
    hot = ((be[:, None] == experts[None, :]) & inside[:, None]).to(tl.int32)
    rows_end = tl.sum(hot * (start + counts)[None, :], axis=1)  # 0 for a spare block
    slots = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + slots, tl.full((BLOCKS, BLOCK_M), 0, tl.int32) + n,
             mask=(b < num_blocks)[:, None] & (slots >= rows_end[:, None]))


@triton.jit(do_not_specialize=["n", "num_blocks", "n_tiles"])
def _dispatch_kernel(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, counts_ptr, padded_ptr,
                     n, E, num_blocks, n_tiles,
                     BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                     HIST_TILE: tl.constexpr, PHASE: tl.constexpr):
    """The dispatch of :func:`dispatch` without a sort: a row's slot is its expert's first slot
    + the rows of its expert in earlier tiles + its rank in its own tile.  PHASE 0 (one tile,
    one program): everything.  PHASE 1 (a program per tile): the tile's per-expert counts to
    ``hist``.  PHASE 2 (a program per tile or per BLOCKS blocks, whichever is more): each
    program sums ``hist`` (all tiles: the counts; the tiles before its own: its offsets),
    places its tile's rows and writes its blocks; program 0 writes the counts."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    if PHASE == 1:
        rows, e, hot, rank, hist = _tile_ranks(ids_ptr, pid * ROWS, n, E, ROWS, E_PAD)
        tl.store(hist_ptr + pid * E_PAD + experts, hist)
    else:
        if PHASE == 0:
            rows, e, hot, rank, counts = _tile_ranks(ids_ptr, 0, n, E, ROWS, E_PAD)
            before = tl.zeros((E_PAD,), dtype=tl.int32)
        else:
            counts = tl.zeros((E_PAD,), dtype=tl.int32)
            before = tl.zeros((E_PAD,), dtype=tl.int32)
            for t0 in range(0, n_tiles, HIST_TILE):
                t = t0 + tl.arange(0, HIST_TILE)
                h = tl.load(hist_ptr + t[:, None] * E_PAD + experts[None, :], mask=(t < n_tiles)[:, None], other=0)
                counts += tl.sum(h, axis=0)
                before += tl.sum(h * (t < pid).to(tl.int32)[:, None], axis=0)
        padded, start, end = _expert_layout(counts, BLOCK_M)
        if PHASE == 0:
            _place_rows(sorted_ptr, rows, e, hot, rank, start + before)
        elif pid < n_tiles:
            rows, e, hot, rank, hist = _tile_ranks(ids_ptr, pid * ROWS, n, E, ROWS, E_PAD)
            _place_rows(sorted_ptr, rows, e, hot, rank, start + before)
        if pid == 0:
            tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
            tl.store(padded_ptr + experts, padded.to(tl.int64), mask=experts < E)
        if PHASE == 0:
            for b0 in range(0, num_blocks, BLOCKS):
                _write_blocks(sorted_ptr, block_expert_ptr, counts, start, end, b0, n, E, num_blocks,
                              BLOCK_M, E_PAD, BLOCKS)
        elif pid * BLOCKS < num_blocks:
            _write_blocks(sorted_ptr, block_expert_ptr, counts, start, end, pid * BLOCKS, n, E, num_blocks,
                          BLOCK_M, E_PAD, BLOCKS)


@functools.lru_cache(maxsize=4096)
def _dispatch_params(n: int, num_experts: int, block_m: int, tile: int) -> tuple:
    """``(num_blocks, tiles, grid of the last launch, constexprs)`` of a dispatch of ``n`` rows."""
    e_pad = triton.next_power_of_2(num_experts)
    rows = max(16, min(1024, tile // e_pad))
    tiles = -(-n // rows)
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    grid = 1 if tiles == 1 else max(tiles, -(-num_blocks // _DISPATCH_BLOCKS))
    kw = dict(BLOCK_M=block_m, E_PAD=e_pad, ROWS=rows, BLOCKS=_DISPATCH_BLOCKS,
              HIST_TILE=max(1, min(64, tile // e_pad)), num_warps=8 if rows * e_pad > 4096 else 4)
    return num_blocks, tiles, (grid,), kw


def _dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Dispatch:
    """:func:`dispatch` of checked arguments (a contiguous, non-empty id table): the buffers
    sized from the shapes, then the kernel."""
    T, k = topk_ids.shape
    n = T * k
    dev = topk_ids.device
    num_blocks, tiles, grid, kw = _dispatch_params(n, num_experts, block_m, _DISPATCH_TILE)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    counts, padded = torch.empty((2, num_experts), dtype=torch.int64, device=dev).unbind(0)
    args = (sorted_ids, block_expert, counts, padded, n, num_experts, num_blocks, tiles)
    if tiles == 1:
        _DISPATCH(grid, topk_ids, sorted_ids, *args, PHASE=0, **kw)
    else:
        hist = torch.empty((tiles, kw["E_PAD"]), dtype=torch.int32, device=dev)
        _DISPATCH((tiles,), topk_ids, hist, *args, PHASE=1, **kw)
        _DISPATCH(grid, topk_ids, hist, *args, PHASE=2, **kw)
    return Dispatch(sorted_ids, block_expert, counts, padded, n, num_experts, k, block_m)


def dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, validate: bool = True) -> Dispatch:
    """The (token, expert) rows grouped by expert then by row id, each expert's rows padded to a
    multiple of ``block_m`` (see :class:`Dispatch`): what a stable sort by expert gives, made
    without one.  ``_dispatch_kernel`` counts each expert's rows with prefix sums over one-hot
    tiles of the ids (no atomics, so no order of threads can show), places every row and marks
    each block's expert; the buffers are sized from the shapes (a bound on the blocks), so
    nothing is read back.  An id table of more rows than one tile (``_DISPATCH_TILE`` one-hot
    elements) takes a second launch: per-tile counts first, then each tile placed after the
    earlier tiles' rows.  ``validate`` checks that every id is in ``0..num_experts-1`` (a
    device sync on a GPU); without it, an id outside the range is left out of every count
    and slot."""
    checks.tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), dim=2)
    checks.kernel_device("topk_ids", topk_ids)
    checks.positive_int("num_experts", num_experts)
    checks.positive_int("block_m", block_m)
    if validate:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in 0..{num_experts - 1}, got values in {lo}..{hi}")
    return _dispatch(topk_ids, num_experts, block_m)


# --------------------------------------------------------------------------------------------
# 3. Grouped GEMM
# --------------------------------------------------------------------------------------------

@triton.jit
def _silu_mul(gate, up):
    """``silu(gate) * up`` in fp32: ``gate / (1 + exp(-gate)) * up``."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["n_valid"])
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, ws_ptr, sorted_ids_ptr, block_expert_ptr,
                         n_valid, N, K, s_am, s_ak, s_we, s_wn, s_wk, s_cm, s_cn,
                         A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                         SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, N_FAST: tl.constexpr):
    """Block ``pid_m`` of the dispatch times its expert's weight ``w[e]`` (N_w, K), read as
    (K, N).  FUSE_SILU: columns n and N + n of ``w[e]`` are gate and up; the output is
    ``silu(gate) * up``.  The K loop is the matmul's: each K block is ``k_order.ptr_step``
    (one masked block of ``acc = tl.dot(a, b, acc)``), from block 0 upward, and with
    CHUNK_BLOCKS > 0 (a long K, :func:`batch_invariance_kit.ops.k_order.k_chunk_blocks`) in
    chunks of CHUNK_BLOCKS blocks, each summed from zero, added in chunk order, as matmul's
    ``_tile`` does.  SPLIT_K > 1 (variant only, CHUNK_BLOCKS 0): the K blocks of split
    ``program_id(2)``, fp32 partials to ``ws``.  N_FAST: a 1-D grid over (block, N tile) whose
    N tiles of one block run next to each other (else block ``program_id(0)``, N tile
    ``program_id(1)``): which program computes a tile, never how."""
    if N_FAST:
        n_tiles = tl.cdiv(N, BLOCK_N)
        pid_m = tl.program_id(0) // n_tiles
        pid_n = tl.program_id(0) % n_tiles
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    split = tl.program_id(2)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = ids < n_valid
        arow = (ids // A_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        cols = offs_n.to(tl.int64)
        a_base = a_ptr + arow[:, None] * s_am
        w_base = w_ptr + expert.to(tl.int64) * s_we + cols[None, :] * s_wn
        u_base = w_base + N * s_wn  # the up half (FUSE_SILU)
        k_blocks = tl.cdiv(K, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if CHUNK_BLOCKS == 0:  # one loop over this program's K blocks
            if SPLIT_K == 1:
                kb_lo = 0
                kb_hi = k_blocks
            else:
                per_split = tl.cdiv(k_blocks, SPLIT_K)
                kb_lo = split * per_split
                kb_hi = tl.minimum(kb_lo + per_split, k_blocks)
            for kb in range(kb_lo, kb_hi):  # upward from the range's first block
                acc = k_order.ptr_step(a_base, w_base, acc, kb, K, s_ak, s_wk, mask_m, mask_n, BLOCK_K, UPCAST)
                if FUSE_SILU:
                    acc_u = k_order.ptr_step(a_base, u_base, acc_u, kb, K, s_ak, s_wk, mask_m, mask_n, BLOCK_K, UPCAST)
        else:  # a long K: chunk sums from zero, added in chunk order
            for c0 in range(0, k_blocks, CHUNK_BLOCKS):
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for kb in range(c0, tl.minimum(c0 + CHUNK_BLOCKS, k_blocks)):  # upward
                    part = k_order.ptr_step(a_base, w_base, part, kb, K, s_ak, s_wk, mask_m, mask_n, BLOCK_K, UPCAST)
                    if FUSE_SILU:
                        part_u = k_order.ptr_step(a_base, u_base, part_u, kb, K, s_ak, s_wk, mask_m, mask_n, BLOCK_K,
                                              UPCAST)
                acc += part
                if FUSE_SILU:
                    acc_u += part_u
        rows = ids.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            if FUSE_SILU:
                acc = _silu_mul(acc, acc_u)
            tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cn, from_f32(acc, c_ptr.dtype.element_ty),
                     mask=mask)
        else:  # partials, contiguous [SPLIT_K, n_valid, (2 if FUSE_SILU else 1) * N]
            width = 2 * N if FUSE_SILU else N
            base = (split * n_valid + rows[:, None]) * width + cols[None, :]
            tl.store(ws_ptr + base, acc, mask=mask)
            if FUSE_SILU:
                tl.store(ws_ptr + base + N, acc_u, mask=mask)


@triton.jit(do_not_specialize=["n_valid"])
def _splitk_silu_kernel(ws_ptr, c_ptr, n_valid, N, s_cm, s_cn, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """The variant's second pass for the fused gate/up GEMM: the gate's and the up's partial
    sums each added in split order by ``k_order.sum_splits`` (the pass of
    ``k_order.chunk_reduce_kernel``, which the unfused GEMM's variant launches as it is), then
    ``silu(gate) * up``, rounded once.  A kernel of its own for the activation between the sum
    and the rounding; partials as ``_grouped_gemm_kernel`` stores them, ``[SPLIT_K, n_valid, 2N]``."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < n_valid)[:, None] & (cols < N)[None, :]
    gate = ws_ptr + rows[:, None] * (2 * N) + cols[None, :]
    split_stride = tl.cast(n_valid, tl.int64) * (2 * N)
    acc = _silu_mul(k_order.sum_splits(gate, split_stride, mask, SPLIT_K, BLOCK_M, BLOCK_N),
                    k_order.sum_splits(gate + N, split_stride, mask, SPLIT_K, BLOCK_M, BLOCK_N))
    tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cn, from_f32(acc, c_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=4096)
def _table_config(num_tokens, top_k, num_experts, dtype, impl) -> MoEConfig:
    """:func:`select_config`, cached per shape."""
    return select_config(num_tokens, top_k, num_experts, dtype, impl)


def _resolve_config(config, num_tokens, top_k, num_experts, dtype, impl) -> MoEConfig:
    if config is None:
        return _table_config(num_tokens, top_k, num_experts, dtype, impl)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be None or a MoEConfig, got {type(config).__name__}")
    if impl == "invariant" and (config.block_k != k_order.block_k(dtype) or config.split_k != 1):
        raise ValueError(f"config of the invariant kernel must have block_k={k_order.block_k(dtype)} and split_k=1 "
                         f"(the fixed K schedule), got block_k={config.block_k}, split_k={config.split_k}")
    return config


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, disp: Dispatch, *, activation: str | None = None,
                 gather_tokens: bool = False, impl: str = "invariant", config: MoEConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``a`` times their expert's weight, one output row per dispatch row id.

    ``a``: (num_valid, K), or with ``gather_tokens`` (T, K) (row id ``i`` reads ``a[i // top_k]``);
    ``w``: (E, N_w, K) (``nn.Linear`` layout per expert).  ``activation=None``: out (num_valid,
    N_w) = ``a_row @ w[e].T``; ``"silu_mul"``: ``N_w = 2 I`` (gate rows first, then up) and out
    (num_valid, I) = ``silu(a_row @ w_g.T) * (a_row @ w_u.T)``, rounded once.  ``config``:
    the table's pick by default (its ``block_m`` must equal ``disp.block_m``).  ``out``: optional,
    contiguous, of ``a``'s dtype."""
    _check_impl(impl)
    if impl == "reference":
        raise ValueError("impl must be 'invariant' or 'variant' for grouped_gemm (the reference is reference_moe)")
    if not isinstance(disp, Dispatch):
        raise TypeError(f"disp must be a Dispatch (from moe.dispatch), got {type(disp).__name__}")
    if activation not in (None, "silu_mul"):
        raise ValueError(f"activation must be None or 'silu_mul', got {activation!r}")
    checks.tensor("a", a, dim=2)
    checks.tensor("w", w, dim=3)
    checks.same_dtype("w", w, "a", a)
    checks.same_device("w", w, "a", a)
    _on_kernel_device("a", a, impl)
    rows_a = disp.num_valid // disp.top_k if gather_tokens else disp.num_valid
    if a.shape[0] != rows_a:
        raise ValueError(f"a must have {rows_a} rows for this dispatch, got {a.shape[0]}")
    if w.shape[0] != disp.num_experts:
        raise ValueError(f"w has {w.shape[0]} experts but the dispatch has {disp.num_experts}")
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"w has {w.shape[2]} columns (K) but a has {a.shape[1]}")
    fuse = activation == "silu_mul"
    if fuse and w.shape[1] % 2:
        raise ValueError(f"w must have an even number of rows (gate then up) for silu_mul, got {w.shape[1]}")
    N = w.shape[1] // 2 if fuse else w.shape[1]
    T = disp.num_valid // disp.top_k
    cfg = _resolve_config(config, T, disp.top_k, disp.num_experts, a.dtype, impl)
    if cfg.block_m != disp.block_m:
        raise ValueError(f"config.block_m={cfg.block_m} must equal the dispatch's block_m={disp.block_m}")
    if out is None:
        out = torch.empty((disp.num_valid, N), dtype=a.dtype, device=a.device)
    else:
        _check_out("out", out, (disp.num_valid, N), a.dtype, a)
    _grouped_gemm(a, w, disp, fuse, gather_tokens, impl, cfg, out)
    return out


#: Accumulator values a thread may hold in a fused gate/up launch over a long K, whose four fp32
#: tiles would otherwise spill (128 x 128 with 8 warps: 256 a thread).  The launch narrows
#: ``BLOCK_N`` to fit (not below 16, ``tl.dot``'s least); which program computes a column never
#: changes its bits.  ``launch_info`` and the configs keep the table's ``block_n``.
_FUSED_LONG_K_VALUES = 128


#: The order of the grouped GEMM's programs: ``"m_fast"`` (the blocks of one N tile next to each
#: other) or ``"n_fast"`` (the N tiles of one block next to each other, as vLLM's ``fused_moe``
#: with ``GROUP_SIZE_M = 1``).  It decides which program computes a tile, never the K order:
#: both give the same bits (``tests/test_moe.py``).  The kit ships ``n_fast``: on an H100 the layer
#: took within 1.5 % of the same time either way up to 256 tokens, and from 1,024 ``m_fast`` took
#: 1.05-1.23x ``n_fast``'s time (``results/h100/explorations/moe_tile_order``).
TILE_ORDERS = ("m_fast", "n_fast")
TILE_ORDER = "n_fast"


@functools.lru_cache(maxsize=4096)
def _gemm_params(num_valid: int, num_blocks: int, N: int, K: int, dtype: torch.dtype, impl: str, cfg: MoEConfig,
                 fuse: bool, a_div: int, order: str) -> tuple:
    """``(grid, split, constexprs, grid of the split-K pass)`` of a grouped-GEMM launch, cached
    per shape.  The invariant K order is the matmul's (chunks for a long K); the variant keeps
    its table's split-K and K step.  ``order``: :data:`TILE_ORDER`'s values."""
    if order not in TILE_ORDERS:
        raise ValueError(f"TILE_ORDER must be one of {TILE_ORDERS}, got {order!r}")
    split = max(1, min(cfg.split_k, -(-K // cfg.block_k)))
    chunk_blocks = k_order.k_chunk_blocks(K, dtype) if impl == "invariant" else 0
    block_n = cfg.block_n
    if fuse and chunk_blocks:  # gate and up over a long K: four fp32 tiles (chunk sum and running sum of each)
        block_n = max(16, min(block_n, _FUSED_LONG_K_VALUES * cfg.num_warps * 32 // (4 * cfg.block_m)))
    kw = dict(A_DIV=a_div, FUSE_SILU=fuse, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
              CHUNK_BLOCKS=chunk_blocks, SPLIT_K=split, UPCAST=INTERPRET, N_FAST=order == "n_fast",
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    n_tiles = -(-N // block_n)
    grid = (num_blocks * n_tiles, 1, split) if order == "n_fast" else (num_blocks, n_tiles, split)
    return grid, split, kw, (-(-num_valid // 32), -(-N // 64))


def _grouped_gemm(a, w, disp, fuse, gather_tokens, impl, cfg, out) -> None:
    """The grouped GEMM on checked arguments (``out`` (num_valid, N) given)."""
    N = out.shape[1]
    K = w.shape[2]
    grid, split, kw, pass_grid = _gemm_params(disp.num_valid, disp.num_blocks, N, K, a.dtype, impl, cfg, fuse,
                                              disp.top_k if gather_tokens else 1, TILE_ORDER)
    ws = out
    if split > 1:
        ws = torch.empty((split, disp.num_valid, 2 * N if fuse else N), dtype=torch.float32, device=a.device)
    _GROUPED_GEMM(
        grid, a, w, out, ws, disp.sorted_ids, disp.block_expert, disp.num_valid, N, K,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1), **kw)
    if split > 1 and fuse:
        _SPLITK_SILU(
            pass_grid, ws, out, disp.num_valid, N, out.stride(0), out.stride(1), SPLIT_K=split, BLOCK_M=32, BLOCK_N=64,
            num_warps=4,
        )
    elif split > 1:  # matmul's pass over [SPLIT_K, 1, num_valid, N] partials (no bias)
        k_order.launch_chunk_reduce(ws, out, None, disp.num_valid, N, 1, (0, out.stride(0), out.stride(1)), (0, 0),
                                    split, block_m=32, block_n=64, grid=pass_grid + (1,))


# --------------------------------------------------------------------------------------------
# 4. Combine
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _combine_kernel(y_ptr, w_ptr, s_ptr, out_ptr, T, H, s_ym, s_sm, s_om, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr, LANES: tl.constexpr, HAS_SHARED: tl.constexpr):
    """BLOCK_T tokens x BLOCK_H columns; each element is its own fp32 sum over the ranks: one
    chain in rank order (LANES = 1, the invariant), or LANES strided chains then added (variant);
    with HAS_SHARED the shared experts' output (``s_ptr``) added last, before the one rounding."""
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = toks < T
    mask = tmask[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    if LANES == 1:
        for r in tl.static_range(TOPK):  # rank order 0, 1, ..., TOPK-1
            wt = tl.load(w_ptr + toks * TOPK + r, mask=tmask, other=0.0)
            y = to_f32(tl.load(y_ptr + (toks * TOPK + r)[:, None] * s_ym + cols[None, :], mask=mask, other=0.0))
            acc = acc + wt[:, None] * y
    else:
        for lane in tl.static_range(LANES):  # lane l: ranks l, l + LANES, ...; then lane order
            part = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for r in tl.static_range(lane, TOPK, LANES):
                wt = tl.load(w_ptr + toks * TOPK + r, mask=tmask, other=0.0)
                y = to_f32(tl.load(y_ptr + (toks * TOPK + r)[:, None] * s_ym + cols[None, :], mask=mask,
                                   other=0.0))
                part = part + wt[:, None] * y
            acc = acc + part
    if HAS_SHARED:
        acc = acc + to_f32(tl.load(s_ptr + toks[:, None] * s_sm + cols[None, :], mask=mask, other=0.0))
    tl.store(out_ptr + toks[:, None] * s_om + cols[None, :], from_f32(acc, out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, topk_weights: torch.Tensor, *, shared: torch.Tensor | None = None,
            impl: str = "invariant", out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_{r=0}^{k-1} topk_weights[t, r] * y[t * k + r]`` in fp32, rounded once to
    ``y``'s dtype.  ``y`` (T*k, H), ``topk_weights`` fp32 (T, k) -> (T, H).

    ``shared``: optional, contiguous (T, H) of ``y``'s dtype, the shared experts'
    output (DeepSeek): ``out[t] = round(sum_r w_r y_r + shared[t])``, the shared term added
    last in fp32, inside the one rounding.
    ``impl``: "invariant" (one chain in rank order whatever ``T``), "variant" (the ranks spread
    over lanes chosen from ``T``, :func:`combine_launch`: the negative control) or "reference"
    (float64 sum, rounded once).  ``out``: optional, contiguous, of ``y``'s dtype."""
    _check_impl(impl)
    checks.tensor("y", y, dim=2)
    checks.tensor("topk_weights", topk_weights, dtypes=(torch.float32,), dim=2)
    checks.same_device("topk_weights", topk_weights, "y", y)
    _on_kernel_device("y", y, impl)
    T, k = topk_weights.shape
    if y.shape[0] != T * k:
        raise ValueError(f"y must have {T * k} rows (tokens x top_k), got {y.shape[0]}")
    H = y.shape[1]
    _check_shared(shared, T, H, y, "y")
    if out is None:
        out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    else:
        _check_out("out", out, (T, H), y.dtype, y)
    if impl == "reference":
        ref = (topk_weights.double().unsqueeze(-1) * y.double().view(T, k, H)).sum(1)
        if shared is not None:
            ref = ref + shared.double()
        return out.copy_(ref.to(y.dtype))
    _combine(y, topk_weights, impl, out, shared)
    return out


def _check_shared(shared, T: int, H: int, like: torch.Tensor, like_name: str) -> None:
    """``shared``: None, or a contiguous (T, H) of the dtype and device of ``like`` (the
    argument ``like_name``)."""
    if shared is None:
        return
    checks.tensor("shared", shared, dtypes=(like.dtype,), dim=2)
    checks.same_device("shared", shared, like_name, like)
    if tuple(shared.shape) != (T, H):
        raise ValueError(f"shared must have shape {(T, H)} (tokens, hidden), got {tuple(shared.shape)}")


@functools.lru_cache(maxsize=4096)
def _combine_params(T: int, k: int, H: int, impl: str, has_shared: bool) -> tuple:
    """``(grid, constexprs)`` of the combine kernel (:func:`combine_launch`), cached per shape."""
    lc = combine_launch(T, k, H, impl)
    bt, bh = lc["block_t"], lc["block_h"]
    return (-(-T // bt), -(-H // bh)), dict(TOPK=k, BLOCK_T=bt, BLOCK_H=bh, LANES=lc["lanes"],
                                           HAS_SHARED=has_shared, num_warps=lc["num_warps"])


def _combine(y, topk_weights, impl, out, shared=None) -> None:
    """The combine kernel on checked arguments (without ``shared``, ``y`` stands in for its
    pointer: the kernel never reads it)."""
    T, k = topk_weights.shape
    H = y.shape[1]
    grid, kw = _combine_params(T, k, H, impl, shared is not None)
    s = y if shared is None else shared
    _COMBINE(grid, y, topk_weights, s, out, T, H, y.stride(0), s.stride(0), out.stride(0), **kw)


# --------------------------------------------------------------------------------------------
# The shared experts' activation
# --------------------------------------------------------------------------------------------

#: rows and columns per program of :func:`silu_mul` (fixed: the same launch for every batch)
SILU_MUL_BLOCK = (4, 512)


@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(gu_ptr, out_ptr, T, I, s_gm, s_om, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    """BLOCK_T rows x BLOCK_I columns of ``silu(gate) * up`` in fp32, rounded once."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < I)[None, :]
    g = to_f32(tl.load(gu_ptr + rows[:, None] * s_gm + cols[None, :], mask=mask, other=0.0))
    u = to_f32(tl.load(gu_ptr + rows[:, None] * s_gm + (cols + I)[None, :], mask=mask, other=0.0))
    tl.store(out_ptr + rows[:, None] * s_om + cols[None, :], from_f32(_silu_mul(g, u), out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gu: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu`` (T, 2I) (gate columns, then up) -> (T, I) in ``gu``'s dtype:
    the grouped GEMM's fused activation (``gate / (1 + exp(-gate)) * up`` in fp32, rounded once)
    as a kernel of its own, for a dense SwiGLU MLP (the DeepSeek layer's shared experts).  Each
    element is computed on its own with one launch shape for every ``T``: the same bits in any
    batch.  ``gu``: contiguous; ``out``: optional, contiguous, of ``gu``'s dtype."""
    checks.tensor("gu", gu, dim=2)
    _on_kernel_device("gu", gu, "invariant")
    if gu.shape[1] % 2:
        raise ValueError(f"gu must have an even number of columns (gate then up), got {gu.shape[1]}")
    T, I = gu.shape[0], gu.shape[1] // 2
    if out is None:
        out = gu.new_empty((T, I))
    else:
        _check_out("out", out, (T, I), gu.dtype, gu)
    bt, bi = SILU_MUL_BLOCK
    _SILU_MUL((-(-T // bt), -(-I // bi)), gu, out, T, I, gu.stride(0), out.stride(0), BLOCK_T=bt, BLOCK_I=bi,
              num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# The whole layer
# --------------------------------------------------------------------------------------------

def _check_moe_inputs(x, router_weight, w_gate_up, w_down, top_k, scoring, renormalize, impl):
    _check_impl(impl)
    checks.tensor("x", x, dim=2)
    for name, t, d in (("router_weight", router_weight, 2), ("w_gate_up", w_gate_up, 3), ("w_down", w_down, 3)):
        checks.tensor(name, t, dim=d)
        checks.same_dtype(name, t, "x", x)
        checks.same_device(name, t, "x", x)
    _on_kernel_device("x", x, impl)
    T, H = x.shape
    E = router_weight.shape[0]
    if router_weight.shape[1] != H:
        raise ValueError(f"router_weight must have shape (E, {H}) for x of hidden size {H}, "
                         f"got {tuple(router_weight.shape)}")
    if w_gate_up.shape[0] != E or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must have shape ({E}, 2*I, {H}), got {tuple(w_gate_up.shape)}")
    inter = w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (E, H, inter):
        raise ValueError(f"w_down must have shape ({E}, {H}, {inter}), got {tuple(w_down.shape)}")
    _check_top_k(top_k, E)
    _check_options(scoring, renormalize)


def reference_moe(x, router_weight, w_gate_up, w_down, top_k, *, scoring="softmax", renormalize=True, shared=None):
    """float64 MoE from the gating logits (rounded to ``x``'s dtype, as the kernels' are) to
    the output (plus ``shared``, the shared experts' output, when given), rounded once to
    ``x``'s dtype."""
    logits = (x.double() @ router_weight.double().t()).to(x.dtype)
    w, ids = reference_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    x64, w13, w2 = x.double(), w_gate_up.double(), w_down.double()
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for r in range(top_k):
        for e in torch.unique(ids[:, r]).tolist():
            sel = (ids[:, r] == e).nonzero().squeeze(1)
            h = x64[sel] @ w13[e].t()
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[sel] += w[sel, r].double().unsqueeze(1) * (act @ w2[e].t())
    if shared is not None:
        out += shared.double()
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, *, scoring: str = "softmax", renormalize: bool = True, impl: str = "invariant",
              config: MoEConfig | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """One MoE layer: ``x`` (T, H); ``router_weight`` (E, H); ``w_gate_up`` (E, 2I, H) (gate rows,
    then up rows); ``w_down`` (E, H, I); all of one float dtype, contiguous -> (T, H).

    ``logits = x @ router_weight.T`` (the kit's matmul, same ``impl``), :func:`route`,
    :func:`dispatch`, :func:`grouped_gemm` (gate/up + SiLU-and-mul, then down), :func:`combine`,
    each with the same ``impl``.
    ``config`` forces the grouped-GEMM launch (for the invariant kernel: any M/N tile, same bits).
    ``shared``: optional (T, H) of ``x``'s dtype, the shared experts' output, added by the
    combine inside its one rounding (:func:`combine`)."""
    _check_moe_inputs(x, router_weight, w_gate_up, w_down, top_k, scoring, renormalize, impl)
    _check_shared(shared, x.shape[0], x.shape[1], x, "x")
    if impl == "reference":
        return reference_moe(x, router_weight, w_gate_up, w_down, top_k, scoring=scoring, renormalize=renormalize,
                             shared=shared)
    T, H = x.shape
    E = router_weight.shape[0]
    dt, dev = x.dtype, x.device
    cfg = _resolve_config(config, T, top_k, E, dt, impl)
    # every operand is checked contiguous above: the steps launch their kernels directly
    logits = x.new_empty((T, E))
    MM.launch(x, router_weight, logits, None, k_order.Product(1, T, E, H, (0, H, 1), (0, 1, H), (0, E, 1)), impl=impl)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=dev)
    _route(logits, top_k, scoring, renormalize, impl, weights, ids)
    disp = _dispatch(ids, E, cfg.block_m)
    h = x.new_empty((disp.num_valid, w_down.shape[2]))
    _grouped_gemm(x, w_gate_up, disp, True, True, impl, cfg, h)
    y = x.new_empty((disp.num_valid, H))
    _grouped_gemm(h, w_down, disp, False, False, impl, cfg, y)
    out = torch.empty_like(x)
    _combine(y, weights, impl, out, shared)
    return out


def launch_info(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype = torch.bfloat16,
                impl: str = "invariant") -> dict:
    """The router launch and the grouped-GEMM config ``impl`` uses for this batch (for tables)."""
    cfg = select_config(num_tokens, top_k, num_experts, dtype, impl)
    return {"impl": impl, "tokens": num_tokens, "experts": num_experts, "top_k": top_k,
            "tokens_per_expert": tokens_per_expert(num_tokens, top_k, num_experts),
            "router": router_launch(num_tokens, num_experts, impl), **cfg.as_dict()}


#: the eager launches of this module's kernels (:mod:`.direct_launch`)
_ROUTER, _DISPATCH, _GROUPED_GEMM, _SPLITK_SILU, _COMBINE, _SILU_MUL = (
    DirectLaunch(_router_kernel), DirectLaunch(_dispatch_kernel), DirectLaunch(_grouped_gemm_kernel),
    DirectLaunch(_splitk_silu_kernel), DirectLaunch(_combine_kernel), DirectLaunch(_silu_mul_kernel))
