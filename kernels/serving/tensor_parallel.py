"""Tensor parallelism: sharded linears, the all-reduce that sums their partial products, and the
kit's model sharded over ranks.

A **column-parallel** linear splits a weight's output rows (N) over ``world`` ranks: each rank
computes whole output columns with the full K loop, so nothing is reduced across ranks.  A
**row-parallel** linear splits K: rank ``r`` computes the partial product of its K slice and an
**all-reduce** sums the ``world`` partials element by element.  That sum is a reduction the
kernels do not see, and its order is the all-reduce's:

* ``"fixed"``: every rank gathers every partial and sums them rank 0 + rank 1 + ... + rank
  ``world-1`` in fp32, rounded once to the partials' dtype: one order per element, whatever the
  message size, the same bits on every rank;
* ``"ring"`` (the variant twin): a ring all-reduce (reduce-scatter, then all-gather) of the
  flattened message cut into ``world`` near-equal chunks; the sum of chunk ``c`` starts at rank
  ``c`` and goes round the ring (``c, c+1, ..., c-1``).  The chunk boundaries follow the message
  size, which is ``tokens x hidden``: the batch decides which rank starts an element's sum;
* ``"gloo"``: ``torch.distributed.all_reduce`` of the process group's backend (the peer; its
  algorithm and order are the backend's).

The fp32 sum of two partials does not depend on the order (``a + b == b + a`` bit for bit), so
at two ranks the ring's order changes nothing; from three ranks on it does.

Two forms of every reduction: :func:`fixed_order_sum` and :func:`ring_sum` take the partials as
a list (one process, the ranks simulated); :func:`all_reduce` runs them between the processes of
a ``torch.distributed`` group (gloo on CPU processes) with the same bits.  :func:`run_ranks`
starts such processes; :class:`ShardedQwen3Model` is one rank of the kit's model (attention heads
and MLP / expert columns split over ranks, ``o_proj`` and ``down`` row-parallel) which the
serving engine drives unchanged on every rank.
"""
from __future__ import annotations

import datetime
import os
import queue as _queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checks import positive_int
from ..ops.matmul import linear
from .engine import Engine, Request, completion_key
from .model import Qwen3Config, Qwen3Model

__all__ = ["REDUCTIONS", "shard_range", "chunk_bounds", "fixed_order_sum", "ring_sum", "ring_order",
           "simulate_all_reduce", "column_parallel_linear", "row_parallel_linear", "all_reduce",
           "ShardedQwen3Model", "run_ranks", "tp_group", "reduction_check", "load_check", "in_sequence"]

#: the all-reduce orders: the fixed one, its variant twin, the process group's own
REDUCTIONS = ("fixed", "ring", "gloo")


# -------------------------------------------------------------------------------- arguments
def _reduction(order, allowed=REDUCTIONS) -> str:
    if order not in allowed:
        raise ValueError(f"order must be one of {allowed}, got {order!r}")
    return order


def _partials(partials) -> list:
    if not isinstance(partials, (list, tuple)) or not partials:
        raise ValueError(f"partials must be a non-empty list of tensors, got {type(partials).__name__}")
    for i, p in enumerate(partials):
        if not isinstance(p, torch.Tensor) or not p.dtype.is_floating_point:
            raise TypeError(f"partials[{i}] must be a floating-point torch.Tensor, got "
                            f"{getattr(p, 'dtype', type(p).__name__)}")
        if p.shape != partials[0].shape or p.dtype != partials[0].dtype:
            raise ValueError(f"partials[{i}] has shape {tuple(p.shape)}/{p.dtype}, partials[0] "
                             f"{tuple(partials[0].shape)}/{partials[0].dtype}: every rank's partial must match")
    return list(partials)


