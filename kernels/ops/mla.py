"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged *latent* cache: a float64 reference,
one batch-invariant form for prefill and decode, and two variant twins.

The latent cache
----------------
MLA caches one vector per token instead of per-head keys and values: the compressed latent
``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) followed by the rotary key part
``k_pe`` (``rope_dim`` values, shared by every head).  The cache is the kit's paged cache with
one "kv head": ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, written through a block
table and a slot mapping with :func:`batch_invariance_kit.ops.attention.write_kv` (a bit copy).

Head ``h`` of the model sees ``k_h = [W_kc[h] c ; k_pe]`` and ``v_h = W_vc[h]^T c``, with
``W_kc`` ``(heads, qk_nope_dim, kv_lora_rank)`` and ``W_vc`` ``(heads, kv_lora_rank, v_dim)``
(the two halves of ``kv_b_proj``).  Two forms compute the same math with different arithmetic:

* **absorbed** (MQA over the latent): ``q_lat = W_kc[h]^T q_nope`` once per query, scores
  ``q_lat . c + q_pe . k_pe`` against the cache as it is, the output ``o_lat = sum p c``
  (``kv_lora_rank`` values), then ``o = W_vc[h]^T o_lat``.  Head dims: ``kv_lora_rank +
  rope_dim`` for scores (512 + 64 in DeepSeek-V3) and ``kv_lora_rank`` for values;
* **expanded** (MHA): keys and values of every head are built from the latent (``qk_nope_dim +
  rope_dim`` = 128 + 64 and ``v_dim`` = 128), then ordinary attention.  Engines use it for
  prefill (fewer FLOPs over long prompts) and the absorbed form for decode.

Rounded differently, the two forms give different bits: an engine that prefills with one and
decodes with the other breaks prefill == decode by construction.  The kit uses the absorbed
form for every step (``impl="invariant"``); ``impl="two_forms"`` is the engine habit, kept as
the negative control.

