"""Attention over a paged KV cache: a float64 reference, a batch-*invariant* Triton kernel and
its split-KV *variant* twin.

The files
---------
* :mod:`.schedule`: the reduction schedule (:class:`AttnConfig`, :func:`split_size_at`,
  :func:`query_tile`, :func:`split_plan`): which tiles and splits a row's keys fall into;
* :mod:`.cache`: the paged KV cache and its allocator (:func:`new_cache`, :func:`write_kv` and its
  bit-copying kernel, :class:`PagedCache`);
* :mod:`.kernels`: the Triton kernels (the online-softmax tile step, the split state, the left
  fold, the split and merge kernels);
* :mod:`.plan`: the plan of a step (:func:`make_plan`) and its one layout in a flat buffer
  (:class:`PlanLayout`), shared by the planner and by persistent plans;
* :mod:`.launcher`: the launches of a planned step (:func:`launch`) and its workspace;
* :mod:`.ops`: the public ops, :func:`attention` and :func:`decode`;
* :mod:`.validate`: the checks of the arguments (each error names the argument);
* :mod:`.reference`: the float64 reference and torch's SDPA on keys gathered from the cache;
* :mod:`.testing`: the helpers that the tests and chapter 6 share (head layout, seeded data, a
  cache, the decode operator of the harness, the mixed-batch and chunked-prefill cases).

The paged KV cache
------------------
``k_cache``, ``v_cache``: ``(num_blocks, block_size, kv_heads, head_dim)``; a sequence's key at
position ``p`` lives in physical block ``block_table[s, p // block_size]``, row
``p % block_size`` (:mod:`.cache`).

One kernel for prefill, decode and mixed batches
------------------------------------------------
:func:`attention` takes a *varlen* batch like vLLM: ``q`` ``(num_tokens, q_heads, head_dim)``
holds the new tokens of every sequence back to back (``query_start_loc``), ``seq_lens[s]`` is
the context of sequence ``s`` *after* this step (cached tokens + new ones), so the new tokens
of ``s`` are at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and are causal.  Decode is
the case ``q_len = 1`` (:func:`decode`), prefill ``q_len = prompt`` (:func:`prefill`), chunked
prefill, prefix-cache hits and speculative verify steps ``q_len < seq_len``, starting at any
position.  GQA: ``q_heads`` a multiple of ``kv_heads``.  A sequence with ``q_len = 0`` (a
padding entry) takes no work.

The reduction schedule (what makes a token's bits independent of everything but itself)
-------------------------------------------------------------------------------------
Every query row (one token, one q head) at position ``p`` is reduced over its keys ``0..p`` in
the same way, whichever launch it is part of:

1. keys are cut into KV tiles of ``block_n`` positions (tile ``j`` = keys ``j*block_n ..``),
   visited in increasing order; the row's own position lies in its *diagonal* tile
   ``p // block_n``, where keys ``> p`` are masked (score ``-inf``); every earlier tile is
   visible to the whole row (launches of many-token steps leave its mask out: no bit moves);
2. tiles are grouped into *splits* of ``S(p)`` keys (a multiple of ``block_n``): split ``i``
   covers tiles ``i*S/block_n ..``; the row has ``ceil((p+1) / S)`` splits.  ``S`` is
   :func:`split_size_at`: ``min(split_size, block_n * next_pow2(ceil(n / split_target)))``
   for a row whose keys span ``n`` tiles (on the GPU: 64-key splits up to 2048 keys of
   context, 128 up to 4096, 256 up to 8192, then 512), or ``split_size`` for every row when
   ``split_target`` is ``None``.  A function of the row's diagonal tile only.  Each split's
   state is an online softmax from scratch over its tiles in fp32: running max ``m``, sum
   ``l`` and ``acc`` (``alpha = exp(m_old - m_new)``, ``p = exp(s - m_new)`` with the
   score's scaling fused into the subtraction on the GPU, ``l = l*alpha +
   rowsum(p)``, ``acc = acc*alpha + p @ V``; 16-bit ``p`` is rounded to V's dtype for the
   tensor cores; ``rowsum`` is a fixed pairwise tree, below);
3. the split states are merged by the *left fold* ``((((e + s0) + s1) + s2) + ...)`` from the
   empty state ``e`` (``m = -inf``, ``l = 0``, ``acc = 0``), with ``M = max(m_a, m_b)``,
   ``l = fma(l_a, e^(m_a-M), l_b*e^(m_b-M))``, ``acc`` likewise (:func:`.kernels._fold`); then
   ``out = acc / l`` rounded once (RNE) to q's dtype.  (``e + s0`` is ``s0`` but for a ``-0``
   in its ``acc``, which becomes ``+0``: every launch folds split 0 the same way.)

Query tiles sit on an absolute grid
-----------------------------------
A program's query tile holds up to ``q_tile`` consecutive tokens of one sequence times the q
heads of one kv head (the rows of ``tl.dot``; rows never mix: every reduction is along a row).
Tiles are cut at the multiples of ``q_tile`` *of the position*, not of the chunk: a chunk that
starts at position 70 with ``q_tile = 16`` gets a partial first tile 70..79, then 80..95, ...
Because ``q_tile`` divides ``block_n``, every tile lies inside one KV tile, so all its rows
share the diagonal tile, hence the tiles they visit and the split size; the tile's last key
only decides how far loads go (keys past a row's position are masked either way).  A row
therefore runs exactly the tiles, splits and operations that decoding its position alone
runs: chunk boundaries, prefix-cache hits and verify steps may fall anywhere.

Launches: parallel or serial
----------------------------
Who computes what is a launch decision that never changes the bits.  A launch with fewer than
``serial_programs`` (query tile, kv head) programs runs one program per split, writes the fp32
states to a workspace, and a second kernel (one program per token, q head and block of
:data:`MERGE_COLUMNS` output columns) folds them; a larger launch runs *serially*: one program
per (query tile, kv head) builds each split's state in turn inside one loop over the row's
tiles and folds it into the running state as soon as the split closes, then writes the output.
The serial program performs exactly the operations of the split programs plus the merge kernel,
in the same order.  The merge folds column-wise (each column carries its own ``m`` and ``l``:
the same operations on the same values), so a thread folds its own columns with no data from
other threads; on Hopper it is launched with programmatic dependent launch and waits
(``griddepcontrol.wait``) before it reads a state.

Decode tiles and the row sum
----------------------------
A one-token step fills only ``q_heads / kv_heads`` rows of a tile (4 of 64 with 32 q and 8 kv
heads).  With ``decode_block_m=16`` the one-token steps of a launch run in a second launch of
the same kernel source with 16-row tiles (which tile a token gets depends on its own step
only).  Prefill == decode then needs every row to see the same arithmetic in a 64-row tile and
a 16-row tile.  ``tl.sum`` reduces in an order set by the register layout: with 16 rows and 4
warps, the warps split a row's keys among them, a cross-warp step the 64-row tile does not
have, and on the H200 decode differed from prefill at dozens of positions
(``results/h200/explorations/attention_16row_decode_tiles``).  The row sum ``l`` therefore never
goes through ``tl.sum``.  Compiled, it is ``p @ ones`` on the tensor cores (the 16-bit ``p``
that ``p @ V`` uses; the tensor cores' order is the same for every tile height), its 16 equal
columns kept as they are in 16-row programs and one of them taken in 64-row programs, updated
by an explicit FMA; under the interpreter (and for fp32 values) it is a fixed pairwise tree
built from ``tl.split`` (``(0+1)+(2+3)...``, :func:`.kernels._row_sum`).  Compiled kernels keep the
softmax state in base 2 (``exp2`` of scores scaled by ``scale * log2 e``, the fold in ``exp2``);
the interpreter keeps base e.  (d) holds at every position on both
(``results/h200/attention_decode_tiles.json``, ``tests/test_attention.py``).

Planning once per step
----------------------
:func:`make_plan` builds everything a launch needs besides the tensors from the step's *host*
metadata, with whole-array NumPy operations and one copy to the device (:mod:`.plan`). Every
layer of a step reuses the plan (``attention(..., plan=plan)``): no device-to-host copy per
layer.  A padded decode plan (``decode_capacity``, ``max_seq_len``) has fixed sizes, so a decode
launch can be captured once in a CUDA graph and replayed with the plan's buffer refilled
(:class:`PlanLayout`).

``impl``:

* ``"invariant"`` (default): split sizes from the config and the row's own position;
* ``"variant"``: the same kernels, launched like production split-KV decode: the *number* of
  splits comes from the occupancy, ``num_splits = max(1, 2*SMs // (num_seqs*kv_heads))``, and
  ``split_size = ceil(seq_len / num_splits)`` (rounded up to whole tiles).  Another batch size,
  another split, another merge: it fails the invariance check (the negative control);
* ``"reference"``: float64 math (SDPA-style: ``softmax(q k^T * scale + causal mask) v``) on the
  keys gathered from the cache, rounded once to q's dtype;
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` on a gathered contiguous KV
  (the peer; one call per sequence, in q's dtype).

Caveat: bitwise prefill == decode holds for finite inputs; a signed zero can differ in the
degenerate case where every probability of a diagonal tile underflows to 0 (in prefill, keys
beyond a row's position up to its tile's last row read the real cache, in decode zeros, and
``0 * -v = -0``).
"""
from __future__ import annotations

from .cache import PagedCache, allocate_blocks, block_table, grow_blocks, new_cache, slots, write_kv
from .launcher import launch
from .ops import attention, decode, prefill
from .plan import AttnPlan, MergePlan, PlanLayout, TileGroup, make_plan
from .reference import gather_kv
from .schedule import (DEFAULT_CONFIG, INTERPRETER_CONFIG, AttnConfig, default_config, num_sms, query_tile,
                       resolve_config, split_plan, split_size_at)
from .validate import IMPLS

__all__ = [
    "IMPLS",
    "AttnConfig",
    "DEFAULT_CONFIG",
    "INTERPRETER_CONFIG",
    "default_config",
    "resolve_config",
    "num_sms",
    "new_cache",
    "block_table",
    "grow_blocks",
    "allocate_blocks",
    "slots",
    "write_kv",
    "PagedCache",
    "query_tile",
    "split_size_at",
    "split_plan",
    "attention",
    "TileGroup",
    "MergePlan",
    "AttnPlan",
    "PlanLayout",
    "make_plan",
    "launch",
    "prefill",
    "decode",
    "gather_kv",
]