def shard_range(size: int, rank: int, world: int, *, name: str = "size") -> slice:
    """The slice of ``size`` (heads, columns, K) that ``rank`` of ``world`` holds: equal
    contiguous shards; ``size`` must divide by ``world`` (a ValueError naming ``name`` otherwise)."""
    positive_int("world", world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
    if size % world:
        raise ValueError(f"{name}={size} does not divide over world={world} ranks")
    n = size // world
    return slice(rank * n, (rank + 1) * n)


# --------------------------------------------------------------- the reductions, one process
def chunk_bounds(numel: int, world: int) -> list:
    """The ring's chunks of a flattened message of ``numel`` elements: ``world`` pieces of
    ``ceil(numel / world)`` elements (the last ones shorter or empty), as ``[(start, end)]``.
    A function of the message size: of the number of tokens in the batch."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    positive_int("world", world)
    step = -(-numel // world)
    return [(min(c * step, numel), min((c + 1) * step, numel)) for c in range(world)]


def ring_order(numel: int, world: int) -> torch.Tensor:
    """``(numel,)`` int64: the rank that starts each element's sum in the ring (then ``+1``,
    ``+2``, ... round the ring): chunk ``c`` starts at rank ``c``."""
    first = torch.empty(numel, dtype=torch.int64)
    for c, (lo, hi) in enumerate(chunk_bounds(numel, world)):
        first[lo:hi] = c
    return first


def fixed_order_sum(partials) -> torch.Tensor:
    """The fixed-order all-reduce's result: ``((p0 + p1) + p2) + ...`` per element, in fp32,
    rounded once to the partials' dtype."""
    parts = _partials(partials)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def ring_sum(partials) -> torch.Tensor:
    """The ring all-reduce's result: chunk ``c`` (:func:`chunk_bounds` of the flattened message)
    summed ``p_c + p_{c+1} + ... + p_{c-1}`` (ranks modulo ``world``) in fp32, rounded once."""
    parts = _partials(partials)
    world, shape, dt = len(parts), parts[0].shape, parts[0].dtype
    flat = [p.reshape(-1).float() for p in parts]
    out = torch.empty(flat[0].numel(), dtype=torch.float32)
    for c, (lo, hi) in enumerate(chunk_bounds(out.numel(), world)):
        acc = flat[c][lo:hi]
        for j in range(1, world):
            acc = acc + flat[(c + j) % world][lo:hi]
        out[lo:hi] = acc
    return out.to(dt).reshape(shape)


def simulate_all_reduce(partials, order: str = "fixed") -> torch.Tensor:
    """:func:`fixed_order_sum` or :func:`ring_sum` of a list of partials (one per rank)."""
    return {"fixed": fixed_order_sum, "ring": ring_sum}[_reduction(order, ("fixed", "ring"))](partials)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, rank: int, world: int, *,
                           impl: str = "invariant") -> torch.Tensor:
    """Rank ``rank``'s output columns of ``x @ weight.T``: the rows :func:`shard_range` gives it of
    ``weight`` (N, K), the full K loop: no cross-rank reduction."""
    w = weight[shard_range(weight.shape[0], rank, world, name="weight.shape[0]")]
    return linear(x, w, impl=impl)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, world: int, *, order: str = "fixed",
                        impl: str = "invariant") -> torch.Tensor:
    """``x @ weight.T`` with K split over ``world`` simulated ranks: each rank's partial product
    (the kit's :func:`~batch_invariance_kit.ops.matmul.linear` over its K slice), then the
    all-reduce ``order`` (:func:`simulate_all_reduce`)."""
    _reduction(order, ("fixed", "ring"))
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be torch.Tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (tokens, K) and weight (N, K) must be 2-D with one K, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    K = weight.shape[1]
    parts = []
    for r in range(positive_int("world", world)):
        s = shard_range(K, r, world, name="weight.shape[1]")
        parts.append(linear(x[:, s].contiguous(), weight[:, s].contiguous(), impl=impl))
    return simulate_all_reduce(parts, order)


# ---------------------------------------------------------- the reductions, between processes
def _group_ranks(group) -> tuple:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, world, to_global


def _ring_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    rank, world, to_global = _group_ranks(group)
    flat = x.reshape(-1).float().clone()
    bounds = chunk_bounds(flat.numel(), world)
    nxt, prv = to_global((rank + 1) % world), to_global((rank - 1) % world)

    def exchange(send_c: int, recv_c: int, add: bool) -> None:
        (slo, shi), (rlo, rhi) = bounds[send_c], bounds[recv_c]
        buf = torch.empty(rhi - rlo, dtype=torch.float32)
        reqs = []
        if shi > slo:
            reqs.append(dist.isend(flat[slo:shi].clone(), nxt, group=group))
        if rhi > rlo:
            reqs.append(dist.irecv(buf, prv, group=group))
        for q in reqs:
            q.wait()
        if rhi > rlo:
            flat[rlo:rhi] = buf + flat[rlo:rhi] if add else buf

    for s in range(world - 1):  # reduce-scatter: chunk c's sum starts at rank c
        exchange((rank - s) % world, (rank - s - 1) % world, True)
    for s in range(world - 1):  # all-gather: rank r holds chunk r+1 complete
        exchange((rank + 1 - s) % world, (rank - s) % world, False)
    return flat.to(x.dtype).reshape(x.shape)