The schedule of the absorbed kernel
-----------------------------------
One program per (query token, block of heads): the heads of one token are the rows of its tile
(MQA: every head reads the same cached rows).  A row at position ``p`` visits the KV tiles of
``block_n`` keys ``0 .. p // block_n`` in order (keys ``> p`` masked), groups them into splits
of ``split_size_at(p)`` keys (the kit attention's position-graded sizes,
:func:`batch_invariance_kit.ops.attention.split_size_at`), builds each split's online-softmax
state from scratch in fp32 and folds it into a running state in split order (the left fold
``M = max(m, m_i)``, ``l = fma(l, e^(m-M), l_i e^(m_i-M))``, ``acc`` likewise).  The row sum is a
fixed pairwise tree and ``p`` is rounded to the cache's dtype before its product with the
latent.  Nothing in a row's arithmetic depends on the other rows, the other tokens of the
step, the step's size or the chunk boundaries: prefill == decode at every position, any chunk
start.  Who computes a split is a launch decision: a step of few tokens (a decode step of a
small batch) runs one program per (token, block of heads, split), writes the split states to
an fp32 workspace and folds them in a merge kernel, in the same order, so the same bits
(:data:`MLA_LAUNCH`).  ``impl="variant"`` runs the same kernels with split sizes chosen from
the batch (``num_splits = max(1, 2*SMs // num_seqs)`` per sequence, as production split-KV
decode does): the negative control of the batch-invariance check.

The per-head projections (``W_kc`` absorption, ``W_vc`` output) are :func:`head_matmul`, a
Triton kernel whose K loop has a fixed block size (its ``"variant"``: a block size picked from
the number of tokens).
"""
from __future__ import annotations

import math

import torch

from .. import checks
from ..device import DEVICE, INTERPRET
from . import attention as A

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .tl_numerics import dot_acc, from_f32, to_f32  # noqa: E402

__all__ = ["IMPLS", "MLA_LAUNCH", "mla_block_h", "mla_parallel", "MLAShape", "new_latent_cache", "write_latent", "LatentCache",
           "mla_split_sizes", "mla_attention", "reference_mla_attention", "head_matmul", "mla", "reference_mla"]

#: ``invariant``: the absorbed form for every step, splits by position; ``variant``: the
#: absorbed form with splits chosen from the batch; ``two_forms``: multi-token steps expanded
#: to per-head keys and values (the kit's GQA attention), one-token steps absorbed;
#: ``reference``: float64.
IMPLS = ("invariant", "variant", "two_forms", "reference")


#: The absorbed kernel's launch: heads per program (the rows of its tiles; ``small_block_h``
#: where ``block_h`` would give fewer than ``small_programs`` programs, a step of a few tokens),
#: warps and pipeline stages; a step with fewer (token, head block) programs than
#: ``parallel_below_per_sm`` times the GPU's SMs runs one program per split plus a merge launch
#: instead of folding each row's splits in one program (``merge_block_h`` heads and
#: ``merge_warps`` warps per merge program).  Work only: a row's arithmetic is its own
#: at any of them (on an H100, at DeepSeek-V3 sizes, every shape tried gave the same bits; with
#: one program per row, 64 heads with 8 warps and 2 stages were the fastest for 64 decode tokens
#: and for a 4096-token prefill, 16 heads for one decode token; one program per split was 2.2x
#: faster for 8 decode tokens over 4096 keys (16 programs on 132 SMs) and 1.6x slower for 64
#: (128 programs): ``results/h100/explorations/mla_launch`` and ``results/h100/mla_bench.json``).
MLA_LAUNCH = {"block_h": 64, "small_block_h": 16, "small_programs": 16, "num_warps": 8, "num_stages": 2,
              "parallel_below_per_sm": 0.5, "merge_block_h": 16, "merge_warps": 4}


def mla_parallel(programs: int, max_splits: int) -> bool:
    """Whether a step of ``programs`` (token, head block) programs runs one program per split
    (:data:`MLA_LAUNCH`; SMs: the current GPU's, 8 under the interpreter, as attention's plans)."""
    return max_splits > 1 and programs < MLA_LAUNCH["parallel_below_per_sm"] * A.num_sms()


def mla_block_h(num_tokens: int, heads: int) -> int:
    """Heads per program of the absorbed kernel for a step of ``num_tokens`` tokens (a power of
    two, 16 to 64; :data:`MLA_LAUNCH`)."""
    cap = triton.next_power_of_2(heads)
    bh = max(16, min(MLA_LAUNCH["block_h"], cap))
    if num_tokens * triton.cdiv(heads, bh) < MLA_LAUNCH["small_programs"]:
        bh = max(16, min(MLA_LAUNCH["small_block_h"], cap))
    return bh


class MLAShape:
    """The head layout of one MLA layer, checked: ``heads``, ``kv_lora_rank``, ``rope_dim``
    (even: rotary pairs), ``qk_nope_dim``, ``v_dim``."""

    def __init__(self, heads: int, kv_lora_rank: int, rope_dim: int, qk_nope_dim: int, v_dim: int):
        for name, v in (("heads", heads), ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim),
                        ("qk_nope_dim", qk_nope_dim), ("v_dim", v_dim)):
            checks.positive_int(name, v)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (rotary pairs), got {rope_dim}")
        self.heads, self.kv_lora_rank, self.rope_dim = heads, kv_lora_rank, rope_dim
        self.qk_nope_dim, self.v_dim = qk_nope_dim, v_dim

    @property
    def latent_dim(self) -> int:
        """Values per cached token: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def scale(self) -> float:
        """DeepSeek's softmax scale ``1 / sqrt(qk_nope_dim + rope_dim)`` (both forms)."""
        return 1.0 / math.sqrt(self.qk_nope_dim + self.rope_dim)

    def __repr__(self) -> str:
        return (f"MLAShape(heads={self.heads}, kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, "
                f"qk_nope_dim={self.qk_nope_dim}, v_dim={self.v_dim})")


# --------------------------------------------------------------------------------------------
# The latent cache
# --------------------------------------------------------------------------------------------

def new_latent_cache(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype=torch.bfloat16,
                     device=None) -> torch.Tensor:
    """The paged latent cache ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, zeros."""
    checks.positive_int("kv_lora_rank", kv_lora_rank)
    checks.positive_int("rope_dim", rope_dim)
    k, _ = A.new_cache(num_blocks, block_size, 1, kv_lora_rank + rope_dim, dtype=dtype, device=device)
    return k[:, :, 0, :]


def _check_cache(cache, kv_lora_rank: int) -> None:
    checks.tensor("cache", cache, dim=3, contiguous=False)
    if cache.stride(2) != 1:
        raise ValueError(f"cache must have unit stride in its last dim, got strides {cache.stride()}")
    checks.positive_int("kv_lora_rank", kv_lora_rank)
    if cache.shape[2] <= kv_lora_rank:
        raise ValueError(f"cache rows hold {cache.shape[2]} values: kv_lora_rank={kv_lora_rank} leaves no rope part")


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                 check_slots: bool = True) -> None:
    """Store ``[latent ; k_pe]`` (``(T, kv_lora_rank)`` and ``(T, rope_dim)``) at ``slot_mapping``
    (``-1``: skip) of the latent cache: :func:`batch_invariance_kit.ops.attention.write_kv` on the
    cache seen as one kv head (bits copied)."""
    checks.tensor("latent", latent, dim=2, contiguous=False, nonempty=False)
    checks.tensor("k_pe", k_pe, dim=2, contiguous=False, nonempty=False)
    _check_cache(cache, latent.shape[1])
    if latent.shape[1] + k_pe.shape[1] != cache.shape[2]:
        raise ValueError(f"latent ({latent.shape[1]}) + k_pe ({k_pe.shape[1]}) values must equal the cache's "
                         f"{cache.shape[2]} per token")
    if k_pe.shape[0] != latent.shape[0]:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens but latent has {latent.shape[0]}")
    kv = torch.cat([latent, k_pe], dim=1)[:, None, :]
    c4 = cache.unsqueeze(2)
    A.write_kv(kv, kv, c4, c4, slot_mapping, check_slots=check_slots)


class LatentCache:
    """A paged latent cache with its allocator (tests, benchmarks, the book): sequences get
    physical blocks on demand from a free list shuffled by ``seed`` (``None``: in order).  A
    *step* is a list of ``(name, q, seq_len)`` as in
    :class:`batch_invariance_kit.ops.attention.PagedCache`, ``q`` the absorbed queries
    ``(q_len, heads, kv_lora_rank + rope_dim)``."""

    def __init__(self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype=torch.bfloat16,
                 *, device=None, seed: int | None = None):
        self.cache = new_latent_cache(num_blocks, block_size, kv_lora_rank, rope_dim, dtype, device)
        self.kv_lora_rank, self.block_size, self.num_blocks = kv_lora_rank, block_size, num_blocks
        self.free = (list(range(num_blocks - 1, -1, -1)) if seed is None else
                     torch.randperm(num_blocks, generator=torch.Generator().manual_seed(int(seed))).tolist())
        self.tables: dict = {}

    def write(self, name, latent: torch.Tensor, k_pe: torch.Tensor, start: int = 0) -> None:
        """Store positions ``start .. start + len(latent) - 1`` of sequence ``name``."""
        end = start + latent.shape[0]
        blocks = self.tables.setdefault(name, [])
        if triton.cdiv(end, self.block_size) - len(blocks) > len(self.free):
            raise ValueError(f"out of blocks: sequence {name!r} needs positions up to {end}, "
                             f"{len(self.free)} of num_blocks={self.num_blocks} are free")
        A.grow_blocks(blocks, end, self.block_size, self.free.pop)
        bt = A.block_table([blocks], self.cache.device)
        write_latent(latent, k_pe, self.cache, A.slots(bt, 0, start, end, self.block_size))

    def args(self, steps) -> tuple:
        """``(q, block_table, seq_lens, query_start_loc)`` of a step."""
        steps = list(steps)
        if not steps:
            raise ValueError("steps must hold at least one (name, q, seq_len)")
        dev = self.cache.device
        for i, (name, q, n) in enumerate(steps):
            if name not in self.tables:
                raise ValueError(f"steps[{i}]: sequence {name!r} has no blocks in this cache (write it first)")
            if n > len(self.tables[name]) * self.block_size:
                raise ValueError(f"steps[{i}] seq_len={n} is longer than sequence {name!r}'s blocks hold")
        bt = A.block_table([self.tables[name] for name, _, _ in steps], dev)
        lens = torch.tensor([n for _, _, n in steps], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0] + [q.shape[0] for _, q, _ in steps]).cumsum(0).to(torch.int32).to(dev)
        return torch.cat([q for _, q, _ in steps]), bt, lens, qsl

    def run(self, steps, *, scale: float, impl: str = "invariant", config=None, out=None) -> list:
        """:func:`mla_attention` of one step, split back per entry."""
        q, bt, lens, qsl = self.args(steps)
        o = mla_attention(q, self.cache, bt, lens, qsl, kv_lora_rank=self.kv_lora_rank, scale=scale, impl=impl,
                          config=config, out=out)
        return list(o.split([st[1].shape[0] for st in steps]))


# --------------------------------------------------------------------------------------------
# The absorbed kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _pairwise_row_sum(p, ROWS: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr):
    """Sum of each row of ``p`` (ROWS, W) by a pairwise tree over adjacent columns
    (``(0+1)+(2+3)...``): each level adds two elements, so no register layout enters."""
    x = p
    for i in tl.static_range(LOG2_W):
        x = tl.sum(tl.reshape(x, (ROWS, W >> (i + 1), 2)), 2)
    return tl.reshape(x, (ROWS,))


@triton.jit
def _mla_fold(m, l, acc, m_i, l_i, acc_i):
    """``state (+) split state`` in fp32 with explicit FMAs (one rounding each)."""
    m_new = tl.maximum(m, m_i)
    a = tl.exp(m - m_new)
    b = tl.exp(m_i - m_new)
    return m_new, tl.fma(l, a, l_i * b), tl.fma(acc, a[:, None], acc_i * b[:, None])