def all_reduce(x: torch.Tensor, *, order: str = "fixed", group=None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` (``None``: the default process group); returns a new
    tensor, the same bits on every rank.  ``order``: one of :data:`REDUCTIONS` (module docstring).
    ``"fixed"`` and ``"ring"`` give the bits of :func:`fixed_order_sum` / :func:`ring_sum` of the
    ranks' tensors."""
    _reduction(order)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not dist.is_initialized():
        raise RuntimeError("all_reduce needs an initialised torch.distributed process group (see run_ranks)")
    host = x.detach().to("cpu").contiguous()  # gloo moves host memory
    if order == "fixed":
        parts = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, host, group=group)
        out = fixed_order_sum(parts)
    elif order == "ring":
        out = _ring_all_reduce(host, group)
    else:
        out = host.clone()
        dist.all_reduce(out, group=group)
    return out.to(x.device)


# ---------------------------------------------------------------------------- the model
class ShardedQwen3Model(Qwen3Model):
    """Rank ``rank`` of ``world`` of the kit's model (dense or MoE), Megatron-style: the fused QKV
    and gate/up (each expert's, for a MoE) column-parallel (its slice of the query and key/value
    heads, of the intermediate columns), ``o_proj`` and ``down`` (each expert's) row-parallel,
    their partial outputs summed by :func:`all_reduce` with ``order`` over ``group``.  Norms, the
    embedding, the router and ``lm_head`` are replicated: every rank computes the same hidden
    states and log-probabilities.  The engine drives it like the unsharded model, on every rank
    with the same requests.  ``weights``: the full model's (``None``: drawn from ``cfg.seed``).

    Query and key/value heads, the intermediate size and (for a MoE) the expert intermediate size
    must divide by ``world``."""

    def __init__(self, cfg: Qwen3Config, rank: int, world: int, *, order: str = "fixed", group=None,
                 weights: dict | None = None, device=None, linear_config=None):
        if not isinstance(cfg, Qwen3Config):
            raise TypeError(f"cfg must be a Qwen3Config, got {type(cfg).__name__}")
        self.order, self.group = _reduction(order), group
        q = shard_range(cfg.num_attention_heads, rank, world, name="num_attention_heads")
        kv = shard_range(cfg.num_key_value_heads, rank, world, name="num_key_value_heads")
        inter = shard_range(cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size, rank, world,
                            name="moe_intermediate_size" if cfg.is_moe else "intermediate_size")
        super().__init__(cfg, weights, device=device, linear_config=linear_config)
        self.rank, self.world = rank, world
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_heads, self.kv_heads = q.stop - q.start, kv.stop - kv.start

        def rows(w, s, unit=1):
            return w[s.start * unit:s.stop * unit]

        for L in self.layers:
            qw, kw, vw = L.qkv.split([hq * d, hkv * d, hkv * d])
            L.qkv = torch.cat([rows(qw, q, d), rows(kw, kv, d), rows(vw, kv, d)]).contiguous()
            L.o = L.o[:, q.start * d:q.stop * d].contiguous()
            if cfg.is_moe:
                gate, up = L.experts_gate_up.chunk(2, dim=1)
                L.experts_gate_up = torch.cat([gate[:, inter], up[:, inter]], dim=1).contiguous()
                L.experts_down = L.experts_down[:, :, inter].contiguous()
            else:
                gate, up = L.gate_up.chunk(2)
                L.gate_up = torch.cat([gate[inter], up[inter]]).contiguous()
                L.down = L.down[:, inter].contiguous()

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, order=self.order, group=self.group)


# ------------------------------------------------------------------------------ processes
def _rank_main(rank, world, init, fn, args, kwargs, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        try:
            results.put((rank, True, fn(rank, world, *args, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 600.0, **kwargs) -> list:
    """Run ``fn(rank, world, *args, **kwargs)`` in ``world`` fresh processes joined in a gloo process
    group (``torch.multiprocessing``'s forkserver start: a fresh process, not this one, imports
    torch and the kit once and forks the ranks; on a machine with CUDA, the spawn start: every
    rank imports them itself and runs the kit's compiled kernels on the GPU, the collectives
    moving host copies either way; a ``file://`` rendezvous in a temporary folder);
    returns their results in rank order.  ``fn`` and its arguments must pickle (``fn`` a
    module-level function); a rank's exception is raised here as a RuntimeError with its
    traceback."""
    positive_int("world", world)
    if not callable(fn):
        raise TypeError(f"fn must be a module-level callable, got {type(fn).__name__}")
    if torch.cuda.is_available():  # CUDA cannot be used in a forked process: each rank starts afresh
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # one fresh server imports torch and the kit, each rank forks from it
    results = ctx.Queue()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, fn, args, kwargs, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        waited = 0.0
        try:
            while len(out) < world:  # the first failure ends the launch (its peers would wait in a collective)
                try:
                    r, ok, value = results.get(timeout=1.0)
                except _queue.Empty:
                    waited += 1.0
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                    if dead or waited > timeout:
                        raise RuntimeError(f"ranks {dead or 'all'} of {world} gave no result "
                                           f"({'exited' if dead else f'{timeout:.0f} s passed'})")
                    continue
                if not ok:
                    raise RuntimeError(f"rank {r} of {world} failed:\n{value}")
                out[r] = value
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world else 0)
                if p.is_alive():
                    p.terminate()
                    p.join()
    return [out[r] for r in range(world)]


# ----------------------------------------------------------------- checks run on every rank
def tp_group(world: int, tp: int | None = None) -> tuple:
    """Inside a process group of ``world`` ranks: ``(group, rank in it, its size, its index)`` of
    this rank's tensor-parallel group: ``world // tp`` groups of ``tp`` consecutive ranks
    (``None`` or ``world``: one group, the default process group), so that several TP groups
    serve concurrently in one launch."""
    tp = world if tp is None else positive_int("tp", tp)
    if world % tp:
        raise ValueError(f"tp={tp} must divide the world of {world} ranks")
    if tp == world:
        return None, dist.get_rank(), world, 0
    group, _ = dist.new_subgroups(tp)
    return group, dist.get_rank(group), tp, dist.get_rank() // tp


def reduction_check(rank: int, world: int, orders, hidden: int, batch_sizes, *, seeds=(0,), tp=None) -> dict:
    """On every rank: the kit's alone-vs-batch check
    (:func:`~batch_invariance_kit.verify.harness.check_invariance`) of :func:`all_reduce` over
    this rank's tensor-parallel group (:func:`tp_group`) for each of ``orders``.  Rank ``r``'s
    partials are rows of ``hidden`` values of its own seeded stream (row ``t`` the same in every
    batch); ``f(batch)`` is their all-reduce, ``f(row alone)`` the all-reduce of one row.
    Returns ``{"tp", "reports": {order: InvarianceReport}, "matches": {order: bool}}``: whether
    the fixed and ring results of the largest batch equal :func:`fixed_order_sum` /
    :func:`ring_sum` of the group's partials (the one-process simulation) bit for bit."""
    from ..verify.harness import bitwise_equal, check_invariance, row_maker

    group, r, n, _ = tp_group(world, tp)
    makers = [row_maker(hidden, device="cpu") for _ in range(n)]
    seeds = tuple(seeds)
    reports = {o: check_invariance(lambda x, o=o: all_reduce(x, order=o, group=group),
                                   lambda bs, seed: makers[r](bs, seed * 1000 + r),
                                   list(batch_sizes), positions="all", seeds=seeds)
               for o in orders}
    bs = max(batch_sizes)
    parts = [makers[i](bs, seeds[0] * 1000 + i) for i in range(n)]
    matches = {o: bitwise_equal(all_reduce(parts[r], order=o, group=group), simulate_all_reduce(parts, o))
               for o in orders if o != "gloo"}
    return {"tp": n, "reports": reports, "matches": matches}


def _serve(model: Qwen3Model, requests: list, **engine_kwargs) -> list:
    return [completion_key(c) for c in Engine(model, **engine_kwargs).run(requests)]


def load_check(rank: int, world: int, cfg, target: Request, load: list, orders=("fixed",), *, tp=None,
               linear_config=None, unsharded: bool = False, **engine_kwargs) -> dict:
    """On every rank: serve ``target`` alone and then ``target`` among the ``load`` requests with
    :class:`ShardedQwen3Model` over this rank's tensor-parallel group (:func:`tp_group`), per
    all-reduce order.  ``cfg``: one :class:`~batch_invariance_kit.serving.model.Qwen3Config`, or
    a list of one per group (the groups serve their models concurrently).  Returns ``{"tp",
    "cfg", order: {"alone": key, "in_batch": key}}`` with
    :func:`~batch_invariance_kit.serving.engine.completion_key` of the target (its tokens and the
    bytes of its fp32 log-probability rows); ``unsharded``: the group's first rank also serves
    ``target`` alone with the whole model (``"unsharded"``: TP=1's key)."""
    group, r, n, g = tp_group(world, tp)
    if isinstance(cfg, (list, tuple)):
        if len(cfg) != world // n:
            raise ValueError(f"cfg must be one Qwen3Config or a list of {world // n} (one per TP group), "
                             f"got {len(cfg)}")
        cfg = cfg[g]
    out = {"tp": n, "cfg": cfg}
    for order in orders:
        m = ShardedQwen3Model(cfg, r, n, order=order, group=group, linear_config=linear_config)
        out[order] = {"alone": _serve(m, [target], **engine_kwargs)[0],
                      "in_batch": _serve(m, [target] + list(load), **engine_kwargs)[0]}
    if unsharded and r == 0:
        out["unsharded"] = _serve(Qwen3Model(cfg, linear_config=linear_config), [target],
                                  **engine_kwargs)[0]
    return out


def in_sequence(rank: int, world: int, *calls) -> list:
    """Run several checks in one launch: ``calls`` are ``(fn, args, kwargs)``; returns each
    ``fn(rank, world, *args, **kwargs)`` in order (for :func:`run_ranks`)."""
    return [fn(rank, world, *args, **kwargs) for fn, args, kwargs in calls]