@triton.jit(do_not_specialize=["max_splits"])
def _mla_kernel(q_ptr, c_ptr, bt_ptr, tok_seq_ptr, tok_pos_ptr, tok_split_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                max_splits, scale, heads, s_qt, s_qh, s_cb, s_cs, s_bts, s_ot, s_oh,
                LORA: tl.constexpr, ROPE: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_N: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                UPCAST: tl.constexpr, PARALLEL: tl.constexpr):
    """Serial: program (query token, block of heads): the row's splits built and folded in
    order, then ``o_lat = acc / l`` rounded once to out's dtype.  ``PARALLEL``: program (query
    token, block of heads, split) builds that split's state the same way and writes it to the
    fp32 workspace (row ``(token * heads + head) * max_splits + split``); :func:`_mla_merge_kernel`
    folds them in split order: the same operations, so the same bits, with more programs for a
    step of few tokens."""
    tok = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    seq = tl.load(tok_seq_ptr + tok)
    pos = tl.load(tok_pos_ptr + tok)
    split_tiles = tl.load(tok_split_ptr + tok) // BLOCK_N
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    l_ok = dl < LORA
    r_ok = dr < ROPE
    q_row = q_ptr + tok.to(tl.int64) * s_qt + h[:, None] * s_qh
    q_lat = tl.load(q_row + dl[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + LORA + dr[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = to_f32(q_lat)
        q_pe = to_f32(q_pe)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bts
    n_tiles = pos // BLOCK_N + 1
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc_i = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    if PARALLEL:  # this program's split only
        t_lo = tl.program_id(2) * split_tiles
        t_hi = tl.minimum(t_lo + split_tiles, n_tiles)
    else:
        t_lo, t_hi = 0, n_tiles
    for t in range(t_lo, t_hi):
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = keys <= pos
        blk = tl.load(bt_row + keys // CACHE_BLOCK, mask=k_ok, other=0)
        base = blk.to(tl.int64) * s_cb + (keys % CACHE_BLOCK) * s_cs
        c = tl.load(c_ptr + base[:, None] + dl[None, :], mask=k_ok[:, None] & l_ok[None, :], other=0.0)
        kpe = tl.load(c_ptr + base[:, None] + LORA + dr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
        s = dot_acc(q_lat, tl.trans(c), s, UPCAST)
        s = dot_acc(q_pe, tl.trans(kpe), s, UPCAST)
        x = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))  # finite: key t * BLOCK_N <= pos is visible
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(x - m_new[:, None])
        l_i = l_i * alpha + _pairwise_row_sum(p, BLOCK_H, BLOCK_N, LOG2_N)
        acc_i = dot_acc(from_f32(p, c.dtype), c, acc_i * alpha[:, None], UPCAST)
        m_i = m_new
        if not PARALLEL:
            if ((t + 1) % split_tiles == 0) | (t + 1 == n_tiles):
                m, l, acc = _mla_fold(m, l, acc, m_i, l_i, acc_i)
                m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
                l_i = tl.zeros((BLOCK_H,), tl.float32)
                acc_i = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    if PARALLEL:
        keep = h_ok & (h * 0 + t_lo < t_hi)  # a split past the row's last stores nothing
        w = (tok.to(tl.int64) * heads + h) * max_splits + tl.program_id(2)
        tl.store(ws_acc_ptr + w[:, None] * L_PAD + dl[None, :], acc_i, mask=keep[:, None])
        tl.store(ws_ml_ptr + w * 2, m_i, mask=keep)
        tl.store(ws_ml_ptr + w * 2 + 1, l_i, mask=keep)
    else:
        o = acc / l[:, None]
        o_ptr = out_ptr + tok.to(tl.int64) * s_ot + h[:, None] * s_oh + dl[None, :]
        tl.store(o_ptr, from_f32(o, out_ptr.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])


@triton.jit(do_not_specialize=["max_splits"])
def _mla_merge_kernel(ws_acc_ptr, ws_ml_ptr, tok_pos_ptr, tok_split_ptr, out_ptr, max_splits, heads, s_ot, s_oh,
                      LORA: tl.constexpr, L_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (query token, block of heads): the left fold of the row's split states from the
    workspace in split order, from the empty state (``_mla_fold``, as the serial program folds
    them), then ``o_lat = acc / l`` rounded once to out's dtype."""
    tok = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    dl = tl.arange(0, L_PAD)
    n = tl.load(tok_pos_ptr + tok) // tl.load(tok_split_ptr + tok) + 1  # the row's splits
    w0 = (tok.to(tl.int64) * heads + h) * max_splits
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    for j in range(0, n):
        m_j = tl.load(ws_ml_ptr + (w0 + j) * 2, mask=h_ok, other=0.0)
        l_j = tl.load(ws_ml_ptr + (w0 + j) * 2 + 1, mask=h_ok, other=1.0)  # (padding rows: no 0 / 0)
        acc_j = tl.load(ws_acc_ptr + (w0 + j)[:, None] * L_PAD + dl[None, :], mask=h_ok[:, None], other=0.0)
        m, l, acc = _mla_fold(m, l, acc, m_j, l_j, acc_j)
    o = acc / l[:, None]
    o_ptr = out_ptr + tok.to(tl.int64) * s_ot + h[:, None] * s_oh + dl[None, :]
    tl.store(o_ptr, from_f32(o, out_ptr.dtype.element_ty), mask=h_ok[:, None] & (dl < LORA)[None, :])


def mla_split_sizes(seq_lens, query_start_loc, *, impl: str = "invariant", config=None) -> list:
    """Keys per split of every query token of a step (host lists).  ``"invariant"``:
    :func:`batch_invariance_kit.ops.attention.split_size_at` of the token's own position.
    ``"variant"``: per sequence, ``num_splits = max(1, 2*SMs // num_seqs)`` and ``ceil(seq_len /
    num_splits)`` keys rounded up to whole ``block_n`` tiles: a function of the batch."""
    if impl not in ("invariant", "variant"):
        raise ValueError(f"impl must be 'invariant' or 'variant', got {impl!r}")
    cfg = A.resolve_config(config)
    lens, qsl = [int(x) for x in seq_lens], [int(x) for x in query_start_loc]
    bn, out = cfg.block_n, []
    num_splits = max(1, (2 * A.num_sms()) // max(1, len(lens)))
    memo: dict = {}
    for s, n in enumerate(lens):
        q_len = qsl[s + 1] - qsl[s]
        if impl == "variant":
            keys = -(-n // num_splits)
            out += [max(bn, -(-keys // bn) * bn)] * q_len
        else:
            for p in range(n - q_len, n):
                if p not in memo:
                    memo[p] = A.split_size_at(p, cfg)
                out.append(memo[p])
    return out


def _check_step(q, cache, block_table, seq_lens, query_start_loc, kv_lora_rank, name_q="q"):
    checks.tensor(name_q, q, dim=3, contiguous=False)
    _check_cache(cache, kv_lora_rank)
    checks.same_dtype("cache", cache, name_q, q)
    checks.same_device("cache", cache, name_q, q)
    if q.shape[2] != cache.shape[2]:
        raise ValueError(f"{name_q} has {q.shape[2]} values per head; the cache holds kv_lora_rank + rope_dim = "
                         f"{cache.shape[2]}")
    if q.stride(2) != 1:
        raise ValueError(f"{name_q} must have unit stride in its last dim, got strides {q.stride()}")
    checks.tensor("block_table", block_table, dtypes=(torch.int32,), dim=2)
    checks.tensor("seq_lens", seq_lens, dtypes=(torch.int32, torch.int64), dim=1)
    checks.tensor("query_start_loc", query_start_loc, dtypes=(torch.int32, torch.int64), dim=1)
    lens = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    S = len(lens)
    if len(qsl) != S + 1 or block_table.shape[0] != S:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {S + 1} entries and block_table {S} rows, got "
                         f"{len(qsl)} and {block_table.shape[0]}")
    if qsl[0] != 0 or qsl[-1] != q.shape[0] or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to the {q.shape[0]} query tokens, got {qsl}")
    bs = cache.shape[1]
    for s, n in enumerate(lens):
        if n < qsl[s + 1] - qsl[s]:
            raise ValueError(f"seq_lens[{s}]={n} is shorter than its {qsl[s + 1] - qsl[s]} new tokens")
        if n > block_table.shape[1] * bs:
            raise ValueError(f"seq_lens[{s}]={n} is longer than block_table's {block_table.shape[1]} blocks of {bs}")
    return lens, qsl


def _positions(lens, qsl) -> list:
    """The position of every query token of a step (host lists)."""
    return [p for s, n in enumerate(lens) for p in range(n - (qsl[s + 1] - qsl[s]), n)]


def _token_meta(lens, qsl, pos, dev):
    """Per query token of a step (``pos``: their positions, :func:`_positions`): its sequence and
    its position, int32 on ``dev``."""
    seq = [s for s in range(len(lens)) for _ in range(qsl[s + 1] - qsl[s])]
    return (torch.tensor(seq, dtype=torch.int32, device=dev), torch.tensor(pos, dtype=torch.int32, device=dev))


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, *, kv_lora_rank: int, scale: float, impl: str = "invariant",
                  config=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The absorbed MLA attention of a varlen step: ``q`` ``(T, heads, kv_lora_rank + rope_dim)``
    (absorbed query, then its rope part) against the latent cache -> ``o_lat`` ``(T, heads,
    kv_lora_rank)`` in q's dtype.  ``seq_lens``/``query_start_loc``/``block_table`` as in
    :func:`batch_invariance_kit.ops.attention.attention` (causal; new tokens are each sequence's
    last positions).  ``impl``: ``"invariant"``, ``"variant"`` or ``"reference"`` (float64)."""
    if impl not in ("invariant", "variant", "reference"):
        raise ValueError(f"impl must be 'invariant', 'variant' or 'reference' for mla_attention, got {impl!r}")
    lens, qsl = _check_step(q, cache, block_table, seq_lens, query_start_loc, kv_lora_rank)
    scale = checks.positive_float("scale", scale)
    T, H, _ = q.shape
    shape = (T, H, kv_lora_rank)
    out = checks.output("out", out, shape, q.dtype, q, like_name="q", inputs=(("q", q), ("cache", cache)))
    if impl == "reference":
        return out.copy_(reference_mla_attention(q, cache, block_table, seq_lens, query_start_loc,
                                                 kv_lora_rank=kv_lora_rank, scale=scale))
    checks.kernel_device("q", q)
    cfg = A.resolve_config(config)
    splits = mla_split_sizes(lens, qsl, impl=impl, config=cfg)
    dev = q.device
    pos = _positions(lens, qsl)
    tok_seq, tok_pos = _token_meta(lens, qsl, pos, dev)
    tok_split = torch.tensor(splits, dtype=torch.int32, device=dev)
    rope = cache.shape[2] - kv_lora_rank
    block_h = mla_block_h(T, H)
    bn = cfg.block_n
    l_pad = max(16, triton.next_power_of_2(kv_lora_rank))
    hb = triton.cdiv(H, block_h)
    max_splits = max((p // sp + 1 for p, sp in zip(pos, splits)), default=1)
    parallel = mla_parallel(T * hb, max_splits)
    if parallel:  # a step of few tokens: one program per split, then the merge
        ws_acc = torch.empty((T * H * max_splits, l_pad), dtype=torch.float32, device=dev)
        ws_ml = torch.empty((T * H * max_splits, 2), dtype=torch.float32, device=dev)
    else:
        ws_acc = ws_ml = out
    _mla_kernel[(T, hb, max_splits if parallel else 1)](
        q, cache, block_table, tok_seq, tok_pos, tok_split, out, ws_acc, ws_ml, max_splits, scale, H,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0), out.stride(0),
        out.stride(1), LORA=kv_lora_rank, ROPE=rope, L_PAD=l_pad,
        R_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=bn, LOG2_N=bn.bit_length() - 1,
        CACHE_BLOCK=cache.shape[1], UPCAST=INTERPRET, PARALLEL=parallel, num_warps=MLA_LAUNCH["num_warps"],
        num_stages=MLA_LAUNCH["num_stages"])
    if parallel:  # merge_block_h heads per program (a fold is element-wise: any grouping, the same bits)
        mh = MLA_LAUNCH["merge_block_h"]
        _mla_merge_kernel[(T, triton.cdiv(H, mh))](ws_acc, ws_ml, tok_pos, tok_split, out, max_splits, H,
                                                   out.stride(0), out.stride(1), LORA=kv_lora_rank, L_PAD=l_pad,
                                                   BLOCK_H=mh, num_warps=MLA_LAUNCH["merge_warps"])
    return out


def _gather(cache, block_table, s, n):
    """Rows ``0..n-1`` of sequence ``s`` from the paged cache (host copy for the references)."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=block_table.device)
    return cache[block_table[s, pos // bs].long(), pos % bs]


def reference_mla_attention(q, cache, block_table, seq_lens, query_start_loc, *, kv_lora_rank: int,
                            scale: float) -> torch.Tensor:
    """float64 absorbed attention, rounded once to q's dtype."""
    lens, qsl = seq_lens.tolist(), query_start_loc.tolist()
    out = torch.empty((q.shape[0], q.shape[1], kv_lora_rank), dtype=q.dtype, device=q.device)
    for s, n in enumerate(lens):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        kv = _gather(cache, block_table, s, n).double()                    # (n, lora + rope)
        sc = torch.einsum("thd,nd->thn", q[a:b].double(), kv) * scale     # (q_len, H, n)
        pos = torch.arange(n - (b - a), n, device=q.device)
        sc = sc.masked_fill(torch.arange(n, device=q.device)[None, None, :] > pos[:, None, None], float("-inf"))
        out[a:b] = torch.einsum("thn,nl->thl", torch.softmax(sc, -1), kv[:, :kv_lora_rank]).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Per-head projections
# --------------------------------------------------------------------------------------------

@triton.jit
def _head_mm_kernel(x_ptr, w_ptr, o_ptr, T, K, N, s_xt, s_xh, s_wh, s_wk, s_ot, s_oh,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                    PARTIAL: tl.constexpr):
    """Program (block of tokens, head, block of columns): ``x[t, h] @ w[h]`` over K blocks of
    ``BLOCK_K`` in increasing order, fp32, rounded once.  Each block's products accumulate into
    the running sum; with ``PARTIAL`` each block's sum is formed first and then added (the
    grouping of split-K: another association, where the block size decides the bits)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < T
    n_ok = n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + t.to(tl.int64)[:, None] * s_xt + h * s_xh + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + h.to(tl.int64) * s_wh + k[:, None] * s_wk + n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if PARTIAL:  # an FMA by one, not an add: Triton would fold ``acc + dot(a, b, 0)`` into the dot
            acc = tl.fma(dot_acc(a, b, tl.zeros((BLOCK_T, BLOCK_N), tl.float32), UPCAST), 1.0, acc)
        else:
            acc = dot_acc(a, b, acc, UPCAST)
    tl.store(o_ptr + t.to(tl.int64)[:, None] * s_ot + h * s_oh + n[None, :], from_f32(acc, o_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


#: K per step of the invariant head GEMM (fixed: the K order of every output element)
HEAD_MM_BLOCK_K = 32 if INTERPRET else 64


def head_matmul(x: torch.Tensor, w: torch.Tensor, *, impl: str = "invariant", out=None) -> torch.Tensor:
    """``out[t, h] = x[t, h] @ w[h]``: ``x`` ``(T, heads, K)``, ``w`` ``(heads, K, N)`` -> ``(T,
    heads, N)`` in x's dtype, fp32 accumulation.  ``"invariant"``: K blocks of
    :data:`HEAD_MM_BLOCK_K`, each accumulated into the running sum; ``"variant"``: each block's
    partial sum added to it, blocks of 16 for fewer than 16 tokens, else 64 (a K grouping picked
    from the batch, as a split-K launch picks it); ``"reference"``: float64, rounded once."""
    if impl not in ("invariant", "variant", "reference"):
        raise ValueError(f"impl must be 'invariant', 'variant' or 'reference', got {impl!r}")
    checks.tensor("x", x, dim=3, contiguous=False)
    checks.tensor("w", w, dim=3, contiguous=False)
    checks.same_dtype("w", w, "x", x)
    checks.same_device("w", w, "x", x)
    T, H, K = x.shape
    if w.shape[0] != H or w.shape[1] != K:
        raise ValueError(f"w must have shape ({H}, {K}, N) for x of {H} heads and K={K}, got {tuple(w.shape)}")
    if x.stride(2) != 1 or w.stride(2) != 1:
        raise ValueError("x and w must have unit stride in their last dim")
    N = w.shape[2]
    out = checks.output("out", out, (T, H, N), x.dtype, x, inputs=(("x", x), ("w", w)))
    if impl == "reference":
        return out.copy_(torch.einsum("thk,hkn->thn", x.double(), w.double()).to(x.dtype))
    checks.kernel_device("x", x)
    bk = HEAD_MM_BLOCK_K if impl == "invariant" else (16 if T < 16 else 64)
    bn = max(16, min(64, triton.next_power_of_2(N)))
    _head_mm_kernel[(triton.cdiv(T, 16), H, triton.cdiv(N, bn))](
        x, w, out, T, K, N, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_T=16, BLOCK_N=bn, BLOCK_K=bk, UPCAST=INTERPRET, PARTIAL=impl == "variant")
    return out


# --------------------------------------------------------------------------------------------
# The layer's attention: absorption, attention, output projection
# --------------------------------------------------------------------------------------------

def _check_weights(q_nope, q_pe, w_kc, w_vc, cache):
    checks.tensor("q_nope", q_nope, dim=3, contiguous=False)
    checks.tensor("q_pe", q_pe, dim=3, contiguous=False)
    checks.tensor("w_kc", w_kc, dim=3)
    checks.tensor("w_vc", w_vc, dim=3)
    T, H, nope = q_nope.shape
    if q_pe.shape[:2] != (T, H):
        raise ValueError(f"q_pe must have q_nope's {T} tokens and {H} heads, got shape {tuple(q_pe.shape)}")
    if w_kc.shape[0] != H or w_kc.shape[1] != nope:
        raise ValueError(f"w_kc must have shape ({H} heads, qk_nope_dim={nope}, kv_lora_rank), got {tuple(w_kc.shape)}")
    lora = w_kc.shape[2]
    if w_vc.shape[0] != H or w_vc.shape[1] != lora:
        raise ValueError(f"w_vc must have shape ({H} heads, kv_lora_rank={lora}, v_dim), got {tuple(w_vc.shape)}")
    if cache.shape[2] != lora + q_pe.shape[2]:
        raise ValueError(f"the cache holds {cache.shape[2]} values per token; kv_lora_rank={lora} + rope_dim="
                         f"{q_pe.shape[2]} (from w_kc and q_pe) = {lora + q_pe.shape[2]}")
    for name, t in (("q_pe", q_pe), ("w_kc", w_kc), ("w_vc", w_vc), ("cache", cache)):
        checks.same_dtype(name, t, "q_nope", q_nope)
        checks.same_device(name, t, "q_nope", q_nope)
    return MLAShape(H, lora, q_pe.shape[2], nope, w_vc.shape[2])


def mla(q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, w_kc, w_vc, *, impl: str = "invariant",
        scale: float | None = None, config=None) -> torch.Tensor:
    """MLA attention of a varlen step from the per-head queries: ``q_nope`` ``(T, heads,
    qk_nope_dim)``, ``q_pe`` ``(T, heads, rope_dim)`` (rotary applied), the latent cache (this
    step's tokens already written), ``w_kc`` ``(heads, qk_nope_dim, kv_lora_rank)``, ``w_vc``
    ``(heads, kv_lora_rank, v_dim)`` -> ``(T, heads, v_dim)``.  ``scale``: default
    ``1/sqrt(qk_nope_dim + rope_dim)``.  ``impl``: see :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_cache(cache, 1)
    shp = _check_weights(q_nope, q_pe, w_kc, w_vc, cache)
    scale = shp.scale if scale is None else checks.positive_float("scale", scale)
    if impl == "reference":
        return reference_mla(q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, w_kc, w_vc, scale=scale)
    mm = "variant" if impl == "variant" else "invariant"
    q_lat = head_matmul(q_nope, w_kc, impl=mm)
    q = torch.cat([q_lat, q_pe], dim=2)
    attn = "variant" if impl == "variant" else "invariant"
    o_lat = mla_attention(q, cache, block_table, seq_lens, query_start_loc, kv_lora_rank=shp.kv_lora_rank,
                          scale=scale, impl=attn, config=config)
    out = head_matmul(o_lat, w_vc, impl=mm)
    if impl == "two_forms":
        _expanded_multi_token_steps(out, q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, w_kc, w_vc,
                                    shp, scale)
    return out


def _expanded_multi_token_steps(out, q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, w_kc, w_vc, shp,
                                scale) -> None:
    """The engines' prefill form, written into ``out`` for the sequences with more than one new
    token: per-head keys ``[W_kc c ; k_pe]`` and values ``W_vc^T c`` (zero-padded to the key
    dim) expanded from the latent cache blocks of those sequences (copied into a cache of their
    own), then the kit's GQA attention with as many kv heads as q heads."""
    lens, qsl = seq_lens.tolist(), query_start_loc.tolist()
    multi = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] > 1]
    if not multi:
        return
    if shp.v_dim > shp.qk_nope_dim + shp.rope_dim:
        raise ValueError(f"two_forms expands values into the key dim: v_dim={shp.v_dim} must be <= "
                         f"qk_nope_dim + rope_dim = {shp.qk_nope_dim + shp.rope_dim}")
    bs = cache.shape[1]
    H, lora, d = shp.heads, shp.kv_lora_rank, shp.qk_nope_dim + shp.rope_dim
    need = [triton.cdiv(lens[s], bs) for s in multi]
    used = torch.cat([block_table[s, :n] for s, n in zip(multi, need)]).long()
    nb = used.shape[0]
    c = cache[used].reshape(nb * bs, -1)
    lat = c[:, None, :lora].expand(nb * bs, H, lora).contiguous()
    k_nope = head_matmul(lat, w_kc.transpose(1, 2).contiguous())
    k = torch.cat([k_nope, c[:, None, lora:].expand(nb * bs, H, shp.rope_dim)], dim=2)
    v = torch.zeros_like(k)
    v[:, :, :shp.v_dim] = head_matmul(lat, w_vc)
    toks = torch.cat([torch.arange(qsl[s], qsl[s + 1]) for s in multi]).to(out.device)
    q = torch.cat([q_nope, q_pe], dim=2)[toks].contiguous()
    sub_qsl = torch.tensor([0] + [qsl[s + 1] - qsl[s] for s in multi]).cumsum(0).to(torch.int32).to(out.device)
    first = torch.tensor([0] + need[:-1]).cumsum(0).tolist()
    sub_bt = A.block_table([list(range(a, a + n)) for a, n in zip(first, need)], out.device)
    o = A.attention(q, k.view(nb, bs, H, d), v.view(nb, bs, H, d), sub_bt, seq_lens[multi].to(torch.int32).contiguous(),
                    sub_qsl, scale=scale)
    out[toks] = o[:, :, :shp.v_dim]


def reference_mla(q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, w_kc, w_vc, *,
                  scale: float) -> torch.Tensor:
    """float64 MLA in the expanded form (per-head keys and values), rounded once."""
    lens, qsl = seq_lens.tolist(), query_start_loc.tolist()
    lora = w_kc.shape[2]
    T, H, _ = q_nope.shape
    out = torch.empty((T, H, w_vc.shape[2]), dtype=q_nope.dtype, device=q_nope.device)
    wk, wv = w_kc.double(), w_vc.double()
    for s, n in enumerate(lens):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        kv = _gather(cache, block_table, s, n).double()
        k_nope = torch.einsum("hnl,jl->jhn", wk, kv[:, :lora])                 # (n, H, nope)
        v = torch.einsum("jl,hlv->jhv", kv[:, :lora], wv)                       # (n, H, v)
        sc = (torch.einsum("thn,jhn->thj", q_nope[a:b].double(), k_nope)
              + torch.einsum("thr,jr->thj", q_pe[a:b].double(), kv[:, lora:])) * scale
        pos = torch.arange(n - (b - a), n, device=q_nope.device)
        sc = sc.masked_fill(torch.arange(n, device=q_nope.device)[None, None, :] > pos[:, None, None], float("-inf"))
        out[a:b] = torch.einsum("thj,jhv->thv", torch.softmax(sc, -1), v).to(q_nope.dtype)
    return out
